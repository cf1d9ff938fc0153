"""The HTTP/JSON gateway: the spec's API, exactly, over aiohttp."""

from wqbroker.http.app import create_app, make_runner
from wqbroker.http.transport import DEFAULT_MAX_BODY

__all__ = ["DEFAULT_MAX_BODY", "create_app", "make_runner"]
