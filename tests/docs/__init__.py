"""The documentation's runnable blocks: the runner, and the tests that run every page."""
