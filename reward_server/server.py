"""`rlmesh reward`: serve RewardService."""

from __future__ import annotations

import argparse
import dataclasses
import asyncio
import logging
import os

import uvloop

from rlmesh.reward_server.environments.agent import AgentEnvironment
from rlmesh.reward_server.environments.code import CodeEnvironment
from rlmesh.reward_server.environments.judge import JudgeEnvironment
from rlmesh.reward_server.environments.math import MathEnvironment
from rlmesh.reward_server.environments.mcp_tools import McpToolEnvironment
from rlmesh.reward_server.environments.openenv_remote import OpenEnvEnvironment
from rlmesh.reward_server.limits import RequestLimits
from rlmesh.reward_server.sandbox import Sandbox, SandboxLimits
from rlmesh.reward_server.environments.function import FunctionEnvironment
from rlmesh.reward_server.function_workers import WorkerLimits, limit_memory
from rlmesh.reward_server.registry import BUILTIN
from rlmesh.reward_server.service import RewardService
from rlmesh.v1 import reward_pb2, reward_pb2_grpc
from rlmesh.services.auth import ANY, Policy, TLSFiles, load_token
from rlmesh.services.config import RunConfig
from rlmesh.services.grpc_server import Server, ServerLimits, start_server
from rlmesh.services.prom import serve_metrics
from rlmesh.services.telemetry import setup_logging

SERVICE_NAME = reward_pb2.DESCRIPTOR.services_by_name["RewardService"].full_name
# Under mutual TLS only rollout servers start agent episodes (RunAgent runs the configured agent
# against the endpoint the caller names); every other method serves any tier.
POLICY = Policy({"RunAgent": frozenset({"rollout"})}, default=ANY)


def build_service(config: RunConfig, token: str | None, tls: TLSFiles | None) -> RewardService:
    """The reward service `config` describes, with its local environments (remote ones are
    registered by `serve`, which needs the loop)."""
    section = config.reward
    service = RewardService(
        # A name declared remote is served by its remote server, never by the built-in of that name.
        {k: v for k, v in section.functions.items() if k not in section.remote},
        builtin=[name for name in BUILTIN if name not in section.remote and name != "math"],
        token=token, remote_timeout_s=section.score_timeout_s, score_timeout_s=section.score_timeout_s,
        env_timeout_s=section.env_timeout_s,
        env_max_concurrency=section.env_max_concurrency,
        session_idle_timeout_s=section.session_idle_timeout_s,
        replica_id=section.replica_id or os.environ.get("RLMESH_REPLICA_ID") or None,
        allow_register=section.allow_register, limits=RequestLimits.from_config(section), tls=tls,
        function_limits=WorkerLimits.from_config(section),
    )
    # Names in `remote` (e.g. run by `rlmesh up` in an env process of their own) are proxied, not built here.
    for name, mcp in _local(section.mcp, section.remote):
        service.add_local(name, McpToolEnvironment(name, mcp.url, command=mcp.command, env=mcp.env, cwd=mcp.cwd,
                                                   score=mcp.score, max_turns=mcp.max_turns,
                                                   call_timeout_s=mcp.call_timeout_s))
    for name, code in _local(section.code, section.remote):
        sandbox = Sandbox(SandboxLimits.from_config(code), python=code.python,
                          max_concurrency=section.env_max_concurrency)
        service.add_local(name, CodeEnvironment(name, sandbox, tests_key=code.tests_key))
    for name, judge in _local(section.judge, section.remote):
        service.add_local(name, JudgeEnvironment(name, **judge.model_dump()))
    for name, path in _local(section.agents, section.remote):
        # Agents verify the rollout tier's HTTPS endpoint (where the mesh has TLS) with the mesh's CA.
        service.add_local(name, AgentEnvironment(name, path, timeout_s=section.agent_timeout_s,
                                                 env=tuple(section.function_env),
                                                 ca_file=tls.ca if tls is not None else None,
                                                 max_concurrency=section.agent_max_concurrency))
    if "math" not in section.remote:  # the built-in math environment, with its settings from reward.math
        service.add_local("math", MathEnvironment(**section.math.model_dump()))
    for name, env in section.openenv.items():
        service.add_local(name, OpenEnvEnvironment(name, env.url, **env.model_dump(exclude={"url"})))
    for name, hub in _local(section.verifiers, section.remote):
        from rlmesh.reward_server.environments.verifiers_env import make_environment

        service.add_local(name, make_environment(name, hub.env_id, hub.args, hub.timeout_s))
    return service


