"""Writes examples/data/reasoning/{train,test}.{jsonl,parquet}, the main demo's data: generated
two-step word problems with single-digit numbers, in GSM8K's format (`question`, and `answer`: a
worked solution ending in `#### <number>`) plus two columns for the demo:

- `final`: the answer alone (for exact-answer scorers, e.g. examples/hf_mcp_stdio.yaml's);
- `solution`: the same working ending in `\\boxed{<number>}`, the SFT warm start's target;
- `rejected`: a plausible wrong solution that stops one step early and boxes the intermediate
  result. `sft.label_noise` imitates it instead of `solution` on that fraction of the examples (and
  `rlmesh dpo` can read it as the dispreferred answer), so the warm start has a habit the `math`
  environment scores 0 and RL has to unlearn: finishing the problem pays.

A solution reads "Buy 4: 3 + 4 = 7. Give 2: 7 - 2 = 5. \\boxed{5}" (about 45 characters, as many
tokens: the tiny model's tokenizer is one token a byte). Deterministic: the same files every run,
so they are committed.

`--one-step` writes examples/data/reasoning_one_step instead (examples/smollm2_grpo.yaml, the real
model's demo): one change to a count of 3-20, half gains ("gets 12 more") and half losses ("gives
away 5"), one line of working. SmolLM2-135M-Instruct answers about a fifth of them greedily as
shipped (two-step problems: under a tenth), so GRPO has groups with mixed rewards to learn from.

`--long` writes examples/data/reasoning_long instead (examples/reasoning_long_grpo.yaml, the
long-generation benchmark's task): one running count through a long-tailed number of steps
(`long_steps`: half the problems 3-5 steps, one in ten over 20, capped at 45), so worked answers run
from ~60 to ~1,000 tokens. Each step's label repeats the question's phrase ("sells 3: 12 - 3 = 9.")
and the count stays within 0-20, so a longer answer is the same skill repeated, not a harder one.

    python scripts/make_reasoning_data.py [--one-step | --long] [--output DIR] [--num-train N] [--num-test N] [--seed S]
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Callable

from sample_data import generate

NAMES = [("Ava", "She"), ("Ben", "He"), ("Chloe", "She"), ("Dev", "He"), ("Elena", "She"), ("Felix", "He"),
         ("Grace", "She"), ("Hiro", "He"), ("Ines", "She"), ("Jamal", "He"), ("Kira", "She"), ("Liam", "He")]
ITEMS = ["apples", "stickers", "marbles", "pencils", "cards", "shells", "beads", "stamps"]

# question, steps [(label, left, op, right)]: each step is written "<label>: <left> <op> <right> = <result>."
Problem = tuple[str, list[tuple[str, int, str, int]]]


def gain_then_loss(rng: random.Random) -> Problem:
    (name, he), item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(2, 9), rng.randint(1, 9)
    c = rng.randint(1, min(9, a + b))
    return (f"{name} has {a} {item}. {he} buys {b} more, then gives away {c}. How many {item} are left?",
            [(f"Buy {b}", a, "+", b), (f"Give {c}", a + b, "-", c)])


def loss_then_gain(rng: random.Random) -> Problem:
    (name, he), item = rng.choice(NAMES), rng.choice(ITEMS)
    a = rng.randint(2, 9)
    b, c = rng.randint(1, a), rng.randint(1, 9)
    return (f"{name} has {a} {item}. {he} loses {b}, then finds {c} more. How many {item} now?",
            [(f"Lose {b}", a, "-", b), (f"Find {c}", a - b, "+", c)])


def two_gifts(rng: random.Random) -> Problem:
    (name, _), (friend, _), item = rng.choice(NAMES), rng.choice(NAMES), rng.choice(ITEMS)
    if friend == name:
        friend = "Max"
    a, b, c = rng.randint(2, 9), rng.randint(1, 9), rng.randint(1, 9)
    return (f"{name} has {a} {item}, gets {b} from {friend} and buys {c}. How many {item} now?",
            [(f"Get {b}", a, "+", b), (f"Buy {c}", a + b, "+", c)])


def together(rng: random.Random) -> Problem:
    (name, _), (other, _), item = rng.choice(NAMES), rng.choice(NAMES), rng.choice(ITEMS)
    if other == name:
        other = "Max"
    a, b = rng.randint(2, 9), rng.randint(1, 9)
    return (f"{name} has {a} {item}. {other} has {b} more. How many do they have together?",
            [(other, a, "+", b), ("Both", a, "+", a + b)])


KINDS: list[Callable[[random.Random], Problem]] = [gain_then_loss, loss_then_gain, two_gifts, together]
OPS = {"+": lambda x, y: x + y, "-": lambda x, y: x - y}


def working(steps: list[tuple[str, int, str, int]]) -> tuple[list[str], list[int]]:
    """The solution's lines, one a step, and each step's result."""
    lines, results = [], []
    for label, left, op, right in steps:
        results.append(OPS[op](left, right))
        lines.append(f"{label}: {left} {op} {right} = {results[-1]}.")
    return lines, results


def row(problem: Problem) -> dict[str, str]:
    question, steps = problem
    lines, results = working(steps)
    answer, early = results[-1], results[-2]
    gsm8k = "\n".join([*lines, f"#### {answer}"])
    return {"question": question, "answer": gsm8k, "final": str(answer),
            "solution": " ".join([*lines, f"\\boxed{{{answer}}}"]),
            "rejected": " ".join([*lines[:-1], f"\\boxed{{{early}}}"])}


def rows_of(draw: Callable[[random.Random], Problem],
            to_row: Callable[[Problem], dict[str, str]] = row) -> Callable[[int, random.Random, set[str]], list[dict[str, str]]]:
    """A row maker drawing problems with `draw`, written by `to_row`."""

    def make(num: int, rng: random.Random, seen: set[str]) -> list[dict[str, str]]:
        rows = []
        while len(rows) < num:
            problem = draw(rng)
            if problem[0] in seen:  # train and test never share a question
                continue
            seen.add(problem[0])
            rows.append(to_row(problem))
        return rows

    return make


make_rows = rows_of(lambda rng: rng.choice(KINDS)(rng))


def one_change(rng: random.Random) -> Problem:
    (name, he), item = rng.choice(NAMES), rng.choice(ITEMS)
    a = rng.randint(3, 20)
    if rng.random() < 0.5:
        verb, b = rng.choice(["gets", "buys", "finds"]), rng.randint(2, 15)
        return (f"{name} has {a} {item}. {he} {verb} {b} more {item}. How many {item} does {he.lower()} have now?",
                [(f"{verb.capitalize()} {b}", a, "+", b)])
    verb, b = rng.choice(["gives away", "loses", "sells"]), rng.randint(1, a - 1)
    return (f"{name} has {a} {item}. {he} {verb} {b} {item}. How many {item} does {he.lower()} have now?",
            [(f"{verb.capitalize()} {b}", a, "-", b)])


def one_step_row(problem: Problem) -> dict[str, str]:
    """As `row`, for one step: the `rejected` solution applies the other operation."""
    question, [(label, left, op, right)] = problem
    answer = OPS[op](left, right)
    other = "-" if op == "+" else "+"
    wrong = OPS[other](left, right)
    line = f"{label}: {left} {op} {right} = {answer}."
    return {"question": question, "answer": f"{line}\n#### {answer}", "final": str(answer),
            "solution": f"{line} \\boxed{{{answer}}}",
            "rejected": f"{label}: {left} {other} {right} = {wrong}. \\boxed{{{wrong}}}"}


GAINS, LOSSES = ["buys", "finds", "gets"], ["sells", "loses", "gives"]
LONG_MIN_STEPS, LONG_MAX_STEPS, LONG_MAX_COUNT = 3, 45, 20


def long_steps(rng: random.Random) -> int:
    """A Pareto (Zipf-like) draw: P(more than n steps) = (3/n)^1.1, capped at LONG_MAX_STEPS."""
    return min(LONG_MAX_STEPS, int(LONG_MIN_STEPS * rng.paretovariate(1.1)))


def running_count(rng: random.Random) -> Problem:
    """A count changed by `long_steps` gains and losses of 1-9, kept within 0..LONG_MAX_COUNT."""
    (name, he), item = rng.choice(NAMES), rng.choice(ITEMS)
    count = start = rng.randint(2, 9)
    steps, phrases = [], []
    for _ in range(long_steps(rng)):
        gain = count < 2 or (count + 1 <= LONG_MAX_COUNT and rng.random() < 0.5)
        by = rng.randint(1, min(9, LONG_MAX_COUNT - count) if gain else min(9, count))
        phrase = f"{rng.choice(GAINS if gain else LOSSES)} {by}"
        steps.append((phrase, count, "+" if gain else "-", by))
        phrases.append(phrase)
        count += by if gain else -by
    return (f"{name} has {start} {item}. Then {he.lower()} {', '.join(phrases)}. How many {item} are left?", steps)


make_long_rows = rows_of(running_count)
make_one_step_rows = rows_of(one_change, one_step_row)


def main() -> None:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--long", action="store_true")
    pre.add_argument("--one-step", action="store_true")
    args, sys.argv[1:] = pre.parse_known_args()
    if args.one_step:
        generate(__doc__.split("\n\n")[3], make_one_step_rows, default_output="examples/data/reasoning_one_step",
                 num_train=1000, num_test=64)
    elif args.long:
        generate(__doc__.split("\n\n")[4], make_long_rows, default_output="examples/data/reasoning_long",
                 num_train=600, jsonl=False)
    else:
        generate(__doc__.split("\n\n")[0], make_rows, default_output="examples/data/reasoning", num_train=2000,
                 test_first=True)


if __name__ == "__main__":
    main()
