"""Progress into a file or a pipe is a whole line now and then, never carriage-return frames."""

import io

from rlmesh.services.progress import LineProgress, progress


def test_lines_at_most_every_interval_and_one_at_the_end():
    out = io.StringIO()
    bar = LineProgress(10, "GRPO", "step", every_s=3600, file=out)
    for _ in range(10):
        bar.update(1)
    bar.set_postfix(reward="0.500")
    bar.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert len(lines) == 2  # the first step, then the end (the interval is an hour)
    assert lines[0].startswith("GRPO: step 1/10 after") and lines[1].startswith("GRPO: step 10/10 after")
    assert lines[1].endswith("reward=0.500")


def test_not_a_terminal_gets_lines(capsys):
    assert isinstance(progress(5, "x", "step"), LineProgress)  # pytest's captured stderr is not a terminal
