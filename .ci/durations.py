#!/usr/bin/env python3
"""Prints where a CI run's time went, from its JUnit XML reports: the slowest tests, and the time
per test file, with totals. Standard library only (it runs before and after the virtualenv exists).

    python3 .ci/durations.py .ci/reports/*.xml [--top 40]
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict


def _cases(path: str) -> list[tuple[str, float, str, str]]:
    """(name, seconds, outcome, message) of every test case; the message is a failure's or error's."""
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome, message = tag, found.get("message", "") or (found.text or "").strip()
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        cases.append((name, float(case.get("time", 0.0)), outcome, message))
    return cases


def _module(classname: str) -> str:
    """tests.e2e.test_mesh.TestX -> tests/e2e/test_mesh.py (pytest's classname is the dotted path)."""
    parts = classname.split(".")
    for i, part in enumerate(parts):
        if part.startswith("test_"):
            return "/".join(parts[: i + 1]) + ".py"
    return classname


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", help="JUnit XML files (pytest --junitxml)")
    parser.add_argument("--top", type=int, default=40, help="how many of the slowest tests to list")
    args = parser.parse_args()
    cases = []
    for path in args.reports:
        try:
            cases += _cases(path)
        except (OSError, ET.ParseError) as err:
            print(f"durations: cannot read {path}: {err}", file=sys.stderr)
    if not cases:
        return 0
    by_file: dict[str, list[float]] = defaultdict(list)
    for name, seconds, *_ in cases:
        by_file[_module(name.split("::")[0])].append(seconds)
    print(f"\n== slowest {args.top} tests (seconds, outcome) ==")
    for name, seconds, outcome, _ in sorted(cases, key=lambda c: -c[1])[:args.top]:
        print(f"{seconds:8.1f}  {outcome:7s}  {name}")
    print("\n== seconds per test module (tests) ==")
    for module, times in sorted(by_file.items(), key=lambda kv: -sum(kv[1])):
        print(f"{sum(times):8.1f}  {len(times):4d}  {module}")
    # Again in short, near the end of the log (what a reader of its last lines sees): the ten slowest
    # tests and the ten heaviest modules.
    print("\n== in short: the 10 slowest tests, the 10 heaviest modules ==")
    for name, seconds, outcome, _ in sorted(cases, key=lambda c: -c[1])[:10]:
        print(f"{seconds:8.1f}  {outcome:7s}  {name.removeprefix('tests.')}")
    for module, times in sorted(by_file.items(), key=lambda kv: -sum(kv[1]))[:10]:
        print(f"{sum(times):8.1f}  {len(times):4d}  {module}")
    counts = defaultdict(int)
    for _, _, outcome, _ in cases:
        counts[outcome] += 1
    # Last, where a reader of the end of the log sees them: what each failure or error said (a
    # session fixture's error repeats on every test that used it: printed once).
    said = set()
    for name, _, outcome, message in cases:
        if outcome in ("failure", "error") and message not in said:
            said.add(message)
            print(f"{outcome}: {name}: {message.splitlines()[0][:400] if message else '(no message)'}")
    print(f"\n{sum(c[1] for c in cases):.0f} s in {len(cases)} tests: "
          + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
