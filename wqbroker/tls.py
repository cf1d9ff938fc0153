"""TLS for both servers, from one certificate chain and its key (``-tls-cert``, ``-tls-key``).

:func:`load_server_tls` reads and checks the pair once, at start, and gives an ``ssl.SSLContext``
for the HTTP site and ``grpc.ServerCredentials`` for the gRPC port. A file that cannot be read, is
not PEM, is encrypted, or a key that does not match the certificate, is a :class:`TLSError` with a
one-line message naming the file.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from typing import NoReturn

import grpc


class TLSError(Exception):
    """The certificate or key cannot be used. The message is one line."""


@dataclass(frozen=True, slots=True)
class ServerTLS:
    """What both servers need to speak TLS."""

    ssl_context: ssl.SSLContext  # for the aiohttp site (HTTPS)
    grpc_credentials: grpc.ServerCredentials  # for server.add_secure_port


def _read(path: str, what: str, marker: bytes) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise TLSError(f"cannot read the TLS {what} {path}: {e.strerror or e}") from None
    if marker not in data:
        raise TLSError(f"the TLS {what} {path} is not in PEM format (no {marker.decode()})")
    return data


def _encrypted() -> NoReturn:
    raise TLSError("is encrypted; give it unencrypted (and readable only by the broker)")


def load_server_tls(cert: str | None, key: str | None) -> ServerTLS | None:
    """The TLS material for ``cert`` (a PEM certificate chain, the server's first) and ``key``
    (its PEM private key); None when both are unset. Raises TLSError."""
    if not cert and not key:
        return None
    if not cert or not key:
        raise TLSError("TLS needs both a certificate (-tls-cert) and its key (-tls-key)")
    cert_pem = _read(cert, "certificate", b"-----BEGIN CERTIFICATE-----")
    key_pem = _read(key, "key", b"PRIVATE KEY-----")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.set_alpn_protocols(["http/1.1"])
    try:
        context.load_cert_chain(cert, key, password=_encrypted)
    except TLSError as e:
        raise TLSError(f"the TLS key {key} {e}") from None
    except ssl.SSLError as e:
        if e.reason == "KEY_VALUES_MISMATCH":
            raise TLSError(f"the TLS key {key} does not match the certificate {cert}") from None
        reason = e.reason or str(e)
        raise TLSError(
            f"cannot use the TLS certificate {cert} with the key {key}: {reason}"
        ) from None
    except OSError as e:
        raise TLSError(f"cannot read the TLS certificate or key: {e.strerror or e}") from None
    credentials = grpc.ssl_server_credentials([(key_pem, cert_pem)])
    return ServerTLS(context, credentials)
