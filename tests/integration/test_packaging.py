"""The built wheel installs one import root. Builds the wheel from a copy of the source tree
(tracked and unignored files, as a clean checkout has them), installs it with --no-deps into a fresh
virtualenv, and checks that site-packages gained only `rlmesh` and its metadata, that the old
top-level names (`services`, `learner`, ...) do not import there, that `import rlmesh` works with
no dependency installed, and that the contracts and config import from the wheel once their
dependencies are importable. Every package folder under the mapped roots must be in the wheel."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
OLD_TOP_LEVEL = ("services", "learner", "rollout_server", "reward_server", "entrypoints", "proto")


def _source_copy(dest: Path) -> Path:
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        src = REPO / name
        if src.is_file():  # a tracked file deleted in the working tree is gone from the copy too
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    src = _source_copy(tmp / "src")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(src),
                    "-w", str(tmp / "dist")], check=True, cwd=tmp)
    (built,) = (tmp / "dist").glob("rlmesh-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(tmp_path_factory, wheel) -> tuple[Path, Path, set[str]]:
    """(python, site-packages, names site-packages had before the install)."""
    root = tmp_path_factory.mktemp("venv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    python = root / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True).stdout.strip())
    before = {p.name for p in site.iterdir()}
    # This interpreter's pip installs into the bare venv (no pip of its own needed there).
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
                   check=True)
    return python, site, before


def _run(python: Path, code: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    # -I would also drop PYTHONPATH; a neutral cwd keeps the repository's folders off sys.path.
    return subprocess.run([str(python), "-c", code], capture_output=True, text=True, cwd=cwd,
                          env={"PATH": os.environ["PATH"], "PAGER": "cat", **env})


def test_the_wheel_installs_only_rlmesh(venv):
    python, site, before = venv
    added = sorted({p.name for p in site.iterdir()} - before)
    assert added == ["rlmesh", "rlmesh-0.1.0.dist-info"], added


def test_old_top_level_names_do_not_import_and_rlmesh_does_without_dependencies(venv, tmp_path):
    python, site, _ = venv
    for name in OLD_TOP_LEVEL:
        out = _run(python, f"import {name}", tmp_path)
        assert out.returncode != 0 and f"No module named '{name}'" in out.stderr, (name, out.stderr)
    # No dependency at all is installed here: the package root and the API's help still work.
    out = _run(python, "import rlmesh, sys; help(rlmesh.train); print(rlmesh.__file__)", tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith(str(site / "rlmesh" / "__init__.py"))


def test_contracts_and_config_import_from_the_wheel_given_their_dependencies(venv, tmp_path):
    python, site, _ = venv
    # This environment's site-packages on PYTHONPATH lends the dependencies; its editable install
    # of rlmesh is a .pth hook, which Python runs only for site directories, so it stays out.
    deps = sysconfig.get_path("purelib")
    code = ("import rlmesh.v1.common_pb2, rlmesh.services.config, rlmesh.services.domain.chat, sys\n"
            "print(rlmesh.v1.common_pb2.__file__)\n"
            "assert 'torch' not in sys.modules")
    out = _run(python, code, tmp_path, PYTHONPATH=deps)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith(str(site / "rlmesh" / "v1"))


def test_every_package_folder_is_in_the_wheel(wheel):
    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dir: dict[str, str] = tool["package-dir"]
    expected = set()
    for package, folder in package_dir.items():
        for init in (REPO / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / folder)
            # A folder mapped on its own (rlmesh.services under rlmesh) is counted under its own root.
            dotted = ".".join([package, *rel.parts])
            if max((p for p in package_dir if dotted == p or dotted.startswith(p + ".")), key=len) == package:
                expected.add(dotted)
    names = set(zipfile.ZipFile(wheel).namelist())
    in_wheel = {n[: -len("/__init__.py")].replace("/", ".") for n in names if n.endswith("/__init__.py")}
    assert sorted(expected - in_wheel) == [], "package folders missing from the wheel (add them to pyproject's packages)"
    assert {n.split("/")[0] for n in names} == {"rlmesh", "rlmesh-0.1.0.dist-info"}
