"""How an OpenEnv observation becomes the message the model reads, and the config that declares an
OpenEnv server. (The protocol itself runs against a real server in
tests/integration/test_openenv_environment.py.)"""

import pytest

from rlmesh.reward_server.environments.openenv_remote import render_observation
from rlmesh.services.config import RunConfig


def test_a_single_text_field_is_the_message():
    assert render_observation({"feedback": "Higher."}, None, "guess") == "Higher."


def test_several_fields_or_non_text_become_json_and_empty_is_nothing():
    assert render_observation({"stdout": "4\n", "exit_code": 0}, None, "code") == '{"exit_code": 0, "stdout": "4\\n"}'
    assert render_observation({"board": [1, 2]}, None, "game") == '{"board": [1, 2]}'
    assert render_observation({}, None, "game") == ""


def test_a_named_field_is_picked_and_a_missing_one_names_the_fix():
    assert render_observation({"stdout": "4", "exit_code": 0}, "stdout", "code") == "4"
    assert render_observation({"legal": [1, 2]}, "legal", "game") == "[1, 2]"
    with pytest.raises(ValueError, match=r"no field 'text'.*\['stdout'\].*reward\.openenv\.code\.observation_field"):
        render_observation({"stdout": "4"}, "text", "code")


def test_openenv_servers_are_declared_under_reward_openenv():
    config = RunConfig.model_validate({"reward": {"openenv": {"echo": {"url": "http://127.0.0.1:8000",
                                                                     "action_field": "code", "reset_keys": []}}}})
    echo = config.reward.openenv["echo"]
    assert (echo.url, echo.action_field, echo.reset_keys, echo.max_turns) == ("http://127.0.0.1:8000", "code", [], 8)
    with pytest.raises(ValueError, match="max_turns"):
        RunConfig.model_validate({"reward": {"openenv": {"echo": {"url": "http://x", "max_turns": 0}}}})
    with pytest.raises(ValueError, match="url"):
        RunConfig.model_validate({"reward": {"openenv": {"echo": {"action_field": "code"}}}})
