"""Generate workbench/assets/corpus.txt: the project's own training text, seeded and deterministic.

No machine here reaches the internet, and the package may only ship text it owns, so the corpus is made
here: one item per line, half arithmetic (`317+48=365`, `52*7=364`, `90-13=77`) and half sentences from
a small hand-written grammar with subject-verb agreement. Both have structure a tiny byte-level GPT picks
up within tens of steps (digits and '=' first, then common words), and the arithmetic gives an
exact-match accuracy metric beside the loss.

Re-running with the same arguments writes a byte-identical file:
    python scripts/make_corpus.py                 # -> workbench/assets/corpus.txt
    python scripts/make_corpus.py --out /tmp/c.txt --seed 1 --lines 2000
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "workbench" / "assets" / "corpus.txt"

# (singular, plural) pairs, so agreement is something the model can learn.
SUBJECTS = [
    ("the cat", "the cats"), ("a small dog", "two small dogs"), ("my sister", "my sisters"),
    ("the old farmer", "the old farmers"), ("a robot", "the robots"), ("the teacher", "the teachers"),
    ("a tired student", "the tired students"), ("the baker", "the bakers"),
    ("our neighbour", "our neighbours"),
    ("the captain", "the sailors"), ("a young fox", "three young foxes"), ("the child", "the children"),
]
TRANSITIVE = [
    ("sees", "see"), ("likes", "like"), ("carries", "carry"), ("finds", "find"), ("paints", "paint"),
    ("builds", "build"), ("follows", "follow"), ("opens", "open"), ("counts", "count"), ("cleans", "clean"),
    ("drops", "drop"), ("watches", "watch"),
]
INTRANSITIVE = [
    ("sleeps", "sleep"), ("runs", "run"), ("sings", "sing"), ("waits", "wait"), ("laughs", "laugh"),
    ("works", "work"), ("rests", "rest"), ("dances", "dance"),
]
OBJECTS = [
    "a red ball", "the river", "two apples", "the green door", "a long letter", "the blue boat",
    "a warm loaf", "the tall tree", "five stones", "the map", "a paper kite", "the garden gate",
    "an empty box", "the bright lamp", "a wooden chair", "the last train",
]
PLACES = [
    "in the garden", "near the river", "at the market", "on the hill", "by the window", "in the kitchen",
    "under the bridge", "at school",
]
TIMES = ["today", "at night", "every morning", "after lunch", "on sunday", "in the rain", "slowly", "again"]
CLAUSES = [
    "because it is cold", "when the sun rises", "and then it rains", "after the bell rings",
    "while the kettle sings", "before the shop closes", "so everyone is happy", "but nobody notices",
]


def subject_and_number(rng: random.Random) -> tuple[str, int]:
    number = rng.randrange(2)  # 0 = singular, 1 = plural; picks the matching verb form
    return rng.choice(SUBJECTS)[number], number


def sentence(rng: random.Random) -> str:
    subj, n = subject_and_number(rng)
    kind = rng.randrange(5)
    if kind == 0:
        words = [subj, rng.choice(INTRANSITIVE)[n], rng.choice(TIMES)]
    elif kind == 1:
        words = [subj, rng.choice(TRANSITIVE)[n], rng.choice(OBJECTS)]
    elif kind == 2:
        words = [subj, rng.choice(TRANSITIVE)[n], rng.choice(OBJECTS), rng.choice(PLACES)]
    elif kind == 3:
        words = [subj, rng.choice(TRANSITIVE)[n], rng.choice(OBJECTS), rng.choice(CLAUSES)]
    else:
        other, m = subject_and_number(rng)
        words = [subj, rng.choice(INTRANSITIVE)[n], rng.choice(PLACES), "and", other,
                 rng.choice(TRANSITIVE)[m], rng.choice(OBJECTS)]
    text = " ".join(words)
    return text[0].upper() + text[1:] + "."


def arithmetic(rng: random.Random) -> str:
    op = rng.choice("+-*")
    if op == "+":
        a, b = rng.randrange(1000), rng.randrange(1000)
        return f"{a}+{b}={a + b}"
    if op == "-":
        a, b = sorted((rng.randrange(1000), rng.randrange(1000)), reverse=True)  # keep results >= 0
        return f"{a}-{b}={a - b}"
    a, b = rng.randrange(100), rng.randrange(10)
    return f"{a}*{b}={a * b}"


def make_corpus(seed: int = 0, lines: int = 9000) -> str:
    """The corpus text: `lines` items, each an arithmetic fact or a grammar sentence, in random order."""
    rng = random.Random(seed)
    items = [arithmetic(rng) if rng.random() < 0.5 else sentence(rng) for _ in range(lines)]
    return "\n".join(items) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lines", type=int, default=9000)
    args = parser.parse_args(argv)
    text = make_corpus(args.seed, args.lines)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    # newline="\n" and ascii so the bytes are identical on every platform.
    args.out.write_text(text, encoding="ascii", newline="\n")
    print(f"wrote {args.out} ({len(text.encode())} bytes, {args.lines} lines)")


if __name__ == "__main__":
    main()
