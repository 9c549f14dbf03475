"""`math`: final-answer scoring of worked solutions. The completion's answer is its last `\\boxed{}`,
else what follows its last `####` (GSM8K's marker), else its last number; the reference is
metadata.answer, read the same way (a GSM8K worked solution gives the number after `####`; a bare
answer is taken whole). Equivalence is math-verify's (fractions, decimals, LaTeX, percentages,
thousands separators; units and `\\text{}` stripped), with plain string equality as the fallback
when math-verify finds no expression in either.

math-verify bounds its own parsing with SIGALRM, which works only in a process's main thread — and
the reward server calls environments from worker threads. So verification runs in a few worker
processes (`VerifyPool`), each doing one item at a time in its main thread; an item that takes longer
than `timeout_s` gets its worker killed and replaced, and scores 0 with a `timeout` component, while
the other workers go on. Components: `correct` (held-out accuracy reads it), `format` (the answer is
boxed or after `####`), `extracted` (any answer was found) and `timeout`."""

from __future__ import annotations

import logging
import multiprocessing
import queue
import re
import threading
from multiprocessing.connection import Connection
from typing import Any

from rlmesh.reward_server.environments.base import ScoreInput, ScoreOutput
from rlmesh.services.config import MathEnvironmentSection, default

log = logging.getLogger(__name__)

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_WORDS = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{2,}")  # a word of 2+ letters, not a LaTeX command


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`), braces balanced; None if there is none."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
    return None  # unbalanced: the completion was cut off inside the box


def extract_answer(text: str) -> tuple[str | None, str]:
    """(answer, where it came from: `boxed`, `hash`, `number` or `none`)."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed, "boxed"
    if "####" in text:
        after = text.rsplit("####", 1)[1].strip().splitlines()
        if after and after[0].strip():
            return after[0].strip(), "hash"
    numbers = _NUMBER.findall(text)
    if numbers:
        return numbers[-1], "number"
    return None, "none"


def reference_answer(answer: Any) -> str:
    """metadata.answer as the answer to compare with: boxed content, the text after `####`, or all of it."""
    text = str(answer)
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        return text.rsplit("####", 1)[1].strip()
    return text.strip()


def _normalize(text: str) -> str:
    return re.sub(r"\s+|\\[,;! ]|\$|,", "", text).rstrip(".").lower()


def equivalent(gold: str, answer: str, alarm_s: int = 0) -> bool:
    """math-verify's equivalence of two final answers (string equality when it parses neither)."""
    from math_verify import parse, verify

    def expressions(text: str) -> list:
        # As LaTeX, with plain words (units: "18 dollars") dropped, which LaTeX would read as
        # products of symbols; as plain text when that finds nothing.
        latex = _WORDS.sub("", text).strip()
        found = parse(f"${latex}$", parsing_timeout=alarm_s or None) if latex else []
        return found or parse(text, parsing_timeout=alarm_s or None)

    gold_exprs, answer_exprs = expressions(gold), expressions(answer)
    if gold_exprs and answer_exprs:
        return bool(verify(gold_exprs, answer_exprs, timeout_seconds=alarm_s or None))
    return _normalize(gold) == _normalize(answer)


def _worker(conn: Connection, alarm_s: int) -> None:
    """A verification process: (gold, answer) in, (ok, result or error text) out, until EOF."""
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    import math_verify  # noqa: F401  (imported before saying ready: start-up is not an item's time)

    conn.send(("ready", None))
    while True:
        try:
            gold, answer = conn.recv()
        except EOFError:
            return
        try:
            conn.send((True, equivalent(gold, answer, alarm_s)))
        except Exception as err:  # an answer math-verify cannot handle is this item's error
            conn.send((False, f"{type(err).__name__}: {err}"))


class VerifyTimeout(Exception):
    """An item's verification ran past the timeout; its worker was killed."""


