"""An asyncio event loop on a thread of its own, for environments whose client library is async
(MCP, OpenEnv). The reward server calls environments from worker threads; each call is handed to
this loop with a deadline, and its errors come back naming the server it talked to."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


class LoopThread:
    def __init__(self, name: str, server: str, timeout_s: float) -> None:
        # `server` names the remote end in every error, e.g. "MCP server http://host:8000/mcp".
        self.server, self.timeout_s = server, timeout_s
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name=name, daemon=True).start()

    def run(self, coro_fn: Callable[[], Awaitable[T]], what: str) -> T:
        """Run `coro_fn()` on the loop and wait for it, at most `timeout_s`."""
        async def bounded():
            return await asyncio.wait_for(coro_fn(), self.timeout_s)

        try:
            return asyncio.run_coroutine_threadsafe(bounded(), self.loop).result()
        except (TimeoutError, asyncio.TimeoutError):
            raise TimeoutError(f"{self.server}: {what} took longer than {self.timeout_s}s") from None
        except Exception as err:
            raise ConnectionError(f"{self.server}: {what} failed: {type(err).__name__}: {err}") from None

    def submit(self, coro: Awaitable[object]) -> None:
        """Start `coro` on the loop without waiting for it (best-effort cleanup)."""
        asyncio.run_coroutine_threadsafe(coro, self.loop)
