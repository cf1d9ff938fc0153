"""The HTTP/JSON gateway: the spec's API, exactly, over aiohttp."""

from wqbroker.http.app import DEFAULT_MAX_BODY, create_app, make_runner

__all__ = ["DEFAULT_MAX_BODY", "create_app", "make_runner"]
