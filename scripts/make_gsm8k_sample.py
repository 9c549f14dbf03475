"""Writes examples/data/gsm8k_sample/{train,test}.{jsonl,parquet}: generated grade-school word
problems in GSM8K's format — `question`, and `answer` holding a worked solution (GSM8K's
`<<expression=result>>` annotations included) that ends in `#### <number>`. Deterministic: the same
files every run, so they are committed and the tests read them.

    python scripts/make_gsm8k_sample.py [--output DIR] [--num-train N] [--num-test N] [--seed S]
"""

from __future__ import annotations

import random
from collections.abc import Callable

from sample_data import generate

NAMES = [("Ava", "She"), ("Ben", "He"), ("Chloe", "She"), ("Dev", "He"), ("Elena", "She"), ("Felix", "He"),
         ("Grace", "She"), ("Hiro", "He"), ("Ines", "She"), ("Jamal", "He"), ("Kira", "She"), ("Liam", "He")]
ITEMS = ["apples", "stickers", "marbles", "pencils", "cards", "shells", "beads", "stamps"]
GOODS = [("notebook", "notebooks"), ("sandwich", "sandwiches"), ("ticket", "tickets"), ("plant", "plants"),
         ("book", "books"), ("mug", "mugs")]

Problem = tuple[str, list[str], int]  # question, solution lines, final answer


def packs(rng: random.Random) -> Problem:
    (name, he), item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b, c = rng.randint(3, 40), rng.randint(2, 9), rng.randint(3, 12)
    bought = b * c
    return (f"{name} has {a} {item}. {he} buys {b} packs with {c} {item} in each pack. "
            f"How many {item} does {name} have now?",
            [f"{name} buys {b} * {c} = <<{b}*{c}={bought}>>{bought} {item}.",
             f"Now {name} has {a} + {bought} = <<{a}+{bought}={a + bought}>>{a + bought} {item}."], a + bought)


def change(rng: random.Random) -> Problem:
    (name, he), (one, many) = rng.choice(NAMES), rng.choice(GOODS)
    b, c = rng.randint(2, 8), rng.randint(2, 15)
    cost = b * c
    money = cost + rng.randint(1, 60)
    return (f"{name} had ${money}. {he} bought {b} {many} for ${c} per {one}. How many dollars does "
            f"{he.lower()} have left?",
            [f"The {many} cost {b} * {c} = <<{b}*{c}={cost}>>{cost} dollars.",
             f"{name} has {money} - {cost} = <<{money}-{cost}={money - cost}>>{money - cost} dollars left."],
            money - cost)


def boxes(rng: random.Random) -> Problem:
    (name, he) = rng.choice(NAMES)
    b, each = rng.randint(2, 9), rng.randint(4, 15)
    eaten = rng.randint(1, each - 1)
    total = b * each
    return (f"{name} baked {total} cookies and put them equally into {b} boxes. Then {he.lower()} ate {eaten} "
            "cookies from one box. How many cookies are left in that box?",
            [f"Each box gets {total} / {b} = <<{total}/{b}={each}>>{each} cookies.",
             f"After eating, that box has {each} - {eaten} = <<{each}-{eaten}={each - eaten}>>{each - eaten} cookies."],
            each - eaten)


def trip(rng: random.Random) -> Problem:
    s1, h1, s2, h2 = rng.randint(20, 70), rng.randint(2, 5), rng.randint(20, 70), rng.randint(1, 4)
    d1, d2 = s1 * h1, s2 * h2
    return (f"A train travels at {s1} miles per hour for {h1} hours, then at {s2} miles per hour for {h2} hours. "
            "How many miles does it travel in total?",
            [f"First it travels {s1} * {h1} = <<{s1}*{h1}={d1}>>{d1} miles.",
             f"Then it travels {s2} * {h2} = <<{s2}*{h2}={d2}>>{d2} miles.",
             f"In total it travels {d1} + {d2} = <<{d1}+{d2}={d1 + d2}>>{d1 + d2} miles."], d1 + d2)


def reading(rng: random.Random) -> Problem:
    (name, he) = rng.choice(NAMES)
    p, q, w = rng.randint(5, 30), rng.randint(10, 50), rng.randint(2, 4)
    week = 5 * p + 2 * q
    return (f"{name} reads {p} pages every weekday and {q} pages on each day of the weekend. How many pages "
            f"does {he.lower()} read in {w} weeks?",
            [f"On weekdays {he.lower()} reads 5 * {p} = <<5*{p}={5 * p}>>{5 * p} pages a week.",
             f"On the weekend {he.lower()} reads 2 * {q} = <<2*{q}={2 * q}>>{2 * q} pages a week.",
             f"That is {5 * p} + {2 * q} = <<{5 * p}+{2 * q}={week}>>{week} pages a week.",
             f"In {w} weeks {he.lower()} reads {week} * {w} = <<{week}*{w}={week * w}>>{week * w} pages."], week * w)


def sale(rng: random.Random) -> Problem:
    (one, many) = rng.choice(GOODS)
    pct = rng.choice([10, 20, 25, 50])
    price = rng.randint(1, 12) * 20
    off = price * pct // 100
    n = rng.randint(2, 5)
    each = price - off
    return (f"A {one} costs ${price}. This week it is {pct}% off. How many dollars do {n} {many} cost this week?",
            [f"The discount is {price} * {pct} / 100 = <<{price}*{pct}/100={off}>>{off} dollars.",
             f"One {one} costs {price} - {off} = <<{price}-{off}={each}>>{each} dollars.",
             f"{n} {many} cost {each} * {n} = <<{each}*{n}={each * n}>>{each * n} dollars."], each * n)


KINDS: list[Callable[[random.Random], Problem]] = [packs, change, boxes, trip, reading, sale]


def make_rows(num: int, rng: random.Random, seen: set[str]) -> list[dict[str, str]]:
    rows = []
    while len(rows) < num:
        question, lines, answer = rng.choice(KINDS)(rng)
        if question in seen:  # train and test never share a question
            continue
        seen.add(question)
        rows.append({"question": question, "answer": "\n".join([*lines, f"#### {answer}"])})
    return rows


def main() -> None:
    generate(__doc__.split("\n\n")[0], make_rows, default_output="examples/data/gsm8k_sample", num_train=400,
             test_first=False)


if __name__ == "__main__":
    main()
