"""The docker-compose stack in a real Docker engine (opt-in: `make test-containers`).

One run of the whole stack from a clean engine state that grows and shrinks while it trains: it
starts with one rollout and one reward server, whose containers crash after the first steps (their
main process SIGKILLed from the host, which is what the engine's restart policy answers; `docker kill`
counts as a manual stop and is not restarted); once they are back, `docker compose up --scale
rollout=2 --scale reward=2` adds one of each, the Valkey container is restarted, and `--scale
rollout=1 --scale reward=1` takes them away again. Joining rollout servers must get the
learner's current weights (digest-verified) before their groups are trained, every reward replica
must serve a fair share of the Score calls, and the prompts a leaving rollout server held must be
generated again by the one that stays. The run (ended by a stop request once all that is done) must
learn (train reward and held-out accuracy), lose no group, train no group twice, need no re-issue of
lost queue entries, and end with the rollout weights equal to the learner's; then `down` must leave
no container, network, volume or process behind. Every container runs as a non-root user, on a
read-only root filesystem, with no capabilities and no privilege escalation. The same run has the `observability` profile on:
its Prometheus (Debian's package, built by `stack.sh images`) scrapes every tier, replicas included,
answers on the host's loopback, and counts each reward replica's Score calls."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from rlmesh.learner.trackers.metrics import surviving_lineage
from rlmesh.services.ports import free_port

# The first test builds the images and runs the stack (module fixture): ~20 minutes here with the images built.
pytestmark = [pytest.mark.containers, pytest.mark.timeout(3000)]

REPO = Path(__file__).resolve().parents[2]
STACK = REPO / "deploy/docker/stack.sh"
PROJECT = "rlmesh-test"
MAX_STEPS, GROUPS_PER_STEP = 300, 32
"""learner.num_steps is only a bound: the test asks the learner to stop (the stop request `rlmesh.train`'s
callbacks use) once the events below are done, however long this machine takes to start vLLM (the learner
trains ~1 step a second on one rollout server; with a bound of 100 a run once ended, in CI, before a
joiner started beside the busy server had a group trained: see _scale_up)."""
SCALE_UP_AT = 2
"""Steps trained with one rollout and one reward server before both are crashed and scaled to REPLICAS."""
REPLICAS = 2
"""Rollout and reward servers while the stack is grown: two of each. Three of each (docs/deployment.md's
timeline) took ~30 minutes on this 2-core, 24 GB machine, and once in CI its joiners never reached the learner."""
STEPS_AFTER_SCALE_DOWN = 6
"""Steps trained after both are scaled back to one, before the stop request."""
DOCKER = "/usr/bin/docker" if Path("/usr/bin/docker").exists() else "docker"
# Run inside an rlmesh container (the image's redis client, the queue password from its environment).
QUEUE = """
import json, os, sys, redis
r = redis.Redis(host="valkey", password=os.environ["RLMESH_QUEUE_PASSWORD"], socket_timeout=10)
"""
HELD = QUEUE + """
held = {}  # consumer -> group ids of the prompt entries pending on it
for p in r.xpending_range("rlmesh:prompts", "rollout", "-", "+", 100000):
    entry = r.xrange("rlmesh:prompts", p["message_id"], p["message_id"])
    if entry:
        held.setdefault(p["consumer"].decode(), []).append(entry[0][1][b"key"].decode())
