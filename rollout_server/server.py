"""`rlmesh rollout`: a vLLM rollout server. Wires the generator, the queue worker, the gRPC
servicer and membership with the learner (register, heartbeat, re-register): `serve` is
`start_engine`, `build` and `run`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import uvloop

from rlmesh.v1 import learner_pb2, learner_pb2_grpc, reward_pb2_grpc, rollout_pb2, rollout_pb2_grpc
from rlmesh.rollout_server.agents import AgentRunner
from rlmesh.rollout_server.episode import EpisodeRunner
from rlmesh.rollout_server.generator import VLLMGenerator
from rlmesh.rollout_server.reward_client import Replica, RewardPool
from rlmesh.rollout_server.service import RolloutService
from rlmesh.rollout_server.worker import RolloutWorker
from rlmesh.services.auth import ANY, Policy, TLSFiles, check_can_serve, load_token
from rlmesh.services.config import HFModelSection, RunConfig
from rlmesh.services.grpc_client import make_channel, rpc_problem
from rlmesh.services.grpc_server import ServerLimits, start_server
from rlmesh.services.prom import serve_metrics
from rlmesh.services.queue import StreamQueue, connect_queue, run_streams
from rlmesh.services.retry import Backoff, retry
from rlmesh.services.telemetry import setup_logging
from rlmesh.services.weights import build_receiver

SERVICE_NAME = rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"].full_name
HEARTBEAT_S = 2.0  # until the learner's first heartbeat reply sets the interval (HeartbeatResponse.heartbeat_interval_s)
# Under mutual TLS only the learner may move this server's weights or pause it: every method but
# Generate and GetStatus (new weight-plane methods included) is the learner's.
POLICY = Policy({"Generate": ANY, "GetStatus": ANY}, default=frozenset({"learner"}))
LEARNER_UNREACHABLE = Backoff(0.5, 10.0)
# Before the first registration the learner may simply not be up yet (`rlmesh up` starts it after
# SFT, this server before): ask every second at most, so it is found within a second of serving.
LEARNER_STARTING = Backoff(0.25, 1.0)


def model_path(config: RunConfig) -> str:
    if not isinstance(config.model, HFModelSection):
        raise ValueError("the rollout server needs model.type=hf with model.path; `rlmesh up` prepares the "
                         "tiny model and passes its path (or run `rlmesh tiny-model --output DIR` first)")
    return config.model.path


def refuse_untested_architecture(config: RunConfig, path: str) -> None:
    """A model whose in-place updates the family matrix does not prove is refused before vLLM loads
    (unless model.allow_untested_architecture): its weights could silently stop following the learner's."""
    from rlmesh.services.model_families import UnsupportedArchitecture, check_supported_architecture

    if getattr(config.model, "allow_untested_architecture", False) or not (Path(path) / "config.json").is_file():
        return
    try:
        check_supported_architecture(path)
    except UnsupportedArchitecture as err:
        raise SystemExit(f"rlmesh rollout: {err} (model.allow_untested_architecture=true starts anyway)") from None


def engine_dead(generator: VLLMGenerator) -> bool:
    return generator.engine is not None and generator.engine.errored


