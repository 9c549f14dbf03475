"""The import graph keeps its shape. Everything lives under one import root, `rlmesh`, and each
layer may import only the layers named for it in `ALLOWED` (docs/architecture.md's Layout section
says the same in words). Read from the source with `ast`, so a lazy import inside a function counts too."""

import ast
import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# folder -> the dotted package it is installed as (pyproject.toml's package-dir)
ROOTS = {
    "proto/rlmesh/v1": "rlmesh.v1",
    "services": "rlmesh.services",
    "learner": "rlmesh.learner",
    "rollout_server": "rlmesh.rollout_server",
    "reward_server": "rlmesh.reward_server",
    "entrypoints": "rlmesh",
}
OLD_TOP_LEVEL = ("services", "learner", "rollout_server", "reward_server", "entrypoints")

V1, DOMAIN, SERVICES = "rlmesh.v1", "rlmesh.services.domain", "rlmesh.services"
# entrypoints/ is the package root: its modules (rlmesh.cli, rlmesh.up, rlmesh.api, ...) compose the tiers.
ENTRYPOINTS = tuple(sorted(f"rlmesh.{p.stem}" for p in (REPO / "entrypoints").glob("*.py") if p.stem != "__init__"))
ENGINE = "rlmesh.learner.train"
# data/ (examples, sources, hf for `data.type: hf`) is one concept: the examples every recipe and the
# RL service read.
DATA = "rlmesh.learner.data"
# metrics.jsonl, the reward curve and the experiment trackers: the records of the RL service and of the
# offline recipes alike.
TRACKERS = "rlmesh.learner.trackers"
RL = "rlmesh.learner.rl"

# Layers, most specific prefix first: a module belongs to the first layer its name starts with. One rule
# per folder.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("rlmesh.v1", (V1,)),
    ("rlmesh.services.domain", (V1, DOMAIN)),
    ("rlmesh.services", (V1, SERVICES)),
    (ENGINE, (V1, DOMAIN, SERVICES, ENGINE)),
    ("rlmesh.learner.devtools", (V1, DOMAIN, SERVICES, "rlmesh.learner.devtools")),
    (DATA, (V1, DOMAIN, SERVICES, DATA)),
    (TRACKERS, (V1, DOMAIN, SERVICES, TRACKERS)),
    ("rlmesh.learner.recipes", (V1, DOMAIN, SERVICES, ENGINE, DATA, TRACKERS, "rlmesh.learner.devtools",
                                "rlmesh.learner.recipes")),
    # the RL learner service: server and controller, and the parts they wire
    (RL, (V1, DOMAIN, SERVICES, ENGINE, DATA, TRACKERS, RL)),
    ("rlmesh.learner", ()),  # the folder itself: its rooms only
    ("rlmesh.rollout_server", (V1, DOMAIN, SERVICES, "rlmesh.rollout_server")),
    ("rlmesh.reward_server", (V1, DOMAIN, SERVICES, "rlmesh.reward_server")),
    *((name, ("rlmesh",)) for name in ENTRYPOINTS),
    # the package root: the light Python API facade, which forwards to rlmesh.api
    ("rlmesh", (V1, "rlmesh.api")),
]
# The RL service's modules that wire the others; no part of it may import them.
DRIVERS = ("rlmesh.learner.rl.controller", "rlmesh.learner.rl.server")


def _module_name(path: Path) -> str:
    for folder, package in ROOTS.items():
        base = REPO / folder
        if base in path.parents:
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            return ".".join([package, *parts])
    raise AssertionError(f"{path} is under no package root")


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            # `from rlmesh.learner import controller` imports rlmesh.learner.rl.controller
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def source_modules() -> dict[str, set[str]]:
    """dotted module name -> the rlmesh names it imports (generated code excluded)."""
    out = {}
    for folder in ROOTS:
        for path in (REPO / folder).rglob("*.py"):
            if "_pb2" in path.name:
                continue
            out[_module_name(path)] = {n for n in _imports(path) if _within(n, "rlmesh")}
    return out


def layer_of(module: str) -> tuple[str, tuple[str, ...]]:
    return next((name, allowed) for name, allowed in LAYERS if _within(module, name))


def violations(modules: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, names in sorted(modules.items()):
        layer, allowed = layer_of(module)
        for name in sorted(names):
            # `from rlmesh.x import y` also lists rlmesh.x.y, which may be a function, not a module
            if not any(_within(name, a) or _within(a, name) for a in allowed):
                bad.append(f"{module} ({layer}) imports {name}")
            if any(_within(name, d) for d in DRIVERS) and not any(_within(module, d) for d in DRIVERS) \
                    and layer not in ENTRYPOINTS:
                bad.append(f"{module} imports the learner's driver {name}")
    return bad


def test_every_layer_imports_only_what_it_may():
    assert violations(source_modules()) == []


def test_nothing_imports_the_old_top_level_names():
    """`services`, `learner`, ... exist only as `rlmesh.*`: a bare import would load a second copy."""
    bad = []
    for path in _project_files():
        if "_pb2" in path.name:
            continue
        for name in _imports(path):
            if name.split(".")[0] in OLD_TOP_LEVEL:
                bad.append(f"{path.relative_to(REPO)} imports {name}")
    assert bad == []


def _project_files() -> list[Path]:
    """The repository's own .py files: hidden folders (.venv, .cache's virtualenvs) are not walked
    (walking them took this test ~110 s)."""
    found = []
    for folder, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("node_modules", "runs", "models")]
        found.extend(Path(folder) / f for f in files if f.endswith(".py"))
    return found


def test_a_planted_back_import_is_caught():
    """The check can fail: a tier importing another tier, the engine importing the RL service, a
    component importing the controller and plumbing importing a tier are all reported."""
    modules = source_modules()
    planted = {
        "rlmesh.rollout_server.worker": "rlmesh.learner.rl.issuer",
        "rlmesh.learner.train.trainer": "rlmesh.learner.rl.controller",
        "rlmesh.learner.rl.evaluator": "rlmesh.learner.rl.controller",
        "rlmesh.services.queue": "rlmesh.reward_server.service",
        "rlmesh.learner.rl.controller": "rlmesh.learner.recipes.sft",
        "rlmesh.learner.trackers.metrics": "rlmesh.learner.rl.ledger",
        "rlmesh.learner.data.sources": "rlmesh.learner.trackers.base",
    }
    for module, name in planted.items():
        assert module in modules, module
        found = violations({module: modules[module] | {name}})
        assert any(name in v for v in found), (module, name)
