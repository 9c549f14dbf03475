"""An LLM judge as a single-turn environment: each completion is put into a rubric and sent to an
OpenAI-compatible chat endpoint (a vLLM server, or any provider); the score in the judge's reply,
mapped from [min_score, max_score] to [0, 1], is the reward.

Configured under `reward.judge.<name>`. The rubric's placeholders are {prompt} (the item's user
messages), {completion} and {reference} (`metadata[reference_key]`), filled in one pass (a
completion that itself contains "{reference}" stays as written). `score_regex`'s first group is
the score; the last match in the reply counts, so a judge may reason before its verdict.

Every item gets its own result: an unparseable verdict, a score out of range, an endpoint that is
down or answers with an error are per-item errors naming the item and the URL (never trained on),
while the rest of the batch is scored. Requests in flight are bounded by `max_concurrency` over all
batches; each has a deadline (`timeout_s`) and is retried `retries` times with backoff when it could
not connect, timed out, or got HTTP 429 or 5xx. Component: `judge_score` (the raw score).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from typing import Any

import httpx

from rlmesh.reward_server.environments.base import Message, ScoreInput, ScoreOutput
from rlmesh.reward_server.environments.loop_thread import LoopThread
from rlmesh.services.retry import Backoff, retry
from rlmesh.services.config import JudgeEnvironmentSection, default

_JUDGE = JudgeEnvironmentSection

_PLACEHOLDER = re.compile(r"\{(prompt|completion|reference)\}")
_RETRY = Backoff(0.5, 4.0)
log = logging.getLogger(__name__)


class _Transient(Exception):
    """A request that may succeed if tried again: no connection, no answer in time, 429 or 5xx."""


def fill_rubric(rubric: str, prompt: str, completion: str, reference: str) -> str:
    values = {"prompt": prompt, "completion": completion, "reference": reference}
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], rubric)


def parse_verdict(verdict: str, score_regex: re.Pattern[str], min_score: float, max_score: float) -> float:
    """The reward in [0, 1] from a judge's reply; ValueError saying why when there is none."""
    matches = [m.group(1) for m in score_regex.finditer(verdict)]
    if not matches:
        raise ValueError(f"unparseable verdict (score_regex {score_regex.pattern!r} found no score): "
                         f"{verdict[-300:]!r}")
    try:
        score = float(matches[-1])
    except ValueError:
        raise ValueError(f"unparseable verdict: score {matches[-1]!r} is not a number") from None
    if not min_score <= score <= max_score:
        raise ValueError(f"verdict score {score:g} is outside [{min_score:g}, {max_score:g}]")
    return score


def _prompt_text(prompt: list[Message]) -> str:
    return "\n\n".join(m.get("content", "") for m in prompt if m.get("role") == "user")


class JudgeEnvironment:
    def __init__(self, name: str, *, url: str, model: str, rubric: str, system: str | None = None,
                 reference_key: str = default(_JUDGE, "reference_key"), score_regex: str, min_score: float,
                 max_score: float, temperature: float = default(_JUDGE, "temperature"),
                 max_tokens: int = default(_JUDGE, "max_tokens"), max_concurrency: int = default(_JUDGE, "max_concurrency"),
                 timeout_s: float = default(_JUDGE, "timeout_s"), retries: int = default(_JUDGE, "retries"),
                 api_key_env: str | None = None) -> None:
        self.name, self.model, self.rubric, self.system = name, model, rubric, system
        self.endpoint = url.rstrip("/") + "/chat/completions"
        self.description = f"LLM judge {model} at {self.endpoint}; reward = score mapped to [0, 1]"
        self.reference_key, self.min_score, self.max_score = reference_key, min_score, max_score
        self.score_regex = re.compile(score_regex)
        self.temperature, self.max_tokens = temperature, max_tokens
        self.timeout_s, self.retries = timeout_s, retries
        headers = {}
        if api_key_env:
            key = os.environ.get(api_key_env)
            if not key:
                raise ValueError(f"reward.judge.{name}.api_key_env: environment variable {api_key_env} is not set; "
                                 "export the API key in it, or drop api_key_env for an endpoint without keys")
            headers["Authorization"] = f"Bearer {key}"
        # Batches are bounded by the reward server's env timeout; the loop only needs a backstop.
        self._loop = LoopThread(f"judge-{name}", f"judge {self.endpoint}", 3600.0)

        async def start() -> tuple[httpx.AsyncClient, asyncio.Semaphore]:
            limits = httpx.Limits(max_connections=max_concurrency)
            return httpx.AsyncClient(headers=headers, limits=limits), asyncio.Semaphore(max_concurrency)

        self._client, self._slots = self._loop.run(start, "starting the HTTP client")

    def score(self, items: list[ScoreInput]) -> list[ScoreOutput]:
        async def all_items() -> list[ScoreOutput]:
            return list(await asyncio.gather(*(self._judge(item) for item in items)))

        return self._loop.run(all_items, f"judging {len(items)} items")

    async def _judge(self, item: ScoreInput) -> ScoreOutput:
        where = f"{self.name}: item {item.id!r}"
        reference = item.metadata.get(self.reference_key)
        if reference is None and "{reference}" in self.rubric:
            return ScoreOutput(error=f"{where}: the rubric uses {{reference}} but metadata has no "
                                     f"{self.reference_key!r}")
        messages = [{"role": "system", "content": self.system}] if self.system else []
        messages.append({"role": "user", "content": fill_rubric(self.rubric, _prompt_text(item.prompt),
                                                                item.completion, str(reference or ""))})
        body = {"model": self.model, "messages": messages, "temperature": self.temperature,
                "max_tokens": self.max_tokens}
        try:
            verdict = await self._request(body)
            score = parse_verdict(verdict, self.score_regex, self.min_score, self.max_score)
        except (ConnectionError, ValueError) as err:
            return ScoreOutput(error=f"{where}: {err}")
        reward = (score - self.min_score) / (self.max_score - self.min_score)
        return ScoreOutput(reward=reward, components={"judge_score": score})

    async def _request(self, body: dict[str, Any]) -> str:
        """The judge's reply text; ConnectionError naming the endpoint when there is none."""

        async def once() -> str:
            try:
                async with self._slots:
                    response = await self._client.post(self.endpoint, json=body, timeout=self.timeout_s)
            except httpx.TimeoutException:
                raise _Transient(f"no answer within timeout_s={self.timeout_s}s") from None
            except httpx.TransportError as err:
                raise _Transient(f"{type(err).__name__}: {err}") from None
            if response.status_code == 429 or response.status_code >= 500:
                raise _Transient(f"HTTP {response.status_code}: {response.text[:200]}")
            if response.status_code != 200:
                raise ConnectionError(f"judge endpoint {self.endpoint} answered HTTP {response.status_code} "
                                      f"(not retried): {response.text[:300]}")
            try:
                content = response.json()["choices"][0]["message"]["content"]
            except (ValueError, KeyError, IndexError, TypeError):
                raise ConnectionError(f"judge endpoint {self.endpoint} answered something other than a chat "
                                      f"completion: {response.text[:300]!r}") from None
            return content or ""

        def failed(err: BaseException, elapsed_s: float) -> ConnectionError:
            return ConnectionError(f"judge endpoint {self.endpoint} failed after {self.retries + 1} attempt(s): {err}")

        # Retries are logged at debug: a judge under load answers 429 to many items at once.
        return await retry(once, what=f"judge endpoint {self.endpoint}", retry_on=_Transient, backoff=_RETRY,
                           max_attempts=self.retries + 1, give_up=failed, log=log, level=logging.DEBUG)
