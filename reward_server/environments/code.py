"""Code generation scored by running the model's program against the item's tests in a sandbox
(`rlmesh.reward_server.sandbox`: namespaces, an unprivileged uid, rlimits; one sandbox per item).

The program is the last ```python (or ```py) block of the completion, or the whole completion when
it has none. The tests are `metadata.tests` (the key is configurable): a list, or a JSON string of
a list, whose entries are either
- assert-style Python, run after the program in its namespace: `"assert add(2, 3) == 5"`, or
- a stdin/stdout pair, the program run with that input: `{"input": "2 3\\n", "output": "5\\n"}`
  (stdout compared up to trailing whitespace).
Both kinds may be mixed. Reward = the fraction of tests passed; components: `pass_rate`, `correct`
(1 when all pass), `timed_out`, and `test_<i>` (1/0) per test. A program that crashes, hangs,
fork-bombs or tries to reach the network or the host's files scores 0 on the tests it fails; an item
whose tests are missing or malformed, or whose sandbox could not start, gets a per-item error and is
never trained on.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from rlmesh.reward_server.environments.base import ScoreInput, ScoreOutput
from rlmesh.reward_server.sandbox import Sandbox
from rlmesh.services.config import CodeEnvironmentSection, default

log = logging.getLogger(__name__)

_FENCED = re.compile(r"```(?:python3?|py)[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)


def extract_program(completion: str) -> str:
    """The last ```python block (an unclosed one runs to the end), else the whole completion."""
    blocks = _FENCED.findall(completion)
    return blocks[-1] if blocks else completion


def parse_tests(value: Any, key: str) -> list[str | dict[str, str]]:
    """The item's tests, checked; raises ValueError saying what is wrong with them."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ValueError(f"metadata.{key} is a string but not JSON ({err}); give a list of tests") from None
    if not isinstance(value, list) or not value:
        raise ValueError(f"metadata.{key} must be a non-empty list of tests (assert strings or "
                         f"{{'input': ..., 'output': ...}} objects), got {str(value)[:100]!r}")
    for i, test in enumerate(value):
        ok = isinstance(test, str) or (isinstance(test, dict) and set(test) == {"input", "output"}
                                       and all(isinstance(v, str) for v in test.values()))
        if not ok:
            raise ValueError(f"metadata.{key}[{i}] = {str(test)[:100]!r} is neither an assert string nor an "
                             "object with exactly the string fields 'input' and 'output'")
    return value


class CodeEnvironment:
    max_batch_size = 1  # one sandbox per call: a slow item holds only its own worker

    def __init__(self, name: str, sandbox: Sandbox, *, tests_key: str = default(CodeEnvironmentSection, "tests_key")) -> None:
        self.name, self.tests_key, self._sandbox = name, tests_key, sandbox
        self.description = f"Python program run against metadata.{tests_key} in a sandbox; reward = pass rate"
        probe_s = sandbox.check()
        log.info("code environment %s: sandbox checked (probe run %.2fs; programs run as %s); limits in force: %s",
                 name, probe_s, sandbox.isolation, sandbox.limits.describe())

    def score(self, items: list[ScoreInput]) -> list[ScoreOutput]:
        return [self._score_one(item) for item in items]

    def _score_one(self, item: ScoreInput) -> ScoreOutput:
        if self.tests_key not in item.metadata:
            return ScoreOutput(error=f"{self.name}: item {item.id!r} has no metadata.{self.tests_key}; the prompt "
                                     "must carry the tests the program is run against")
        try:
            tests = parse_tests(item.metadata[self.tests_key], self.tests_key)
        except ValueError as err:
            return ScoreOutput(error=f"{self.name}: item {item.id!r}: {err}")
        result = self._sandbox.run(extract_program(item.completion), tests)
        if "sandbox: cannot" in result.stderr:
            return ScoreOutput(error=f"{self.name}: item {item.id!r}: the sandbox failed to start: "
                                     f"{result.stderr.strip()[-300:]}")
        components = {"pass_rate": result.pass_rate, "correct": float(all(t.passed for t in result.tests)),
                      "timed_out": float(result.timed_out)}
        components.update({f"test_{i}": float(t.passed) for i, t in enumerate(result.tests)})
        return ScoreOutput(reward=result.pass_rate, components=components)