class _Worker:
    def __init__(self, ctx: Any, alarm_s: int, start_timeout_s: float) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker, args=(child, alarm_s), daemon=True, name="math-verify")
        self.process.start()
        child.close()
        if not self.conn.poll(start_timeout_s):
            self.kill()
            raise RuntimeError(f"a math-verify worker did not start within {start_timeout_s:.0f}s")
        self.conn.recv()

    def kill(self) -> None:
        self.process.kill()
        self.process.join(5)
        self.conn.close()


class VerifyPool:
    """`num_workers` verification processes, started on first use (spawned: the reward server has
    threads, which fork would copy half-locked). `check` blocks its calling thread until a worker is
    free, then bounds the item at `timeout_s`."""

    def __init__(self, num_workers: int, timeout_s: float) -> None:
        self.num_workers, self.timeout_s = num_workers, timeout_s
        self._alarm_s = max(int(timeout_s * 2) + 1, 2)  # math-verify's own alarm, never before ours
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._lock = threading.Lock()
        self._started = False
        self.num_killed = 0

    def _spawn(self) -> _Worker:
        return _Worker(multiprocessing.get_context("spawn"), self._alarm_s, start_timeout_s=120.0)

    def _start(self) -> None:
        with self._lock:
            if not self._started:
                for _ in range(self.num_workers):
                    self._idle.put(self._spawn())
                self._started = True

    def check(self, gold: str, answer: str) -> bool:
        """Whether `answer` is equivalent to `gold`. Raises VerifyTimeout past the timeout, and
        ValueError when math-verify raised on the item."""
        self._start()
        worker = self._idle.get()
        try:
            worker.conn.send((gold, answer))
            if worker.conn.poll(self.timeout_s):
                ok, result = worker.conn.recv()
            else:
                ok, result = None, None
        except (EOFError, OSError):  # the worker died under this item
            ok, result = None, "the verification process died"
        if ok is None:
            worker.kill()
            self.num_killed += 1
            # Replace it from another thread so this item's verdict is not held up by a start-up.
            threading.Thread(target=lambda: self._idle.put(self._spawn()), daemon=True).start()
            if result is None:
                raise VerifyTimeout(f"math-verify took longer than {self.timeout_s:g}s; its process was killed")
            raise ValueError(result)
        self._idle.put(worker)
        if not ok:
            raise ValueError(f"math-verify failed: {result}")
        return bool(result)

    def close(self) -> None:
        while not self._idle.empty():
            self._idle.get_nowait().kill()


class MathEnvironment:
    name = "math"
    description = ("final answer (last \\boxed{}, else after ####, else the last number) checked against "
                   "metadata.answer with math-verify; components correct, format, extracted, timeout")

    def __init__(self, timeout_s: float = default(MathEnvironmentSection, "timeout_s"),
                 num_workers: int = default(MathEnvironmentSection, "num_workers"),
                 format_weight: float = default(MathEnvironmentSection, "format_weight")) -> None:
        self.pool = VerifyPool(num_workers, timeout_s)
        self.format_weight = format_weight

    def score(self, items: list[ScoreInput]) -> list[ScoreOutput]:
        return [self._score_one(item) for item in items]

    def _score_one(self, item: ScoreInput) -> ScoreOutput:
        if item.metadata.get("answer") is None:
            return ScoreOutput(error="metadata has no 'answer' field; the prompt group must carry env_metadata.answer "
                                     "(data.answer_key names the column)")
        gold = reference_answer(item.metadata["answer"])
        answer, where = extract_answer(item.completion)
        components = {"correct": 0.0, "format": float(where in ("boxed", "hash")),
                      "extracted": float(answer is not None), "timeout": 0.0}
        if answer is not None:
            try:
                components["correct"] = float(self.pool.check(gold, answer))
            except VerifyTimeout as err:
                log.warning("math: %s (answer %.80r)", err, answer)
                components["timeout"] = 1.0
            except ValueError as err:
                return ScoreOutput(error=f"math: cannot verify answer {answer[:80]!r} against {gold[:80]!r}: {err}")
        reward = components["correct"] + self.format_weight * components["format"]
        return ScoreOutput(reward=reward, components=components)
