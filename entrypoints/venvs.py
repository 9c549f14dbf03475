"""`rlmesh venv`: a virtualenv for environments whose libraries pin what rlmesh pins otherwise (a
`verifiers` environment from the Hub: verifiers 0.3 pins mcp and openai). It holds the packages asked
for, rlmesh's light runtime (gRPC, protobuf, pydantic, ...: what an environment server needs) and
rlmesh itself without its dependencies, so that `DIR/bin/python -m rlmesh.cli reward` serves the
environment, and `rlmesh up` starts it so when `reward.verifiers.NAME.python` names DIR/bin/python."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

SOURCE = Path(__file__).resolve().parent.parent  # the checkout, when rlmesh runs from one


def runtime_requirements() -> list[str]:
    """rlmesh's own dependencies without extras (what `pip install rlmesh` alone installs)."""
    found = metadata.requires("rlmesh") or []
    return [r.split(";")[0].strip() for r in found if "extra ==" not in r]


def rlmesh_itself() -> list[str]:
    """pip arguments that install this rlmesh without dependencies: the checkout it runs from
    (editable: the environment server runs the same code), else the same version from the index."""
    pyproject = SOURCE / "pyproject.toml"
    if pyproject.is_file() and re.search(r'^name\s*=\s*"rlmesh"', pyproject.read_text(), re.M):
        return ["--no-deps", "-e", str(SOURCE)]
    return ["--no-deps", f"rlmesh=={metadata.version('rlmesh')}"]


def make_venv(output: Path, packages: list[str], python: str = sys.executable) -> Path:
    """Create (or update) the virtualenv at `output` with `packages`; its interpreter's path."""
    interpreter = output / "bin" / "python"
    steps = []
    if not interpreter.exists():
        steps.append(("creating the virtualenv", [python, "-m", "venv", str(output)]))
    pip = [str(interpreter), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    steps += [(f"installing {' '.join(packages)} and rlmesh's runtime", [*pip, *packages, *runtime_requirements()]),
              ("installing rlmesh (without its dependencies)", [*pip, *rlmesh_itself()]),
              ("checking that rlmesh's environment server imports",
               [str(interpreter), "-c", "import rlmesh.reward_server.server"])]
    for what, cmd in steps:
        t0 = time.monotonic()
        print(f"rlmesh venv: {what} ...", flush=True)
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"rlmesh venv: {what} failed (exit {done.returncode}):\n"
                               f"{(done.stderr or done.stdout).strip()[-3000:]}")
        print(f"rlmesh venv: {what}: done in {time.monotonic() - t0:.0f} s", flush=True)
    return interpreter


def add_parser(sub: argparse._SubParsersAction) -> None:
    venv = sub.add_parser("venv", help="a virtualenv for an environment whose libraries clash with rlmesh's (a "
                                       "verifiers environment): the packages, rlmesh's runtime and rlmesh",
                          epilog="example: rlmesh venv --output envs/sophistry verifiers==0.3.1 sophistry-bench-sprint\n"
                                 "then: reward.verifiers.NAME.python=envs/sophistry/bin/python (docs/environments.md)",
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    venv.add_argument("packages", nargs="+", metavar="PACKAGE", help="what pip installs (names, pins, paths)")
    venv.add_argument("--output", required=True, help="the virtualenv's directory (updated when it exists)")
    venv.add_argument("--python", default=sys.executable,
                      help="the interpreter the virtualenv is made from (default: this one)")


def run(args: argparse.Namespace) -> int:
    try:
        interpreter = make_venv(Path(args.output).absolute(), args.packages, args.python)
    except RuntimeError as err:
        print(err, file=sys.stderr)
        return 1
    print(f"rlmesh venv: ready; name its interpreter in the config: reward.verifiers.NAME.python={interpreter}")
    return 0
