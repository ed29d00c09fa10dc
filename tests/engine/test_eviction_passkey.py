"""Passkey prompts: the needle sits at the asked depth and the prompt has the asked length."""
from __future__ import annotations

import pytest

from kvforge.eval.passkey import FILLER, NEEDLE, QUESTION, passkey_prompt


class CharTokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(map(chr, ids))


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_needle_at_depth(depth):
    tok = CharTokenizer()
    ids = passkey_prompt(tok, 2000, depth, 12345)
    text = tok.decode(ids)
    assert len(ids) == 2000 and text.endswith(QUESTION)
    at = text.index(NEEDLE.format(key=12345))
    assert text.count(FILLER) > 10
    assert abs(at / 2000 - depth) < 0.1
    assert text.count("12345") == 2
