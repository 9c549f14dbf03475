"""What an environment server `rlmesh up` starts gets of its environment: the basics, rlmesh's own
service settings and the mesh token, the names in `reward.env_server_env`; never the queue password,
a tracker's key or the hub token. And its memory limit reaches its command line."""

from __future__ import annotations

from rlmesh.env_servers import env_server_environment
from rlmesh.services.config import RunConfig

PLANTED = {"PATH": "/usr/bin", "HOME": "/home/u", "PYTHONPATH": "/src", "RLMESH_TOKEN": "mesh-token",
           "RLMESH_TLS_CERT": "/tls/reward.pem", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318",
           "RLMESH_QUEUE_PASSWORD": "queue-secret", "WANDB_API_KEY": "tracker-secret", "HF_TOKEN": "hub-secret",
           "AWS_SECRET_ACCESS_KEY": "cloud-secret", "JUDGE_KEY": "named", "HF_HOME": "/cache/hf"}


def test_an_environment_server_gets_the_basics_the_mesh_token_and_what_is_named_only(monkeypatch):
    for k in list(__import__("os").environ):
        monkeypatch.delenv(k)
    for k, v in PLANTED.items():
        monkeypatch.setenv(k, v)
    config = RunConfig.model_validate({"reward": {"env_server_env": ["JUDGE_KEY"]}})
    env = env_server_environment(config, {"RLMESH_RUN_DIR": "/runs/r1"})
    assert env == {"PATH": "/usr/bin", "HOME": "/home/u", "PYTHONPATH": "/src", "RLMESH_TOKEN": "mesh-token",
                   "RLMESH_TLS_CERT": "/tls/reward.pem", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318",
                   "JUDGE_KEY": "named", "HF_HOME": "/cache/hf", "RLMESH_RUN_DIR": "/runs/r1"}
    # A queue password the mesh made for this run (rlmesh up's embedded Valkey) is withheld too, and so is a
    # password under another name, while a token under another name is passed.
    config = RunConfig.model_validate({"queue": {"password_env": "MY_QUEUE_PW"}, "network": {"token_env": "MY_TOKEN"}})
    env = env_server_environment(config, {"MY_QUEUE_PW": "made-for-the-run", "MY_TOKEN": "t"})
    assert "MY_QUEUE_PW" not in env and env["MY_TOKEN"] == "t" and "JUDGE_KEY" not in env
