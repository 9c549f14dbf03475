"""The Python API: `rlmesh.train`, `rlmesh.sft`, `rlmesh.dpo` and `rlmesh.export`, thin over the
functions behind the `rlmesh` command. `train` runs the same local mesh as `rlmesh up` (the same
processes, run directory and progress bar) and calls the user's callbacks, in the user's process,
with each metrics.jsonl row as the run writes it.

A `reward_fn` reaches the reward server by import path: a function defined at the top level of a
module becomes `module:function`, registered under `reward.functions` and made the dataset's
environment; the directory its module is imported from goes on the services' PYTHONPATH (for a
script run as `python script.py`, its own directory and file stem).

Nothing heavy is imported here at module level, so `import rlmesh` and `help(rlmesh.train)` stay
instant; torch and vLLM load in the services' own processes."""

from __future__ import annotations

import copy
import inspect
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

if TYPE_CHECKING:
    from rlmesh.services.config import RunConfig

ConfigLike = Union[str, "os.PathLike[str]", Mapping[str, Any], "RunConfig", None]
"""A run config: a YAML file's path, a mapping shaped like that file, a RunConfig, or None (the
built-in defaults, as `rlmesh up` without `-c`)."""

Overrides = Union[Mapping[str, Any], Sequence[str], None]
"""Dotted overrides: {"learner.lr": 1e-4} (values as Python objects) or ["learner.lr=1e-4"]
(strings parsed as YAML, exactly as on the command line)."""

REWARD_FN_ENV = "reward_fn"
"""The environment name a `reward_fn` is served under."""

# Set in every service `train` starts: a service that imports the user's script to find its
# reward function and so reaches `train` again names the missing `__main__` guard.
_IN_SERVICE = "RLMESH_API_SERVICE"


class StopTraining(Exception):
    """Raise in a callback to end the run early (returning False does the same). From
    `on_step_end(N, ...)` the run ends at step N exactly; from `on_eval` at the step the learner has
    reached. The learner then runs its final evaluation, writes a checkpoint at that step and
    summary.json, and every service stops."""


class Callback:
    """Base class for `train` callbacks; override either method. Both run in the caller's process
    as the run's metrics arrive. The learner starts step N+1 only once `on_step_end(N, ...)` has
    returned (generation goes on meanwhile), so keep them quick. Returning False, or raising
    StopTraining, ends the run at that step (see StopTraining); any other exception stops every
    service and propagates out of `train`."""

    def on_step_end(self, step: int, metrics: dict[str, Any]) -> bool | None:
        """After optimizer step `step` (= the new policy version); `metrics` is its metrics.jsonl row
        (reward_mean, loss, staleness_max, tokens_per_s, ...)."""
        return None

    def on_eval(self, version: int, record: dict[str, Any]) -> bool | None:
        """After a held-out evaluation of policy `version`; `record` holds `accuracy`,
        `reward_mean`, `num_prompts`, ... (metrics.jsonl's eval row)."""
        return None


@dataclass(frozen=True)
class RunResult:
    """What `train` returns: the run's outcome and where its outputs are."""

    run_dir: Path
    """The run directory (config, logs, metrics, checkpoints, summary.json)."""
    metrics_path: Path
    """metrics.jsonl: one row per step and per evaluation."""
    checkpoint: Path | None
    """The final checkpoint (DCP shards, and an HF model in `model/` unless checkpoint.hf_model=false)."""
    held_out_accuracy_before: float | None
    """Held-out accuracy of the starting policy (after the SFT warm start, if any); None with
    learner.eval_at_start=false."""
    held_out_accuracy_after: float
    """Held-out accuracy of the final policy."""
    num_steps: int
    """Optimizer steps taken (fewer than learner.num_steps when a callback stopped the run)."""
    stopped_early: str | None
    """Why a callback stopped the run, or None when it ran all learner.num_steps."""
    summary: dict[str, Any] = field(repr=False)
    """summary.json as the learner wrote it."""


