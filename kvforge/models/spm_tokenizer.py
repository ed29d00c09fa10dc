"""SentencePiece-style BPE from a GGUF's `tokenizer.ggml.*` keys (tokenizer.ggml.model == "llama"), as Gemma ships.

The GGUF stores pieces, scores and token types but no merges. A merge is every split of a piece into two pieces
of the vocabulary; merges rank in the order their result appears in the file (Gemma's file order is its merge
order), longer left halves first. Spaces become "\u2581" before BPE, unknown characters fall back to <0xNN> byte
pieces, and control / user-defined pieces are matched whole.
"""
from __future__ import annotations

from typing import Any

import tokenizers
from tokenizers import AddedToken, decoders, models, normalizers

SPACE = "\u2581"
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def _respell(piece: str) -> str:
    """Runs of spaces are stored as real spaces; the BPE sees them as SPACE pieces, like every other space."""
    return SPACE * len(piece) if " " in piece and not piece.strip() else piece


def merges_from_vocab(pieces: list[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every (left, right) split of each piece into two vocabulary pieces, by the piece's rank, longer left first."""
    merges: list[tuple[str, str]] = []
    for piece in pieces:
        splits = [(piece[:i], piece[i:]) for i in range(len(piece) - 1, 0, -1)]
        merges.extend((left, right) for left, right in splits if left in vocab and right in vocab)
    return merges


def sentencepiece_bpe(meta: dict[str, Any]) -> tokenizers.Tokenizer:
    """A byte-fallback BPE tokenizer equivalent to the SentencePiece model the GGUF describes."""
    raw: list[str] = list(meta["tokenizer.ggml.tokens"])
    pieces = [_respell(p) for p in raw]
    vocab: dict[str, int] = {}
    for i, piece in enumerate(pieces):
        vocab.setdefault(piece, i)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = pieces[int(unk_id)] if unk_id is not None else "<unk>"
    bpe = models.BPE(vocab=vocab, merges=merges_from_vocab(pieces, vocab), unk_token=unk, fuse_unk=True,
                     byte_fallback=True)
    tk = tokenizers.Tokenizer(bpe)
    tk.normalizer = normalizers.Replace(" ", SPACE)
    tk.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    types = list(meta.get("tokenizer.ggml.token_type", []))
    control = [p for p, k in zip(raw, types) if k == _CONTROL]
    user = [p for p, k in zip(raw, types) if k == _USER_DEFINED and p in vocab]
    tk.add_special_tokens([AddedToken(p, normalized=False, special=True) for p in control])
    tk.add_tokens([AddedToken(p, normalized=False, special=False) for p in user])
    return tk
