"""The Grafana dashboard queries only metrics the tiers define (a renamed metric breaks this)."""

import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
DEFINED_IN = ["learner/rl/prom.py", "rollout_server/prom.py", "reward_server/prom.py"]


def test_every_dashboard_query_names_a_defined_metric():
    source = "".join((REPO / f).read_text() for f in DEFINED_IN)
    defined = {n.removesuffix("_total") for n in re.findall(r'"(rlmesh_[a-z_]+)"', source)}
    dashboard = json.loads((REPO / "deploy/grafana/rlmesh.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {re.sub(r"_(total|bucket|sum|count)$", "", m) for e in exprs for m in re.findall(r"rlmesh_[a-z_]+", e)}
    assert used and used <= defined, used - defined
    # counters are queried as rates of their `_total` series, never as raw values
    counters = set(re.findall(r'Counter(?:MetricFamily)?\(\s*"(rlmesh_[a-z_]+?)(?:_total)?"', source))
    for e in exprs:
        for name in counters:
            if re.search(rf"\b{name}_total\b", e):
                assert "rate(" in e, e
