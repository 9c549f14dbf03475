"""The sections of the run config that connect the tiers: the queue, the weight broadcast, the
network (addresses, auth, TLS, limits) and logging."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rlmesh.services.config.base import Section


class QueueSection(Section):
    url: str = "embedded"
    """`embedded` starts a Valkey server for the run (with a random password); otherwise a redis:// or rediss:// (TLS) URL, best without a password in it (use password_file / password_env)."""
    username: str | None = None
    """ACL user the services log in as (`{tier}` becomes learner or rollout, for one ACL user per tier); unset: the default user."""
    password_file: str | None = None
    """File holding the queue password (`{tier}` becomes learner or rollout); takes precedence over password_env."""
    password_env: str = "RLMESH_QUEUE_PASSWORD"
    """Environment variable holding the queue password (unset: no password). Never written to config files."""
    tls_ca_file: str | None = None
    """CA certificate that verifies a rediss:// server (unset: the system's CAs)."""
    tls_cert_file: str | None = None
    """Client certificate for a rediss:// server that asks for one (`{tier}` allowed)."""
    tls_key_file: str | None = None
    """Key of tls_cert_file (`{tier}` allowed)."""
    prompt_stream: str = "rlmesh:prompts"
    """Stream of prompt groups (learner -> rollout)."""
    trajectory_stream: str = "rlmesh:trajectories"
    """Stream of trajectory groups (rollout -> learner)."""
    max_len: int = Field(10000, ge=1)
    """Unacked entries a stream may hold; producers wait beyond it (nothing is trimmed)."""
    claim_idle_ms: int = Field(60000, ge=100)
    """Entries pending this long on a dead consumer are claimed by another."""


class WeightSyncSection(Section):
    backend: Literal["gloo", "nccl"] = "gloo"
    """Broadcast transport: gloo (any host; every transfer digest-verified) or nccl (GPU learner and rollout servers, vLLM's NCCL engine; not yet run on a GPU)."""
    master_address: str = "127.0.0.1"
    """Address rollout servers dial to reach the learner's rendezvous store, and the only weight group they join: in containers the learner's host or Service name, never 0.0.0.0."""
    bind_address: str | None = None
    """Local interface the learner's rendezvous store listens on (unset: the one master_address resolves to); set it where master_address is not a local address, e.g. the pod IP behind a Service name."""
    store_port: int = Field(0, ge=0, le=65535)
    """Port of that store (0: any free port; fix it where a firewall or Service must name it)."""
    timeout_s: float = Field(120.0, gt=0)
    """Deadline of one broadcast round (rendezvous included)."""
    control_concurrency: int = Field(64, ge=1)
    """Most channels the learner dials at once when a transfer group forms (a thousand servers dialled in the same instant is a connection storm); InitWeightTransfer and UpdateWeights then go to every member at once, since each waits in a collective all members must enter."""
    digest_algorithm: Literal["blake3", "xxh3", "sha256"] = "blake3"
    """Digest both sides take of every gloo transfer: blake3 (cryptographic: catches tampering on the weight network), xxh3 (~5x faster, catches corruption only: for a weight network strangers cannot reach), or sha256; a group with a rollout server that cannot digest with it uses sha256."""
    announce_min_servers: int = Field(32, ge=1)
    """Groups of at least this many rollout servers get each update announced once on a Valkey stream (one entry, whatever the number of servers) instead of one UpdateWeights call per server; smaller groups, and any group with a server without Valkey, keep the calls."""
    snapshot: bool = True
    """Copy the weights into a buffer kept across updates and send from it on a thread of its own, so the next training step waits only for the copy (costs a second copy of the sent weights in memory; gloo only: nccl sends from the GPU)."""

    @model_validator(mode="after")
    def _dialable(self) -> "WeightSyncSection":
        if self.master_address in ("0.0.0.0", "::", ""):
            raise ValueError(f"weight_sync.master_address={self.master_address!r} is not an address rollout servers "
                             "can dial; give the learner's host name, IP or Service name (and weight_sync.bind_address "
                             "where that name is not a local interface)")
        return self


class TLSSection(Section):
    cert_file: str | None = None
    """PEM certificate this service presents, as a server and as a client (`{tier}` becomes learner, rollout or reward; `rlmesh tls-init` makes them); RLMESH_TLS_CERT overrides it."""
    key_file: str | None = None
    """PEM key of cert_file (`{tier}` allowed); RLMESH_TLS_KEY overrides it."""
    ca_file: str | None = None
    """PEM CA that signed every tier's certificate; RLMESH_TLS_CA overrides it. Set with cert_file: mutual TLS (servers refuse clients without a certificate from this CA, and the certificate's CN is the caller's tier)."""
    server_name_is_tier: bool = True
    """Clients check a server's certificate against its tier name (a DNS name `learner`, `rollout`, `reward` in the certificate) rather than the host dialled, so one certificate per tier serves any pod IP; false: against the host dialled."""


