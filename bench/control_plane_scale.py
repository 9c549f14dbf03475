"""Control plane at scale: one real learner control plane and one real Valkey against N simulated
rollout servers, for N in `--clients` (10,100,1000 by default; 10,000 runs on 2 cores), side by side.

learner (this process, real code): the LearnerService gRPC server (`rlmesh.learner.rl.membership`), the
          prompt issuer, the trajectory admission (`rlmesh.learner.rl.admission`, every group validated
          against what was issued, read while a step trains by `TrajectoryReader.admit_during`) and the
          weight broadcaster's control plane (`rlmesh.learner.rl.broadcast`: InitWeightTransfer at each
          group rebuild; then per step one entry on a Valkey stream that every server follows and
          answers on a report stream (`rlmesh.services.weights.announce`), or with --control calls one
          UpdateWeights call per server (it pauses, receives, loads and resumes inside it); + digest
          check). The bytes are not moved: a simulated transport forms no gloo group (a 1,001-rank gloo
          group is not what this measures). It runs on uvloop, as every rlmesh tier does.
clients (`--sim-procs` other processes): N asyncio tasks speaking the real protocols: RegisterGenerator, a
          Heartbeat at the interval the learner's replies set (`rlmesh.learner.rl.membership`), and the
          real queue protocol on the same Valkey (read a prompt group from the consumer group,
          "generate" for `--gen-s`, publish a well-formed TrajectoryGroup of `--group-size` samples x
          `--completion-tokens` tokens with logprobs, ack the prompt); a fake RolloutService gRPC
          servicer in each process answers the control RPCs, on N ports in all (so the learner holds
          N channels, N TCP connections). Each server follows the announce stream on a Valkey connection
          of its own, or, with `--follow process` (what `auto` picks where Valkey's file descriptors
          do not allow two connections a server: 10,000 on this machine's hard limit of 20,000), one
          reader per simulator process hands each entry to all its servers, each of which answers it
          itself (`ProcessFollower`).
The training step is a stand-in: `--step-s` seconds of a thread that sleeps (it holds no GIL, as a
GPU step mostly does not), run the way the controller runs its step (`rlmesh.learner.rl.controller`):
arrivals are admitted while it runs, and the prompt top-up after each broadcast runs in the
background. Per step the learner takes `--groups-per-step` groups (default N, one per server; with
max_staleness 1, twice that outstanding).

Printed per N: registration time, the control plane's wall time per step on the learner's critical
path (the step's wall time less the training stand-in and less waiting for generation: prompts
issued in the foreground, admission before and just after the step, ack, broadcast control RPCs),
as a share of the stand-in step and of a real demo step (`DEMO_STEP_S`), the learner process's CPU
per step (heartbeats and what ran beside training included), queue throughput, Valkey memory and
clients, p50/p99 latencies of register, heartbeat, claim (XREADGROUP), publish, ack and the weight-update
announcement's round trip (announced to reported, on Valkey's clock), and the check that every issued
group was trained exactly once: none lost, none duplicated.
Run: python bench/control_plane_scale.py [--clients 100,1000,10000 --groups-per-step 1000 --steps 4]"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import collections
import itertools
import json
import os
import random
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SIM_DIGEST = "simulated"
HEARTBEAT_S = 2.0  # rlmesh.rollout_server.server.HEARTBEAT_S, until the learner's first heartbeat reply
DEMO_STEP_S = 33.7
"""A real demo step: the demo config (examples/smollm2_grpo.yaml, 8 groups x 8 a step, max_staleness 1, one
core per tier) stepped every 33.7 s (mean of steps 2-6) in `bench/placement.py --runs split:1` on a 2-core
AMD EPYC, 2026-11-29 (docs/performance.md, row 5); the shipped config's six runs in docs/real-model.md trained
25.9-41.7 s a step."""


# --- the simulated rollout tier (second process) ------------------------------------------------

def straggle_s(slow_updates: str, rng: random.Random) -> float:
    """Seconds a simulated server takes to load one announced update under --slow-updates FRACTION:SECONDS:
    SECONDS with probability FRACTION, else none (drawn afresh for every server and update)."""
    if not slow_updates:
        return 0.0
    fraction, seconds = map(float, slow_updates.split(":"))
    return seconds if rng.random() < fraction else 0.0


def fake_rollout_servicer(control: str, queue_url: str, follow_by: str, slow_updates: str = ""):
    from rlmesh.services.queue import connect
    from rlmesh.services.weights.announce import follow_updates
    from rlmesh.services.weights.base import PROTOCOL_VERSION
    from rlmesh.v1 import rollout_pb2, rollout_pb2_grpc

    following: dict[str, asyncio.Task] = {}
    clients: dict = {}  # a Valkey client per simulated server, as each rollout server has its own
    process_follower = ProcessFollower(queue_url)

    class FakeRollout(rollout_pb2_grpc.RolloutServiceServicer):
        """Answers the weight-control RPCs as a rollout server whose weight receive is simulated.
        `versions`: what each server following announcements holds (it answers each entry itself);
        `version`: what every server holds when updates come as calls (one servicer answers all)."""

        version = 0
        versions: dict[str, int] = {}

        def held(self, generator_id: str) -> int:
            return self.versions.get(generator_id, self.version)

        async def InitWeightTransfer(self, request, context):
            follow = control == "announce" and bool(request.announce_stream and request.announce_public_key)
            if request.generator_id in following:  # as the rollout server: a new group replaces the old one's
                following.pop(request.generator_id).cancel()
            rng = random.Random(request.generator_id)

            async def apply(update, gid=request.generator_id):  # this servicer's update path, for one server
                await asyncio.sleep(straggle_s(slow_updates, rng))  # a straggler (--slow-updates) loads slowly
                reply = await self.UpdateWeights(update, None)
                self.versions[gid] = max(self.versions.get(gid, 0), update.version)
                return reply
            if follow and follow_by == "process":
                process_follower.join(request, apply)
            elif follow:  # the rollout server's own follower
                valkey = clients.setdefault(request.generator_id, connect(queue_url))
                following[request.generator_id] = asyncio.create_task(follow_updates(valkey, request, apply))
            return rollout_pb2.InitWeightTransferResponse(digest_algorithms=["blake3", "sha256"],
                                                          announced_updates=follow,
                                                          protocol_version=PROTOCOL_VERSION)

        async def UpdateWeights(self, request, context):
            self.version = max(self.version, request.version)
            return rollout_pb2.UpdateWeightsResponse(num_tensors=len(request.tensors), received_digests=[SIM_DIGEST],
                                                     digest_algorithm="blake3")

    return FakeRollout()


class ProcessFollower:
    """`--follow process`: one blocking read of the announce stream for all the simulated servers of a
    process, each of which then answers the entry itself (`announce.answer`: signature check, its update
    path, its own HMAC'd report) in order from an inbox of its own (one server slow to load an update
    holds back only its own next one), over a shared pool of 64 connections. 10,000 servers following on a
    connection each, beside each one's blocking prompt read, need 20,000+ Valkey connections, past one
    Valkey's file-descriptor hard limit on this machine (20,000); what the learner sees is the same."""

    def __init__(self, queue_url: str) -> None:
        self.queue_url, self.members, self.stream, self.task = queue_url, {}, "", None
        self.reader = self.reports = None

    def join(self, init, apply) -> None:
        import redis.asyncio as aioredis

        from rlmesh.services.queue import connect

        if self.reader is None:
            self.reader = connect(self.queue_url)
            self.reports = aioredis.Redis(connection_pool=aioredis.BlockingConnectionPool.from_url(
                self.queue_url, max_connections=64, timeout=None))
        if init.generator_id in self.members:  # a new group replaces the old one's
            self.members[init.generator_id][2].cancel()
        inbox: asyncio.Queue = asyncio.Queue()
        self.members[init.generator_id] = (init, inbox, asyncio.create_task(self.answer_in_order(init, apply, inbox)))
        if init.announce_stream != self.stream:  # a new group: the old one's stream is over
            if self.task is not None:
                self.task.cancel()
            self.stream, self.task = init.announce_stream, asyncio.create_task(self.run(init.announce_stream))

    async def answer_in_order(self, init, apply, inbox: asyncio.Queue) -> None:
        """One simulated server's follower past the shared read: each entry in turn, as `follow_updates` does."""
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

        from rlmesh.services.weights.announce import answer

        public_key = Ed25519PublicKey.from_public_bytes(init.announce_public_key)
        while True:
            await answer(self.reports, init, await inbox.get(), apply, public_key)

    async def run(self, stream: str) -> None:
        from rlmesh.services.weights.announce import BLOCK_MS, LOST

        last = "0-0"
        while True:
            try:
                got = await self.reader.xread({stream: last}, count=1, block=BLOCK_MS)
            except LOST as err:
                print(f"process follower: Valkey unreachable ({err!r}); retrying", file=sys.stderr)
                continue
            for _, entries in got or []:
                for entry_id, fields in entries:
                    last = entry_id
                    for init, inbox, _ in self.members.values():
                        if init.announce_stream == stream:
                            inbox.put_nowait(fields)


