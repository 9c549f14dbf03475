"""The import graph keeps its shape: `services/` (the ground every tier stands on) imports no tier,
tiers do not import each other, and no learner component imports the controller. Read from the
source with `ast`, so a lazy import inside a function counts too."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TIERS = ("learner", "rollout_server", "reward_server", "entrypoints")


def imports(package: str) -> dict[str, set[str]]:
    """module file -> top-level-qualified names it imports."""
    out = {}
    for path in (REPO / package).rglob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
        out[str(path.relative_to(REPO))] = names
    return out


def _offenders(package: str, forbidden: tuple[str, ...]) -> list[str]:
    return [f"{f} imports {n}" for f, names in imports(package).items() for n in sorted(names)
            if n.split(".")[0] in forbidden]


def test_services_imports_no_tier():
    assert not _offenders("services", TIERS)


def test_tiers_do_not_import_each_other():
    assert not _offenders("learner", ("rollout_server", "reward_server", "entrypoints"))
    assert not _offenders("rollout_server", ("learner", "reward_server", "entrypoints"))
    assert not _offenders("reward_server", ("learner", "rollout_server", "entrypoints"))


def test_no_learner_component_imports_the_controller():
    bad = [f"{f} imports the controller" for f, names in imports("learner").items()
           if f != "learner/controller.py" and "learner.controller" in names]
    assert not bad