print(json.dumps(held))
"""
PUBLISHED = QUEUE + """
keys = json.loads(sys.argv[1])
print(json.dumps([k for k in keys if r.sismember("rlmesh:trajectories:published", k)]))
"""


class Stack:
    """docker-compose around the repo's file, under its own project name and run config."""

    def __init__(self, config_dir: Path) -> None:
        engine = subprocess.run([str(STACK), "engine"], capture_output=True, text=True, check=True).stdout
        # The compose file requires both secrets; each stack gets its own.
        self.env = {**os.environ, "COMPOSE_PROJECT_NAME": PROJECT, "RLMESH_CONFIG_DIR": str(config_dir),
                    "RLMESH_PROMETHEUS_PORT": str(free_port()),
                    "RLMESH_VALKEY_IMAGE": "rlmesh/valkey:bookworm", "RLMESH_TOKEN": secrets.token_hex(32),
                    "RLMESH_QUEUE_PASSWORD": secrets.token_hex(32)}
        for line in engine.splitlines():
            if line.startswith("export DOCKER_HOST="):
                self.env["DOCKER_HOST"] = line.split("=", 1)[1]

    def compose(self, *args: str, timeout: float = 300) -> str:
        tool = ["docker-compose"] if shutil.which("docker-compose") else [DOCKER, "compose"]
        out = subprocess.run([*tool, "--profile", "observability", *args], cwd=REPO, env=self.env, capture_output=True, text=True, timeout=timeout)
        assert out.returncode == 0, f"compose {' '.join(args)} failed:\n{out.stdout}\n{out.stderr}"
        return out.stdout

    def scale(self, rollout: int, reward: int) -> None:
        """`up --scale` of the rollout and reward services alone, as an operator scales a running
        stack: no other service is started again (`prepare` would train the model anew) or recreated."""
        self.compose("up", "-d", "--no-build", "--no-deps", "--no-recreate", "--scale", f"rollout={rollout}",
                     "--scale", f"reward={reward}", "rollout", "reward", timeout=600)

    def docker(self, *args: str, check: bool = True, timeout: float = 120, stderr: bool = False) -> str:
        """What `docker ARGS` printed (with its stderr after its stdout when `stderr`)."""
        out = subprocess.run([DOCKER, *args], env=self.env, capture_output=True, text=True, timeout=timeout)
        assert not check or out.returncode == 0, f"docker {' '.join(args)} failed:\n{out.stderr}"
        return out.stdout + out.stderr if stderr else out.stdout

    def containers(self, service: str | None = None, every: bool = True) -> list[str]:
        filters = ["--filter", f"label=com.docker.compose.project={PROJECT}"]
        if service:
            filters += ["--filter", f"label=com.docker.compose.service={service}"]
        return self.docker("ps", "-q", *(["-a"] if every else []), *filters).split()

    def inspect(self, container: str, fmt: str) -> str:
        return self.docker("inspect", "-f", fmt, container).strip()

    def generator_id(self, container: str) -> str:
        """The id a rollout container registers under: its IP on the compose network and port."""
        return self.inspect(container, "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}") + ":50053"

    def crash(self, container: str) -> None:
        """SIGKILL the container's main process from the host, as the OOM killer would."""
        os.kill(int(self.inspect(container, "{{.State.Pid}}")), signal.SIGKILL)

    def train_rows(self, learner: str) -> list[dict]:
        out = self.docker("exec", learner, "cat", "/data/runs/compose/metrics.jsonl", check=False)
        return [r for r in map(json.loads, out.splitlines()) if r.get("kind") == "train"]

    def queue(self, container: str, script: str, *args: str) -> object:
        """What `script` (QUEUE and a query) prints as JSON, run in an rlmesh container."""
        return json.loads(self.docker("exec", container, "python", "-c", script, *args))

    def prometheus(self, query: str, path: str = "query", **params: object) -> list[dict]:
        """The result of a query to the stack's Prometheus, through its loopback port."""
        url = (f"http://127.0.0.1:{self.env['RLMESH_PROMETHEUS_PORT']}/api/v1/{path}?"
               + urllib.parse.urlencode({"query": query, **params}))
        with urllib.request.urlopen(url, timeout=10) as response:
            return json.loads(response.read())["data"]["result"]

    def scraped(self) -> dict:
        """Which tiers Prometheus scrapes (`up`, by the `tier` label; one series per replica), the
        learner's policy version and the rollout tier's generated tokens, as it last saw them."""
        try:
            up = [(r["metric"]["tier"], float(r["value"][1])) for r in self.prometheus('up{job="rlmesh"}')]
            version = [float(r["value"][1]) for r in self.prometheus("rlmesh_learner_policy_version")]
            tokens = [float(r["value"][1]) for r in self.prometheus("sum(rlmesh_rollout_generated_tokens_total)")]
        except OSError as err:  # not answering yet
            return {"error": repr(err)}
        return {"up": sorted(up), "policy_version": max(version, default=0.0), "rollout_tokens": sum(tokens)}

    def score_calls(self, start: float, end: float) -> dict[str, dict]:
        """Each reward replica's Score calls (by its scrape address) between `start` and `end` (Unix
        times), counter resets (a crash) included, and when Prometheus first saw it answer one."""
        query = 'sum by (instance) (rlmesh_reward_env_calls_total{method="score"})'
        series = self.prometheus(query, "query_range", start=start, end=end, step=5)
        out = {}
        for s in series:
            values = [(t, float(v)) for t, v in s["values"]]
            # A replica that joined in the window counts from zero; a reset (a crash) from zero again.
            joined = values[0][0] > start + 10
            calls = (values[0][1] if joined else 0.0) + sum(b - a if b >= a else b
                                                            for (_, a), (_, b) in zip(values, values[1:]))
            first = next((t for t, v in values if v > 0), None)
            out[s["metric"]["instance"]] = {"calls": calls, "first_call_s": None if first is None else first - start}
        return out

    def logs(self) -> str:
        """Every container's state and the last lines each service said (the learner's first: a failure
        shows why the others wait on it, which a tail of all services mixed together may not)."""
        states = self.docker("ps", "-a", "--filter", f"label=com.docker.compose.project={PROJECT}",
                             "--format", "{{.Names}}\t{{.Status}}", check=False)
        learner = self.compose("logs", "--no-color", "--tail", "30", "learner")[-3000:]
        # Each rollout server's own tail: a joiner that waits (on DNS, on vLLM, on the learner) says so.
        rollouts = "\n".join(self.docker("logs", "--tail", "12", c, check=False, stderr=True)[-2000:]
                              for c in self.containers("rollout"))
        return f"{states}\n{learner}\n{rollouts}\n" + self.compose("logs", "--no-color", "--tail", "10")[-3000:]
