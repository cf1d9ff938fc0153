"""wq broker: a job-queue broker with an HTTP/JSON API and a gRPC API over one asyncio store."""

__version__ = "0.1.0"


def main() -> int:
    """``wqbroker``, the command (``python -m wqbroker``): needs the ``broker`` extra."""
    from wqwire.flags import run_command

    return run_command("wqbroker", "wqbroker.__main__", "broker")
