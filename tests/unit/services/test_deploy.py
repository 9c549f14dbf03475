"""The deploy manifests and docker-compose file: every run config they carry loads, and every
command they run parses with the real CLI."""

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from rlmesh.cli import build_parser
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
    for service in compose["services"].values():
        if not service.get("image", "").startswith("${RLMESH_IMAGE:-rlmesh:cpu}"):
            continue  # valkey, prometheus
        args = _compose_args(service)
        # Same tier, same flags; only the config path and run directory differ by deployment.
        assert {a for a in args if a.startswith("--")} <= {a for a in k8s[args[0]] if a.startswith("--")}
    maps = [d for d in _k8s_docs() if d["kind"] == "ConfigMap"]
    k8s_config = yaml.safe_load(maps[0]["data"]["run.yaml"])
    compose_config = yaml.safe_load((REPO / "deploy/compose.rlmesh.yaml").read_text())
    assert k8s_config["weight_sync"]["store_port"] == compose_config["weight_sync"]["store_port"]
    for section in ("model", "data", "algorithm", "learner"):
        assert k8s_config[section] == compose_config[section], f"{section} differs between compose and k8s"


def test_compose_observability_profile_scrapes_every_tier_and_is_hardened():
    """Prometheus comes up only with `--profile observability`, hardened like the other services, on the
    host's loopback only, with deploy's scrape config finding every tier that serves /metrics there."""
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    prom = compose["services"]["prometheus"]
    assert prom["profiles"] == ["observability"]
    assert all("profiles" not in s for name, s in compose["services"].items() if name != "prometheus")
    assert prom["read_only"] and prom["cap_drop"] == ["ALL"] and "no-new-privileges:true" in prom["security_opt"]
    assert not prom["user"].startswith("0")
    assert all(port.startswith("127.0.0.1:") for port in prom["ports"]), prom["ports"]
    assert "./deploy/prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in prom["volumes"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in prom["command"]
    scrape = yaml.safe_load((REPO / "deploy/prometheus/prometheus.yml").read_text())
    (dns,) = [sd for job in scrape["scrape_configs"] for sd in job.get("dns_sd_configs", [])]
    port = load_config(REPO / "deploy/compose.rlmesh.yaml").logging.metrics_port
    served = {name for name, s in compose["services"].items()
              if s.get("image", "").startswith("${RLMESH_IMAGE") and name != "prepare"}  # prepare: a one-off job
    assert set(dns["names"]) == served and dns["port"] == port