def trajectory(prompt, generator_id: str, completion_tokens: int, rng: random.Random, version: int,
               pool: list[int] | None = None):
    """A well-formed group; its token ids are slices of `pool` (random ids drawn once per client:
    drawing 2,048 a group cost the simulators more CPU than the learner spends on it)."""
    from rlmesh.v1 import common_pb2

    pool = pool or [rng.randrange(1, 1000) for _ in range(2 * completion_tokens)]
    samples = []
    for i in range(prompt.n):
        start = rng.randrange(len(pool) - completion_tokens + 1)
        ids = pool[start:start + completion_tokens]
        samples.append(common_pb2.Sample(
            index=i, completion=common_pb2.TokenSequence(token_ids=ids, loss_mask=[1] * len(ids)),
            logprobs=[-0.5] * len(ids), reward=float(i % 2), min_version=version,
            max_version=version, finish_reason="length"))
    return common_pb2.TrajectoryGroup(group_id=prompt.group_id, run_id=prompt.run_id, prompt=prompt,
                                      prompt_token_ids=list(range(1, 33)), samples=samples,
                                      generator_id=generator_id, generation_seconds=0.0)


async def simulate(args: argparse.Namespace) -> None:
    import grpc

    from rlmesh.services.config import QueueSection
    from rlmesh.services.grpc_client import make_channel
    import redis.asyncio as aioredis

    from rlmesh.services.queue import run_streams
    from rlmesh.v1 import common_pb2, learner_pb2, learner_pb2_grpc, rollout_pb2_grpc

    server, fake = grpc.aio.server(), fake_rollout_servicer(args.control, args.queue_url, args.follow,
                                                             args.slow_updates)
    rollout_pb2_grpc.add_RolloutServiceServicer_to_server(fake, server)
    ports = [bind(server, args.port_base and args.port_base + args.first_client + i) for i in range(args.num_clients)]
    await server.start()
    learner = learner_pb2_grpc.LearnerServiceStub(make_channel(args.learner, default_timeout_s=120))
    stop = asyncio.Event()
    errors: collections.Counter = collections.Counter()
    took: dict[str, list[float]] = collections.defaultdict(list)  # call -> seconds, each call

    async def client(i: int) -> float:
        i += args.first_client
        gid, rng = f"sim{i}", random.Random(i)
        pool = [rng.randrange(1, 1000) for _ in range(4 * args.completion_tokens)]
        # Its own queue client, as each rollout server has (a blocked read holds a connection), whose socket
        # timeout outlasts --idle-block-ms (`connect`'s 5 s does not).
        await asyncio.sleep(args.ramp_s * (i - args.first_client) / args.num_clients)
        prompts, trajectories = run_streams(aioredis.Redis.from_url(
            args.queue_url, socket_connect_timeout=30, socket_timeout=args.idle_block_ms / 1000 + 30,
            health_check_interval=30), QueueSection(url=args.queue_url))
        t0 = time.monotonic()
        for attempt in itertools.count():  # as the rollout server: again, backing off (LEARNER_STARTING)
            try:
                await learner.RegisterGenerator(learner_pb2.RegisterGeneratorRequest(
                    generator_id=gid, address=f"127.0.0.1:{ports[i - args.first_client]}", num_workers=1))
                break
            except grpc.aio.AioRpcError as err:
                errors[f"RegisterGenerator {err.code().name}"] += 1
                await asyncio.sleep(min(0.25 * 2 ** min(attempt, 2), 1.0) * rng.uniform(0.5, 1.5))
        registered = time.monotonic() - t0
        took["register"].append(registered)

        async def beat() -> None:
            await asyncio.sleep(rng.uniform(0, HEARTBEAT_S))
            interval_s = HEARTBEAT_S
            while not stop.is_set():
                try:
                    t = time.monotonic()
                    reply = await learner.Heartbeat(learner_pb2.HeartbeatRequest(generator_id=gid))
                    took["heartbeat"].append(time.monotonic() - t)
                    interval_s = reply.heartbeat_interval_s or HEARTBEAT_S  # as the rollout server does
                except grpc.aio.AioRpcError as err:
                    errors[f"Heartbeat {err.code().name}"] += 1
                await asyncio.sleep(interval_s)

        async def work() -> None:
            while not stop.is_set():
                t = time.time()
                entries = await prompts.read(gid, count=1, block_ms=args.idle_block_ms)
                for entry in entries:
                    # From the call, or from the entry's XADD (its id, Valkey's clock) if it came while
                    # the read was blocked: a server waiting for work is not a latency.
                    took["claim"].append(time.time() - max(t, int(entry.id.split("-")[0]) / 1000))
                    group = common_pb2.PromptGroup.FromString(entry.data)
                    t = time.monotonic()
                    while fake.held(gid) < group.issued_at_version:  # as a rollout server's worker waits
                        await asyncio.sleep(0.05)
                    took["weights_wait"].append(time.monotonic() - t)
                    version = fake.held(gid)  # the weights it generates with
                    await asyncio.sleep(args.gen_s * rng.uniform(0.5, 1.5))
                    data = trajectory(group, gid, args.completion_tokens, rng, version, pool).SerializeToString()
                    t = time.monotonic()
                    await trajectories.publish(group.group_id, data)
                    took["publish"].append(time.monotonic() - t)
                    t = time.monotonic()
                    await prompts.ack(entry.id)
                    took["ack"].append(time.monotonic() - t)

        asyncio.get_running_loop().create_task(beat())
        asyncio.get_running_loop().create_task(work())
        return registered

    times = await asyncio.gather(*(client(i) for i in range(args.num_clients)))
    print(json.dumps({"register_p50_s": sorted(times)[len(times) // 2], "register_max_s": max(times),
                      "register_failed": sum(v for k, v in errors.items() if k.startswith("Register"))}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)  # the learner says when
    stop.set()
    print(json.dumps({"client_errors": dict(errors),
                      "took": {k: [round(x, 5) for x in v] for k, v in took.items()}}), flush=True)


def bind(server, port: int) -> int:
    """A port for one simulated server: `port` where given and free (below the ephemeral range, which at
    10,000 servers their Valkey connections need), else one the system picks."""
    if port:
        try:
            if bound := server.add_insecure_port(f"127.0.0.1:{port}"):
                return bound
        except RuntimeError:  # taken
            pass
    return server.add_insecure_port("127.0.0.1:0")


# --- the learner (this process) -----------------------------------------------------------------

class SimulatedSender:
    """The gloo sender's interface with nothing moved: every worker 'receives' SIM_DIGEST."""

    engine, verifies, snapshots = "rlmesh_gloo", True, True

    def rendezvous(self, epoch: int):
        from rlmesh.services.weights.base import Rendezvous

        return Rendezvous("127.0.0.1", 1, prefix=f"sim/epoch{epoch}", secret=b"s" * 32)

    def form_group(self, epoch: int, world_size: int) -> None: ...

    def send(self, named, metas, digest_algorithm: str = "sha256") -> str:
        return SIM_DIGEST

    def send_flat(self, flats, metas, digest_algorithm: str = "sha256") -> str:
        return SIM_DIGEST

    def close(self) -> None: ...


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


class TimedAnnouncer:
    """The real UpdateAnnouncer, noting when each update was announced and every group's report stream,
    so that each report's round trip can be read off its stream entry's id (Valkey's clock) at the end."""

    def __init__(self, announcer) -> None:
        self.announcer, self.announced_at, self.report_keys = announcer, {}, []

    def __getattr__(self, name):
        return getattr(self.announcer, name)

    async def open(self, epoch: int) -> tuple[str, str]:
        keys = await self.announcer.open(epoch)
        self.report_keys.append(keys[1])
        return keys

    async def announce(self, request) -> None:
        self.announced_at[request.version] = time.time()
        await self.announcer.announce(request)

    async def round_trips(self) -> list[float]:
        """Seconds from each update's announcement to each server's report of it on the report stream."""
        from rlmesh.services.weights.announce import REPORT_FIELD
        from rlmesh.v1 import rollout_pb2

        out = []
        for key in self.report_keys:
            start = "-"
            while entries := await self.announcer.client.xrange(key, min=start, count=1000):
                for entry_id, fields in entries:
                    version = rollout_pb2.UpdateWeightsReport.FromString(fields[REPORT_FIELD]).version
                    if version in self.announced_at:
                        out.append(int(entry_id.split(b"-")[0]) / 1000 - self.announced_at[version])
                start = b"(" + entries[-1][0]
        return out


async def learner_run(n: int, args: argparse.Namespace, follow_by: str) -> dict:
    from rlmesh.learner.rl.admission import Admission
    from rlmesh.learner.rl.broadcast import WeightBroadcaster, WeightSource
    from rlmesh.learner.data.examples import Example
    from rlmesh.learner.rl.issuer import PromptIssuer
    from rlmesh.learner.rl.membership import LearnerService, Membership
    from rlmesh.learner.rl.reader import TrajectoryReader, mark_queues
    from rlmesh.learner.rl.validation import Bounds
    from rlmesh.services.config import NetworkSection, QueueSection, WeightSyncSection
    from rlmesh.services.grpc_server import ServerLimits, start_server
    from rlmesh.services.queue import connect, run_streams
    from rlmesh.services.valkey import start_embedded_valkey
    from rlmesh.services.weights.announce import UpdateAnnouncer
    from rlmesh.v1 import learner_pb2, learner_pb2_grpc

    import rlmesh.services.weights.wire  # noqa: F401 - torch, loaded before anyone calls, as in a real learner

    valkey = start_embedded_valkey()
    url = valkey.connection_url
    redis = connect(url)
    # Valkey's default of 10,000 clients is not enough past ~4,000 servers (a blocking prompt read and an
    # announcement follower each): as many as its file descriptors allow (it inherits this process's limit).
    await redis.config_set("maxclients", resource.getrlimit(resource.RLIMIT_NOFILE)[0] - 32)
    prompts, trajectories = run_streams(redis, QueueSection(url=url))
    run_id, state = f"scale{n}", {"version": 0}
    await mark_queues(prompts, trajectories, run_id)
    membership = Membership(token=None, rpc_timeout_s=120, expire_after_s=120)
    service = LearnerService(membership, run_id, lambda: learner_pb2.LearnerStatusResponse(),
                             lambda: state["version"])
    server = await start_server([(learner_pb2_grpc.add_LearnerServiceServicer_to_server, service,
                                  "rlmesh.v1.LearnerService")], port=0,
                                limits=ServerLimits.from_config(NetworkSection(), "learner"))
    # The simulated servers are spread over --sim-procs processes: one asyncio loop answering a
    # thousand servers' calls at once starves (its calls fail CANCELLED), which no real server does.
    procs = max(1, min(args.sim_procs, n))
    slices = [(n * k // procs, n * (k + 1) // procs) for k in range(procs)]
    sims = [subprocess.Popen([sys.executable, __file__, "--simulate", "--num-clients", str(hi - lo), "--first-client",
                              str(lo), "--learner", f"127.0.0.1:{server.port}", "--queue-url", url, "--gen-s",
                              str(args.gen_s), "--completion-tokens", str(args.completion_tokens),
                              "--control", args.control, "--follow", follow_by, "--port-base", str(args.port_base),
                              "--idle-block-ms", str(args.idle_block_ms), "--slow-updates", args.slow_updates,
                              "--ramp-s",
                              str(args.ramp_s if args.ramp_s is not None else n / 200)],
                             cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}) for lo, hi in slices]
    atexit.register(lambda: [sim.kill() for sim in sims])
    t0 = time.monotonic()
    lines = [json.loads(await asyncio.get_running_loop().run_in_executor(None, sim.stdout.readline)) for sim in sims]
    register = {"register_p50_s": max(x["register_p50_s"] for x in lines),
                "register_max_s": max(x["register_max_s"] for x in lines), "all_registered_s": time.monotonic() - t0,
                "register_failed": sum(x["register_failed"] for x in lines)}
    assert len(membership.generators) == n, f"{len(membership.generators)} of {n} registered"

    examples = [Example(id=str(i), messages=[{"role": "user", "content": f"{i} + {i}?"}], env="arithmetic",
                        metadata={"answer": str(2 * i)}) for i in range(1000)]
    B, k = args.groups_per_step or n, 1
    issuer = PromptIssuer(prompts, run_id, examples, group_size=args.group_size, groups_per_step=B, max_staleness=k)
    dropped: list[dict] = []
    admission = Admission(trajectories, type("W", (), {"write": lambda self, r: dropped.append(r)})(),
                          max_staleness=k, drop_zero_advantage_groups=False, ledger=issuer.ledger,
                          bounds=Bounds(vocab_size=1000, max_abs_reward=10, max_seq_len=4096))
    # Announced from the first server on (the real default, weight_sync.announce_min_servers, is 32).
    broadcaster = WeightBroadcaster(membership, WeightSyncSection(timeout_s=120, announce_min_servers=1),
                                    SimulatedSender(), lambda fn, *a: asyncio.to_thread(fn, *a),
                                    announcer=TimedAnnouncer(UpdateAnnouncer(redis)) if args.control == "announce" else None)
    source = WeightSource.of([])
    # The first broadcast forms the group (InitWeightTransfer to every server) and is not a step.
    state["version"] = 0
    t_init = time.monotonic()
    try:
        await broadcaster.broadcast(0, source)
    except Exception as err:  # noqa: BLE001 - reported as what broke
        broke = f"{type(err).__name__}: {str(err)[:160]}"
    else:
        broke = "" if len(membership.generators) == n else f"{n - len(membership.generators)} servers dropped"
        if not broke and broadcaster.announced != (args.control == "announce"):
            broke = f"--control {args.control}, but the group negotiated announced={broadcaster.announced}"
    init_s = time.monotonic() - t_init
    if broke:
        for sim in sims:
            sim.kill()
        await server.stop(0)
        valkey.stop()
        return {"clients": n, **register, "group_init_s": init_s, "broke": broke}

    reader = TrajectoryReader(prompts, trajectories, run_id=run_id, issuer=issuer, admission=admission,
                              membership=membership, metrics=None)
    buffer: list = []
    held_back: list = []  # eval groups: none are issued here
    trained: list[str] = []
    steps: list[dict] = []
    issuing: asyncio.Future | None = None

    background: list[dict] = []

    async def top_up(num_buffered: int, version: int) -> None:
        """The controller's prompt top-up: issue at `version` as soon as it is sent (each server
        generates once it holds it)."""
        t = time.monotonic()
        await issuer.issue_train(num_buffered, version)
        background.append({"issue_s": time.monotonic() - t})

    async def completion(record: dict) -> None:
        """When the update just sent has completed on every server (nothing on the learner waits for it)."""
        t = time.monotonic()
        record.update(await broadcaster.settled(), settle_s=time.monotonic() - t)

    completions: list[dict] = []
    watching: list[asyncio.Future] = []

    async def train_step() -> float:
        """The training stand-in: a thread busy for --step-s without the GIL; when it ended."""
        await asyncio.to_thread(time.sleep, args.step_s)
        return time.monotonic()

    profile = None
    if args.profile:
        import cProfile

        profile = cProfile.Profile()
        profile.enable()
    for _ in range(args.steps):
        version = state["version"]
        cpu0, wall0, waited, issue_s = time.process_time(), time.monotonic(), 0.0, 0.0
        buffer = [(e, g) for e, g in buffer if not await admission.drop_if_stale(e, g, version)]
        t = time.monotonic()
        for entry, group in held_back:  # arrived as the last step ended (the controller's _fill admits them first)
            if await admission.accept(entry, group, version):
                buffer.append((entry, group))
        held_back, admit_s = [], time.monotonic() - t
        while len(buffer) < B:  # the controller's _fill
            t = time.monotonic()
            if issuing is not None:
                await issuing
                issuing = None
            await issuer.issue_train(len(buffer), version)
            issue_s += time.monotonic() - t
            t = time.monotonic()
            await broadcaster.catch_up(version, source)
            arrivals, held_back = held_back + await reader.read(version), []
            t_read = time.monotonic()
            waited += t_read - t  # the read blocks until something arrives (at most 0.5 s)
            for entry, group in arrivals:
                if await admission.accept(entry, group, version):
                    buffer.append((entry, group))
            admit_s += time.monotonic() - t_read
        batch, buffer = buffer[:B], buffer[B:]
        t_train, cpu_train = time.monotonic(), time.process_time()
        admitted_before = len(buffer)
        step = asyncio.ensure_future(train_step())
        await reader.admit_during(step, version, buffer, held_back)
        t_trained = await step
        cpu_beside = time.process_time() - cpu_train  # what ran beside the training stand-in
        tail_s = time.monotonic() - t_trained  # the last read, after the step's end
        t = time.monotonic()
        for _, group in batch:
            admission.trained(group.group_id)
            trained.append(group.group_id)
        await trajectories.ack(*(entry.id for entry, _ in batch))
        ack_s = time.monotonic() - t
        state["version"] = version + 1
        metrics = await broadcaster.send(version + 1, source)
        issuing = asyncio.ensure_future(top_up(len(buffer), version + 1))
        completions.append({})
        watching.append(asyncio.ensure_future(completion(completions[-1])))
        wall = time.monotonic() - wall0
        train_s = t_trained - t_train
        steps.append({"issue_s": issue_s, "admit_s": admit_s, "tail_s": tail_s, "ack_s": ack_s,
                      "broadcast_s": metrics["broadcast_s"], "wall_s": wall, "waited_s": waited, "train_s": train_s,
                      "critical_s": wall - train_s - waited, "admitted_during_step": len(buffer) - admitted_before,
                      "cpu_s": time.process_time() - cpu0,
                      # the learner's CPU outside the training window: its critical path on a core of its own
                      "critical_cpu_s": time.process_time() - cpu0 - cpu_beside,
                      **{key: v for key, v in metrics.items() if key.startswith("broadcast_") and key.endswith("_s")}})
    if issuing is not None:
        await issuing
    await asyncio.gather(*watching)
    background = [{**b, **c} for b, c in zip(background, completions)]
    if profile is not None:
        profile.disable()
        profile.dump_stats(f"{args.profile}.{n}")
    if args.per_step:
        print(json.dumps({"clients": n, "steps": steps, "beside_steps": background}), file=sys.stderr)
    num_servers_after = len(membership.generators)  # a server that failed an update was dropped
    info, clients_info = await redis.info("memory"), await redis.info("clients")
    depth_p, depth_t = await prompts.depth(), await trajectories.depth()
    round_trips = await broadcaster.announcer.round_trips() if broadcaster.announcer is not None else []
    client_errors: collections.Counter = collections.Counter()
    took: dict[str, list[float]] = collections.defaultdict(list)
    for sim in sims:
        sim.stdin.write("stop\n")
        sim.stdin.flush()
    for sim in sims:
        said = json.loads(sim.stdout.readline() or "{}")
        client_errors.update(said.get("client_errors", {}))
        for call, seconds in said.get("took", {}).items():
            took[call].extend(seconds)
        sim.kill()
    took["announce_round_trip"] = round_trips
    await server.stop(0)
    for g in membership.generators.values():
        await g.channel.close()
    await redis.aclose()
    valkey.stop()

    med = lambda key: sorted(s.get(key, 0.0) for s in steps)[len(steps) // 2]  # noqa: E731
    issued_train = issuer.num_issued
    return {
        "clients": n, "groups_per_step": B, "steps": len(steps), **register, "group_init_s": init_s,
        **{f"{key}_p50": med(key) for key in steps[0]},
        **{f"bg_{key}_p50": sorted(b.get(key, 0.0) for b in background)[len(background) // 2] for key in
           ("settle_s", "issue_s", "broadcast_load_s")},
        "groups_per_s": len(trained) / sum(s["wall_s"] for s in steps),
        "valkey_used_mib": info["used_memory"] / 2**20, "valkey_peak_mib": info["used_memory_peak"] / 2**20,
        "trained": len(trained), "trained_unique": len(set(trained)), "issued": issued_train,
        "outstanding_after": issuer.ledger.in_flight, "buffered_after": len(buffer),
        "dropped": len(dropped), "duplicates": admission.num_duplicates,
        "lost": issued_train - len(trained) - issuer.ledger.in_flight - len(buffer) - len(dropped),
        "duplicated": len(trained) - len(set(trained)) + admission.num_duplicates,
        "critical_s_max": max(s["critical_s"] for s in steps[1:] or steps),
        "share_of_demo_step_p50": med("critical_s") / args.demo_step_s, "share_of_stand_in_p50": med("critical_s") / args.step_s,
        **{f"{call}_{q}_ms": 1000 * quantile(xs, x) for call, xs in took.items() for q, x in (("p50", 0.5), ("p99", 0.99))},
        **{f"num_{call}": len(xs) for call, xs in took.items()},
        "valkey_clients": clients_info["connected_clients"], "valkey_clients_mib": info.get("mem_clients_normal", 0) / 2**20,
        "follow_by": follow_by, "servers_after": num_servers_after,
        "prompt_stream_after": [depth_p.length, depth_p.lag], "trajectory_stream_after": [depth_t.length, depth_t.lag],
        "client_errors": dict(client_errors), "sim_procs": procs, "learner_maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", default="10,100,1000")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--completion-tokens", type=int, default=256)
    p.add_argument("--gen-s", type=float, default=1.0, help="simulated generation time of one group (x0.5-1.5)")
    p.add_argument("--step-s", type=float, default=10.0,
                   help="the training step's stand-in (seconds), which the overhead is a fraction of")
    p.add_argument("--control", choices=["announce", "calls"], default="announce",
                   help="announce: one Valkey stream entry per step, whatever the number of servers, each server "
                        "reporting on a second stream (weight_sync.announce_min_servers); "
                        "calls: one UpdateWeights call per server per step")
    p.add_argument("--groups-per-step", type=int, default=0,
                   help="groups a step trains (0: one per simulated server, N)")
    p.add_argument("--demo-step-s", type=float, default=DEMO_STEP_S,
                   help="a real demo step (seconds), the share's denominator; the default's source is at DEMO_STEP_S")
    p.add_argument("--follow", choices=["auto", "server", "process"], default="auto",
                   help="who follows the announce stream: each simulated server on a connection of its own, or one "
                        "reader per simulator process (ProcessFollower); auto: per server where Valkey's file "
                        "descriptors allow two connections a server")
    p.add_argument("--idle-block-ms", type=int, default=20000,
                   help="how long a simulated server's prompt read blocks (it returns as soon as a prompt arrives): "
                        "10,000 idle servers re-reading every 2.5 s took more CPU than the simulators' two cores have "
                        "(a rollout server blocks 200 ms; the learner sees none of it)")
    p.add_argument("--slow-updates", default="", metavar="FRACTION:SECONDS",
                   help="stragglers: each simulated server takes SECONDS to load an announced update with probability "
                        "FRACTION, drawn afresh per update (a busy node, a pause); e.g. 0.001:15")
    p.add_argument("--ramp-s", type=float, default=None,
                   help="the simulated servers start spread over this long (default N / 200 s: 50 s at 10,000)")
    p.add_argument("--profile", help="write the learner's cProfile stats of each N's steps to PATH.N")
    p.add_argument("--port-base", type=int, default=20000,
                   help="simulated server i listens on this + i (below the ephemeral range); 0: ports the system picks")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--per-step", action="store_true", help="print every step's timings (JSON) to stderr")
    p.add_argument("--simulate", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--sim-procs", type=int, default=8, help="processes the simulated servers are spread over")
    p.add_argument("--num-clients", type=int, help=argparse.SUPPRESS)
    p.add_argument("--first-client", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--learner", help=argparse.SUPPRESS)
    p.add_argument("--queue-url", help=argparse.SUPPRESS)
    args = p.parse_args()
    # Stopped (SIGTERM), it exits as on an error: interpreter exit stops Valkey, and the simulators (below).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    # Every simulated server is a Valkey connection or two, a listening socket and a learner channel:
    # as many file descriptors as the hard limit allows (the simulators and Valkey inherit it).
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    import uvloop  # the event loop every rlmesh tier runs on

    if args.simulate:
        uvloop.run(simulate(args))
        return
    load0 = os.getloadavg()
    results = []
    for n in map(int, args.clients.split(",")):
        if n + 256 > hard:
            raise SystemExit(f"{n} clients need {n + 256} file descriptors in the learner; the hard limit is {hard}")
        follow_by = args.follow if args.follow != "auto" else "server" if 2 * n + 256 < hard - 32 else "process"
        results.append(uvloop.run(learner_run(n, args, follow_by)))
        print(json.dumps(results[-1]), flush=True)
    broken = [r for r in results if r.get("broke")]
    for r in broken:
        print(f"{r['clients']} clients: BROKE at the first group formation ({r['group_init_s']:.1f} s): {r['broke']}")
    results = [r for r in results if not r.get("broke")]
    rows = [("clients", "clients", "d"), ("register all (s)", "all_registered_s", ".2f"), ("  calls failed, retried", "register_failed", "d"),
            ("group init (s)", "group_init_s", ".3f"), ("issue / step (s)", "issue_s_p50", ".3f"),
            ("admit / step (s)", "admit_s_p50", ".3f"), ("  after the step", "tail_s_p50", ".3f"),
            ("admitted during step", "admitted_during_step_p50", "d"), ("ack / step (s)", "ack_s_p50", ".3f"),
            ("broadcast ctl / step (s)", "broadcast_s_p50", ".3f"),
            ("  send (calls out)", "broadcast_send_s_p50", ".3f"),
            ("beside the next step:", None, ""), ("  update completes (s)", "bg_settle_s_p50", ".3f"),
            ("  prompts issued (s)", "bg_issue_s_p50", ".3f"),
            ("critical path / step (s)", "critical_s_p50", ".3f"), ("waited for generation (s)", "waited_s_p50", ".3f"),
            ("learner CPU / step (s)", "cpu_s_p50", ".3f"), ("  of it on the critical path", "critical_cpu_s_p50", ".3f"),
            ("groups/s through queue", "groups_per_s", ".0f"), ("valkey used (MiB)", "valkey_used_mib", ".1f"),
            ("valkey peak (MiB)", "valkey_peak_mib", ".1f"), ("learner max RSS (MiB)", "learner_maxrss_mib", ".0f"),
            ("servers at the end", "servers_after", "d"), ("valkey clients (end)", "valkey_clients", "d"), ("  their buffers (MiB)", "valkey_clients_mib", ".1f"),
            ("p50 / p99 (ms):", None, ""),
            *((f"  {call.replace('_', ' ')} p{q}", f"{call}_p{q}_ms", ".1f") for call in
              ("register", "heartbeat", "claim", "weights_wait", "publish", "ack", "announce_round_trip")
              for q in ("50", "99")),
            ("  announcement: all in (s)", "bg_settle_s_p50", ".3f"),
            ("trained / unique", None, ""), ("lost / dup / dropped", None, "")]
    print()
    for label, key, fmt in rows:
        if key is None and label.startswith(("beside", "p50")):
            cells = [""] * len(results)
        elif key is None and label.startswith("trained"):
            cells = [f"{r['trained']}/{r['trained_unique']}" for r in results]
        elif key is None:
            cells = [f"{r['lost']}/{r['duplicated']}/{r['dropped']}" for r in results]
        else:
            cells = [format(r[key], fmt) if key in r else "-" for r in results]
        print(f"{label:26s}" + "".join(f"{c:>12s}" for c in cells))
    print(f"{'share of a ' + format(args.step_s, 'g') + ' s stand-in':26s}"
          + "".join(f"{100 * r['share_of_stand_in_p50']:>11.2f}%" for r in results))
    print(f"{'share of a demo step':26s}" + "".join(f"{100 * r['share_of_demo_step_p50']:>11.2f}%" for r in results)
          + f"   (a real demo step: {args.demo_step_s:g} s)")
    print(f"{'  worst steady step':26s}"
          + "".join(f"{100 * r['critical_s_max'] / args.demo_step_s:>11.2f}%" for r in results))
    for r in results:
        if r["client_errors"]:
            print(f"{r['clients']} clients: failed calls {r['client_errors']}")
    print("announce stream followed per " + ", ".join(f"{r['follow_by']} at {r['clients']}" for r in results))
    print(f"control RPCs: {args.control}; {args.steps} steps, {args.group_size} samples x {args.completion_tokens} "
          f"tokens a group, generation {args.gen_s} s a group")
    print(f"load average at start {load0}, at end {os.getloadavg()} on {os.cpu_count()} cores")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