class LimitsSection(Section):
    learner_max_message_mib: int = Field(4, ge=1)
    """Largest request or response the learner's control-plane server accepts (MiB)."""
    rollout_max_message_mib: int = Field(32, ge=1)
    """Largest request or response a rollout server accepts (MiB): weight-update metadata lists every tensor's name and shape."""
    reward_max_message_mib: int = Field(64, ge=1)
    """Largest request or response a reward server accepts (MiB): a Score batch carries prompts and completions."""
    max_concurrent_rpcs: int = Field(4096, ge=1)
    """Calls one server runs at once; past it a call is refused with RESOURCE_EXHAUSTED."""
    max_metadata_kib: int = Field(16, ge=1)
    """Largest header metadata a server accepts per call (KiB)."""


class NetworkSection(Section):
    host: str = "127.0.0.1"
    """Interface services bind to. Anything but a loopback address needs a token (or mutual TLS), or `insecure: true`."""
    insecure: bool = False
    """Serve without a token on a non-loopback address (a trusted lab network only): anyone who reaches a port may then call it."""
    tls: TLSSection = TLSSection()
    """TLS on every gRPC channel, mutual when ca_file and cert_file are both set."""
    limits: LimitsSection = LimitsSection()
    """Bounds every gRPC server enforces."""
    learner_address: str = "127.0.0.1:50051"
    """Learner control plane."""
    reward_address: str = "127.0.0.1:50052"
    """Reward server name (host:port); rollout servers spread Score calls and episodes over every address it resolves to, and over several names comma-separated (`a:50052,b:50052`)."""
    reward_connection_age_s: float = Field(30.0, gt=0)
    """A reward server ends each client connection after this long (calls in flight finish first), so that rollout servers resolve the reward name again: replicas that join get calls within about this long."""
    token_env: str = "RLMESH_TOKEN"
    """Environment variable holding the shared bearer token (unset: no auth, allowed only on loopback or with `insecure`)."""
    token_file: str | None = None
    """File holding the shared bearer token (takes precedence over token_env)."""
    rpc_timeout_s: float = Field(30.0, gt=0)
    """Default deadline of a control-plane call."""


    @property
    def reward_addresses(self) -> list[str]:
        return [a.strip() for a in self.reward_address.split(",") if a.strip()]


class LoggingSection(Section):
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Log level of every service."""
    progress: bool = True
    """Show a progress bar in `rlmesh up`."""
    format: Literal["text", "json"] = "text"
    """Log lines as text, or one JSON object per line (service, level, message, group id, version, trace id)."""
    trackers: list[Literal["jsonl", "tensorboard", "wandb", "mlflow"]] = ["jsonl"]
    """Where the learner's step and eval metrics go; metrics.jsonl is always written (`pip install rlmesh[trackers]`)."""
    wandb_project: str = "rlmesh"
    """W&B project (offline unless WANDB_MODE=online; the run id is kept in the run directory)."""
    mlflow_tracking_uri: str | None = None
    """MLflow tracking URI (None: a file store in `<run_dir>/mlruns`)."""
    mlflow_experiment: str = "rlmesh"
    """MLflow experiment the run is logged under."""
    metrics_port: int | None = Field(None, ge=0, le=65535)
    """Prometheus /metrics port of every service, on network.host (0: any free port; ports written to `<run_dir>/metrics_ports/`; None: off)."""
    vllm_metrics: bool = False
    """Also serve vLLM's own `vllm:*` series on the rollout servers' /metrics (latency histograms per request; costs front-end CPU every engine step)."""
    trace_sample_ratio: float = Field(1.0, ge=0.0, le=1.0)
    """Fraction of prompt groups traced, decided where a group's trace starts and followed by every tier (the SDK's OTEL_TRACES_SAMPLER overrides)."""
    eval_samples: int = Field(16, ge=0)
    """Greedy held-out answers written per evaluation to `<run_dir>/eval_samples.jsonl` (the prompt's last message, the completion's text, reward, verdict, finish reason), the first N in the eval set's order: what the model actually wrote, for when accuracy looks wrong (0: none)."""
    trace_file: bool = False
    """Also write every span as one JSON object per line to `<run_dir>/traces/<service>-<pid>.jsonl` (OTLP is used when OTEL_EXPORTER_OTLP_ENDPOINT is set)."""
