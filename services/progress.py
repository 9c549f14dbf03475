"""Progress for long work: a tqdm bar on a terminal, and where the output is a file or a pipe, a
plain line now and then (a log holds no carriage-return frames)."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


class LineProgress:
    """tqdm's `update` / `set_postfix` / `close` / `n` / `write`, printed as whole lines: at most one
    every `every_s` seconds while it moves, and one at the end."""

    def __init__(self, total: int, desc: str, unit: str, every_s: float = 30.0, file: TextIO | None = None) -> None:
        self.total, self.desc, self.unit, self.every_s = total, desc, unit, every_s
        self.file = file or sys.stderr
        self.n = 0
        self.postfix: dict[str, Any] = {}
        self.t0 = time.monotonic()
        self._last_line = -float("inf")
        self._printed_n = -1

    def _line(self) -> None:
        extra = " ".join(f"{k}={v}" for k, v in self.postfix.items())
        elapsed = time.monotonic() - self.t0
        print(f"{self.desc}: {self.unit} {self.n}/{self.total} after {elapsed:.0f}s {extra}".rstrip(),
              file=self.file, flush=True)
        self._last_line, self._printed_n = time.monotonic(), self.n

    def update(self, k: int = 1) -> None:
        self.n += k
        if k and time.monotonic() - self._last_line >= self.every_s:
            self._line()

    def set_postfix(self, **kwargs: Any) -> None:
        self.postfix = kwargs

    def write(self, text: str) -> None:
        print(text, file=self.file, flush=True)

    def close(self) -> None:
        if self.n != self._printed_n:
            self._line()


def progress(total: int, desc: str, unit: str, enabled: bool = True, every_s: float = 30.0) -> Any:
    """A tqdm bar on stderr when it is a terminal, else a `LineProgress`; `enabled=False`: a disabled bar."""
    from tqdm import tqdm

    if enabled and not sys.stderr.isatty():
        return LineProgress(total, desc, unit, every_s)
    return tqdm(total=total, desc=desc, unit=unit, disable=not enabled, dynamic_ncols=True)
