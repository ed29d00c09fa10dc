"""Prompt lookup (n-gram) drafting: continue the sequence the way its own text continued before."""
from __future__ import annotations


def propose_ngram(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the sequence's last n tokens,
    trying n from max_n down to min_n (Saxena, "Prompt Lookup Decoding", 2023; vLLM's ngram drafter)."""
    length = len(token_ids)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        tail = token_ids[length - n:]
        for start in range(length - n - 1, -1, -1):
            if token_ids[start: start + n] == tail:
                return token_ids[start + n: start + n + k]
    return []
