"""Stop conditions checked after every generated token."""
from __future__ import annotations

from kvforge.engine.sequence import Sequence


def check_stop(seq: Sequence, tokenizer, max_model_len: int, eos_token_ids: list[int]) -> str | None:
    """'stop' or 'length' when seq must finish now, else None. Sets seq.stop_text_len for stop strings."""
    p = seq.params
    last = seq.token_ids[-1]
    if last in p.stop_token_ids or (not p.ignore_eos and last in eos_token_ids):
        return "stop"
    if p.stop and tokenizer is not None and _tail_has_stop(seq, tokenizer, p.stop):
        text = tokenizer.decode(seq.output_token_ids)
        hits = [i for s in p.stop if (i := text.find(s)) >= 0]
        if hits:
            seq.stop_text_len = min(hits)
            return "stop"
    if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= max_model_len:
        return "length"
    return None


def _tail_has_stop(seq: Sequence, tokenizer, stops: list[str]) -> bool:
    """Cheap per-token check on the last tokens only: a text token decodes to at least one character,
    and the margin of 8 covers special tokens, which decode to nothing."""
    tail = tokenizer.decode(seq.output_token_ids[-(max(len(s) for s in stops) + 8):])
    return any(s in tail for s in stops)
