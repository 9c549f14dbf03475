"""Shared-secret bearer-token auth and optional TLS for every gRPC hop."""

from __future__ import annotations

import hmac
import os
from dataclasses import dataclass
from pathlib import Path

import grpc


def load_token(token_file: str | None, token_env: str = "RLMESH_TOKEN") -> str | None:
    """The shared token from a secret file (preferred) or an environment variable; None = no auth."""
    if token_file:
        path = Path(token_file)
        if not path.is_file():
            raise ValueError(f"network.token_file={token_file!r} does not exist; create it or unset it")
        token = path.read_text().strip()
        if not token:
            raise ValueError(f"network.token_file={token_file!r} is empty")
        return token
    return os.environ.get(token_env) or None


def token_matches(metadata: tuple[tuple[str, str | bytes], ...] | None, token: str) -> bool:
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
            return hmac.compare_digest(value[len("Bearer "):], token)
    return False


@dataclass(frozen=True)
class TLSFiles:
    """PEM files for a TLS server (cert + key) or client (root CA)."""

    cert: str | None = None
    key: str | None = None
    ca: str | None = None

    @classmethod
    def from_env(cls) -> TLSFiles | None:
        cert, key, ca = (os.environ.get(f"RLMESH_TLS_{n}") for n in ("CERT", "KEY", "CA"))
        return cls(cert, key, ca) if (cert or ca) else None

    def server_credentials(self) -> grpc.ServerCredentials:
        if not (self.cert and self.key):
            raise ValueError("TLS server needs both RLMESH_TLS_CERT and RLMESH_TLS_KEY")
        return grpc.ssl_server_credentials([(Path(self.key).read_bytes(), Path(self.cert).read_bytes())])

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(Path(self.ca).read_bytes() if self.ca else None)
