"""The environment servers `rlmesh up` starts beside the main reward server: one for the environments
of `reward.env_processes` (this interpreter), and one per `verifiers` environment with an interpreter
of its own (`reward.verifiers.NAME.python`). Each is a reward server serving those environments alone,
which the main reward server proxies like any remote environment.

They run code rlmesh does not own (an environment author's package, a game), so each starts with what
it needs and no more: an address-space limit (`reward.env_server_memory_mb`, applied by `rlmesh reward
--memory-mb`) and an environment holding only the basics (path, locale, home, caches), rlmesh's own
service settings (`RLMESH_*`, `OTEL_*`: the mesh token and TLS files it authenticates calls with),
and the variables the user names in `reward.env_server_env` — never the queue password, a tracker's
key or a hub token."""

from __future__ import annotations

import os
from pathlib import Path

from rlmesh.processes import Mesh
from rlmesh.services.child_env import child_env
from rlmesh.services.config import RewardSection, RunConfig, dump_config
from rlmesh.services.ports import free_port

def env_server_environment(config: RunConfig, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The whole environment of an environment server, from this process's (with `extra`, the mesh's
    own additions, on top): the basics, PYTHONPATH, rlmesh's service settings and the mesh token, the
    names in `reward.env_server_env`, and never the queue password."""
    return child_env(["PYTHONPATH", config.network.token_env, *config.reward.env_server_env],
                     prefixes=("RLMESH_", "OTEL_"), withheld=[config.queue.password_env],
                     source={**os.environ, **(extra or {})})


def start_env_servers(mesh: Mesh, config: RunConfig, resolved: RunConfig, run_dir: Path) -> dict[str, int]:
    """Write each environment server's config and start it (under the memory limit, with the clean
    environment); `resolved.reward.remote` then names them for the main reward server. Returns
    {service name: port}, for the caller to wait on before starting the main reward server."""
    host = config.network.host
    ports = {name: free_port() for name in config.reward.env_processes}
    if ports:
        # One reward server serving every environment locally, proxied by the main one.
        env_config = resolved.model_copy(deep=True)
        env_config.reward.remote, env_config.reward.env_processes = {}, []
        dump_config(env_config, run_dir / "config.env.yaml")
        resolved.reward.remote = {**resolved.reward.remote, **{name: f"{host}:{p}" for name, p in ports.items()}}
    hubs = hub_servers(resolved, run_dir)
    env = env_server_environment(config, mesh.env)
    limit = ["--memory-mb", str(config.reward.env_server_memory_mb)]
    for name, port in ports.items():
        mesh.spawn(f"env-{name}", ["reward", "-c", str(run_dir / "config.env.yaml"), "--port", str(port), *limit],
                   env=env)
    for name, (python, port) in hubs.items():
        mesh.spawn(f"env-{name}", ["reward", "-c", str(run_dir / f"config.env-{name}.yaml"), "--port", str(port),
                                   *limit], python=python, env=env)
    ports.update({name: port for name, (_, port) in hubs.items()})
    return {f"env-{name}": port for name, port in ports.items()}


def hub_servers(resolved: RunConfig, run_dir: Path) -> dict[str, tuple[str, int]]:
    """The environments that run in an interpreter of their own (`reward.verifiers.NAME.python`, a
    virtualenv with `verifiers` and the environment's package): each gets an environment server started
    with that interpreter (its config written beside the run's), and the main reward server proxies it
    (`resolved.reward.remote` updated). Returns {name: (python, port)}."""
    hubs = {}
    for name, hub in resolved.reward.verifiers.items():
        if hub.python is None or name in resolved.reward.remote:
            continue
        if not Path(hub.python).is_file():
            raise SystemExit(f"rlmesh up: reward.verifiers.{name}.python={hub.python} is not a file; make the "
                             f"environment's virtualenv with `rlmesh venv --output DIR verifiers==0.3.1 PACKAGE` and "
                             f"name DIR/bin/python")
        port = free_port()
        own = resolved.model_copy(deep=True)
        # The reward section's settings (timeouts, limits) without any environment but this one, hosted there.
        settings = {k: v for k, v in resolved.reward.model_dump().items() if not isinstance(v, (dict, list))}
        own.reward = RewardSection(**settings, verifiers={name: hub.model_copy(update={"python": None})})
        dump_config(own, run_dir / f"config.env-{name}.yaml")
        resolved.reward.remote = {**resolved.reward.remote, name: f"{resolved.network.host}:{port}"}
        hubs[name] = (hub.python, port)
    return hubs
