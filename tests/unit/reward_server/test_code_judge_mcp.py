"""The pure parts of the code, judge and MCP-stdio environments: program extraction, test parsing,
rubric filling, verdict parsing, and their config sections' validation."""

from __future__ import annotations

import re

import pytest
from pydantic import ValidationError

from rlmesh.reward_server.environments.code import extract_program, parse_tests
from rlmesh.reward_server.environments.judge import fill_rubric, parse_verdict
from rlmesh.services.config import RewardSection


def test_the_last_python_block_is_the_program_else_the_whole_completion():
    text = "Try:\n```python\nx = 1\n```\nBetter:\n```py\nx = 2\n```\nDone."
    assert extract_program(text) == "x = 2\n"
    assert extract_program("```python\nx = 3\nprint(x)") == "x = 3\nprint(x)"  # cut off before the fence
    assert extract_program("x = 4") == "x = 4"
    assert extract_program("```\nplain fence\n```") == "```\nplain fence\n```"


def test_tests_are_a_list_of_asserts_or_io_pairs():
    assert parse_tests(["assert f()"], "tests") == ["assert f()"]
    assert parse_tests('[{"input": "1", "output": "2"}]', "tests") == [{"input": "1", "output": "2"}]
    for bad, says in [([], "non-empty list"), ("assert x", "not JSON"), ([{"input": "1"}], "tests[0]"),
                      ([3], "tests[0]"), ({"a": 1}, "non-empty list")]:
        with pytest.raises(ValueError, match=re.escape(says)):
            parse_tests(bad, "tests")


def test_rubric_placeholders_are_filled_in_one_pass():
    rubric = "Q: {prompt}\nA: {completion}\nRef: {reference}\nJSON: {\"score\": 1}"
    filled = fill_rubric(rubric, "2+2?", "it is {reference}", "4")
    assert filled == "Q: 2+2?\nA: it is {reference}\nRef: 4\nJSON: {\"score\": 1}"


def test_verdicts_parse_to_the_last_score_or_fail_naming_why():
    regex = re.compile(RewardSection(judge={"j": {"url": "u", "model": "m", "rubric": "{completion}"}})
                       .judge["j"].score_regex)
    assert parse_verdict("Score: 3 at first, but on reflection score = 7.5", regex, 0, 10) == 7.5
    with pytest.raises(ValueError, match="unparseable verdict"):
        parse_verdict("I think it is good.", regex, 0, 10)
    with pytest.raises(ValueError, match=r"outside \[0, 10\]"):
        parse_verdict("Score: 11", regex, 0, 10)


def test_reward_config_checks_mcp_transport_judge_rubric_and_budgets():
    ok = RewardSection(mcp={"a": {"command": ["mcp-server-time"], "env": {"TZ": "UTC"}}, "b": {"url": "http://h/mcp"}},
                       code={"code": {"wall_s": 5}})
    assert ok.mcp["a"].command == ["mcp-server-time"] and ok.code["code"].wall_s == 5
    for bad, says in [
        ({"mcp": {"a": {}}}, "exactly one of `url`"),
        ({"mcp": {"a": {"url": "http://h/mcp", "command": ["x"]}}}, "exactly one of `url`"),
        ({"mcp": {"a": {"command": []}}}, "`command` is empty"),
        ({"mcp": {"a": {"url": "http://h/mcp", "cwd": "/tmp"}}}, "`env` and `cwd` apply"),
        ({"code": {"c": {"wall_s": 30}}}, "code.c.wall_s=30.0 must be below env_timeout_s=30.0"),
        ({"judge": {"j": {"url": "u", "model": "m", "rubric": "no placeholder"}}}, "{completion}"),
        ({"judge": {"j": {"url": "u", "model": "m", "rubric": "{completion}", "score_regex": "\\d+"}}}, "group"),
        ({"judge": {"j": {"url": "u", "model": "m", "rubric": "{completion}", "timeout_s": 20}}},
         "timeout_s * (retries + 1) = 40s exceeds env_timeout_s"),
    ]:
        with pytest.raises(ValidationError, match=re.escape(says)):
            RewardSection(**bad)
