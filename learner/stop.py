"""A request to end an RL run early: a file in the run directory. `rlmesh.train` writes it when a
callback stops the run; the learner looks for it before each step and, once it is there, trains no
further step: it runs its final evaluation, writes a checkpoint at the version it reached and
summary.json, and exits as it does after `learner.num_steps`."""

from __future__ import annotations

from pathlib import Path

STOP_REQUEST = "stop_request"


def request_stop(run_dir: Path, reason: str) -> None:
    """Ask the learner of the run in `run_dir` to stop after the step it is on."""
    (run_dir / STOP_REQUEST).write_text(reason.strip() + "\n")


def stop_requested(run_dir: Path) -> str | None:
    """The reason given for a stop request, or None when none was made."""
    try:
        return (run_dir / STOP_REQUEST).read_text().strip() or "stop requested"
    except FileNotFoundError:
        return None


def clear_stop_request(run_dir: Path) -> None:
    """Forget a request left by an earlier run in this directory (`rlmesh up --run-dir` reuses one)."""
    (run_dir / STOP_REQUEST).unlink(missing_ok=True)
