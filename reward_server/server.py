"""`rlmesh reward`: serve RewardService."""

from __future__ import annotations

import argparse
import os

import uvloop

from rlmesh.reward_server.environments.math import MathEnvironment
from rlmesh.reward_server.environments.code import CodeEnvironment
from rlmesh.reward_server.environments.judge import JudgeEnvironment
from rlmesh.reward_server.environments.mcp_tools import McpToolEnvironment
from rlmesh.reward_server.environments.openenv_remote import OpenEnvEnvironment
from rlmesh.reward_server.sandbox import Sandbox, SandboxLimits
from rlmesh.reward_server.service import BUILTIN, RewardService
from rlmesh.v1 import reward_pb2, reward_pb2_grpc
from rlmesh.services.auth import TLSFiles, load_token
from rlmesh.services.config import RunConfig
from rlmesh.services.grpc_server import start_server
from rlmesh.services.telemetry import setup_logging

SERVICE_NAME = reward_pb2.DESCRIPTOR.services_by_name["RewardService"].full_name


async def serve(config: RunConfig, port: int) -> None:
    log = setup_logging("reward", config.logging.level)
    token = load_token(config.network.token_file, config.network.token_env)
    section = config.reward
    service = RewardService(
        # A name declared remote is served by its remote server, never by the built-in of that name.
        {k: v for k, v in section.functions.items() if k not in section.remote},
        builtin=[name for name in BUILTIN if name not in section.remote and name != "math"],
        token=token, remote_timeout_s=section.score_timeout_s,
        env_timeout_s=section.env_timeout_s,
        env_max_concurrency=section.env_max_concurrency,
        session_idle_timeout_s=section.session_idle_timeout_s,
        replica_id=section.replica_id or os.environ.get("RLMESH_REPLICA_ID") or None,
    )
    # Names in `remote` (e.g. run by `rlmesh up` in an env process of their own) are proxied, not built here.
    for name, mcp in _local(section.mcp, section.remote):
        service.add_local(name, McpToolEnvironment(name, mcp.url, command=mcp.command, env=mcp.env, cwd=mcp.cwd,
                                                   score=mcp.score, max_turns=mcp.max_turns,
                                                   call_timeout_s=mcp.call_timeout_s))
    for name, code in _local(section.code, section.remote):
        limits = SandboxLimits(**code.model_dump(exclude={"tests_key", "python"}))
        sandbox = Sandbox(limits, python=code.python, max_concurrency=section.env_max_concurrency)
        service.add_local(name, CodeEnvironment(name, sandbox, tests_key=code.tests_key))
    for name, judge in _local(section.judge, section.remote):
        service.add_local(name, JudgeEnvironment(name, **judge.model_dump()))
    if "math" not in section.remote:  # the built-in math environment, with its settings from reward.math
        service.add_local("math", MathEnvironment(**section.math.model_dump()))
    for name, env in section.openenv.items():
        service.add_local(name, OpenEnvEnvironment(name, env.url, **env.model_dump(exclude={"url"})))
    for name, address in section.remote.items():
        await service.register_remote(name, address)
    server = await start_server(
        [(reward_pb2_grpc.add_RewardServiceServicer_to_server, service, SERVICE_NAME)],
        host=config.network.host, port=port, token=token, tls=TLSFiles.from_env(),
    )
    log.info("reward server on port %d (replica %s); environments: %s", server.port, service.sessions.replica,
             ", ".join(e.name for e in service.environments()))
    await server.serve_forever(grace_s=5.0)


def _local(envs: dict, remote: dict) -> list:
    return [(name, env) for name, env in envs.items() if name not in remote]


def main(config: RunConfig, args: argparse.Namespace) -> int:
    port = args.port if args.port is not None else int(config.network.reward_addresses[0].rsplit(":", 1)[1])
    uvloop.run(serve(config, port))
    return 0
