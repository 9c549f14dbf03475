"""`rlmesh check` and `rlmesh eval` run no learner: their rollout server also gets the cores the run
gives the learner, where the run lists both."""

from __future__ import annotations

from rlmesh.evaluate import stand_in_cores
from rlmesh.services.config import RunConfig


def _config(rollout: str, learner: str) -> RunConfig:
    return RunConfig.model_validate({"rollout": {"cpu_cores": rollout}, "learner": {"cpu_cores": learner}})


def test_listed_cores_are_joined():
    assert stand_in_cores(_config("0", "1")) == "0,1"
    assert stand_in_cores(_config("0-1,4", "2,4")) == "0,1,2,4"


def test_an_unpinned_tier_leaves_the_rollout_setting_alone():
    assert stand_in_cores(_config("0", "auto")) == "0"
    assert stand_in_cores(_config("auto", "1")) == "auto"