async def keep_membership(stub: learner_pb2_grpc.LearnerServiceStub, generator_id: str, address: str,
                          worker: RolloutWorker, generator: VLLMGenerator, log: logging.Logger) -> None:
    registered, interval_s = False, HEARTBEAT_S

    async def register_or_beat() -> None:
        nonlocal registered, interval_s
        if not registered:
            if engine_dead(generator):
                # Dying (watch_health exits the server): registered again, it would be a member the
                # learner's next weight-transfer group waits on until its timeout, after its
                # restarted successor has registered.
                await asyncio.sleep(1.0)
                return
            if await generator.recover_from_lost_learner():
                worker.ready.clear()
                log.warning("the learner went away during a weight update; weights marked incomplete, "
                            "serving nothing until the learner resends them")
            reply = await stub.RegisterGenerator(learner_pb2.RegisterGeneratorRequest(
                generator_id=generator_id, address=address, num_workers=1, version=generator.version))
            registered = True
            worker.learner_run_id = reply.run_id
            if reply.version == generator.version:
                worker.ready.set()  # both loaded the same initial weights
                log.info("registered with learner as %s at version %d; serving prompts", generator_id, reply.version)
            else:
                log.info("registered as %s; learner is at version %d, waiting for its weights",
                         generator_id, reply.version)
        else:
            hb = await stub.Heartbeat(learner_pb2.HeartbeatRequest(
                generator_id=generator_id, version=generator.version, num_inflight_groups=worker.num_inflight))
            interval_s = hb.heartbeat_interval_s or HEARTBEAT_S  # 0: a learner that predates the field
            if not hb.registered:
                log.warning("learner no longer knows %s; registering again", generator_id)
                registered = False

    ever_registered = False
    while True:
        await retry(register_or_beat, what="learner unreachable", retry_on=grpc.aio.AioRpcError,
                    backoff=LEARNER_UNREACHABLE if ever_registered else LEARNER_STARTING,
                    log_every_s=0.0 if ever_registered else 10.0, describe=rpc_problem, log=log)
        ever_registered = ever_registered or registered
        if registered:  # one that the learner forgot registers again at once
            await asyncio.sleep(interval_s)


class EngineDeadError(RuntimeError):
    """vLLM's engine died under the server (e.g. its engine-core process was OOM-killed)."""


async def watch_health(server, generator: VLLMGenerator, worker: RolloutWorker, queues: list[StreamQueue],
                       log: logging.Logger) -> None:
    """Liveness ("") follows the vLLM engine: when it dies the server says NOT_SERVING and exits
    non-zero, so a supervisor restarts it instead of it failing every prompt forever. Readiness
    (the RolloutService name) also needs the queue reachable and the learner's current weights."""
    ready = True
    while True:
        await asyncio.sleep(1.0)
        if engine_dead(generator):
            await server.set_serving(False)
            worker.ready.clear()
            raise EngineDeadError(f"vLLM engine died ({generator.engine.dead_error!r}); exiting so that a "
                                  "supervisor restarts this rollout server (its pending prompts are claimed)")
        now_ready = worker.ready.is_set() and all(q.connected for q in queues)
        if now_ready != ready:
            await server.set_serving(now_ready, names=[SERVICE_NAME])
            ready = now_ready
            log.info("readiness: %s", "SERVING" if ready else "NOT_SERVING (no current weights or queue unreachable)")


async def serve(config: RunConfig, args: argparse.Namespace) -> None:
    """Build the rollout server (`start_engine`, then `build`), then run it until it is stopped (`run`)."""
    log = setup_logging("rollout", config.logging.level, fmt=config.logging.format,
                        trace_file=config.logging.trace_file,
                        sample_ratio=config.logging.trace_sample_ratio)
    token = load_token(config.network.token_file, config.network.token_env)
    tls = TLSFiles.from_config(config.network, "rollout")
    check_can_serve(config.network.host, token=token, tls=tls, insecure=config.network.insecure)  # before vLLM loads
    if getattr(args, "await_model", None):
        await_model(getattr(args, "placeholder_model", None) or model_path(config), args.await_model, log)
    from rlmesh.services.precision import resolve_precision

    config = resolve_precision(config)  # rollout.dtype=learner: serve in the learner's compute dtype
    receiver = build_receiver(config.weight_sync)
    generator = await start_engine(config, args, receiver.engine)
    await run(await build(config, args, generator, receiver, token, tls, log), log)


