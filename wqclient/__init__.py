"""wq client library."""
