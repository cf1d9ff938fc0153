"""What the token and TLS tests share: the tokens they hand out, the token file, and TLS material
made at test time with trustme (a throwaway CA; nothing is shipped or fetched)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import trustme

from wqbroker.auth import SCOPES

# One token for each single scope, one for each "all but one scope", and one with everything:
# a call is tried with the smallest token that should pass and the largest that should not.
ONLY = {scope: f"only-{scope}-4f1c9a27d3b8e605" for scope in SCOPES}
ALL_BUT = {scope: f"all-but-{scope}-9e2d7b14c6a3f058" for scope in SCOPES}
ROOT = "root-0b5e8c3f71a6d249"
UNKNOWN = "nobody-knows-this-token-1234"


def token_file_text() -> str:
    lines = ["# wq test tokens", ""]
    for scope in SCOPES:
        lines.append(f"{ONLY[scope]} {scope}")
        lines.append(f"{ALL_BUT[scope]} {','.join(s for s in SCOPES if s != scope)}")
    lines.append(f"{ROOT} {', '.join(SCOPES)}  # everything")
    return "\n".join(lines) + "\n"


def write_token_file(directory: Path, text: str | None = None, name: str = "tokens") -> Path:
    path = directory / name
    path.write_text(token_file_text() if text is None else text)
    return path


def rewrite(path: Path, text: str) -> None:
    """Replace a file's text (small: fine from a coroutine)."""
    path.write_text(text)


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def metadata(token: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {token}"),)


@dataclass(frozen=True)
class TLSFiles:
    """A CA and a server certificate it issued for 127.0.0.1 and localhost, as PEM files."""

    ca: Path  # the CA certificate: what clients trust
    cert: Path  # the server's certificate chain
    key: Path  # the server's private key


def make_tls_files(directory: Path) -> TLSFiles:
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    files = TLSFiles(directory / "ca.pem", directory / "server.pem", directory / "server.key")
    ca.cert_pem.write_to_path(str(files.ca))
    server.private_key_pem.write_to_path(str(files.key))
    with open(files.cert, "wb") as f:
        for pem in server.cert_chain_pems:
            f.write(pem.bytes())
    return files
