"""Seeded synthetic workloads: random token prompts of given length ranges."""
from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class Request:
    prompt_ids: list[int]
    max_tokens: int


def random_tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    """n random token ids, avoiding the first ids, where special tokens live."""
    low = min(100, vocab_size // 2)
    return [rng.randrange(low, vocab_size) for _ in range(n)]


def random_workload(num_requests: int, prompt_len: tuple[int, int], output_len: tuple[int, int], vocab_size: int,
                    seed: int = 0) -> list[Request]:
    """Prompts of uniform random lengths and tokens (avoiding the first 100 ids, where special tokens live)."""
    rng = random.Random(seed)
    return [Request(random_tokens(rng, rng.randint(*prompt_len), vocab_size), rng.randint(*output_len))
            for _ in range(num_requests)]
