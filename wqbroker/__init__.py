"""wq broker: a job-queue broker with an HTTP/JSON API and a gRPC API over one asyncio store."""

__version__ = "0.1.0"
