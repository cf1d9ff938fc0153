"""What the transports need to reach a broker over TLS (``https://``, ``grpcs://``) and to send a
bearer token.

Trust: the CA certificates in ``ca_file`` (PEM) when one is given, else the system's store (for
gRPC, the file OpenSSL would use: ``SSL_CERT_FILE`` or the system bundle; gRPC's own roots if there
is none). A token is sent as ``Authorization: Bearer TOKEN``; it never appears in a message.

A broker whose certificate fails verification is a :class:`~wqclient.errors.CertificateError`
with the same message from both transports (:func:`certificate_error`): the reason, and what to
do about it (the CA to give, or the host name to use).
"""

from __future__ import annotations

import os
import ssl

from wqclient.errors import CertificateError, WqError

# What to do about a certificate that failed verification: an issuer this client does not trust
# (or an expired certificate), or a certificate not issued for the host in the URL.
CA_HINT = "give the broker's CA certificate with -ca-file or $WQ_CA_FILE (ca_file in the library)"
HOST_HINT = (
    "the certificate is not issued for the host in the broker URL: use a name it is issued "
    "for, or give the broker a certificate for this one"
)


def check_token(token: str) -> str:
    """``token`` if it can travel in a header (printable ASCII, no spaces); else WqError (which
    does not repeat it)."""
    if not (token.isascii() and token.isprintable()) or " " in token:
        raise WqError("the token must be printable ASCII without spaces")
    return token


def certificate_error(where: str, reason: str, wrong_host: bool) -> CertificateError:
    """The error for a broker whose certificate failed verification, the same from both
    transports: ``where`` (``cannot reach the broker at …``), why (``reason``, as OpenSSL says
    it), and what to do about it."""
    hint = HOST_HINT if wrong_host else CA_HINT
    return CertificateError(f"{where}: TLS certificate verification failed ({reason}); {hint}")


def ca_error(ca_file: str, e: Exception) -> WqError:
    reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
    return WqError(f"cannot use the CA file {ca_file}: {reason}")


def ssl_context(ca_file: str | None) -> ssl.SSLContext:
    """The client context for ``https://``: verify the broker against ``ca_file`` or the system
    store. Raises WqError if ``ca_file`` cannot be read or holds no certificate."""
    try:
        return ssl.create_default_context(cafile=ca_file)
    except (OSError, ValueError) as e:  # ssl.SSLError is an OSError
        assert ca_file is not None
        raise ca_error(ca_file, e) from None


def system_roots() -> bytes | None:
    """The system's CA bundle (what ssl verifies against by default), or None for gRPC's own."""
    cafile = ssl.get_default_verify_paths().cafile
    if cafile is None:
        return None
    try:
        with open(cafile, "rb") as f:
            return f.read()
    except OSError:
        return None


def env_default(value: str | None, name: str) -> str | None:
    """``value`` if given (an empty string: explicitly none), else the environment's ``name``;
    None when neither says anything."""
    if value is None:
        value = os.environ.get(name)
    return value or None
