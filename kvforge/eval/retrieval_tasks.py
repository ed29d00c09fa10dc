"""RULER-style retrieval tasks, generated: no download (Hsieh et al., "RULER: What's the Real Context Size of
Your Long-Context Language Models?", 2024, arXiv:2404.06654).

Each task builds one context (facts hidden in filler text from the panel's texts at random line breaks) and
several questions about it, each with its exact answer. The questions come after the whole context, so a cache
compressed at the end of the context must serve all of them (the case KVzip says breaks query-aware methods).
"""
from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

WORDS = ("apple", "river", "candle", "falcon", "marble", "violin", "harbor", "pepper", "lantern", "meadow", "copper",
         "glacier", "orchid", "saddle", "thunder", "walnut", "velvet", "compass", "banjo", "cactus", "dolphin", "ember",
         "fossil", "goblet", "hammock", "igloo", "jasmine", "kettle", "lizard", "magnet", "nectar", "oyster", "parrot",
         "quiver", "raven", "sapphire", "tulip", "umbrella", "walrus", "yarrow", "zephyr", "anchor", "biscuit")
INTRO = "Some special facts are hidden inside the following text. Read it and remember them.\n\n"


@dataclass(frozen=True)
class Question:
    prompt: str  # asked after the context; the answer follows it directly
    answer: str  # the exact continuation (starts with a space)


@dataclass(frozen=True)
class Case:
    task: str
    facts: list[str]  # sentences hidden in the filler, in order
    questions: list[Question]


def _number(rng: random.Random) -> str:
    return str(rng.randrange(1_000_000, 9_999_999))


def _keys(rng: random.Random, n: int) -> list[str]:
    return [f"{a}-{b}" for a, b in zip(rng.sample(WORDS, n), rng.sample(WORDS, n))]


def _needle(key: str, value: str) -> str:
    return f"One of the special magic numbers for {key} is: {value}."


def _ask(key: str) -> str:
    return f"What is the special magic number for {key} mentioned in the text above? The special magic number for {key} is:"


def niah_single(rng: random.Random, questions: int) -> Case:
    """One needle, asked once."""
    key, value = _keys(rng, 1)[0], _number(rng)
    return Case("niah_single", [_needle(key, value)], [Question(_ask(key), f" {value}")])


def niah_multikey(rng: random.Random, questions: int) -> Case:
    """`questions` needles with different keys; each is asked, in an order unlike the text's."""
    keys, values = _keys(rng, questions), [_number(rng) for _ in range(questions)]
    asked = rng.sample(range(questions), questions)
    return Case("niah_multikey", [_needle(k, v) for k, v in zip(keys, values)],
                [Question(_ask(keys[i]), f" {values[i]}") for i in asked])


def multivalue(rng: random.Random, questions: int) -> Case:
    """Two keys with three numbers each, interleaved; each key's numbers are asked in the order they appear."""
    keys = _keys(rng, 2)
    values = {k: [_number(rng) for _ in range(3)] for k in keys}
    facts = [_needle(k, values[k][i]) for i in range(3) for k in keys]
    return Case("multivalue", facts, [Question(
        f"What are all the special magic numbers for {k} mentioned in the text above, in order? "
        f"The special magic numbers for {k} are:", " " + ", ".join(values[k])) for k in keys])


def variable_tracking(rng: random.Random, questions: int) -> Case:
    """Two chains of assignments (VAR A = 12345, VAR B = A, ...); asked which variables hold each value."""
    names = [w.upper()[:5] for w in rng.sample(WORDS, 8)]
    chains = [names[:4], names[4:]]
    values = [str(rng.randrange(10_000, 99_999)) for _ in chains]
    facts = []
    for step in range(4):
        for chain, value in zip(chains, values):
            facts.append(f"VAR {chain[step]} = {value if step == 0 else chain[step - 1]}.")
    return Case("variable_tracking", facts, [Question(
        f"Which variables are assigned the value {value}, directly or through other variables, in the order they "
        f"were assigned? Answer: the variables are:", " " + ", ".join(chain)) for chain, value in zip(chains, values)])


def common_words(rng: random.Random, questions: int) -> Case:
    """A numbered word list in the text: three words appear often (6, 5 and 4 times), the others once or twice."""
    common, rare = rng.sample(WORDS, 3), rng.sample(WORDS, 12)
    rare = [w for w in rare if w not in common][:10]
    words = [w for w, n in zip(common, (6, 5, 4)) for _ in range(n)] + [w for i, w in enumerate(rare) for _ in range(1 + i % 2)]
    rng.shuffle(words)
    facts = [f"Word list item {i + 1}: {w}." for i, w in enumerate(words)]
    return Case("common_words", facts, [Question(
        "Which three words appear most often in the word list above, most frequent first? Answer: the three most "
        "common words are:", " " + ", ".join(common))])


TASKS: dict[str, Callable[[random.Random, int], Case]] = {
    "niah_single": niah_single, "niah_multikey": niah_multikey, "multivalue": multivalue,
    "variable_tracking": variable_tracking, "common_words": common_words}


def line_breaks(tokenizer, ids: list[int]) -> list[int]:
    """Indices i where a fact may go before ids[i]: right after a token that ends a line."""
    ends = {t for t in set(ids) if tokenizer.decode([t]).endswith("\n")}
    return [i + 1 for i, t in enumerate(ids[:-1]) if t in ends]


def build_context(tokenizer, case: Case, filler: list[int], breaks: list[int], length: int,
                  rng: random.Random) -> list[int]:
    """About `length` tokens: the intro, filler from a random place with the facts at random line breaks (in order),
    sized so the context alone fills `length` minus the questions and answers."""
    intro = tokenizer.encode(INTRO)
    facts = [tokenizer.encode(" " + f + "\n") for f in case.facts]
    asked = sum(len(tokenizer.encode("\n" + q.prompt + q.answer + "\n")) for q in case.questions)
    room = max(len(facts), length - len(intro) - sum(map(len, facts)) - asked)
    start = rng.randrange(0, max(1, len(filler) - room))
    window = filler[start: start + room]
    inside = [b - start for b in breaks if start < b < start + room] or [room // 2]
    at = sorted(rng.choice(inside) for _ in facts)
    out, prev = list(intro), 0
    for cut, fact in zip(at, facts):
        out += window[prev:cut] + fact
        prev = cut
    return out + window[prev:]