def _processes_in(container_ids: set[str]) -> list[int]:
    """Host processes still inside any of these containers' cgroups."""
    left = []
    for proc in Path("/proc").iterdir():
        try:
            cgroup = (proc / "cgroup").read_text() if proc.name.isdigit() else ""
        except OSError:
            continue
        if any(cid in cgroup for cid in container_ids):
            left.append(int(proc.name))
    return left


def _hardening(stack: Stack) -> dict[str, dict]:
    """For each running container: the uid of its main process (from the host's /proc), whether a
    write to its root filesystem fails, and what the engine says of its capabilities and options."""
    out = {}
    for container in stack.containers(every=False):
        service = stack.inspect(container, '{{index .Config.Labels "com.docker.compose.service"}}')
        name = f"{service}/{container[:12]}"
        pid = int(stack.inspect(container, "{{.State.Pid}}"))
        status = Path(f"/proc/{pid}/status").read_text()
        uids = next(line.split()[1:] for line in status.splitlines() if line.startswith("Uid:"))
        no_new_privs = next(line.split()[1] for line in status.splitlines() if line.startswith("NoNewPrivs:"))
        probe = subprocess.run([DOCKER, "exec", container, "sh", "-c", "touch /rlmesh-probe"], env=stack.env,
                               capture_output=True, text=True, timeout=60)
        out[name] = {"uids": sorted({int(u) for u in uids}), "root_write_refused": probe.returncode != 0,
                     "no_new_privs": no_new_privs == "1",
                     "cap_drop": stack.inspect(container, "{{json .HostConfig.CapDrop}}"),
                     "read_only": stack.inspect(container, "{{.HostConfig.ReadonlyRootfs}}") == "true"}
    return out


def _wait(predicate, timeout: float, what: str, stack: Stack) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{stack.logs()}"
        time.sleep(2.0)