async def serve(config: RunConfig, port: int) -> None:
    log = setup_logging("reward", config.logging.level, fmt=config.logging.format,
                        trace_file=config.logging.trace_file,
                        sample_ratio=config.logging.trace_sample_ratio)
    token = load_token(config.network.token_file, config.network.token_env)
    tls = TLSFiles.from_config(config.network, "reward")
    try:
        service = build_service(config, token, tls)
    except ValueError as err:  # an environment or reward function that cannot load: its own message says why
        raise SystemExit(f"rlmesh reward: {err}") from None
    section = config.reward
    for name, address in section.remote.items():
        await service.register_remote(name, address)
    server = await start_server(
        [(reward_pb2_grpc.add_RewardServiceServicer_to_server, service, SERVICE_NAME)],
        host=config.network.host, port=port, token=token, tls=tls, insecure=config.network.insecure,
        limits=reward_limits(config), policy=POLICY,
    )
    if serve_metrics(config, "reward", f"reward-{server.port}") is not None:
        from rlmesh.reward_server.prom import register

        register(service.sessions)
    reaper = asyncio.create_task(service.close_idle_forever(), name="idle-sessions")
    function_health = asyncio.create_task(report_function_health(service, server), name="function-health")
    log.info("reward server on port %d (replica %s); environments: %s", server.port, service.sessions.replica,
             ", ".join(e.name for e in service.environments()))
    for env in service.environments():  # what each one is: its kind, and what loaded it (or where it is served)
        log.info("  %s: %s, %s", env.name, env.kind, env.remote_address and f"served by {env.remote_address}"
                 or env.description)
    await server.serve_forever(grace_s=5.0)
    reaper.cancel()
    function_health.cancel()
    for env in service.local.values():
        if isinstance(env, AgentEnvironment):
            env.close()  # agents still running are killed, not waited for


def reward_limits(config: RunConfig) -> ServerLimits:
    """The reward server's bounds. Its connections end after `network.reward_connection_age_s`, so
    that rollout servers resolve the reward name again and spread over replicas that joined; a call
    in flight then still has as long as a whole episode or agent run may take."""
    grace_s = max(config.rollout.episode.episode_timeout_s + config.rollout.episode.step_timeout_s,
                  config.reward.agent_timeout_s + 30.0, config.reward.score_timeout_s) + 30.0
    return dataclasses.replace(ServerLimits.from_config(config.network, "reward"),
                               max_connection_age_s=config.network.reward_connection_age_s,
                               connection_age_grace_s=grace_s)


async def report_function_health(service: RewardService, server: Server, period_s: float = 1.0) -> None:
    """Each user reward function's health under `rlmesh.v1.RewardService/<name>`: NOT_SERVING while
    all its worker processes are stuck or none can start (the server's own health is unchanged:
    other environments are still served)."""
    log = logging.getLogger(__name__)
    last: dict[str, str] = {}
    while True:
        for name, env in list(service.local.items()):
            if not isinstance(env, FunctionEnvironment):
                continue
            problem = env.healthy()
            if problem != last.get(name):
                last[name] = problem
                await server.set_serving(not problem, names=[f"{SERVICE_NAME}/{name}"])
                if problem:
                    log.warning("reward function %s is not serving: %s", name, problem)
                else:
                    log.info("reward function %s is serving", name)
        await asyncio.sleep(period_s)


def _local(envs: dict, remote: dict) -> list:
    return [(name, env) for name, env in envs.items() if name not in remote]


def main(config: RunConfig, args: argparse.Namespace) -> int:
    port = args.port if args.port is not None else int(config.network.reward_addresses[0].rsplit(":", 1)[1])
    if getattr(args, "memory_mb", None) is not None:
        if args.memory_mb < 256:
            raise SystemExit(f"rlmesh reward: --memory-mb {args.memory_mb} is below 256 MiB, too little for the "
                             f"server itself to start; give it at least 256 (reward.env_server_memory_mb)")
        limit_memory(args.memory_mb)
    uvloop.run(serve(config, port))
    return 0
