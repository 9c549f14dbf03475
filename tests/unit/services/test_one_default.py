"""One default per place: a setting's default is written in the run config (services/config) and
nowhere else. A signature or dataclass outside the config that gives a parameter of the same name as a
config field a literal equal to that field's default restates it (and drifts when the config's
changes): it should take `rlmesh.services.config.default(Section, "field")` instead, or no default.

Read from the source with `ast`. `KNOWN` lists the restatements not yet removed and the parameters
that only share a name with a setting; the test fails on any new one, and on a `KNOWN` entry that is
gone (so the list only shrinks)."""

from __future__ import annotations

import ast
from pathlib import Path

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

REPO = Path(__file__).resolve().parents[3]
FOLDERS = ("services", "learner", "rollout_server", "reward_server", "entrypoints")

# (file, parameter): why it stays for now.
SAME_NAME_ONLY = "shares a name with a setting but means another thing"
STDLIB_ONLY = "module runs on the standard library alone (no config import)"
KNOWN = {
    ("learner/train/batch.py", "rank"): SAME_NAME_ONLY + " (a process rank, not learner.lora.rank)",
    ("learner/train/backends/megatron.py", "seed"): SAME_NAME_ONLY + " (a helper's seed)",
    ("learner/train/backends/fsdp2.py", "seed"): SAME_NAME_ONLY + " (a helper's seed)",
    ("learner/data/examples.py", "seed"): SAME_NAME_ONLY + " (a helper's seed)",
    ("learner/devtools/tiny_model.py", "seed"): SAME_NAME_ONLY + " (the tiny model's initialisation seed)",
    ("reward_server/environments/guess_number.py", "seed"): SAME_NAME_ONLY + " (the game's seed)",
    ("services/ports.py", "host"): SAME_NAME_ONLY + " (the interface a free port is looked for on)",
    ("services/grpc_server.py", "port"): SAME_NAME_ONLY + " (0: any free port)",
    ("reward_server/sandbox.py", "max_concurrency"): STDLIB_ONLY,
    ("learner/rl/stop.py", "timeout_s"): SAME_NAME_ONLY + " (how long to wait for callbacks, not weight_sync.timeout_s)",
}


def config_defaults() -> dict[str, set]:
    """Field name -> the literal defaults config fields of that name have (scalars other than "" and None)."""
    from rlmesh.services.config import RunConfig

    found: dict[str, set] = {}
    seen: set[type] = set()

    def walk(model: type[BaseModel]) -> None:
        if model in seen:
            return
        seen.add(model)
        for name, field in model.model_fields.items():
            value = field.default
            if value is not PydanticUndefined and isinstance(value, (bool, int, float, str)) and value != "":
                found.setdefault(name, set()).add((type(value), value))
            annotation = field.annotation
            for t in (*getattr(annotation, "__args__", ()), annotation):
                for inner in (*getattr(t, "__args__", ()), t):
                    if isinstance(inner, type) and issubclass(inner, BaseModel):
                        walk(inner)

    walk(RunConfig)
    return found


def _defaults_in(tree: ast.AST):
    """(name, default expression) of every parameter default and class-level annotated default."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            positional = args.posonlyargs + args.args
            yield from ((a.arg, d) for a, d in zip(positional[len(positional) - len(args.defaults):], args.defaults))
            yield from ((a.arg, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None)
        elif isinstance(node, ast.ClassDef):
            yield from ((s.target.id, s.value) for s in node.body
                        if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name) and s.value is not None)


def restatements(defaults: dict[str, set]) -> set[tuple[str, str]]:
    found = set()
    for folder in FOLDERS:
        for path in (REPO / folder).rglob("*.py"):
            rel = path.relative_to(REPO).as_posix()
            if rel.startswith("services/config/") or "_pb2" in path.name:
                continue
            for name, value in _defaults_in(ast.parse(path.read_text())):
                if isinstance(value, ast.Constant) and (type(value.value), value.value) in defaults.get(name, ()):
                    found.add((rel, name))
    return found


def test_no_setting_has_its_default_written_twice():
    found = restatements(config_defaults())
    new = sorted(found - set(KNOWN))
    assert not new, ("these restate a config default (take rlmesh.services.config.default(Section, 'field') "
                     f"instead, or no default): {new}")
    gone = sorted(set(KNOWN) - found)
    assert not gone, f"no longer found, drop them from KNOWN: {gone}"


def test_a_restated_default_is_caught(tmp_path):
    """The check can fail: a literal equal to a config default under the setting's name is found, the
    same name with another value or a `default(...)` call is not."""
    source = ("def f(score_timeout_s: float = 30.0, env_timeout_s: float = 1.5, max_len=default(Q, 'max_len')): ...\n"
              "class C:\n    claim_idle_ms: int = 60000\n")
    defaults = config_defaults()
    hits = {name for name, value in _defaults_in(ast.parse(source))
            if isinstance(value, ast.Constant) and (type(value.value), value.value) in defaults.get(name, ())}
    assert hits == {"score_timeout_s", "claim_idle_ms"}
