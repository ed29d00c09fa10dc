"""Structured output: a request's grammar (JSON schema, any JSON object, Lark) as a token mask, through llguidance.

`SamplingParams.structured_outputs` names the grammar: {"json": SCHEMA}, {"json_object": True} or {"grammar": LARK}
(vLLM's field names). Each request holds a `RequestGrammar`: the sampler masks its logits row to the tokens the
grammar allows (`allowed_mask`), the engine feeds it every appended token (`accept`), and where the grammar forces
the next tokens (`forced_tokens`) the engine appends them at once: they enter the KV cache as one prefill chunk
(jump-forward) instead of one decode step each. A grammar that does not compile is the request's 400; a token the
grammar refuses fails that request only.
"""
from __future__ import annotations

import json
import weakref

import numpy as np
import torch

from kvforge.errors import InvalidRequestError

_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # kvforge Tokenizer -> llguidance LLTokenizer


class GrammarError(RuntimeError):
    """The grammar refused a token or entered an error state: its request fails, the others go on."""


def llguidance():
    try:
        import llguidance as llg
    except ImportError:
        raise InvalidRequestError("structured output (response_format, tools, structured_outputs) needs the "
                                  "llguidance package: pip install 'kvforge[structured]' (or llguidance)") from None
    return llg


def _grammar_text(spec: dict) -> str:
    llg = llguidance()
    kind, value = next(iter(spec.items()))
    try:
        if kind == "grammar":
            return llg.LLMatcher.grammar_from_lark(value)
        schema = {"type": "object"} if kind == "json_object" or value is True else value
        return llg.LLMatcher.grammar_from_json_schema(schema if isinstance(schema, str) else json.dumps(schema),
                                                      defaults={"whitespace_flexible": False})
    except (ValueError, TypeError) as e:
        raise InvalidRequestError(f"structured output: {kind} is not valid: {e}") from None


def ll_tokenizer(tokenizer, vocab_size: int):
    """The llguidance view of a kvforge Tokenizer (built once per tokenizer, ~1 s)."""
    cached = _TOKENIZERS.get(tokenizer)
    if cached is None or cached[1] != vocab_size:
        llg = llguidance()
        eos = tokenizer.eos_token_id
        cached = (llg.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=eos), vocab_size)
        _TOKENIZERS[tokenizer] = cached
    return cached[0]


class RequestGrammar:
    """One request's position in its grammar."""

    def __init__(self, spec: dict, tokenizer, vocab_size: int):
        if tokenizer is None:
            raise InvalidRequestError("structured output needs a model with a tokenizer")
        llg = llguidance()
        self.vocab_size = vocab_size
        self.matcher = llg.LLMatcher(ll_tokenizer(tokenizer, vocab_size), _grammar_text(spec), log_level=0)
        if self.matcher.is_error():
            raise InvalidRequestError(f"structured output: the grammar does not compile: {self.matcher.get_error()}")

    def allowed_mask(self) -> torch.Tensor:
        """Bool [vocab_size]: the tokens the grammar allows next."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        self._check()
        return torch.from_numpy(np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool))

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise GrammarError(f"structured output: the grammar refused token {token}: {self.matcher.get_error()}")

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces next, whatever the model would say (empty when it has a choice)."""
        if self.matcher.is_stopped():
            return []
        forced = list(self.matcher.compute_ff_tokens())
        self._check()
        return forced

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more (the request stops)."""
        return self.matcher.is_stopped()

    def _check(self) -> None:
        if self.matcher.is_error():
            raise GrammarError(f"structured output: {self.matcher.get_error()}")


def mask_logits(logits: torch.Tensor, seqs) -> tuple[torch.Tensor, dict[int, Exception]]:
    """Logits [N, vocab] with each grammar-bound row's disallowed tokens at -inf (one batched masked_fill), and the
    rows whose grammar failed (their request fails alone). A request that does not jump forward gets, where the
    grammar forces tokens, a mask of the first forced token alone: one decode step per forced token."""
    rows = [i for i, seq in enumerate(seqs) if seq.grammar is not None]
    if not rows:
        return logits, {}
    masks, kept, failed = [], [], {}
    for i in rows:
        grammar = seqs[i].grammar
        mask = torch.zeros(logits.shape[-1], dtype=torch.bool)
        try:
            forced = [] if seqs[i].params.jumps_forward else grammar.forced_tokens()
            if forced:
                mask[forced[0]] = True
            else:
                allowed = grammar.allowed_mask()
                mask[: allowed.shape[0]] = allowed
        except Exception as e:  # noqa: BLE001 - this request's grammar failed, not the step
            failed[i] = e
            continue
        masks.append(mask)
        kept.append(i)
    if kept:
        logits = logits.clone()
        logits[kept] = logits[kept].masked_fill(~torch.stack(masks).to(logits.device), float("-inf"))
    return logits, failed