@pytest.fixture(scope="module")
def run(tmp_path_factory, rlmesh_images):
    """Build the images, bring the stack up clean, grow it, inject the faults, shrink it, wait for the
    learner to finish; yields what the tests check. `down` happens here and its leftovers are returned too."""
    # The containers run as uid 10001 and read the config through a bind mount: pytest's own tmp
    # directories are private to root (0700), so the config goes where that user can read it.
    config_dir = Path(tempfile.mkdtemp(prefix="rlmesh-compose-config-"))
    config_dir.chmod(0o755)
    config = yaml.safe_load((REPO / "deploy/compose.rlmesh.yaml").read_text())
    config["learner"].update(num_steps=MAX_STEPS, groups_per_step=GROUPS_PER_STEP, eval_every=0, min_generators=1)
    config["data"]["num_eval"] = 50  # held-out accuracy before and after, on more than the demo's 20 prompts
    config["learner"]["lr"] = 3.0e-4  # the demo's 5e-4 unlearned over 60+ steps; decays over MAX_STEPS (a bound)
    # Each server takes at most a quarter of the (k + 1) * B = 64 groups outstanding: the work spreads
    # over the replicas (and a leaver holds some) instead of the first reader taking it all.
    config["rollout"]["max_concurrent_groups"] = 16
    config["checkpoint"]["every_n_steps"] = 8
    (config_dir / "compose.rlmesh.yaml").write_text(yaml.safe_dump(config))
    (config_dir / "compose.rlmesh.yaml").chmod(0o644)
    stack = Stack(config_dir)
    stack.compose("down", "-v", "--remove-orphans")
    assert stack.containers() == [], "leftover containers from an earlier run"

    events: dict = {"started": time.time()}
    ids: set[str] = set()
    try:
        stack.compose("up", "-d", "--no-build", timeout=900)
        learner = stack.containers("learner")[0]
        first = stack.containers("rollout")[0]
        _wait(lambda: len(stack.train_rows(learner)) >= SCALE_UP_AT, 900, f"{SCALE_UP_AT} training steps", stack)
        # The replicas are added while the crashed ones restart (see _scale_up), then the run trains on both.
        _crash_and_recover(stack, learner, events, meanwhile=lambda: _scale_up(stack, learner, first, events))
        events["first_rollout"] = stack.generator_id(first)
        _grow(stack, learner, events)
        _restart_valkey(stack, learner, events)
        _shrink(stack, learner, events)
        done = events["scaled_down"]["step"] + STEPS_AFTER_SCALE_DOWN
        _wait(lambda: len(stack.train_rows(learner)) >= done, 900, f"step {done}", stack)
        stack.docker("exec", learner, "sh", "-c", "echo 'the compose test has seen what it needs' "
                     "> /data/runs/compose/stop_request")
        _wait(lambda: stack.inspect(learner, "{{.State.Status}}") == "exited", 600, "the learner to finish", stack)
        events["learner_exit_code"] = int(stack.inspect(learner, "{{.State.ExitCode}}"))
        events["rollout_replicas"] = len(stack.containers("rollout"))
        # The server that stayed goes on after the run: every prompt a leaver held must come back.
        held, survivor = events["scaled_down"]["held"], events["scaled_down"]["survivor"]
        _wait(lambda: len(stack.queue(survivor, PUBLISHED, json.dumps(held))) == len(held), 300,
              "the prompts the leaving rollout servers held to be generated again", stack)
        events["scaled_down"]["held_back"] = stack.queue(survivor, PUBLISHED, json.dumps(held))
        said = _logs(stack, survivor, events["scaled_down"]["time"])
        events["scaled_down"]["claimed_by_survivor"] = sum(
            int(n) for n in re.findall(r"claimed (\d+) prompt groups left pending", said))
        ids = {stack.inspect(c, "{{.Id}}") for c in stack.containers()}
        out_dir = tmp_path_factory.mktemp("out")
        stack.docker("cp", f"{learner}:/data/runs/compose", str(out_dir / "run"))
        events["run_dir"] = out_dir / "run"
        events["logs"] = stack.logs()
        events["follow_up"] = _run_follow_ups()
    finally:
        stack.compose("down", "-v", "--remove-orphans")
        shutil.rmtree(config_dir, ignore_errors=True)
    label = f"label=com.docker.compose.project={PROJECT}"
    events["left"] = {
        "containers": stack.containers(),
        "networks": stack.docker("network", "ls", "-q", "--filter", label).split(),
        "volumes": stack.docker("volume", "ls", "-q", "--filter", label).split(),
        "processes": _processes_in(ids),
    }
    return events


def _logs(stack: Stack, container: str, since: float) -> str:
    """A container's output (stdout and stderr) since `since` (a Unix time)."""
    out = subprocess.run([DOCKER, "logs", "--since", str(int(since)), container], env=stack.env,
                         capture_output=True, text=True, timeout=60)
    return out.stdout + out.stderr


def _crash_and_recover(stack: Stack, learner: str, events: dict, meanwhile=lambda: None) -> None:
    """Crash the rollout and reward containers (one of each yet: the run waits for them), do
    `meanwhile`, and wait until the engine has restarted them and they serve again."""
    crashed = [stack.containers("rollout")[0], stack.containers("reward")[0]]
    events["crashed_at"] = time.time()
    for name, container in zip(("rollout", "reward"), crashed):
        stack.crash(container)
        events[f"{name}_crashed_at_step"] = len(stack.train_rows(learner))
    meanwhile()
    _wait(lambda: all(int(stack.inspect(c, "{{.RestartCount}}")) >= 1 and
                      stack.inspect(c, "{{.State.Health.Status}}") == "healthy" for c in crashed),
          600, "the crashed containers to be restarted and healthy", stack)
    events["restarts"] = {c: int(stack.inspect(c, "{{.RestartCount}}")) for c in crashed}
    events["restarted_healthy_at_step"] = len(stack.train_rows(learner))
    events["restarted_healthy_s"] = time.time() - events["crashed_at"]