def resolve_config(config: ConfigLike = None, overrides: Overrides = None, **kw_overrides: Any) -> RunConfig:
    """The validated RunConfig from `config` plus `overrides` plus keyword overrides (`learner__lr=1e-4`
    or `**{"learner.lr": 1e-4}`; `__` stands for a dot). Raises ConfigError naming the field."""
    from rlmesh.services.config import RunConfig, parse_override, read_config_file, set_path, validate_config

    if config is None:
        data: dict[str, Any] = {}
    elif isinstance(config, RunConfig):
        if not overrides and not kw_overrides:
            return config.model_copy(deep=True)
        data = config.model_dump(mode="json")
    elif isinstance(config, Mapping):
        data = copy.deepcopy(dict(config))
    elif isinstance(config, (str, os.PathLike)):
        data = read_config_file(config)
    else:
        raise TypeError(f"config={config!r}: expected a YAML path, a mapping, a RunConfig or None")
    if isinstance(overrides, Mapping):
        items = list(overrides.items())
    elif isinstance(overrides, Sequence) and not isinstance(overrides, str):
        items = [(".".join(path), value) for path, value in map(parse_override, overrides)]
    elif overrides is None:
        items = []
    else:
        raise TypeError(f"overrides={overrides!r}: expected a mapping of dotted keys or a list of 'key=value'")
    items += [(key.replace("__", "."), value) for key, value in kw_overrides.items()]
    for key, value in items:
        set_path(data, key.split("."), value, repr(key))
    return validate_config(data)


def reward_fn_import_path(fn: Callable[..., Any] | str) -> tuple[str, Path | None]:
    """`module:function` for a reward function, and the directory the reward server must import
    its module from (None when it needs none). Only a function reachable by name from the top
    level of a module file can be imported in another process."""
    if isinstance(fn, str):
        module, sep, name = fn.partition(":")
        if not (sep and module and name):
            raise ValueError(f"reward_fn={fn!r} must look like 'package.module:function'")
        return fn, None
    if not callable(fn):
        raise TypeError(f"reward_fn={fn!r} is neither a function nor a 'package.module:function' string")
    fix = "define it with `def` at the top level of a module (or script) file, or pass 'package.module:function'"
    if inspect.ismethod(fn):
        raise TypeError(f"reward_fn={fn!r} is a bound method: the reward server cannot get its object; {fix}")
    module_name, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not module_name or not qualname:
        raise TypeError(f"reward_fn={fn!r} has no importable name (a callable object or a partial?); {fix}")
    if "<lambda>" in qualname:
        raise TypeError(f"reward_fn is a lambda ({qualname} in {module_name}); the reward server runs in another "
                        f"process and imports the function by name; {fix}")
    if "<locals>" in qualname or "." in qualname:
        raise TypeError(f"reward_fn {qualname!r} in {module_name} is nested in a function or class (a closure "
                        f"cannot be sent to the reward server's process); {fix}")
    module = sys.modules.get(module_name)
    if getattr(module, qualname, None) is not fn:
        raise TypeError(f"reward_fn {qualname!r} is not the object named {module_name}.{qualname}; {fix}")
    file = getattr(module, "__file__", None)
    if module_name == "__main__":
        spec = getattr(module, "__spec__", None)
        if file is None:
            raise TypeError(f"reward_fn {qualname!r} was defined interactively (no file to import it from); {fix}")
        # `python -m pkg.script` has a spec naming its module; `python script.py` has none.
        module_name = spec.name if spec is not None and spec.name != "__main__" else Path(file).stem
    if file is None:
        return f"{module_name}:{qualname}", None
    # The directory holding the module's top-level package: `a.b` from /x/a/b.py -> /x.
    depth = module_name.count(".") + (Path(file).name == "__init__.py")
    return f"{module_name}:{qualname}", Path(file).resolve().parents[depth]


