"""The learner's Prometheus metrics follow the metrics.jsonl records they are fed."""

from prometheus_client import REGISTRY

from rlmesh.learner.rl.prom import PrometheusTracker


def _value(name, **labels):
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_train_records_become_learner_metrics():
    before = {"trained": _value("rlmesh_learner_groups_trained_total"),
              "stale": _value("rlmesh_learner_groups_dropped_total", reason="stale"),
              "age1": _value("rlmesh_learner_staleness_versions_bucket", le="1.0"),
              "load": _value("rlmesh_learner_weight_update_phase_seconds_count", phase="load")}
    tracker = PrometheusTracker()
    record = {"kind": "train", "version": 5, "reward_mean": 0.5, "num_groups": 4, "num_tokens": 100,
              "step_s": 0.5, "train_s": 0.2, "broadcast_s": 0.1, "broadcast_load_s": 0.05,
              "staleness_counts": {"0": 1, "1": 3}, "num_dropped_stale": 2, "num_dropped_other": 0,
              "num_dropped_invalid": 0, "num_duplicates": 0, "in_flight": 8, "mismatch_kl": 0.01}
    tracker.log(record)
    tracker.log({**record, "version": 6, "num_dropped_stale": 3})  # cumulative in the record
    tracker.log({"kind": "eval", "version": 6, "accuracy": 0.75})
    assert _value("rlmesh_learner_policy_version") == 6
    assert _value("rlmesh_learner_groups_trained_total") - before["trained"] == 8
    assert _value("rlmesh_learner_groups_dropped_total", reason="stale") - before["stale"] == 3
    assert _value("rlmesh_learner_staleness_versions_bucket", le="1.0") - before["age1"] == 8
    assert _value("rlmesh_learner_weight_update_phase_seconds_count", phase="load") - before["load"] == 2
    assert _value("rlmesh_learner_mismatch_kl") == 0.01
    assert _value("rlmesh_learner_eval_accuracy") == 0.75