def _scale_up(stack: Stack, learner: str, first: str, events: dict) -> None:
    """Rollout and reward 1 -> REPLICAS, as an operator scales a running stack. It runs while the
    crashed replicas restart: a vLLM start beside a busy vLLM worker, on this 2-core machine, waited
    7 to 9 minutes for the core that worker holds (both bind core 0 under rollout.cpu_cores=auto;
    its process got ~3% of it), so the learner trained 400 steps on the first server before the second
    served (2026-12-02). On hosts with cores to spare, or a node of its own, a joiner starts in ~45 s."""
    t0 = time.time()
    stack.scale(rollout=REPLICAS, reward=REPLICAS)
    events["scaled_up"] = {"time": t0, "step": len(stack.train_rows(learner)), "command_s": time.time() - t0}
    events["scaled_up"]["joiners"] = sorted(stack.generator_id(c) for c in stack.containers("rollout") if c != first)


def _grow(stack: Stack, learner: str, events: dict) -> None:
    """Wait until every joined rollout server's groups are trained and Prometheus scrapes every replica."""
    joiners = set(events["scaled_up"]["joiners"])
    # Reward servers start in seconds: once Prometheus finds them all (DNS discovery every 15 s), every
    # rollout server has them too within a connection age (10 s) and a resolve (5 s).
    _wait(lambda: stack.scraped().get("up", []).count(("reward", 1.0)) == REPLICAS, 120,
          f"{REPLICAS} reward replicas", stack)
    events["all_serving"] = time.time() + 15  # from here to the scale-down, every reward replica serves
    producers = lambda: {g for r in stack.train_rows(learner) for g in r["groups_by_generator"]}  # noqa: E731
    _wait(lambda: joiners <= producers(), 900, f"trained groups from every joined rollout server {joiners}", stack)
    # Scrape every 5 s, DNS discovery every 15 s: every tier (every replica) up within a minute. The
    # rollout servers' token counters restart at 0 with their containers, and the joiner's first groups
    # can be trained before Prometheus scrapes it again: wait for a scrape that saw tokens generated.
    want = sorted([("learner", 1.0)] + [("reward", 1.0)] * REPLICAS + [("rollout", 1.0)] * REPLICAS)
    deadline = time.monotonic() + 90
    while not ((scraped := stack.scraped()).get("up") == want and scraped["policy_version"] > 0
               and scraped["rollout_tokens"] > 0):
        if time.monotonic() > deadline:
            break
        time.sleep(3.0)
    events["prometheus"] = scraped
    events["hardening"] = _hardening(stack)
    # A stranger on the compose network: valkey-cli without the password (its variables unset).
    valkey = stack.containers("valkey")[0]
    events["valkey_without_password"] = stack.docker(
        "exec", valkey, "sh", "-c",
        "env -u VALKEYCLI_AUTH -u REDISCLI_AUTH valkey-cli -h 127.0.0.1 XLEN rlmesh:prompts 2>&1", check=False)
    # A tier holding the password: the queue, and no administrative command.
    events["valkey_with_password"] = stack.docker(
        "exec", valkey, "sh", "-c",
        "{ valkey-cli -h 127.0.0.1 XLEN rlmesh:prompts; valkey-cli -h 127.0.0.1 CONFIG GET dir;"
        " valkey-cli -h 127.0.0.1 FLUSHALL; } 2>&1", check=False)


def _restart_valkey(stack: Stack, learner: str, events: dict) -> None:
    """SIGKILL Valkey (no shutdown, no final flush): the engine restarts it and its append-only file
    (fsync every second) must hold every group."""
    valkey = stack.containers("valkey")[0]
    events["valkey_crashed_at"] = time.time()
    stack.crash(valkey)
    events["valkey_restarted_at_step"] = len(stack.train_rows(learner))
    _wait(lambda: int(stack.inspect(valkey, "{{.RestartCount}}")) >= 1 and
          stack.inspect(valkey, "{{.State.Running}}") == "true", 120, "Valkey to be restarted", stack)
    events["valkey_restarts"] = int(stack.inspect(valkey, "{{.RestartCount}}"))