def _check_callbacks(callbacks: Iterable[Any] | Callback) -> list[Any]:
    is_one = callable(getattr(callbacks, "on_step_end", None)) or callable(getattr(callbacks, "on_eval", None))
    out = [callbacks] if is_one else list(callbacks)
    for cb in out:
        if not (callable(getattr(cb, "on_step_end", None)) or callable(getattr(cb, "on_eval", None))):
            raise TypeError(f"callback {cb!r} has neither on_step_end(step, metrics) nor on_eval(version, record); "
                            "subclass rlmesh.Callback and override one")
    return out


class _Dispatcher:
    """Feeds metrics.jsonl rows to the callbacks. The first stop (False or StopTraining) writes the
    run's stop request; after a step's row, the learner is told the callbacks have seen that step
    (it waits for that before the next step, so a stop lands at exactly the step seen)."""

    def __init__(self, callbacks: list[Any], run_dir: Path) -> None:
        self.callbacks, self.run_dir = callbacks, run_dir
        self.stop_reason: str | None = None

    def __call__(self, row: dict[str, Any]) -> None:
        from rlmesh.learner.rl.stop import mark_seen, request_stop

        kind = row.get("kind")
        method = {"train": "on_step_end", "eval": "on_eval"}.get(kind)
        if method is None:
            return
        for cb in self.callbacks:
            hook = getattr(cb, method, None)
            if hook is None:
                continue
            where = f"{type(cb).__name__}.{method} at version {row['version']}"
            try:
                stop = hook(row["version"], dict(row)) is False
                reason = f"{where} returned False"
            except StopTraining as err:
                stop, reason = True, f"{where} raised StopTraining" + (f": {err}" if str(err) else "")
            if stop and self.stop_reason is None:
                self.stop_reason = reason
                request_stop(self.run_dir, reason)
        if kind == "train":  # after the stop request: the learner reads both once this is written
            mark_seen(self.run_dir, row["version"])


def train(config: ConfigLike = None, *, reward_fn: Callable[..., Any] | str | None = None,
          callbacks: Iterable[Callback | Any] | Callback = (), overrides: Overrides = None, **kw_overrides: Any) -> RunResult:
    """Run RL training on the whole mesh as local processes, as `rlmesh up` does, and return its result.

    config: a YAML path, a mapping shaped like one, a RunConfig, or None for the built-in defaults
        (what `rlmesh up` runs without `-c`; the demo is `examples/arithmetic_grpo.yaml`).
    reward_fn: `(prompt_messages, completion, metadata) -> float | dict` run by the reward server
        on every completion (a dict holds "reward" and optional components; a "correct" component
        is what held-out accuracy reports, else the mean reward). Defined with `def` at the top
        level of a module or script; a script must call `train` under `if __name__ == "__main__":`,
        because the reward server imports it. A 'package.module:function' string works too.
    callbacks: objects with `on_step_end(step, metrics)` and/or `on_eval(version, record)` (see
        Callback; one object or several), called in this process as the run goes; either can
        stop the run early.
    overrides, **kw_overrides: dotted overrides, `overrides={"learner.num_steps": 20}`,
        `overrides=["learner.num_steps=20"]` or `learner__num_steps=20`.

    Raises ConfigError (rlmesh.services.config) for a bad config, TypeError for a reward_fn that cannot be imported by name,
    RuntimeError when the run fails (the message quotes the failing service's log), and
    KeyboardInterrupt on Ctrl-C (every service is stopped in all cases).
    """
    import argparse

    if os.environ.get(_IN_SERVICE):
        raise RuntimeError("rlmesh.train was called inside a service of a running rlmesh.train: the reward server "
                           "imported the script that defines reward_fn, and that ran its top level; call train "
                           "under `if __name__ == \"__main__\":`")
    cfg = resolve_config(config, overrides, **kw_overrides)
    callbacks = _check_callbacks(callbacks)
    env = {_IN_SERVICE: "1"}
    if reward_fn is not None:
        from rlmesh.services.config import validate_config

        path, root = reward_fn_import_path(reward_fn)
        data = cfg.model_dump(mode="json")
        data["reward"]["functions"][REWARD_FN_ENV] = path
        data["data"]["env_name"] = REWARD_FN_ENV
        cfg = validate_config(data)
        if root is not None:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))

    from rlmesh.up import new_run_dir, run_up

    run_dir = new_run_dir(cfg).resolve()
    dispatcher = _Dispatcher(callbacks, run_dir)
    try:
        code = run_up(cfg, argparse.Namespace(run_dir=str(run_dir)), on_row=dispatcher if callbacks else None,
                      env=env)
    except SystemExit as err:  # the launcher's own failures (a service exited while starting, ...)
        raise RuntimeError(str(err.code)) from None
    if code == 130:
        raise KeyboardInterrupt
    summary_path = run_dir / "summary.json"
    if code != 0 or not summary_path.is_file():
        raise RuntimeError(f"rlmesh.train: the run failed (exit {code}); see the output above and {run_dir / 'logs'}")
    summary = json.loads(summary_path.read_text())
    return RunResult(
        run_dir=run_dir, metrics_path=run_dir / "metrics.jsonl",
        checkpoint=Path(summary["checkpoint"]) if summary.get("checkpoint") else None,
        held_out_accuracy_before=summary["held_out_accuracy_before"],
        held_out_accuracy_after=summary["held_out_accuracy_after"],
        num_steps=summary["num_steps"], stopped_early=summary.get("stop_requested"), summary=summary)


