import os

import pytest

from rlmesh.services.affinity import pin_to_cores


@pytest.fixture
def restore_affinity():
    before = os.sched_getaffinity(0)
    yield before
    os.sched_setaffinity(0, before)


def test_pins_to_the_named_cores_and_auto_leaves_them(restore_affinity):
    first = min(restore_affinity)
    pin_to_cores("auto", "learner.cpu_cores")
    assert os.sched_getaffinity(0) == restore_affinity
    pin_to_cores("nobind", "rollout.cpu_cores")
    assert os.sched_getaffinity(0) == restore_affinity
    pin_to_cores(f"{first}-{first}", "learner.cpu_cores")
    assert os.sched_getaffinity(0) == {first}


def test_a_core_that_is_not_there_is_named(restore_affinity):
    missing = max(restore_affinity) + 64
    with pytest.raises(ValueError, match=f"learner.cpu_cores='{missing}'.*available"):
        pin_to_cores(str(missing), "learner.cpu_cores")
    assert os.sched_getaffinity(0) == restore_affinity