@pytest.fixture(scope="module")
def rendered() -> list[dict]:
    """deploy/k8s as `kubectl apply -k` would apply it."""
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not on PATH: `kubectl kustomize deploy/k8s` renders the manifests these "
                    "tests check (Debian: apt-get install kubernetes-client)")
    out = subprocess.run(["kubectl", "kustomize", str(REPO / "deploy/k8s")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def test_k8s_manifests_render_with_kustomize(rendered):
    files = {(d["kind"], d["metadata"]["name"]) for d in _k8s_docs() if d["kind"] != "Kustomization"}
    assert {(d["kind"], d["metadata"]["name"]) for d in rendered} == files
    assert {c["image"] for d in rendered for c in _containers(d)} == {"rlmesh:cpu", "valkey/valkey:8"}


# --- security: pod hardening and network policies, as rendered by kustomize --------------------

APPS = ("rlmesh-learner", "rlmesh-rollout", "rlmesh-reward", "rlmesh-valkey")


def _pod_specs(docs: list[dict]) -> dict[str, dict]:
    out = {}
    for d in docs:
        template = d.get("spec", {}).get("template")
        if d["kind"] in ("Deployment", "Job") and template:
            out[d["metadata"]["name"]] = template["spec"]
    return out


def test_every_pod_runs_restricted(rendered):
    pods = _pod_specs(rendered)
    assert set(pods) == {*APPS, "rlmesh-prepare"}
    for name, pod in pods.items():
        ctx = pod["securityContext"]
        assert ctx["runAsNonRoot"] is True and ctx["runAsUser"] != 0, name
        assert ctx["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert pod["automountServiceAccountToken"] is False, name
        mounts_tmp = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
        for c in pod["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True, (name, sc)
            assert sc["capabilities"]["drop"] == ["ALL"] and "add" not in sc["capabilities"], (name, sc)
            assert c["resources"]["limits"]["memory"], f"{name} has no memory limit"
            assert any(m["mountPath"] == "/tmp" and m["name"] in mounts_tmp for m in c["volumeMounts"]), name


def test_data_volume_is_writable_only_where_outputs_are_written(rendered):
    pods = _pod_specs(rendered)

    def data_mounts(name):
        claims = {v["name"] for v in pods[name]["volumes"]
                  if v.get("persistentVolumeClaim", {}).get("claimName") == "rlmesh-data"}
        return [m for c in pods[name]["containers"] for m in c["volumeMounts"] if m["name"] in claims]

    assert all(not m.get("readOnly") for m in data_mounts("rlmesh-learner") + data_mounts("rlmesh-prepare"))
    assert data_mounts("rlmesh-rollout") and all(m.get("readOnly") for m in data_mounts("rlmesh-rollout"))
    assert data_mounts("rlmesh-reward") == []


def _selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def _peer_matches(peer: dict, labels: dict, namespace: str) -> bool:
    if "namespaceSelector" in peer:
        ns_labels = {"kubernetes.io/metadata.name": namespace}
        if not _selects(peer["namespaceSelector"], ns_labels):
            return False
    elif namespace != "rlmesh":
        return False  # a bare podSelector means pods of the policy's own namespace
    return _selects(peer.get("podSelector", {}), labels)


def _port_matches(rule: dict, port: int) -> bool:
    return "ports" not in rule or any(p["port"] == port and p.get("protocol", "TCP") == "TCP" for p in rule["ports"])


def _allowed(policies: list[dict], direction: str, pod: dict, peer: dict, peer_ns: str, port: int) -> bool:
    """Whether `pod` (labels) lets traffic in from / out to `peer` on `port`, NetworkPolicy semantics."""
    kind, key, peers_key = ("Ingress", "ingress", "from") if direction == "in" else ("Egress", "egress", "to")
    selecting = [p["spec"] for p in policies if _selects(p["spec"]["podSelector"], pod)
                 and kind in p["spec"].get("policyTypes", ["Ingress"])]
    if not selecting:
        return True
    return any(_port_matches(rule, port) and ("from" not in rule and "to" not in rule
                                              or any(_peer_matches(x, peer, peer_ns) for x in rule[peers_key]))
               for spec in selecting for rule in spec.get(key, []))


def _flow(policies, src: str, dst: str, port: int, src_ns: str = "rlmesh") -> bool:
    src_labels, dst_labels = {"app": src}, {"app": dst}
    egress = src_ns != "rlmesh" or _allowed(policies, "out", src_labels, dst_labels, "rlmesh", port)
    return egress and _allowed(policies, "in", dst_labels, src_labels, src_ns, port)


def test_network_policies_deny_by_default_and_allow_exactly_the_flows_each_port_needs(rendered):
    policies = [d for d in rendered if d["kind"] == "NetworkPolicy"]
    deny = [p for p in policies if p["spec"]["podSelector"] == {}
            and set(p["spec"]["policyTypes"]) == {"Ingress", "Egress"}
            and not p["spec"].get("ingress") and not p["spec"].get("egress")]
    assert deny, "a default-deny policy for every pod, both directions"
    needed = [("rlmesh-rollout", "rlmesh-learner", 50051), ("rlmesh-rollout", "rlmesh-learner", 29500),
              ("rlmesh-rollout", "rlmesh-reward", 50052), ("rlmesh-learner", "rlmesh-rollout", 50053),
              ("rlmesh-learner", "rlmesh-valkey", 6379), ("rlmesh-rollout", "rlmesh-valkey", 6379),
              # the weight broadcast's gloo/NCCL data connections (ephemeral ports, full mesh)
              ("rlmesh-rollout", "rlmesh-learner", 41234), ("rlmesh-learner", "rlmesh-rollout", 41234),
              ("rlmesh-rollout", "rlmesh-rollout", 41234)]
    for src, dst, port in needed:
        assert _flow(policies, src, dst, port), f"{src} -> {dst}:{port} must be allowed"
    refused = [("rlmesh-reward", "rlmesh-learner", 50051), ("rlmesh-reward", "rlmesh-learner", 29500),
               ("rlmesh-reward", "rlmesh-valkey", 6379), ("rlmesh-reward", "rlmesh-rollout", 50053),
               ("rlmesh-learner", "rlmesh-reward", 50052), ("rlmesh-valkey", "rlmesh-learner", 50051),
               ("rlmesh-learner", "rlmesh-valkey", 6380), ("rlmesh-rollout", "rlmesh-reward", 29500),
               ("rlmesh-prepare", "rlmesh-valkey", 6379)]
    for src, dst, port in refused:
        assert not _flow(policies, src, dst, port), f"{src} -> {dst}:{port} must be refused"
    for dst, port in [("rlmesh-learner", 50051), ("rlmesh-learner", 29500), ("rlmesh-rollout", 50053),
                      ("rlmesh-reward", 50052), ("rlmesh-valkey", 6379)]:
        assert not _flow(policies, "stranger", dst, port), f"a pod of another app reaches {dst}:{port}"
        assert not _flow(policies, "rlmesh-rollout", dst, port, src_ns="default"), f"another namespace reaches {dst}"
    assert _flow(policies, "keda-operator", "rlmesh-valkey", 6379, src_ns="keda"), "KEDA reads the stream lag"
    for dst in ("rlmesh-learner", "rlmesh-rollout", "rlmesh-reward"):
        assert _flow(policies, "prometheus", dst, 9400, src_ns="monitoring"), f"Prometheus scrapes {dst}"
        assert not _flow(policies, "stranger", dst, 9400), f"a pod of another app scrapes {dst}"
        assert not _flow(policies, "prometheus", dst, 50051, src_ns="monitoring"), "Prometheus reaches /metrics only"
    for app in (*APPS, "rlmesh-prepare"):
        dns = {"k8s-app": "kube-dns"}
        assert _allowed(policies, "out", {"app": app}, dns, "kube-system", 53), f"{app} resolves names"


def test_compose_requires_the_token_and_the_queue_password():
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    env = compose["x-rlmesh"]["environment"]
    for name in ("RLMESH_TOKEN", "RLMESH_QUEUE_PASSWORD"):
        assert env[name].startswith(f"${{{name}:?"), f"{name} must be required (no empty default): {env[name]}"
    valkey = compose["services"]["valkey"]
    command = valkey["command"]
    # the default user needs the password, and even with it runs no administrative command
    user = command[command.index("--user") + 1:]
    assert user[:2] == ["default", "on"] and user[2].startswith(">${RLMESH_QUEUE_PASSWORD:?")
    assert user[3:] == ["~*", "&*", "+@all", "-@dangerous"] and "--requirepass" not in command
    assert valkey["environment"]["VALKEYCLI_AUTH"].startswith("${RLMESH_QUEUE_PASSWORD:?")  # the healthcheck logs in


def test_k8s_secrets_are_required_and_valkey_needs_its_password(rendered):
    refs = {}
    for doc in rendered:
        for c in _containers(doc):
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert not ref.get("optional"), f"{doc['metadata']['name']}: secret {ref} must not be optional"
                    refs.setdefault(doc["metadata"]["name"], set()).add(e["name"])
    for tier in ("rlmesh-learner", "rlmesh-rollout", "rlmesh-reward"):
        assert "RLMESH_TOKEN" in refs[tier], tier
    for tier in ("rlmesh-learner", "rlmesh-rollout"):
        assert "RLMESH_QUEUE_PASSWORD" in refs[tier], tier
    assert "RLMESH_QUEUE_PASSWORD" not in refs["rlmesh-reward"]  # the reward tier never touches the queue
    [valkey] = [c for d in rendered if d["metadata"]["name"] == "rlmesh-valkey" for c in _containers(d)]
    args = valkey["args"]
    assert args[args.index("--user") + 1:] == ["default", "on", ">$(RLMESH_QUEUE_PASSWORD)", "~*", "&*", "+@all",
                                                "-@dangerous"]
    scaler = next(d for d in rendered if d["kind"] == "ScaledObject")
    auth = next(d for d in rendered if d["kind"] == "TriggerAuthentication")
    assert scaler["spec"]["triggers"][0]["authenticationRef"]["name"] == auth["metadata"]["name"]


def test_rollout_autoscaling_reads_the_runs_own_prompt_stream_and_reward_replicas_are_resolved_by_name(rendered):
    """KEDA's ScaledObject has no schema offline: what it must agree with is checked here. The scaler
    reads the lag of the prompt stream's rollout consumer group on the run's Valkey; the reward
    Service is headless, so its name resolves to every reward pod (rollout servers spread over them)."""
    from rlmesh.services.queue import PROMPT_GROUP

    config = load_config_text(next(d for d in rendered if d["kind"] == "ConfigMap")["data"]["run.yaml"])
    scaler = next(d for d in rendered if d["kind"] == "ScaledObject")
    [trigger] = scaler["spec"]["triggers"]
    assert trigger["type"] == "redis-streams"
    meta = trigger["metadata"]
    assert meta["stream"] == config.queue.prompt_stream and meta["consumerGroup"] == PROMPT_GROUP
    valkey = next(d for d in rendered if d["kind"] == "Service" and d["metadata"]["name"] == "rlmesh-valkey")
    host, port = meta["address"].rsplit(":", 1)
    assert config.queue.url.startswith(f"redis://{host}:{port}/") and int(port) == valkey["spec"]["ports"][0]["port"]
    assert int(meta["lagCount"]) > 0 and 1 <= scaler["spec"]["minReplicaCount"] < scaler["spec"]["maxReplicaCount"]
    assert any(d["kind"] == "Deployment" and d["metadata"]["name"] == scaler["spec"]["scaleTargetRef"]["name"]
               for d in rendered)
    reward = next(d for d in rendered if d["kind"] == "Service" and d["metadata"]["name"] == "rlmesh-reward")
    assert reward["spec"]["clusterIP"] == "None", "a ClusterIP pins each rollout server's connection to one pod"
    host, port = config.network.reward_address.rsplit(":", 1)
    assert host == "rlmesh-reward" and int(port) == reward["spec"]["ports"][0]["port"]
    hpa = next(d for d in rendered if d["kind"] == "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "rlmesh-reward"


def load_config_text(text: str):
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        f.write(text)
        f.flush()
        return load_config(f.name)


def test_every_tier_serves_metrics_where_its_scrape_annotations_say(rendered):
    config = yaml.safe_load(next(d for d in rendered if d["kind"] == "ConfigMap")["data"]["run.yaml"])
    port = config["logging"]["metrics_port"]
    for name in ("rlmesh-learner", "rlmesh-rollout", "rlmesh-reward"):
        template = next(d for d in rendered if d["kind"] == "Deployment" and d["metadata"]["name"] == name)["spec"]["template"]
        annotations = template["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true" and int(annotations["prometheus.io/port"]) == port
        assert port in [p["containerPort"] for c in template["spec"]["containers"] for p in c["ports"]]



# Kinds the Kubernetes API itself does not define: no OpenAPI schema exists offline for them.
CUSTOM_KINDS = {("kustomize.config.k8s.io/v1beta1", "Kustomization"), ("keda.sh/v1alpha1", "ScaledObject"),
                ("keda.sh/v1alpha1", "TriggerAuthentication")}
# The oldest Kubernetes still supported upstream when the manifests were checked, and the newest schemas shipped.
K8S_VERSIONS = ("1.32.0", "1.37.0")


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_k8s_manifests_are_valid_against_the_kubernetes_openapi_schemas(version):
    """Offline, strict (an unknown field is an error), with the schemas kubernetes-validate ships."""
    import kubernetes_validate

    checked = 0
    for doc in _k8s_docs():
        if (doc["apiVersion"], doc["kind"]) in CUSTOM_KINDS:
            continue
        kubernetes_validate.validate(doc, version, strict=True)
        checked += 1
    assert checked >= 10


def test_the_kustomization_lists_every_manifest_and_only_those():
    (kustomization,) = [d for d in _k8s_docs() if d["kind"] == "Kustomization"]
    manifests = {p.name for p in (REPO / "deploy/k8s").glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == manifests


def test_a_misspelt_field_fails_the_schema_check():
    import kubernetes_validate

    (deployment,) = [d for d in _k8s_docs() if d["kind"] == "Deployment" and "rollout" in d["metadata"]["name"]]
    broken = yaml.safe_load(yaml.safe_dump(deployment))
    broken["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Never"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSIONS[-1], strict=True)
