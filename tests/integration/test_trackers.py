"""Metrics written through MetricsWriter with every tracker on come back through each tracker's own
reader: TensorBoard's EventAccumulator, the W&B offline run file (wandb's DataStore), MLflow's
client. A second writer on the same run directory continues the same runs (resume)."""

import json
from pathlib import Path

import pytest

from rlmesh.learner.trackers.metrics import MetricsWriter
from rlmesh.learner.trackers import build_trackers
from rlmesh.services.config import LoggingSection

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def _wandb_service_stopped():
    """W&B runs its writer as a service process that lives as long as the process that used it (a
    learner's ends with the learner); this test process goes on, so it stops the service itself."""
    yield
    import wandb

    wandb.teardown()


def _write(run_dir: Path, logging: LoggingSection, versions: range, config: dict) -> None:
    writer = MetricsWriter(run_dir, trackers=build_trackers(logging, run_dir, "trk", config))
    for v in versions:
        writer.write({"kind": "train", "version": v, "reward_mean": v / 10, "grad_norm": 1.0 + v,
                      "groups_by_generator": {"g0": 2}, "last_weights_sha256": "ab"})
    writer.write({"kind": "eval", "version": versions[-1], "accuracy": 0.5, "accuracy_by_env": {"math": 0.25}})
    png = run_dir / "reward_curve.png"
    if not png.exists():
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        plt.plot([0, 1], [0, 1])
        plt.savefig(png)
        plt.close()
    writer.log_image("reward_curve", png, versions[-1])
    writer.close()


def _wandb_records(path: Path) -> list[bytes]:
    """The records of a W&B transaction log (`run-<id>.wandb`, what `wandb sync` uploads): a 7-byte
    header (":W&B", magic 0xBEE1, version 0), then LevelDB-log framing in 32 KiB blocks, each chunk
    `crc32 (4) | length (2, little-endian) | type (1: full, 2: first, 3: middle, 4: last)`. wandb
    0.31 writes it from its Go core and ships no Python reader any more (DataStore is gone)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B" and data[4:6] == b"\xe1\xbe", data[:7]
    records, pending, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            records.append(pending)
    return records


def _wandb_history(run_dir: Path) -> list[dict]:
    import json

    from wandb.proto import wandb_internal_pb2

    rows = []
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        for data in _wandb_records(path):
            rec = wandb_internal_pb2.Record.FromString(data)
            if rec.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in rec.history.item})
    return rows


def test_every_tracker_reads_back_the_step_metrics(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logging = LoggingSection(trackers=["jsonl", "tensorboard", "wandb", "mlflow"])
    config = {"run": {"name": "trk", "seed": 3}, "learner": {"lr": 1e-5, "num_steps": 4}}
    _write(tmp_path, logging, range(1, 3), config)
    _write(tmp_path, logging, range(3, 5), config)  # a resumed learner: same run directory
    assert (tmp_path / "metrics.jsonl").read_text().count('"kind": "train"') == 4

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"images": 0}).Reload()
    assert [(e.step, round(e.value, 3)) for e in events.Scalars("train/reward_mean")] == \
        [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.4)]
    assert [e.value for e in events.Scalars("eval/accuracy_by_env/math")] == [0.25, 0.25]
    assert "reward_curve" in events.Tags()["images"]
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    start = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    assert HParamsPluginData.FromString(start).session_start_info.hparams["learner.lr"].number_value == 1e-5

    history = _wandb_history(tmp_path)
    steps = {row["_step"]: row for row in history}
    assert {s: steps[s]["train/reward_mean"] for s in (1, 2, 3, 4)} == {1: 0.1, 2: 0.2, 3: 0.3, 4: 0.4}
    assert steps[4]["eval/accuracy"] == 0.5
    assert len(list(tmp_path.glob("wandb/offline-run-*"))) == 2  # two processes, one run id
    run_ids = {p.name.rsplit("-", 1)[1] for p in tmp_path.glob("wandb/offline-run-*")}
    assert run_ids == {(tmp_path / "wandb_run_id.txt").read_text().strip()}

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    run_id = (tmp_path / "mlflow_run_id.txt").read_text().strip()
    history = client.get_metric_history(run_id, "train/reward_mean")
    assert sorted((m.step, m.value) for m in history) == [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.4)]
    run = client.get_run(run_id)
    assert run.data.params["learner.lr"] == "1e-05"
    assert "reward_curve.png" in [a.path for a in client.list_artifacts(run_id)]
    assert len(client.search_runs([run.info.experiment_id])) == 1


def test_sft_and_dpo_steps_reach_the_trackers_as_their_own_runs(tmp_path, monkeypatch):
    """`rlmesh dpo` with an SFT warm start, then an RL writer on the same run directory: each stage is
    its own tracker run (TensorBoard sub-run, MLflow run `<run>-<stage>`), so the offline steps, which
    count from 1 again, never land among the RL steps."""
    from rlmesh.learner.recipes.dpo import run_dpo
    from rlmesh.services.config import load_config

    monkeypatch.setenv("WANDB_MODE", "offline")
    config = load_config(None, ["sft.num_steps=3", "sft.batch_size=8", "dpo.num_steps=2", "dpo.batch_size=8",
                                "learner.micro_batch_size=8", "learner.torch_threads=1", "data.num_eval=4",
                                "logging.trackers=[jsonl,tensorboard,mlflow]"])
    out = tmp_path / "run"
    run_dpo(config, out, show_progress=False)
    _write(out, config.logging, range(1, 3), config.model_dump(mode="json"))  # the RL learner after it

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def tb(logdir: Path) -> EventAccumulator:
        return EventAccumulator(str(logdir)).Reload()

    sft, dpo, rl = tb(out / "tensorboard" / "sft"), tb(out / "tensorboard" / "dpo"), tb(out / "tensorboard")
    assert [e.step for e in sft.Scalars("train/nll")] == [1, 2, 3]
    assert [e.step for e in dpo.Scalars("train/loss")] == [1, 2]
    assert [e.step for e in dpo.Scalars("eval/preference_accuracy")] == [0, 2]
    assert "train/nll" not in rl.Tags()["scalars"] and "train/loss" not in rl.Tags()["scalars"]
    assert [e.step for e in rl.Scalars("train/reward_mean")] == [1, 2]
    jsonl = [json.loads(line) for line in (out / "sft_metrics.jsonl").read_text().splitlines()]
    assert [round(e.value, 5) for e in sft.Scalars("train/nll")] == [round(r["nll"], 5) for r in jsonl]

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(out / "mlruns").resolve().as_uri())
    runs = {r.info.run_name: r for r in client.search_runs([client.get_experiment_by_name("rlmesh").experiment_id])}
    assert set(runs) == {"trk", "run-sft", "run-dpo"}  # _write names the RL run "trk"
    nll = client.get_metric_history(runs["run-sft"].info.run_id, "train/nll")
    assert sorted(m.step for m in nll) == [1, 2, 3]
    assert runs["run-sft"].data.params["sft.num_steps"] == "3"
    assert "train/nll" not in runs["trk"].data.metrics and "train/reward_mean" in runs["trk"].data.metrics