def _shrink(stack: Stack, learner: str, events: dict) -> None:
    """Rollout and reward REPLICAS -> 1; which prompts the leaving rollout servers held (pending on them just
    before and just after they left), and each reward replica's Score calls while all of them served."""
    rollouts = {c: stack.generator_id(c) for c in stack.containers("rollout", every=False)}
    # Scaled down while every server holds prompts, so that a leaver's are given back (right after the
    # Valkey restart one held none once: 2026-12-02).
    seen: dict = {}

    def holding() -> bool:
        seen["held"] = stack.queue(next(iter(rollouts)), HELD)
        return all(seen["held"].get(gid) for gid in rollouts.values())

    # Each reward replica's share is read between all_serving and the scale-down: at least 30 s (six
    # scrapes) of it, however soon the joiners' groups were trained.
    time.sleep(max(0.0, events["all_serving"] + 30 - time.time()))
    _wait(holding, 180, "every rollout server to hold prompt groups", stack)
    held_before = seen["held"]  # groups a server finishes before it is gone count as given back too
    t0 = time.time()
    stack.scale(rollout=1, reward=1)
    events["score_calls"] = stack.score_calls(events["all_serving"], t0)
    events["score_calls_since_scale_up"] = stack.score_calls(events["scaled_up"]["time"], t0)
    stayed = stack.containers("rollout")
    assert len(stayed) == 1 and len(stack.containers("reward")) == 1, "scaled down to one of each"
    leavers = {gid for c, gid in rollouts.items() if c not in stayed}
    held_after = stack.queue(stayed[0], HELD)
    held = sorted({g for pending in (held_before, held_after) for who, groups in pending.items() if who in leavers
                   for g in groups})
    left_pending = sorted({g for who, groups in held_after.items() if who in leavers for g in groups})
    events["scaled_down"] = {"time": t0, "step": len(stack.train_rows(learner)), "command_s": time.time() - t0,
                             "leavers": sorted(leavers), "survivor": stayed[0], "held": held,
                             "left_pending": left_pending,
                             "pending_by_server": {"before": {k: len(v) for k, v in held_before.items()},
                                                   "after": {k: len(v) for k, v in held_after.items()}}}


