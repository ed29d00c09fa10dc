"""Prompt lookup (n-gram) drafting: continue the sequence the way its own text continued before
(Saxena, "Prompt Lookup Decoding", 2023; vLLM's ngram drafter)."""
from __future__ import annotations


class NgramIndex:
    """Where each n-gram (min_n <= n <= max_n) of a growing token list last ended, before its final token.
    Each call indexes only the tokens added since the last, so a lookup costs O(new tokens), not O(length)."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.latest_end: dict[tuple[int, ...], int] = {}
        self.indexed = 1  # n-grams ending before this position are indexed

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the most recent earlier occurrence of the last n tokens, trying n from
        max_n down to min_n."""
        length = len(token_ids)
        for end in range(self.indexed, length):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.latest_end[tuple(token_ids[end - n: end])] = end
        self.indexed = max(self.indexed, length)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            end = self.latest_end.get(tuple(token_ids[length - n:]))
            if end is not None:
                return token_ids[end: end + k]
        return []


def propose_ngram(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """One lookup without a kept index."""
    return NgramIndex(min_n, max_n).propose(token_ids, k)
