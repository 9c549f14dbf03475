"""`rlmesh rollout --await-model S` (`rlmesh up` starts rollout servers beside the process that writes
their first model): it returns once the directory is in place, and says which path never came."""

from __future__ import annotations

import logging
import sys
import threading
import time
import types

import pytest

from rlmesh.rollout_server.server import await_model

log = logging.getLogger("test")


@pytest.fixture(autouse=True)
def no_vllm_import(monkeypatch):
    """vLLM's import (what the wait overlaps) is not what these tests time."""
    monkeypatch.setitem(sys.modules, "vllm.v1.engine.async_llm", types.ModuleType("vllm.v1.engine.async_llm"))


def test_it_returns_once_the_model_is_renamed_into_place(tmp_path):
    model = tmp_path / "init_model"
    staging = tmp_path / ".init_model.partial"
    staging.mkdir()
    timer = threading.Timer(0.5, staging.rename, args=(model,))
    timer.start()
    t0 = time.monotonic()
    await_model(str(model), 30, log)
    timer.join()
    assert model.is_dir() and 0.4 < time.monotonic() - t0 < 5


def test_a_model_that_never_comes_is_named(tmp_path):
    with pytest.raises(SystemExit, match=f"{tmp_path / 'never'} did not appear within --await-model 1 s"):
        await_model(str(tmp_path / "never"), 1, log)