def _run_follow_ups() -> dict[str, tuple[int, str]]:
    """Every command `stack.sh up` prints to follow the stack, run exactly as printed (from the repository
    root, in a shell with no DOCKER_HOST or secrets of the test's); its exit code and output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DOCKER_", "RLMESH_", "COMPOSE_"))}
    printed = subprocess.run([str(STACK), "follow-up"], capture_output=True, text=True, check=True,
                             env={**env, "COMPOSE_PROJECT_NAME": PROJECT}).stdout
    commands = [part.strip().removeprefix("or:").strip() for line in printed.splitlines()
                if "deploy/docker/stack.sh" in line for part in line.split("#")]
    results = {}
    for command in commands:
        try:
            out = subprocess.run(["bash", "-c", command], cwd=REPO, env=env, capture_output=True, text=True,
                                 timeout=30)
            results[command] = (out.returncode, out.stdout + out.stderr)
        except subprocess.TimeoutExpired as err:  # `logs -f` of a stack still running follows it
            results[command] = (0, f"{err.stdout or ''}{err.stderr or ''}")
    copied = REPO / "compose-run"
    results["copied metrics.jsonl"] = (0 if (copied / "metrics.jsonl").is_file() else 1, str(copied))
    shutil.rmtree(copied, ignore_errors=True)
    return results


def test_the_commands_printed_to_follow_the_stack_work_as_printed(run):
    follow_up = run["follow_up"]
    assert len(follow_up) == 4, follow_up  # logs -f, ps, copy-run, and what copy-run wrote
    for command, (code, out) in follow_up.items():
        assert code == 0, f"{command!r} failed as printed:\n{out}"
    logs = next(out for command, (_, out) in follow_up.items() if " logs -f learner" in command)
    assert "learner" in logs and len(logs.splitlines()) > 5, logs
    ps = next(out for command, (_, out) in follow_up.items() if command.endswith(" ps"))
    assert "learner" in ps and "rollout" in ps, ps


def _rows(run: dict, name: str = "metrics.jsonl") -> list[dict]:
    return [json.loads(line) for line in (run["run_dir"] / name).read_text().splitlines()]


def test_the_stack_learns_while_it_grows_and_shrinks(run):
    assert run["learner_exit_code"] == 0, run["logs"]
    assert run["rollout_replicas"] == 1
    train = [r for r in _rows(run) if r["kind"] == "train"]
    summary = json.loads((run["run_dir"] / "summary.json").read_text())
    assert summary["stop_requested"] and summary["num_steps"] >= run["scaled_down"]["step"] + STEPS_AFTER_SCALE_DOWN
    assert [r["version"] for r in train] == list(range(1, summary["num_steps"] + 1))
    first, last = train[:8], train[-8:]
    reward_first = sum(r["reward_mean"] for r in first) / len(first)
    reward_last = sum(r["reward_mean"] for r in last) / len(last)
    before, after = summary["held_out_accuracy_before"], summary["held_out_accuracy_after"]
    print(f"containers: train reward {reward_first:.3f} -> {reward_last:.3f}, held-out accuracy {before} -> {after}")
    assert reward_last > reward_first + 0.1, f"reward did not rise: {reward_first:.3f} -> {reward_last:.3f}"
    assert after > before, f"held-out accuracy did not rise: {before} -> {after}"
    assert summary["last_weights_sha256"] == summary["learner_weights_sha256"]
    producers = {gid for r in train for gid in r["groups_by_generator"]}
    assert {run["first_rollout"], *run["scaled_up"]["joiners"]} <= producers, producers
    print(f"containers: events {json.dumps({k: v for k, v in run.items() if k not in ('logs', 'run_dir')}, default=str)}")


def test_crashed_rollout_and_reward_containers_come_back_and_no_group_is_trained_twice(run):
    assert all(count >= 1 for count in run["restarts"].values()), run["restarts"]
    assert run["rollout_crashed_at_step"] <= run["valkey_restarted_at_step"] <= run["scaled_down"]["step"]
    num_steps = json.loads((run["run_dir"] / "summary.json").read_text())["num_steps"]
    rows = _rows(run, "trained_groups.jsonl")
    lineage = surviving_lineage(rows)
    trained = [g for r in lineage for g in r["group_ids"]]
    assert [r["version"] for r in lineage] == list(range(1, num_steps + 1))
    assert len(trained) == len(set(trained)) == num_steps * GROUPS_PER_STEP, "a group was trained twice"


def _joined(run: dict, train: list[dict], weights: list[dict]) -> dict[str, dict]:
    """For each rollout server that joined: its first weight update (the learner's version then), its
    first trained group, and the oldest weights any of its trained groups came from."""
    t0 = run["scaled_up"]["time"]
    out = {}
    for gid in run["scaled_up"]["joiners"]:
        update = next(w for w in weights if gid in w["generators"])
        trained = next(r for r in train if gid in r["groups_by_generator"])
        out[gid] = {"weights_version": update["version"], "weights_s": update["time"] - t0,
                    "digest": update["digest"], "verified": update["verified"],
                    "first_trained_step": trained["version"], "join_s": trained["time"] - t0,
                    "oldest_version": min(r["oldest_version_by_generator"][gid] for r in train
                                          if gid in r["groups_by_generator"])}
    return out


def _timeline(run: dict, train: list[dict], weights: list[dict], joined: dict, shares: dict) -> str:
    """What the run did, step by step, for CI's log."""
    t0, up, down = run["started"], run["scaled_up"], run["scaled_down"]
    short = lambda gid: gid.split(":")[0].rsplit(".", 1)[-1]  # noqa: E731 (the address's last octet)
    sent = {w["version"]: w for w in weights}  # the last update of each version (a catch-up re-sends it)
    lines = ["compose scaling timeline (t: seconds since `up`; rollout servers by their address's last octet)",
             f"t={run['crashed_at'] - t0:6.0f}  step {run['rollout_crashed_at_step']:2d}  the rollout and reward "
             f"containers SIGKILLed; restarted and healthy {run['restarted_healthy_s']:.0f} s later",
             f"t={up['time'] - t0:6.0f}  step {up['step']:2d}  --scale rollout={REPLICAS} --scale reward={REPLICAS} "
             f"(compose {up['command_s']:.0f} s)"]
    for gid, j in joined.items():
        lines.append(f"          rollout .{short(gid)} joined: weights v{j['weights_version']} at +{j['weights_s']:.0f} s "
                     f"({'verified' if j['verified'] else 'not verified'}, digest {j['digest'][:12]}), first trained "
                     f"group at step {j['first_trained_step']}, +{j['join_s']:.0f} s after --scale; oldest weights of "
                     f"its trained groups v{j['oldest_version']}")
    for instance, c in sorted(run["score_calls_since_scale_up"].items()):
        first = "no call" if c["first_call_s"] is None else f"first Score call seen at +{c['first_call_s']:.0f} s"
        lines.append(f"          reward {instance}: {first}")
    lines.append(f"t={run['valkey_crashed_at'] - t0:6.0f}  step {run['valkey_restarted_at_step']:2d}  Valkey "
                 "SIGKILLed and restarted")
    lines.append("          Score calls per reward replica while all served: " + ", ".join(
        f"{i} {c['calls']:.0f} ({shares[i]:.0%})" for i, c in sorted(run["score_calls"].items())))
    lines.append(f"t={down['time'] - t0:6.0f}  step {down['step']:2d}  --scale rollout=1 --scale reward=1 "
                 f"(compose {down['command_s']:.0f} s): rollout {', '.join('.' + short(g) for g in down['leavers'])} "
                 f"left holding {len(down['held'])} prompt groups ({len(down['left_pending'])} still pending once "
                 f"gone, {down['claimed_by_survivor']} claimed by the one that stayed); "
                 f"{len(down['held_back'])}/{len(down['held'])} generated again")
    lines.append("step     t  groups by rollout server        weights to  digest")
    for r in train:
        by = " ".join(f".{short(g)}:{n}" for g, n in sorted(r["groups_by_generator"].items()))
        w = sent.get(r["version"], {})
        lines.append(f"{r['version']:4d} {r['time'] - t0:5.0f}  {by:30s}  {len(w.get('generators', [])):10d}  "
                     f"{w.get('digest', '')[:12]}")
    return "\n".join(lines)


def test_rollout_and_reward_grow_and_shrink_while_training(run, capsys):
    """1 -> REPLICAS -> 1 of each while training: joiners get the current weights (digest-verified) before
    their groups count, each reward replica serves a fair share, a leaver's prompts come back."""
    rows = _rows(run)
    train = [r for r in rows if r["kind"] == "train"]
    weights = [r for r in rows if r["kind"] == "weights"]
    joined = _joined(run, train, weights)
    calls = run["score_calls"]
    total = sum(c["calls"] for c in calls.values())
    shares = {i: c["calls"] / max(total, 1.0) for i, c in calls.items()}
    with capsys.disabled():
        print("\n" + _timeline(run, train, weights, joined, shares))
    assert len(joined) == REPLICAS - 1, joined
    for gid, j in joined.items():
        # Registered at version 0 (the model on disk), it served nothing until the learner's catch-up
        # reached it: none of its trained groups is older than that update, which came before them.
        assert j["verified"] and j["weights_s"] < j["join_s"], (gid, j)
        assert j["oldest_version"] >= j["weights_version"] >= SCALE_UP_AT, (gid, j)
    assert all(w["verified"] and len(w["digest"]) >= 32 for w in weights), "every update digest-verified"
    # Every reward replica took a real share while all served (round-robin, names resolved again
    # as connections age out): at least half of an equal share each.
    assert len(calls) == REPLICAS and all(share >= 0.5 / REPLICAS for share in shares.values()), shares
    down = run["scaled_down"]
    assert down["held"] and down["held_back"] == down["held"], f"a prompt a leaving rollout server held never came back: {down}"
    assert down["claimed_by_survivor"] >= len(down["left_pending"]), down
    assert sum(r["num_failed_samples"] for r in train) == 0, "a reward replica leaving failed samples"
def test_a_killed_valkey_keeps_every_group(run):
    assert run["valkey_restarted_at_step"] < run["scaled_down"]["step"] + STEPS_AFTER_SCALE_DOWN, "mid-run"
    assert run["valkey_restarts"] >= 1, "the engine restarted the killed Valkey"
    summary = json.loads((run["run_dir"] / "summary.json").read_text())
    # An empty Valkey after the restart would have been noticed and its groups issued again.
    assert summary.get("num_reissued_after_queue_loss", 0) == 0
    assert summary["last_weights_sha256"] == summary["learner_weights_sha256"]


def test_down_leaves_no_container_network_volume_or_process(run):
    assert run["left"] == {"containers": [], "networks": [], "volumes": [], "processes": []}


def test_every_container_runs_as_a_non_root_user_on_a_read_only_root(run):
    hardening = run["hardening"]
    services = {name.split("/")[0] for name in hardening}
    assert {"valkey", "reward", "learner", "rollout", "prometheus"} <= services, hardening
    for name, h in hardening.items():
        assert 0 not in h["uids"], f"{name} runs as root: {h}"
        assert h["read_only"] and h["root_write_refused"], f"{name} can write its root filesystem: {h}"
        assert h["no_new_privs"] and "ALL" in h["cap_drop"], f"{name} keeps capabilities or may escalate: {h}"


def test_the_observability_profile_s_prometheus_scrapes_every_tier(run):
    scraped = run["prometheus"]
    want = sorted([("learner", 1.0)] + [("reward", 1.0)] * REPLICAS + [("rollout", 1.0)] * REPLICAS)
    assert scraped.get("up") == want, scraped
    assert scraped["policy_version"] > 0 and scraped["rollout_tokens"] > 0, scraped


def test_valkey_refuses_a_client_without_the_password(run):
    assert "NOAUTH" in run["valkey_without_password"], run["valkey_without_password"]
    answers = [a for a in run["valkey_with_password"].splitlines() if a.strip()]
    assert answers[0].strip().isdigit() and all("NOPERM" in a for a in answers[1:3]), answers
