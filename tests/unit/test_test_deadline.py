"""The tests' own waits end before their pytest-timeout limit (tests/deadline.py), so a hang is
reported by the wait that hung, naming what it waited for."""

import pytest

from tests import deadline


@pytest.mark.timeout(40)
def test_a_wait_longer_than_the_tests_limit_is_cut_to_what_is_left():
    left = deadline.cap(900)
    assert 40 - deadline.MARGIN_S - 5 < left <= 40 - deadline.MARGIN_S
    assert deadline.cap(3) == 3


def test_the_default_limit_applies_without_a_marker(pytestconfig):
    assert deadline.cap(10_000) <= float(pytestconfig.getini("timeout")) - deadline.MARGIN_S