def await_model(path: str, timeout_s: float, log: logging.Logger) -> None:
    """`--await-model`: `rlmesh up` starts this server beside the process that writes the model it loads
    first (the tiny model, or the model before the SFT warm start; written beside and renamed into place).
    vLLM's import (~11 s of one core) runs meanwhile instead of after; then this waits for the directory.
    It blocks the event loop, which has nothing else to run yet."""
    if Path(path).exists():
        return
    log.info("waiting up to %.0f s for %s (the model rlmesh up is preparing); importing vLLM meanwhile", timeout_s, path)
    import vllm.v1.engine.async_llm  # noqa: F401  (what VLLMEngine.start imports)

    deadline = time.monotonic() + timeout_s
    while not Path(path).exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"rlmesh rollout: {path} did not appear within --await-model {timeout_s:.0f} s")
        time.sleep(0.1)


async def start_engine(config: RunConfig, args: argparse.Namespace, weight_engine: str) -> VLLMGenerator:
    """vLLM loaded and ready to sample (warming up on placeholder weights until the first update)."""
    adapter = None
    if config.learner.lora.rank:
        from rlmesh.rollout_server.lora import ServedAdapter

        adapter = ServedAdapter(config.learner.lora)  # vLLM serves the base model plus the learner's adapter
    placeholder = getattr(args, "placeholder_model", None)
    if placeholder and adapter is not None:
        raise SystemExit("rlmesh rollout: --placeholder-model cannot be used with learner.lora.rank > 0 (the learner "
                         "broadcasts only the adapter, so the base model must already be the trained one)")
    refuse_untested_architecture(config, placeholder or model_path(config))
    generator = VLLMGenerator(placeholder or model_path(config), config.rollout, config.run.seed, weight_engine,
                              adapter, placeholder=bool(placeholder), prompt=config.prompt)
    if config.logging.metrics_port is not None:
        from rlmesh.rollout_server.prom import engine_stats_logger

        generator.stat_loggers.append(engine_stats_logger(config.logging.vllm_metrics))
    await generator.start()
    if config.logging.metrics_port is not None and not config.logging.vllm_metrics:
        from rlmesh.rollout_server.prom import skip_request_stats

        skip_request_stats(generator.engine)
    if placeholder:
        generator.start_warm_up()
    return generator


@dataclass
class Serving:
    """A built rollout server: its gRPC server, the parts it runs and how it is known to the learner."""

    server: Any
    generator: VLLMGenerator
    worker: RolloutWorker
    endpoint: Any
    learner: learner_pb2_grpc.LearnerServiceStub
    generator_id: str
    tasks: list[asyncio.Task]


async def build(config: RunConfig, args: argparse.Namespace, generator: VLLMGenerator, receiver, token: str | None,
                tls: TLSFiles | None, log: logging.Logger) -> Serving:
    """Around a started engine: the queue worker, reward and agent clients, the gRPC server (listening),
    metrics, and the background tasks (queue worker, membership, health)."""
    redis = connect_queue(config.queue, "rollout")
    prompts, trajectories = run_streams(redis, config.queue)
    rewards = RewardPool([Replica(address, reward_pb2_grpc.RewardServiceStub(
        make_channel(address, token=token, tls=tls, peer="reward", default_timeout_s=config.reward.score_timeout_s,
                     balanced=True)))
        for address in config.network.reward_addresses], timeout_s=config.reward.score_timeout_s)
    episodes = EpisodeRunner(generator, rewards, config.rollout.episode, config.rollout.max_model_len)
    endpoint = None
    if config.rollout.agent_endpoint.enabled:
        from rlmesh.rollout_server.agent_endpoint import AgentEndpoint

        endpoint = AgentEndpoint(generator, config.rollout.agent_endpoint, config.rollout, tls)
        await endpoint.start()
    # RunAgent waits for the agent's whole episode: its deadline is the agent's limit plus a margin.
    agents = AgentRunner(endpoint, rewards, config.reward.agent_timeout_s + 30.0)
    worker = RolloutWorker(generator, prompts, trajectories, rewards, episodes, consumer="pending",
                           max_concurrent_groups=config.rollout.max_concurrent_groups,
                           max_abs_reward=config.reward.max_abs_reward, queue_url=config.queue.url, agents=agents)
    service = RolloutService(generator, "pending", receiver, worker, on_weights=lambda version: worker.weights_changed(),
                             queue=redis)
    server = await start_server([(rollout_pb2_grpc.add_RolloutServiceServicer_to_server, service, SERVICE_NAME)],
                                host=config.network.host, port=args.port, token=token, tls=tls,
                                insecure=config.network.insecure, policy=POLICY,
                                limits=ServerLimits.from_config(config.network, "rollout"))
    address = f"{args.advertise_host or config.network.host}:{server.port}"
    generator_id = args.generator_id or address
    worker.consumer = service.generator_id = generator_id
    log.info("rollout server %s on port %d", generator_id, server.port)
    if serve_metrics(config, "rollout", generator_id) is not None:
        from rlmesh.rollout_server.prom import register

        register(generator, worker)

    learner_channel = make_channel(config.network.learner_address, token=token, tls=tls, peer="learner",
                                   default_timeout_s=config.network.rpc_timeout_s)
    learner = learner_pb2_grpc.LearnerServiceStub(learner_channel)
    tasks = [
        asyncio.create_task(worker.run(), name="queue-worker"),
        asyncio.create_task(keep_membership(learner, generator_id, address, worker, generator, log), name="membership"),
        asyncio.create_task(watch_health(server, generator, worker, [prompts, trajectories], log), name="health"),
    ]
    return Serving(server, generator, worker, endpoint, learner, generator_id, tasks)


