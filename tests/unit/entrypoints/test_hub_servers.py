"""`rlmesh up`'s environment servers for `reward.verifiers` environments with an interpreter of their
own: each gets a config serving it alone, the main reward server proxies it, and one hosted here (no
`python`) or already remote is left alone. And `data.type: verifiers` must name such an environment."""

from __future__ import annotations

import pytest
import yaml

from rlmesh.services.config import RunConfig, load_config
from rlmesh.env_servers import hub_servers


def test_an_environment_with_its_own_interpreter_gets_a_server_and_the_main_one_proxies_it(tmp_path):
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.touch()
    config = RunConfig.model_validate({"reward": {
        "functions": {"mine": "pkg.mod:fn"}, "mcp": {"calc": {"url": "http://127.0.0.1:1/mcp"}},
        "verifiers": {"own": {"env_id": "some-env", "args": {"level": 2}, "python": str(python)},
                      "here": {"env_id": "other-env"}}}})
    hubs = hub_servers(config, tmp_path)
    assert list(hubs) == ["own"] and hubs["own"][0] == str(python)
    assert config.reward.remote == {"own": f"{config.network.host}:{hubs['own'][1]}"}
    served = load_config(str(tmp_path / "config.env-own.yaml"), [])
    # It serves that environment alone, hosted in its own process (no interpreter of another again).
    assert list(served.reward.verifiers) == ["own"] and served.reward.verifiers["own"].python is None
    assert served.reward.verifiers["own"].args == {"level": 2}
    assert not served.reward.functions and not served.reward.mcp and not served.reward.remote
    assert yaml.safe_load((tmp_path / "config.env-own.yaml").read_text())["reward"]["verifiers"]["own"]["env_id"] \
        == "some-env"


def test_verifiers_data_must_name_a_verifiers_environment():
    with pytest.raises(ValueError, match=r"data.env_name='nope' names no verifiers environment: reward.verifiers "
                                         r"has \['game'\]; add reward.verifiers.nope.env_id"):
        RunConfig.model_validate({"data": {"type": "verifiers", "env_name": "nope"},
                                  "reward": {"verifiers": {"game": {"env_id": "x"}}}})


def test_an_interpreter_that_is_not_there_is_refused_saying_how_to_make_one(tmp_path):
    config = RunConfig.model_validate({"reward": {"verifiers": {"own": {"env_id": "x", "python": "/nope/bin/python"}}}})
    with pytest.raises(SystemExit, match=r"reward.verifiers.own.python=/nope/bin/python is not a file; .*rlmesh venv"):
        hub_servers(config, tmp_path)