def _run_recipe(command: str, cfg: RunConfig, output: str | os.PathLike[str]) -> None:
    """`rlmesh <command> -c CONFIG --output DIR` in a child process (torch's process group and
    threads stay out of the caller's)."""
    from rlmesh.services.config import dump_config

    with tempfile.TemporaryDirectory(prefix="rlmesh-") as tmp:
        config_path = Path(tmp) / "config.yaml"
        dump_config(cfg, config_path)
        argv = [sys.executable, "-m", "rlmesh.cli", command, "-c", str(config_path),
                "--output", str(output)]
        code = subprocess.run(argv, check=False).returncode
    if code != 0:
        raise RuntimeError(f"rlmesh.{command}: failed (exit {code}); see its output above")


def sft(config: ConfigLike = None, *, output: str | os.PathLike[str], overrides: Overrides = None,
        **kw_overrides: Any) -> Path:
    """Supervised fine-tuning (masked NLL on assistant turns), as `rlmesh sft`; returns the HF
    model directory written to `output`. Config and overrides as for `train`; needs sft.num_steps > 0."""
    cfg = resolve_config(config, overrides, **kw_overrides)
    if cfg.sft.num_steps == 0:
        raise ValueError("rlmesh.sft: sft.num_steps is 0; pass sft__num_steps=N or set it in the config")
    _run_recipe("sft", cfg, output)
    return Path(output).resolve()


def dpo(config: ConfigLike = None, *, output: str | os.PathLike[str], overrides: Overrides = None,
        **kw_overrides: Any) -> dict[str, Any]:
    """Offline DPO on (prompt, chosen, rejected) pairs, as `rlmesh dpo`; returns its summary.json
    (held-out preference accuracy and greedy match before/after, `model`: the HF model directory).
    Config and overrides as for `train`; needs dpo.num_steps > 0."""
    cfg = resolve_config(config, overrides, **kw_overrides)
    if cfg.dpo.num_steps == 0:
        raise ValueError("rlmesh.dpo: dpo.num_steps is 0; pass dpo__num_steps=N or set it in the config")
    _run_recipe("dpo", cfg, output)
    return json.loads((Path(output) / "summary.json").read_text())


def export(run_dir: str | os.PathLike[str], *, output: str | os.PathLike[str], step: int | None = None,
           dtype: str = "auto") -> Path:
    """An HF model directory at `output` from a run's checkpoint (the newest, or the one at `step`),
    as `rlmesh export` (`dtype`: auto, float32, bfloat16 or float16); returns it. Raises ValueError when
    there is no such checkpoint."""
    from rlmesh.learner.train.checkpoint import export_hf, find_checkpoint

    return export_hf(find_checkpoint(Path(run_dir), step), Path(output), dtype=dtype)