async def run(built: Serving, log: logging.Logger) -> None:
    """Serve until a stop signal (deregister, stop the worker, drain calls) or until a background task
    dies (its error raised, never silently); then shut the engine down and exit the process."""
    server, generator, worker, tasks = built.server, built.generator, built.worker, built.tasks

    async def on_stop() -> None:
        try:
            await built.learner.Deregister(learner_pb2.DeregisterRequest(generator_id=built.generator_id), timeout=2.0)
        except grpc.aio.AioRpcError:
            pass  # the learner may already be gone
        for t in tasks:
            t.cancel()
        await worker.stop()
        if built.endpoint is not None:
            await built.endpoint.stop()
        log.info("deregistered and stopped the queue worker; draining calls")

    serving = asyncio.create_task(server.serve_forever(grace_s=5.0, on_stop=on_stop))
    done, _ = await asyncio.wait([serving, *tasks], return_when=asyncio.FIRST_COMPLETED)
    for t in done:
        if t is not serving and not t.cancelled() and t.exception() is not None:
            log.error("background task %s failed: %s", t.get_name(), t.exception(), exc_info=t.exception())
            await server.stop(1.0)
            try:
                generator.shutdown()
            except Exception as err:  # a dead engine may fail to shut down; exiting matters more
                log.warning("engine shutdown failed: %r", err)
            raise t.exception()
    log.info("stopped serving; shutting the engine down")
    t0 = time.monotonic()
    generator.shutdown()
    log.info("engine shut down in %.1fs; exiting", time.monotonic() - t0)
    # Everything the process owes is done (deregistered, calls drained, engine down). What is left
    # (the event loop's executor, threads vLLM's front-end started) once held the exit past `rlmesh
    # up`'s 10 s grace, after which it was SIGKILLed: exit now.
    from opentelemetry import trace

    provider = trace.get_tracer_provider()
    if hasattr(provider, "shutdown"):  # the SDK's: export the spans still queued
        provider.shutdown()
    logging.shutdown()
    os._exit(0)


def main(config: RunConfig, args: argparse.Namespace) -> int:
    # A model in a local directory needs no hub: offline, vLLM's start skips look-ups that cannot
    # succeed without one (~18 s a start where no hub is reachable). Set before huggingface_hub loads.
    path = getattr(args, "placeholder_model", None) or getattr(config.model, "path", "")
    if path and (Path(path).is_dir() or getattr(args, "await_model", None)):  # awaited: a local directory
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    uvloop.run(serve(config, args))
    return 0
