"""Shared by the scripts that generate the shipped sample datasets: the command line (output
directory, sizes, seed), disjoint train and test splits, and writing each split as JSONL and
Parquet."""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path

RowMaker = Callable[[int, random.Random, set], list[dict[str, str]]]


def write(rows: list[dict[str, str]], stem: Path, jsonl: bool = True) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    if jsonl:
        stem.with_suffix(".jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.Table.from_pylist(rows), stem.with_suffix(".parquet"))


def generate(description: str, make_rows: RowMaker, *, default_output: str, num_train: int,
             num_test: int = 100, test_first: bool = False, jsonl: bool = True) -> None:
    """Parse the command line, draw the splits from one seeded generator (sharing the set of
    questions seen, so train and test never overlap) and write them. `test_first` keeps the draw
    order a dataset was first made with, so regenerating it gives the same files. `jsonl=False`
    writes Parquet only (for datasets too large to commit twice)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--output", default=str(Path(__file__).resolve().parents[1] / default_output))
    parser.add_argument("--num-train", type=int, default=num_train)
    parser.add_argument("--num-test", type=int, default=num_test)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    rng, seen = random.Random(args.seed), set()
    if test_first:
        test = make_rows(args.num_test, rng, seen)
        train = make_rows(args.num_train, rng, seen)
    else:
        train = make_rows(args.num_train, rng, seen)
        test = make_rows(args.num_test, rng, seen)
    write(train, out / "train", jsonl)
    write(test, out / "test", jsonl)
    print(f"wrote {len(train)} train and {len(test)} test rows to {out}")
