"""The queue is closed to strangers: `rlmesh up`'s embedded Valkey refuses every client that has not
logged in with the run's random password, the logged-in user cannot wipe or reconfigure the
server, and no file of the run directory holds the password (or the run's token)."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
from redis.exceptions import AuthenticationError, NoPermissionError

from rlmesh.processes import Mesh
from rlmesh.services.config import dump_config, load_config
from rlmesh.services.queue import StreamQueue, connect_queue

pytestmark = pytest.mark.security


def _files_holding(run_dir: Path, secret: str) -> list[str]:
    return [str(p) for p in run_dir.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]


@pytest.fixture
def up_queue(tmp_path):
    """What `rlmesh up` does before it starts any service: the embedded queue, the secrets, the
    config files it writes into the run directory."""
    run_dir = tmp_path / "run"
    config = load_config(None, ["queue.url=embedded"])
    mesh = Mesh(run_dir)
    resolved = config.model_copy(deep=True)
    mesh.pass_secrets(config, resolved)
    dump_config(config, run_dir / "config.yaml")
    dump_config(resolved, run_dir / "config.resolved.yaml")
    yield mesh, resolved, run_dir
    mesh.stop()


def test_a_client_without_the_password_is_refused(up_queue):
    mesh, resolved, _ = up_queue
    stranger = redis.Redis.from_url(resolved.queue.url)
    for command in (("XADD", resolved.queue.trajectory_stream, "*", "key", "forged", "data", b"x"),
                    ("XLEN", resolved.queue.prompt_stream), ("FLUSHALL",), ("KEYS", "*"), ("CONFIG", "GET", "*")):
        with pytest.raises(NoPermissionError):
            stranger.execute_command(*command)
    with pytest.raises(AuthenticationError):
        redis.Redis.from_url(resolved.queue.url, username=resolved.queue.username, password="guess").ping()
    with pytest.raises(NoPermissionError):  # any password logs into the default user, which may only PING
        redis.Redis.from_url(resolved.queue.url, password="guess").xlen(resolved.queue.prompt_stream)


async def test_the_services_get_in_with_the_password_from_their_environment(up_queue, monkeypatch):
    mesh, resolved, _ = up_queue
    for name, value in mesh.env.items():  # what every service process inherits
        monkeypatch.setenv(name, value)
    client = connect_queue(resolved.queue, "learner")
    queue = StreamQueue(client, "sec:stream", group="learner", max_len=10)
    await queue.ensure_group()
    assert await queue.publish("g1", b"payload")
    # Even logged in, a service cannot wipe or reconfigure the server.
    for command in (("FLUSHALL",), ("CONFIG", "SET", "requirepass", ""), ("ACL", "SETUSER", "x", "on", ">p", "+@all")):
        with pytest.raises(NoPermissionError):
            await client.execute_command(*command)
    await client.aclose()


def test_no_file_of_the_run_directory_holds_the_password_or_token(up_queue):
    mesh, resolved, run_dir = up_queue
    password, token = mesh.env[resolved.queue.password_env], mesh.env[resolved.network.token_env]
    assert len(password) >= 32 and len(token) >= 32
    assert (run_dir / "valkey" / "valkey.conf").is_file()  # the server's own config sits in the run directory
    assert _files_holding(run_dir, password) == [] and _files_holding(run_dir, token) == []


def test_a_password_in_queue_url_is_redacted_and_moved_to_the_environment(tmp_path):
    config = load_config(None, ["queue.url=redis://app:s3cr%21t@queue.internal:6379/0"])
    mesh = Mesh(tmp_path / "run")
    resolved = config.model_copy(deep=True)
    mesh.pass_secrets(config, resolved)
    dump_config(config, tmp_path / "run" / "config.yaml")
    dump_config(resolved, tmp_path / "run" / "config.resolved.yaml")
    assert resolved.queue.url == "redis://app@queue.internal:6379/0"
    assert mesh.env[config.queue.password_env] == "s3cr!t"
    assert "redis://app:***@queue.internal" in (tmp_path / "run" / "config.yaml").read_text()
    assert _files_holding(tmp_path / "run", "s3cr") == []


def test_rlmesh_config_never_prints_a_password(capsys):
    from rlmesh.cli import main

    assert main(["config", "queue.url=redis://:hunter2@h:6379/0"]) == 0
    out = capsys.readouterr().out
    assert "hunter2" not in out and "redis://:***@h:6379/0" in out


def test_a_run_given_a_token_passes_that_one_and_makes_none(tmp_path, monkeypatch):
    monkeypatch.setenv("RLMESH_TOKEN", "given")
    config = load_config(None, ["queue.url=redis://127.0.0.1:1/0"])
    mesh = Mesh(tmp_path / "run")
    mesh.pass_secrets(config, config.model_copy(deep=True))
    assert "RLMESH_TOKEN" not in mesh.env  # the services inherit the given one


async def test_the_rollout_servers_claim_keepalive_logs_in_too(up_queue, monkeypatch):
    """The keep-alive runs on a connection of its own: it must carry the password as well, or the
    work a live rollout server holds would be claimed by others."""
    import asyncio

    mesh, resolved, _ = up_queue
    for name, value in mesh.env.items():
        monkeypatch.setenv(name, value)
    client = connect_queue(resolved.queue, "rollout")
    queue = StreamQueue(client, "sec:prompts", group="rollout", max_len=10)
    await queue.ensure_group()
    await queue.publish("g1", b"prompt")
    [entry] = await queue.read("r0", block_ms=100)
    await asyncio.sleep(0.5)
    queue.claim_refresher(resolved.queue.url)("r0", [entry.id])
    [pending] = await client.xpending_range("sec:prompts", "rollout", min="-", max="+", count=1)
    assert pending["time_since_delivered"] < 400
    await client.aclose()
