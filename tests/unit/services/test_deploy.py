"""The deploy manifests and docker-compose file: every run config they carry loads, and every
command they run parses with the real CLI."""

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from rlmesh.entrypoints.cli import build_parser
from rlmesh.services.config import load_config

REPO = Path(__file__).resolve().parents[3]


def _k8s_docs():
    for path in sorted((REPO / "deploy/k8s").glob("*.yaml")):
        yield from (d for d in yaml.safe_load_all(path.read_text()) if d)


def _containers(doc):
    spec = doc.get("spec", {})
    template = spec.get("template") or spec.get("jobTemplate", {}).get("spec", {}).get("template", {})
    return template.get("spec", {}).get("containers", [])


def test_k8s_configmap_run_config_loads(tmp_path):
    maps = [d for d in _k8s_docs() if d["kind"] == "ConfigMap"]
    assert maps
    (tmp_path / "run.yaml").write_text(maps[0]["data"]["run.yaml"])
    config = load_config(tmp_path / "run.yaml")
    assert config.queue.url.startswith("redis://") and config.weight_sync.store_port == 29500


def test_k8s_container_commands_parse():
    parser = build_parser()
    commands = [c["args"] for d in _k8s_docs() for c in _containers(d) if c.get("image", "").startswith("rlmesh")]
    assert {args[0] for args in commands} == {"sft", "learner", "reward", "rollout"}
    for args in commands:
        parser.parse_args(args)


def _compose_args(service: dict) -> list[str]:
    if "command" in service:
        return service["command"]
    script = service["entrypoint"][-1]  # sh -c "exec rlmesh rollout ... $$(hostname -i)"
    return script.split("rlmesh ", 1)[1].replace("$$(hostname -i)", "10.0.0.2").split()


def _in_repo(path: str) -> Path:
    """The compose file mounts deploy/ at /config; other paths are the image's /app = the repo."""
    return REPO / "deploy" / path.removeprefix("/config/") if path.startswith("/config/") else REPO / path


def test_compose_commands_parse_and_configs_load():
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    parser = build_parser()
    tiers = set()
    for service in compose["services"].values():
        if not service.get("image", "").startswith("${RLMESH_IMAGE:-rlmesh:cpu}"):
            continue
        parsed = parser.parse_args(_compose_args(service))
        tiers.add(parsed.command)
        load_config(_in_repo(parsed.config))
        if "healthcheck" in service:
            parser.parse_args(service["healthcheck"]["test"][2:])  # ["CMD", "rlmesh", "health", ...]
    assert tiers == {"sft", "reward", "learner", "rollout"}


def test_compose_and_k8s_run_the_same_image_config_and_commands():
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    k8s = {args[0]: args for d in _k8s_docs() for c in _containers(d) if c.get("image") == "rlmesh:cpu"
           for args in [c["args"]]}
    assert compose["x-rlmesh"]["image"] == "${RLMESH_IMAGE:-rlmesh:cpu}"
    for name, service in compose["services"].items():
        if name == "valkey":
            continue
        args = _compose_args(service)
        # Same tier, same flags; only the config path and run directory differ by deployment.
        assert {a for a in args if a.startswith("--")} <= {a for a in k8s[args[0]] if a.startswith("--")}
    maps = [d for d in _k8s_docs() if d["kind"] == "ConfigMap"]
    k8s_config = yaml.safe_load(maps[0]["data"]["run.yaml"])
    compose_config = yaml.safe_load((REPO / "deploy/compose.rlmesh.yaml").read_text())
    assert k8s_config["weight_sync"]["store_port"] == compose_config["weight_sync"]["store_port"]
    for section in ("model", "data", "algorithm", "learner"):
        assert k8s_config[section] == compose_config[section], f"{section} differs between compose and k8s"


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs the kubectl client")
def test_k8s_manifests_render_with_kustomize():
    out = subprocess.run(["kubectl", "kustomize", str(REPO / "deploy/k8s")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    rendered = {(d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(out.stdout) if d}
    files = {(d["kind"], d["metadata"]["name"]) for d in _k8s_docs() if d["kind"] != "Kustomization"}
    assert rendered == files
    images = {c["image"] for d in yaml.safe_load_all(out.stdout) if d for c in _containers(d)}
    assert images == {"rlmesh:cpu", "valkey/valkey:8"}
