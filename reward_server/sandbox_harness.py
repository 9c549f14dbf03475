"""The test harness that runs inside the code sandbox (see `rlmesh.reward_server.sandbox_init`), as
the sandbox user in `/sandbox`, where the model's program is `solution.py`. Standard library only;
its source is passed to `python -I -S -c`.

It reads the spec from stdin: `nonce`, `tests`, `test_timeout_s`, `max_output_bytes`. Each test is
- a string: Python run after the program, in the program's namespace (`assert f(1) == 2`); passes
  when it raises nothing; or
- `{"input": ..., "output": ...}`: the program run as a fresh process with that stdin; passes when
  its stdout equals `output` up to trailing whitespace on each line and trailing blank lines.

Results leave on the harness's original stdout as one line per test, `<nonce> <index> <1|0>
<detail>`; the program's own stdout and stderr go to files, so its output can neither break a
result line nor, without the nonce, forge one. An assert-style test runs in the program's own
interpreter, so a program written to cheat can still pass it (an object whose `__eq__` is always
true, or the nonce read out of this harness's frames); stdin/stdout tests compare what a separate
process printed and are not open to that.
"""

import json
import os
import signal
import subprocess
import sys


def main():
    spec = json.loads(sys.stdin.read())
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    results = os.dup(1)
    out = os.open("output.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(out, 1)
    os.dup2(out, 2)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an over-long write fails with EFBIG, not a kill
    nonce, tests, timeout_s = spec["nonce"], spec["tests"], spec["test_timeout_s"]
    max_bytes = spec["max_output_bytes"]

    write = os.write  # held here: a program that replaces os.write or json.dumps cannot rewrite results

    def report(i, passed, detail=""):
        detail = str(detail)[:300].replace("\n", " ")
        write(results, f"\n{nonce} {i:d} {1 if passed is True else 0:d} {detail}\n".encode("utf-8", "replace"))

    def on_alarm(signum, frame):
        raise TimeoutError(f"test took longer than {timeout_s}s")

    asserts = [(i, t) for i, t in enumerate(tests) if isinstance(t, str)]
    if asserts:
        # Not "__main__": a program's `if __name__ == "__main__":` block (reading stdin, say) stays out.
        namespace = {"__name__": "solution"}
        signal.signal(signal.SIGALRM, on_alarm)
        try:
            signal.setitimer(signal.ITIMER_REAL, timeout_s)
            exec(compile(open("solution.py").read(), "solution.py", "exec"), namespace)
            failure = ""
        except BaseException as err:  # noqa: BLE001 - the program's failure fails its tests
            failure = f"program raised {type(err).__name__}: {err}"
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        for i, test in asserts:
            if failure:
                report(i, False, failure)
                continue
            try:
                signal.setitimer(signal.ITIMER_REAL, timeout_s)
                exec(compile(test, f"test_{i}", "exec"), namespace)
                report(i, True)
            except BaseException as err:  # noqa: BLE001
                report(i, False, f"{type(err).__name__}: {err}")
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)

    for i, test in enumerate(tests):
        if isinstance(test, str):
            continue
        with open(f"stdout_{i}.txt", "w+b") as stdout:
            try:
                proc = subprocess.run([sys.executable, "-I", "-S", "solution.py"], input=test["input"].encode(),
                                      stdout=stdout, stderr=subprocess.DEVNULL, timeout=timeout_s)
            except subprocess.TimeoutExpired:
                report(i, False, f"timed out after {timeout_s}s")
                continue
            except OSError as err:
                report(i, False, f"cannot run the program: {err}")
                continue
            stdout.seek(0)
            got = stdout.read(max_bytes).decode("utf-8", "replace")
        want = test["output"]
        if proc.returncode != 0:
            report(i, False, f"exit status {proc.returncode}")
        elif _normal(got) == _normal(want):
            report(i, True)
        else:
            report(i, False, f"expected {want[:100]!r}, got {got[:100]!r}")


def _normal(text):
    return "\n".join(line.rstrip() for line in text.rstrip().splitlines())


main()
