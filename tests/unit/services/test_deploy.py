"""The deploy manifests and docker-compose file: every run config they carry loads, and every
command they run parses with the real CLI."""

from pathlib import Path

import yaml

from entrypoints.cli import build_parser
from services.config import load_config

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


def test_compose_commands_parse_and_configs_load():
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    parser = build_parser()
    tiers = set()
    for name, service in compose["services"].items():
        if service.get("image") != "rlmesh:cpu" and "<<" not in service:
            continue
        args = service.get("command") or service["entrypoint"][-1].split("rlmesh ", 1)[1].replace("$$(hostname -i)", "10.0.0.2").split()
        parsed = parser.parse_args(args)
        tiers.add(parsed.command)
        load_config(REPO / parsed.config)
    assert tiers == {"sft", "reward", "learner", "rollout"}
