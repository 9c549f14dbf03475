"""Who may call a gRPC server: the shared bearer token, TLS (mutual when a CA is configured), the
tier a caller's certificate names, and the rule that a server reachable beyond loopback never
starts without credentials.

Identity: under mutual TLS a caller's tier is its certificate's common name (`learner`, `rollout`,
`reward`; `rlmesh tls-init` writes such certificates). A server's `Policy` maps its methods to the
tiers that may call them. With a token alone there is one identity, the mesh: the token
authenticates, it does not tell tiers apart.

Every secret the config names by file or environment variable (this token, the queue password) is
read by `read_secret`."""

from __future__ import annotations

import hmac
import ipaddress
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from rlmesh.services.config import NetworkSection, TLSSection, default

if TYPE_CHECKING:
    from rlmesh.services.config import NetworkSection

TIERS = ("learner", "rollout", "reward")


def read_secret(key: str, path: str | None, env: str) -> str | None:
    """A secret from the file `path` (preferred; `key` is the config key that names it, for errors),
    else from the environment variable `env`; None when neither holds one."""
    if path:
        if not Path(path).is_file():
            raise ValueError(f"{key}={path!r} does not exist; create it or unset it")
        secret = Path(path).read_text().strip()
        if not secret:
            raise ValueError(f"{key}={path!r} is empty")
        return secret
    return os.environ.get(env) or None


def load_token(token_file: str | None, token_env: str = default(NetworkSection, "token_env")) -> str | None:
    """The shared token from a secret file (preferred) or an environment variable; None = no auth."""
    return read_secret("network.token_file", token_file, token_env)


def token_matches(metadata: Iterable[tuple[str, str | bytes]] | None, token: str) -> bool:
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
            return hmac.compare_digest(value[len("Bearer "):].encode(), token.encode())
    return False


@dataclass(frozen=True)
class TLSFiles:
    """PEM files: this service's certificate and key (served, and presented to servers it calls)
    and the CA that verifies the other side. With a CA, a server requires client certificates."""

    cert: str | None = None
    key: str | None = None
    ca: str | None = None
    server_name_is_tier: bool = default(TLSSection, "server_name_is_tier")

    @classmethod
    def from_env(cls) -> TLSFiles | None:
        cert, key, ca = (os.environ.get(f"RLMESH_TLS_{n}") for n in ("CERT", "KEY", "CA"))
        return cls(cert, key, ca) if (cert or ca) else None

    @classmethod
    def from_config(cls, network: NetworkSection, tier: str) -> TLSFiles | None:
        """network.tls with `{tier}` filled in; RLMESH_TLS_CERT / _KEY / _CA override each file."""
        tls = network.tls
        files = {}
        for name, value in (("cert", tls.cert_file), ("key", tls.key_file), ("ca", tls.ca_file)):
            value = os.environ.get(f"RLMESH_TLS_{name.upper()}") or value
            files[name] = value.replace("{tier}", tier) if value else None
        if not (files["cert"] or files["ca"]):
            return None
        for name, path in files.items():
            if path and not Path(path).is_file():
                raise ValueError(f"network.tls.{name}_file={path!r} (or $RLMESH_TLS_{name.upper()}) does not "
                                 "exist; `rlmesh tls-init --output DIR` writes a CA and one certificate per tier")
        if bool(files["cert"]) != bool(files["key"]):
            raise ValueError("network.tls.cert_file and network.tls.key_file go together; set both or neither")
        return cls(files["cert"], files["key"], files["ca"], tls.server_name_is_tier)

    @property
    def mutual(self) -> bool:
        """Servers require (and verify) client certificates."""
        return bool(self.ca and self.cert)

    def server_credentials(self) -> grpc.ServerCredentials:
        if not (self.cert and self.key):
            raise ValueError("a TLS server needs network.tls.cert_file and key_file (or RLMESH_TLS_CERT / _KEY)")
        pair = [(Path(self.key).read_bytes(), Path(self.cert).read_bytes())]
        if self.ca:
            return grpc.ssl_server_credentials(pair, root_certificates=Path(self.ca).read_bytes(),
                                               require_client_auth=True)
        return grpc.ssl_server_credentials(pair)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            Path(self.ca).read_bytes() if self.ca else None,
            Path(self.key).read_bytes() if self.key else None,
            Path(self.cert).read_bytes() if self.cert else None,
        )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name other than localhost may resolve to any interface


def check_can_serve(host: str, *, token: str | None, tls: TLSFiles | None, insecure: bool) -> None:
    """Refuse to serve beyond loopback without credentials: a token, or mutual TLS."""
    if is_loopback(host) or token is not None or (tls is not None and tls.mutual) or insecure:
        return
    raise ValueError(
        f"network.host={host!r} is reachable from other machines but no credentials are set, so anyone who reaches "
        "the port could drive this service. Set a shared token (network.token_file, or the variable named by "
        "network.token_env, RLMESH_TOKEN by default), or mutual TLS (network.tls.cert_file, key_file and ca_file; "
        "`rlmesh tls-init` makes them), or bind to 127.0.0.1; on a trusted lab network only, network.insecure=true "
        "serves without credentials")


ANY = None
"""A policy entry allowing every authenticated caller."""


@dataclass(frozen=True)
class Policy:
    """Which tiers may call which methods of a server, under mutual TLS (ignored without it).
    `methods` maps a method name (no service prefix) to its tiers; others get `default`."""

    methods: dict[str, frozenset[str] | None] = field(default_factory=dict)
    default: frozenset[str] | None = ANY

    def allowed(self, method: str) -> frozenset[str] | None:
        return self.methods.get(method.rsplit("/", 1)[-1], self.default)


def peer_tier(context: grpc.aio.ServicerContext) -> str | None:
    """The common name of the caller's verified certificate, or None without mutual TLS."""
    names = (context.auth_context() or {}).get("x509_common_name") or ()
    return names[0].decode() if names else None
