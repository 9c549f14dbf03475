"""The environment of a child process that runs code rlmesh does not own (a user's reward function, an
environment author's package): the basics a program needs and nothing secret unless named. A tier's
own credentials (the queue password, a tracker's or the hub's token) stay with the tier."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

# Passed whenever set: what a Python program needs to start and find its caches; nothing secret.
BASIC = ("PATH", "LANG", "LC_ALL", "TZ", "HOME", "TMPDIR", "XDG_CACHE_HOME", "HF_HOME", "HF_DATASETS_CACHE",
         "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


def child_env(names: Iterable[str] = (), *, prefixes: tuple[str, ...] = (), withheld: Iterable[str] = (),
              source: Mapping[str, str] | None = None) -> dict[str, str]:
    """Of `source` (this process's environment by default): the basics, the variables in `names`, and
    those starting with one of `prefixes`, less any in `withheld`."""
    source = os.environ if source is None else source
    keep, drop = {*BASIC, *names}, set(withheld)
    return {k: v for k, v in source.items() if k not in drop and (k in keep or (prefixes and k.startswith(prefixes)))}
