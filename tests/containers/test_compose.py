"""The docker-compose stack in a real Docker engine (opt-in: `make test-containers`).

One run of the whole stack from a clean engine state, with two rollout replicas: mid-run the
rollout and reward containers crash (their main process SIGKILLed from the host, which is what
the engine's restart policy answers; `docker kill` counts as a manual stop and is not restarted)
and the Valkey container is restarted. The run must complete, learn, train no group twice, need
no re-issue of lost queue entries, and end with the rollout weights equal to the learner's; then
`down` must leave no container, network, volume or process behind. Every container runs as a
non-root user, on a read-only root filesystem, with no capabilities and no privilege escalation.
The same run has the `observability` profile on: its Prometheus (Debian's package, built by
`stack.sh images`) scrapes every tier, replicas included, and answers on the host's loopback."""

from __future__ import annotations

import json
import os
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

from rlmesh.learner.metrics import surviving_lineage
from rlmesh.services.ports import free_port

# The first test builds the images and runs the stack (module fixture): ~10 minutes here.
pytestmark = [pytest.mark.containers, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parents[2]
STACK = REPO / "deploy/docker/stack.sh"
PROJECT = "rlmesh-test"
NUM_STEPS, GROUPS_PER_STEP = 24, 32
DOCKER = "/usr/bin/docker" if Path("/usr/bin/docker").exists() else "docker"


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

    def docker(self, *args: str, check: bool = True, timeout: float = 120) -> str:
        out = subprocess.run([DOCKER, *args], env=self.env, capture_output=True, text=True, timeout=timeout)
        assert not check or out.returncode == 0, f"docker {' '.join(args)} failed:\n{out.stderr}"
        return out.stdout

    def containers(self, service: str | None = None, every: bool = True) -> list[str]:
        filters = ["--filter", f"label=com.docker.compose.project={PROJECT}"]
        if service:
            filters += ["--filter", f"label=com.docker.compose.service={service}"]
        return self.docker("ps", "-q", *(["-a"] if every else []), *filters).split()

    def inspect(self, container: str, fmt: str) -> str:
        return self.docker("inspect", "-f", fmt, container).strip()

    def crash(self, container: str) -> None:
        """SIGKILL the container's main process from the host, as the OOM killer would."""
        os.kill(int(self.inspect(container, "{{.State.Pid}}")), signal.SIGKILL)

    def train_rows(self, learner: str) -> list[dict]:
        out = self.docker("exec", learner, "cat", "/data/runs/compose/metrics.jsonl", check=False)
        return [r for r in map(json.loads, out.splitlines()) if r.get("kind") == "train"]

    def prometheus(self, query: str) -> list[dict]:
        """The result of an instant query to the stack's Prometheus, through its loopback port."""
        url = (f"http://127.0.0.1:{self.env['RLMESH_PROMETHEUS_PORT']}/api/v1/query?"
               + urllib.parse.urlencode({"query": query}))
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

    def logs(self) -> str:
        return self.compose("logs", "--no-color", "--tail", "40")[-8000:]


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
    """Build the images, bring the stack up clean, inject the faults, wait for the learner to finish;
    yields what the tests check. `down` happens here and its leftovers are returned too."""
    # The containers run as uid 10001 and read the config through a bind mount: pytest's own tmp
    # directories are private to root (0700), so the config goes where that user can read it.
    config_dir = Path(tempfile.mkdtemp(prefix="rlmesh-compose-config-"))
    config_dir.chmod(0o755)
    config = yaml.safe_load((REPO / "deploy/compose.rlmesh.yaml").read_text())
    config["learner"].update(num_steps=NUM_STEPS, groups_per_step=GROUPS_PER_STEP, eval_every=0, min_generators=2)
    config["checkpoint"]["every_n_steps"] = 8
    (config_dir / "compose.rlmesh.yaml").write_text(yaml.safe_dump(config))
    (config_dir / "compose.rlmesh.yaml").chmod(0o644)
    stack = Stack(config_dir)
    stack.compose("down", "-v", "--remove-orphans")
    assert stack.containers() == [], "leftover containers from an earlier run"

    events: dict = {}
    ids: set[str] = set()
    try:
        stack.compose("up", "-d", "--no-build", "--scale", "rollout=2", timeout=900)
        learner = stack.containers("learner")[0]
        _wait(lambda: len(stack.train_rows(learner)) >= 4, 900, "four training steps", stack)
        # Scrape every 5 s, DNS discovery every 15 s: every tier (both rollout replicas) up within a minute.
        want = [("learner", 1.0), ("reward", 1.0), ("rollout", 1.0), ("rollout", 1.0)]
        deadline = time.monotonic() + 90
        while (scraped := stack.scraped()).get("up") != want or scraped["policy_version"] <= 0:
            if time.monotonic() > deadline:
                break
            time.sleep(3.0)
        events["prometheus"] = scraped
        events["hardening"] = _hardening(stack)
        # A stranger on the compose network: valkey-cli without the password (its variables unset).
        events["valkey_without_password"] = stack.docker(
            "exec", stack.containers("valkey")[0], "sh", "-c",
            "env -u VALKEYCLI_AUTH -u REDISCLI_AUTH valkey-cli -h 127.0.0.1 XLEN rlmesh:prompts 2>&1", check=False)
        # A tier holding the password: the queue, and no administrative command.
        events["valkey_with_password"] = stack.docker(
            "exec", stack.containers("valkey")[0], "sh", "-c",
            "{ valkey-cli -h 127.0.0.1 XLEN rlmesh:prompts; valkey-cli -h 127.0.0.1 CONFIG GET dir;"
            " valkey-cli -h 127.0.0.1 FLUSHALL; } 2>&1", check=False)
        rollout, reward = stack.containers("rollout", every=False)[0], stack.containers("reward")[0]
        for name, container in (("rollout", rollout), ("reward", reward)):
            stack.crash(container)
            events[f"{name}_crashed_at_step"] = len(stack.train_rows(learner))
        _wait(lambda: all(int(stack.inspect(c, "{{.RestartCount}}")) >= 1 and
                          stack.inspect(c, "{{.State.Running}}") == "true" for c in (rollout, reward)),
              120, "the crashed containers to be restarted", stack)
        events["restarts"] = {c: int(stack.inspect(c, "{{.RestartCount}}")) for c in (rollout, reward)}
        _wait(lambda: len(stack.train_rows(learner)) >= NUM_STEPS // 2, 900, "half the run", stack)
        # Valkey's main process SIGKILLed from the host (no shutdown, no final flush): the engine
        # restarts it and its append-only file (fsync every second) must hold every group.
        valkey = stack.containers("valkey")[0]
        stack.crash(valkey)
        events["valkey_restarted_at_step"] = len(stack.train_rows(learner))
        _wait(lambda: int(stack.inspect(valkey, "{{.RestartCount}}")) >= 1 and
              stack.inspect(valkey, "{{.State.Running}}") == "true", 120, "Valkey to be restarted", stack)
        events["valkey_restarts"] = int(stack.inspect(valkey, "{{.RestartCount}}"))
        _wait(lambda: stack.inspect(learner, "{{.State.Status}}") == "exited", 1200, "the learner to finish", stack)
        events["learner_exit_code"] = int(stack.inspect(learner, "{{.State.ExitCode}}"))
        events["rollout_replicas"] = len(stack.containers("rollout"))
        # The run may end before the restarted replica's vLLM is up again; it must still come back.
        _wait(lambda: all(stack.inspect(c, "{{.State.Health.Status}}") == "healthy" for c in (rollout, reward)),
              300, "the restarted containers to be healthy", stack)
        events["restarted_healthy"] = True
        ids = {stack.inspect(c, "{{.Id}}") for c in stack.containers()}
        out_dir = tmp_path_factory.mktemp("out")
        stack.docker("cp", f"{learner}:/data/runs/compose", str(out_dir / "run"))
        events["run_dir"] = out_dir / "run"
        events["logs"] = stack.logs()
        events["follow_up"] = _run_follow_ups()
    finally:
        stack.compose("down", "-v", "--remove-orphans")
    label = f"label=com.docker.compose.project={PROJECT}"
    events["left"] = {
        "containers": stack.containers(),
        "networks": stack.docker("network", "ls", "-q", "--filter", label).split(),
        "volumes": stack.docker("volume", "ls", "-q", "--filter", label).split(),
        "processes": _processes_in(ids),
    }
    return events


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


def test_the_stack_runs_two_rollout_replicas_and_learns(run):
    assert run["learner_exit_code"] == 0, run["logs"]
    assert run["rollout_replicas"] == 2
    rows = [json.loads(line) for line in (run["run_dir"] / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["version"] for r in train] == list(range(1, NUM_STEPS + 1))
    first, last = train[:8], train[-8:]
    reward_first = sum(r["reward_mean"] for r in first) / len(first)
    reward_last = sum(r["reward_mean"] for r in last) / len(last)
    print(f"containers: train reward {reward_first:.3f} -> {reward_last:.3f}")
    assert reward_last > reward_first + 0.1, f"reward did not rise: {reward_first:.3f} -> {reward_last:.3f}"
    summary = json.loads((run["run_dir"] / "summary.json").read_text())
    assert summary["last_weights_sha256"] == summary["learner_weights_sha256"]
    producers = {gid for r in train for gid in r["groups_by_generator"]}
    assert len(producers) >= 2, f"both replicas generated trained groups: {producers}"
    crash = run["rollout_crashed_at_step"]
    assert all(r["num_generators"] == 2 for r in train[:crash]), "every broadcast before the crash reached both"
    print(f"containers: producers {sorted(producers)}; "
          f"events {json.dumps({k: v for k, v in run.items() if k not in ('logs', 'run_dir')}, default=str)}")


def test_crashed_rollout_and_reward_containers_come_back_and_no_group_is_trained_twice(run):
    assert all(count >= 1 for count in run["restarts"].values()), run["restarts"]
    assert run["restarted_healthy"]
    assert run["rollout_crashed_at_step"] < NUM_STEPS, "the crash must land mid-run"
    rows = [json.loads(line) for line in (run["run_dir"] / "trained_groups.jsonl").read_text().splitlines()]
    lineage = surviving_lineage(rows)
    trained = [g for r in lineage for g in r["group_ids"]]
    assert [r["version"] for r in lineage] == list(range(1, NUM_STEPS + 1))
    assert len(trained) == len(set(trained)) == NUM_STEPS * GROUPS_PER_STEP, "a group was trained twice"


def test_a_killed_valkey_keeps_every_group(run):
    assert run["valkey_restarted_at_step"] < NUM_STEPS, "the kill must land mid-run"
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
    assert scraped.get("up") == [("learner", 1.0), ("reward", 1.0), ("rollout", 1.0), ("rollout", 1.0)], scraped
    assert scraped["policy_version"] > 0 and scraped["rollout_tokens"] > 0, scraped


def test_valkey_refuses_a_client_without_the_password(run):
    assert "NOAUTH" in run["valkey_without_password"], run["valkey_without_password"]
    answers = [a for a in run["valkey_with_password"].splitlines() if a.strip()]
    assert answers[0].strip().isdigit() and all("NOPERM" in a for a in answers[1:3]), answers
