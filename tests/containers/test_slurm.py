"""rlmesh on a real Slurm cluster (opt-in: `make test-containers`): Debian's Slurm 22.05 in five
containers of one Docker network (slurmctld and node1..node4, deploy/slurm/testcluster), a volume
as the cluster file system, and the tiny-model demo submitted with `sbatch deploy/slurm/rlmesh.sbatch`.

One job trains across the four nodes — the learner as a 2-node torchrun job (gloo over the
network), a rollout server on the third, the reward server on the fourth — and loses a node mid-run
(the container SIGKILLed: slurmd and every process on it): Slurm requeues the job, the node comes
back, and the rerun resumes from the newest checkpoint with no group lost or trained twice. A second
job is cancelled mid-run with `scancel`, after which no rlmesh process may be left on any node."""

from __future__ import annotations

import json
import os
import re
import subprocess
import secrets
import time
from pathlib import Path

import pytest
import yaml

from rlmesh.learner.trackers.metrics import surviving_lineage

pytestmark = [pytest.mark.containers, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "deploy/slurm/testcluster/cluster.sh"
STACK = REPO / "deploy/docker/stack.sh"
PROJECT = "rlmesh-slurm-test"
NODES = ["node1", "node2", "node3", "node4"]
NUM_STEPS, GROUPS_PER_STEP, CHECKPOINT_EVERY = 24, 16, 4
DOCKER = "/usr/bin/docker" if Path("/usr/bin/docker").exists() else "docker"
JOIN = os.environ.get("RLMESH_TEST_SLURM_JOIN") == "1"
"""Whether job B is grown by a join job and shrunk again (opt-in: ~6 more minutes on 2 shared cores, most of
it the joiner's vLLM start beside the busy one; CI's time is near its limit)."""
NODE_LOSS = os.environ.get("RLMESH_TEST_SLURM_NODE_LOSS") == "1"
"""Whether job C (`sbatch --no-kill`, two rollout nodes) loses one rollout node mid-run and trains on
without a requeue (opt-in: ~8 more minutes here)."""
NUM_STEPS_C = 16


class Cluster:
    def __init__(self) -> None:
        engine = subprocess.run([str(STACK), "engine"], capture_output=True, text=True, check=True).stdout
        self.env = {"COMPOSE_PROJECT_NAME": PROJECT, "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
        for line in engine.splitlines():
            if line.startswith("export DOCKER_HOST="):
                self.env["DOCKER_HOST"] = line.split("=", 1)[1]

    def cluster(self, *args: str, stdin: str | None = None, timeout: float = 600, check: bool = True) -> str:
        out = subprocess.run([str(CLUSTER), *args], env=self.env, input=stdin, capture_output=True, text=True,
                             timeout=timeout)
        assert not check or out.returncode == 0, f"cluster.sh {' '.join(args)} failed:\n{out.stdout}\n{out.stderr}"
        return out.stdout

    def run(self, *cmd: str, stdin: str | None = None, check: bool = True) -> str:
        """A command on the controller as the rlmesh user (uid 10001), in /shared."""
        return self.cluster("run", *cmd, stdin=stdin, timeout=120, check=check)

    def docker(self, *args: str, check: bool = True) -> str:
        out = subprocess.run([DOCKER, *args], env=self.env, capture_output=True, text=True, timeout=120)
        assert not check or out.returncode == 0, f"docker {' '.join(args)} failed:\n{out.stderr}"
        return out.stdout

    def container(self, service: str) -> str:
        """The service's container (by compose's labels: v1 and v2 name containers differently)."""
        ids = self.docker("ps", "-aq", "--filter", f"label=com.docker.compose.project={PROJECT}",
                          "--filter", f"label=com.docker.compose.service={service}").split()
        assert len(ids) == 1, f"expected one {service} container, found {ids}"
        return ids[0]

    def on_node(self, node: str, *cmd: str, user: str = "root") -> str:
        return self.docker("exec", "-u", user, self.container(node), *cmd, check=False)

    def job_state(self, job: str) -> str:
        out = self.run("scontrol", "show", "job", job, check=False)
        match = re.search(r"JobState=(\S+)", out)
        return match.group(1) if match else "UNKNOWN"

    def train_steps(self, run_dir: str) -> int:
        return len(self.generators(run_dir))

    def read(self, path: str) -> str:
        return self.run("cat", path, check=False)

    def rlmesh_processes(self) -> dict[str, list[str]]:
        """What each compute node still runs as the job's user (uid 10001)."""
        return {node: [line for line in self.on_node(node, "ps", "-u", "10001", "-o", "pid=,args=").splitlines()
                       if line.strip()] for node in NODES}

    def wait(self, predicate, timeout: float, what: str, job: str, every_s: float = 2.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                out = self.read(f"/shared/slurm-{job}.out")
                pytest.fail(f"timed out waiting for {what}; job {job} is {self.job_state(job)}:\n{out[-4000:]}")
            time.sleep(every_s)

    def submit(self, run_dir: str, *overrides: str) -> str:
        out = self.run("env", "RLMESH_LEARNER_NODES=2", "GLOO_SOCKET_IFNAME=eth0", "sbatch", "--nodes=4",
                       "--output=/shared/slurm-%j.out", "/shared/rlmesh.sbatch", "/shared/run.yaml", run_dir, *overrides)
        return out.split()[-1]

    def submit_with_secrets(self, values: dict[str, str], *sbatch_args: str) -> str:
        """`sbatch` from a shell that exported the run's secrets, as a user submits a job to be joined:
        the values reach the shell on stdin, never a command line or a file."""
        names = list(values)
        script = (" ".join(f"read -r {n};" for n in names) + f" export {' '.join(names)};"
                  ' exec env GLOO_SOCKET_IFNAME=eth0 "$@"')
        out = self.run("sh", "-c", script, "sh", "sbatch", *sbatch_args,
                       stdin="".join(f"{values[n]}\n" for n in names))
        return out.split()[-1]

    def generators(self, run_dir: str) -> list[set[str]]:
        """The rollout servers whose groups each training step of the run trained on, in order (a last
        line the learner is still writing is not a step yet)."""
        out = self.on_node("node1", "sh", "-c", f"cat {run_dir}/metrics.jsonl 2>/dev/null || true", user="10001")
        steps = []
        for line in out.splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if row.get("kind") == "train":
                steps.append(set(row["groups_by_generator"]))
        return steps


@pytest.fixture(scope="module")
def slurm(rlmesh_images):
    """The cluster from clean, the model prepared on the shared volume, both jobs run; yields what the
    tests check. The cluster is taken down whatever happens."""
    start = time.monotonic()
    c = Cluster()
    stamp = lambda what: print(f"slurm: {what} at +{time.monotonic() - start:.0f} s", flush=True)  # noqa: E731
    stamp("images")
    c.cluster("down")
    events: dict = {}
    try:
        c.cluster("up", timeout=900)
        stamp("cluster up")
        c.run("rlmesh", "sft", "-c", "/app/examples/arithmetic_grpo.yaml", "--output", "/shared/sft_model")
        config = yaml.safe_load((REPO / "deploy/compose.rlmesh.yaml").read_text())
        for section in ("queue", "weight_sync", "network", "logging"):  # the launch script sets the addresses
            config.pop(section)
        config["model"]["path"] = "/shared/sft_model"
        config["run"] = {"name": "slurm-test"}
        config["learner"].update(num_steps=NUM_STEPS, groups_per_step=GROUPS_PER_STEP, eval_every=8)
        config["checkpoint"]["every_n_steps"] = CHECKPOINT_EVERY
        c.run("sh", "-c", "cat > /shared/run.yaml", stdin=yaml.safe_dump(config))
        c.run("sh", "-c", "cat > /shared/rlmesh.sbatch && chmod 755 /shared/rlmesh.sbatch",
              stdin=(REPO / "deploy/slurm/rlmesh.sbatch").read_text())

        # Job A: trains, loses node2 (learner rank 1) mid-run, is requeued and resumes.
        job = events["job"] = c.submit("/shared/runs/a")
        # Killed between two checkpoints, so that steps past the newest one are lost with the node.
        c.wait(lambda: (n := c.train_steps("/shared/runs/a")) > CHECKPOINT_EVERY and n % CHECKPOINT_EVERY, 600,
               "training to pass a checkpoint", job, every_s=0.2)
        events["killed_at_step"] = c.train_steps("/shared/runs/a")
        stamp(f"node2 killed at step {events['killed_at_step']}")
        c.docker("kill", c.container("node2"))
        killed = time.monotonic()
        c.wait(lambda: c.job_state(job) == "PENDING", 180, "Slurm to requeue the job", job)
        events["requeued_after_s"] = time.monotonic() - killed
        stamp("job requeued")
        c.docker("start", c.container("node2"))
        # Slurm takes node2 back as soon as its slurmd answers, but a step placed on it in the next
        # seconds can still fail ("Requested node configuration is not available"; seen 2026-11-28:
        # the job was requeued again by its script and Slurm then left it pending with idle nodes).
        # So the job is moved to now only once node2 has been idle for a while.
        c.wait(lambda: "idle" in c.run("sinfo", "-h", "-n", "node2", "-o", "%T", check=False), 120,
               "node2 to be back in service", job)
        time.sleep(15)
        # A requeued job may not start for 120 s (Slurm's requeue delay, as its BeginTime); its owner
        # may move that to now.
        c.run("scontrol", "update", f"JobId={job}", "StartTime=now")
        c.wait(lambda: c.job_state(job) == "COMPLETED", 900, "the requeued job to finish", job)
        events["slurm_out"] = c.read(f"/shared/slurm-{job}.out")
        for name in ("summary.json", "trained_groups.jsonl", "metrics.jsonl"):
            events[name] = c.read(f"/shared/runs/a/{name}")
        events["dropped"] = c.run("sh", "-c", "cat /shared/runs/a/dropped_groups.jsonl 2>/dev/null || true")
        events["logs"] = {name: c.read(f"/shared/runs/a/logs/{name}") for name in
                          c.run("ls", "/shared/runs/a/logs").split()}
        events["after_completion"] = c.rlmesh_processes()

        stamp("job A done")
        # Job B on three nodes, with secrets the submitter exported so that it can be joined; cancelled
        # mid-run. Too many steps to finish before the checks below are done: it must still run when they
        # probe it. With JOIN, a join job adds a rollout server on node4 while it trains and leaves again.
        job_secrets = {"RLMESH_TOKEN": secrets.token_hex(32), "RLMESH_QUEUE_PASSWORD": secrets.token_hex(32)}
        job_b = events["job_b"] = c.submit_with_secrets(
            job_secrets, "--nodes=3", "--output=/shared/slurm-%j.out", "/shared/rlmesh.sbatch", "/shared/run.yaml",
            "/shared/runs/b", "learner.num_steps=100000", "checkpoint.every_n_steps=0",
            # The five containers share this host's 2 cores: with `auto` both rollout servers' vLLM workers
            # pinned core 0, and the joiner's, beside a busy one, got 8 s of CPU in its first 6 minutes.
            "rollout.cpu_cores=0-1")
        c.wait(lambda: c.train_steps("/shared/runs/b") >= 2, 600, "job B to train", job_b)
        stamp("job B trains")
        if JOIN:
            _grow_job_b(c, job_b, job_secrets, events, stamp)
        events["running_before_scancel"] = c.rlmesh_processes()
        events["secrets"] = _secrets_stay_in_the_environment(c)
        events["stranger"] = c.on_node("node4", "python3", "-c", STRANGER.format(port=events["secrets"]["valkey_port"]))
        events["tier"] = c.on_node("node4", "python3", "-c", TIER.format(port=events["secrets"]["valkey_port"],
                                                                         password=events["secrets"].pop("password")))
        events["job_b_state_after_probes"] = c.job_state(job_b)
        if JOIN:
            _shrink_job_b(c, job_b, events, stamp)
        c.run("scancel", job_b)
        c.wait(lambda: c.job_state(job_b) == "CANCELLED" and not c.run("squeue", "-h", "-j", job_b, check=False).strip(),
               120, "the cancelled job to leave the queue", job_b)
        time.sleep(2)
        events["after_scancel"] = c.rlmesh_processes()
        stamp("job B cancelled")
        if NODE_LOSS:
            _lose_a_rollout_node(c, events, stamp)
    finally:
        c.cluster("down", check=False)
    events["containers_left"] = c.docker("ps", "-aq", "--filter", f"label=com.docker.compose.project={PROJECT}").split()
    return events


def _grow_job_b(c: Cluster, job_b: str, job_secrets: dict[str, str], events: dict, stamp) -> None:
    """A join job adds a rollout server on node4 to job B; waits until job B trained groups of it."""
    join = events["join_job"] = c.submit_with_secrets(
        job_secrets, "--nodes=1", "--output=/shared/slurm-%j.out", "/shared/rlmesh.sbatch", "--join", "/shared/runs/b")
    joined_at = time.monotonic()
    joiner = f"node4-0-j{join}"
    c.wait(lambda: any(joiner in g for g in c.generators("/shared/runs/b")), 600,
           f"job B to train groups of the join job's rollout server {joiner}", join)
    events["join_trained_after_s"] = time.monotonic() - joined_at
    stamp(f"join job {join}: its groups trained")


def _shrink_job_b(c: Cluster, job_b: str, events: dict, stamp) -> None:
    """`scancel` of the join job: job B goes on training with its own rollout server, node4 empties."""
    join = events["join_job"]
    steps_at_leave = c.train_steps("/shared/runs/b")
    c.run("scancel", join)
    c.wait(lambda: c.job_state(join) == "CANCELLED" and not c.run("squeue", "-h", "-j", join, check=False).strip(),
           120, "the join job to leave the queue", join)
    left_queue = time.monotonic()
    # vLLM's worker process ends after the rollout server that stopped it (seen still running several
    # seconds after the job left the queue, on these busy cores): what still runs a minute on is a leak.
    deadline = time.monotonic() + 60
    while (on_node4 := c.rlmesh_processes()["node4"]) and time.monotonic() < deadline:
        time.sleep(1)
    events["join_node4_empty_after_s"] = time.monotonic() - left_queue
    c.wait(lambda: c.train_steps("/shared/runs/b") >= steps_at_leave + 4, 300,
           "job B to train four more steps after the join job left", job_b)
    events["join_left"] = {"steps_at_leave": steps_at_leave, "job_b": c.job_state(job_b),
                           "generators": c.generators("/shared/runs/b"), "node4": on_node4,
                           "join_out": c.read(f"/shared/slurm-{join}.out"),
                           "trained_groups": c.run("cat", "/shared/runs/b/trained_groups.jsonl", check=False)}
    stamp("join job cancelled, job B goes on")


def _lose_a_rollout_node(c: Cluster, events: dict, stamp) -> None:
    """Job C, `sbatch --no-kill` on four nodes with one learner node: rollout servers on node2 and
    node3, the reward server on node4, the learner waiting for both. Once both servers' groups are
    trained, node3's container is SIGKILLed; the job must go on (no requeue) on node2's server, which
    claims what node3 held. Cancelled once it has trained NUM_STEPS_C steps past the loss."""
    job_secrets = {"RLMESH_TOKEN": secrets.token_hex(32), "RLMESH_QUEUE_PASSWORD": secrets.token_hex(32)}
    job = events["job_c"] = c.submit_with_secrets(
        {**job_secrets, "RLMESH_LEARNER_NODES": "1"}, "--nodes=4", "--no-kill", "--output=/shared/slurm-%j.out",
        "/shared/rlmesh.sbatch", "/shared/run.yaml", "/shared/runs/c", "learner.num_steps=100000",
        "learner.min_generators=2", "checkpoint.every_n_steps=0", "rollout.cpu_cores=0-1")
    c.wait(lambda: {"node2-0", "node3-0"} <= set().union(*c.generators("/shared/runs/c"), set()), 900,
           "job C to train groups of both rollout servers", job)
    port = next(int(m) for m in re.findall(r"queue\.url=redis://node1:(\d+)/0", c.on_node("node1", "ps", "-eo", "args=")))
    probe = PENDING.format(port=port, password=job_secrets["RLMESH_QUEUE_PASSWORD"])
    pending = lambda: json.loads(c.on_node("node4", "python3", "-c", probe) or "{}")  # noqa: E731
    # Killed while node3's server holds claimed prompt groups: what the loss must not lose.
    c.wait(lambda: pending().get("node3-0", 0) > 0, 300, "node3's server to hold claimed prompt groups", job,
           every_s=0.2)
    c.docker("kill", c.container("node3"))
    events["c_killed_at_step"] = killed_at = c.train_steps("/shared/runs/c")
    events["c_pending_at_kill"] = json.dumps(pending())
    killed = time.monotonic()
    stamp(f"job C: node3 killed at step {killed_at}")
    # node3's claims idle out (queue.claim_idle_ms) and node2's server takes them; probed while the job runs.
    c.wait(lambda: pending().get("node3-0", 0) == 0, 600,
           "node3's claimed prompt groups to be taken over", job)
    events["c_pending_after"] = json.dumps(pending())
    events["c_claims_taken_after_s"] = time.monotonic() - killed
    c.wait(lambda: c.train_steps("/shared/runs/c") >= killed_at + NUM_STEPS_C
           and "is not started again" in c.read(f"/shared/slurm-{job}.out"), 900,
           f"job C to train {NUM_STEPS_C} steps without node3", job)
    events["c_steps_after_s"] = time.monotonic() - killed
    events["c_state"] = c.job_state(job)
    events["c_job"] = c.run("scontrol", "show", "job", job, check=False)
    events["c_generators"] = c.generators("/shared/runs/c")
    events["c_trained"] = c.read("/shared/runs/c/trained_groups.jsonl")
    events["c_node2_log"] = c.read("/shared/runs/c/logs/rollout-0-node2.log")
    c.run("scancel", job)
    c.wait(lambda: c.job_state(job) == "CANCELLED", 120, "job C to be cancelled", job)
    events["c_out"] = c.read(f"/shared/slurm-{job}.out")
    stamp("job C cancelled")


# Prompt groups each consumer of the job's prompt stream holds unacked (run's password; XPENDING only).
PENDING = """
import json, redis
r = redis.Redis(host="node1", port={port}, password={password!r}, socket_timeout=10)
print(json.dumps({{c["name"].decode(): int(c["pending"]) for c in r.xpending("rlmesh:prompts", "rollout")["consumers"]}}))
"""


# A stranger on the cluster network (node4 is on it): the job's Valkey on node1, without the password.
STRANGER = """
import redis
try:
    print("answered:", redis.Redis(host="node1", port={port}, socket_timeout=10).xlen("rlmesh:prompts"))
except Exception as err:
    print(type(err).__name__, err)
"""
# A compromised tier, with the password (from the learner's environment): the queue, and nothing more.
TIER = """
import redis
r = redis.Redis(host="node1", port={port}, password={password!r}, socket_timeout=10)
print("queue:", r.xlen("rlmesh:prompts"))
for command in (("CONFIG", "GET", "dir"), ("FLUSHALL",), ("KEYS", "*"), ("SHUTDOWN",)):
    try:
        r.execute_command(*command)
        print("ran", command[0])
    except redis.exceptions.NoPermissionError:
        print("refused", command[0])
"""


def _secrets_stay_in_the_environment(c: Cluster) -> dict:
    """The run's token and queue password, read from the learner's environment on node1 (as its own
    user: root in a container lacks CAP_SYS_PTRACE, which reading another user's environment takes); then
    whether either shows in any process's command line on any node or in any file under /shared."""
    pid = c.on_node("node1", "pgrep", "-u", "10001", "-f", "rlmesh.cli learner").split()[0]
    environ = c.on_node("node1", "cat", f"/proc/{pid}/environ", user="10001").split("\0")
    env = dict(item.split("=", 1) for item in environ if "=" in item)
    secrets = {k: env.get(k, "") for k in ("RLMESH_TOKEN", "RLMESH_QUEUE_PASSWORD")}
    found = {}
    for name, value in secrets.items():
        if not value:
            continue
        found[f"{name} in a command line"] = [node for node in NODES
                                              if value in c.on_node(node, "ps", "-eo", "args=")]
        found[f"{name} in /shared"] = c.run("grep", "-rlF", value, "/shared", check=False).split()
    port = next(int(m) for m in re.findall(r"queue\.url=redis://node1:(\d+)/0", c.on_node("node1", "ps", "-eo", "args=")))
    return {"have": {k: len(v) for k, v in secrets.items()}, "found": found, "valkey_port": port,
            "password": secrets["RLMESH_QUEUE_PASSWORD"]}


def test_the_job_spans_four_nodes_with_each_tier_where_the_script_put_it(slurm):
    out = slurm["slurm_out"]
    assert "on 4 node(s): node1,node2,node3,node4" in out, out
    assert "learner on node1,node2 (2 rank(s)" in out and "reward server on node4" in out, out
    logs = slurm["logs"]
    assert {"learner-node1.log", "learner-node2.log", "rollout-0-node3.log", "reward-node4.log",
            "valkey-node1.log"} <= set(logs), sorted(logs)
    assert "learner rank 1/2" in logs["learner-node2.log"], logs["learner-node2.log"][-2000:]
    assert "registered with learner as node3-0" in logs["rollout-0-node3.log"]


def test_the_job_learns_and_every_broadcast_is_verified_across_hosts(slurm):
    summary = json.loads(slurm["summary.json"])
    before, after = summary["held_out_accuracy_before"], summary["held_out_accuracy_after"]
    train = [r for r in map(json.loads, slurm["metrics.jsonl"].splitlines()) if r.get("kind") == "train"]
    # Learning is judged on the train reward (16 groups of 8 a step, the resumed run's rows where a
    # version ran twice): 20 held-out prompts move in steps of 0.05 and swing by 0.15 between
    # evaluations of one run, so held-out accuracy is asked only not to fall by more than that swing
    # (CI failed on 0.70 -> 0.65, one prompt, on 2026-11-29, with the train reward 0.36 -> 0.76).
    by_version = {r["version"]: r["reward_mean"] for r in train}
    rewards = [by_version[v] for v in sorted(by_version)]
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    print(f"slurm: train reward {first:.2f} -> {last:.2f}; held-out accuracy {before:.2f} -> {after:.2f}; "
          f"resumed from {summary['resumed_from']}")
    assert len(rewards) == NUM_STEPS and last >= first + 0.2, f"train reward did not rise: {first:.2f} -> {last:.2f}"
    assert after >= before - 0.15, f"held-out accuracy fell by more than its swing: {before} -> {after}"
    assert summary["num_ranks"] == 2
    assert summary["last_weights_sha256"] == summary["learner_weights_sha256"]
    assert train and all(r["weights_verified"] == 1.0 for r in train), "a broadcast went unverified"
    assert all(set(r["groups_by_generator"]) == {"node3-0"} for r in train)


def test_a_lost_node_requeues_the_job_which_resumes_with_nothing_lost_or_trained_twice(slurm):
    out = slurm["slurm_out"]
    assert f"job {slurm['job']} run 1 on 4 node(s)" in out, "the job ran a second time after the node loss"
    summary = json.loads(slurm["summary.json"])
    assert CHECKPOINT_EVERY <= summary["resumed_from"] <= slurm["killed_at_step"], (summary["resumed_from"], slurm["killed_at_step"])
    rows = [json.loads(line) for line in slurm["trained_groups.jsonl"].splitlines()]
    lineage = surviving_lineage(rows)
    trained = [g for r in lineage for g in r["group_ids"]]
    assert [r["version"] for r in lineage] == list(range(1, NUM_STEPS + 1))
    assert len(trained) == len(set(trained)) == NUM_STEPS * GROUPS_PER_STEP, "a group was trained twice"
    lost_steps = [r for r in rows if "group_ids" in r and r not in lineage]
    assert lost_steps, "the node was lost between checkpoints: the steps past the newest one were lost with it"
    dropped = {json.loads(line)["group_id"] for line in slurm["dropped"].splitlines()}
    lost = [g for r in lost_steps for g in r["group_ids"] if g not in set(trained) | dropped]
    print(f"slurm: {sum(len(r['group_ids']) for r in lost_steps)} groups trained in lost steps; dropped on record: "
          f"{sorted(set(json.loads(line)['reason'] for line in slurm['dropped'].splitlines()))}")
    assert lost == [], f"groups trained only in lost steps vanished: {lost[:5]}"
    print(f"slurm: node2 killed at step {slurm['killed_at_step']}, requeued after {slurm['requeued_after_s']:.0f} s")


def test_a_finished_job_and_a_cancelled_job_leave_no_process_on_any_node(slurm):
    assert any(slurm["running_before_scancel"].values()), "job B ran processes the check could see"
    assert slurm["after_scancel"] == {node: [] for node in NODES}, slurm["after_scancel"]
    assert slurm["after_completion"] == {node: [] for node in NODES}, slurm["after_completion"]
    assert slurm["containers_left"] == []


def test_secrets_reach_the_tiers_only_through_their_environment(slurm):
    secrets = slurm["secrets"]
    assert secrets["have"] == {"RLMESH_TOKEN": 64, "RLMESH_QUEUE_PASSWORD": 64}, secrets
    assert all(where == [] for where in secrets["found"].values()), secrets["found"]
    print(f"slurm: a client without the password, from node4: {slurm['stranger'].strip()}")
    assert slurm["job_b_state_after_probes"] == "RUNNING"
    assert "AuthenticationError" in slurm["stranger"] or "NOAUTH" in slurm["stranger"], slurm["stranger"]
    # a tier's password works the queue and nothing more
    assert slurm["tier"].split() == ["queue:", slurm["tier"].split()[1], "refused", "CONFIG", "refused", "FLUSHALL",
                                     "refused", "KEYS", "refused", "SHUTDOWN"], slurm["tier"]


@pytest.mark.skipif(not JOIN, reason="opt-in: RLMESH_TEST_SLURM_JOIN=1 (about 6 more minutes here)")
def test_a_join_job_adds_a_rollout_node_to_the_running_job_and_leaves_without_loss(slurm):
    """`sbatch --nodes=1 rlmesh.sbatch --join RUN_DIR` while job B trains: its rollout server on node4 gets
    the running job's weights and its groups are trained; `scancel` of it leaves job B running and
    training on its own rollout server, with no group trained twice."""
    join, left = slurm["join_job"], slurm["join_left"]
    joiner = f"node4-0-j{join}"
    assert f"job {join} joins job {slurm['job_b']} with rollout servers on node4" in left["join_out"], left["join_out"]
    generators = left["generators"]
    print(f"slurm: join job {join}: its first groups trained {slurm['join_trained_after_s']:.0f} s after sbatch; "
          f"job B's steps by rollout server: {[sorted(g) for g in generators]}")
    assert any(joiner in g for g in generators[: left["steps_at_leave"]]), generators
    print(f"slurm: node4 empty {slurm['join_node4_empty_after_s']:.0f} s after the join job left the queue")
    assert left["job_b"] == "RUNNING" and left["node4"] == [], left
    # Groups the join job's server published before it left may still be trained a step or two later
    # (within the staleness bound); the last steps are the job's own server's alone.
    assert len(generators) >= left["steps_at_leave"] + 4 and all(g == {"node2-0"} for g in generators[-2:]), generators
    trained = [g for r in map(json.loads, left["trained_groups"].splitlines()) for g in r.get("group_ids", [])]
    assert trained and len(trained) == len(set(trained)), "a group was trained twice"


@pytest.mark.skipif(not NODE_LOSS, reason="opt-in: RLMESH_TEST_SLURM_NODE_LOSS=1 (about 8 more minutes here)")
def test_losing_a_rollout_node_costs_its_claims_only_with_no_requeue_nothing_lost_or_trained_twice(slurm):
    """Job C (`--no-kill`) loses node3, one of its two rollout nodes, mid-run: the script lets that server
    go, node2's server claims the prompt groups node3 held, and the job trains on, each step once,
    without a requeue."""
    out, job = slurm["c_out"], slurm["job_c"]
    print(f"slurm: job C: node3 killed at step {slurm['c_killed_at_step']}; pending by consumer then "
          f"{slurm['c_pending_at_kill'].strip()}, {slurm['c_claims_taken_after_s']:.0f} s later "
          f"{slurm['c_pending_after'].strip()}; {NUM_STEPS_C} more steps {slurm['c_steps_after_s']:.0f} s after the kill")
    assert slurm["c_state"] == "RUNNING" and "Restarts=0" in slurm["c_job"], slurm["c_job"]
    assert f"job {job} run 1 on" not in out, "the job was requeued"
    assert "rollout-node3-0 on node3 exited" in out and "is not started again" in out, out[-3000:]
    assert json.loads(slurm["c_pending_after"]).get("node3-0", 0) == 0, slurm["c_pending_after"]
    steps = [r for r in map(json.loads, slurm["c_trained"].splitlines()) if "group_ids" in r]
    trained = [g for r in steps for g in r["group_ids"]]
    assert [r["version"] for r in steps] == list(range(1, len(steps) + 1)), [r["version"] for r in steps]
    assert len(steps) >= slurm["c_killed_at_step"] + NUM_STEPS_C
    assert len(trained) == len(set(trained)) == len(steps) * GROUPS_PER_STEP, "a group was trained twice"
    generators = slurm["c_generators"]
    assert all(g == {"node2-0"} for g in generators[-4:]), generators  # the last steps: node2's server alone
    assert json.loads(slurm["c_pending_at_kill"])["node3-0"] > 0  # killed holding claims ...
    assert "left pending by a dead rollout server" in slurm["c_node2_log"], slurm["c_node2_log"][-3000:]  # taken over
