"""transformers as the reference: plain greedy decoding with its own KV cache, no logit processors."""
from __future__ import annotations

import torch


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, last_logits_only: bool = False) -> list[int]:
    """last_logits_only: the prompt's forward computes the last position's logits only (large vocabularies)."""
    keep = {"logits_to_keep": 1} if last_logits_only else {}
    out = model(torch.tensor([prompt_ids]), use_cache=True, **keep)
    past, tokens = out.past_key_values, []
    for _ in range(max_new_tokens):
        nxt = int(out.logits[0, -1].argmax())
        tokens.append(nxt)
        out = model(torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
    return tokens


@torch.inference_mode()
def hf_greedy_recomputed(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding that runs the whole sequence each step, with no cache (transformers 5.25's Mamba2ForCausalLM
    ignores `past_key_values`, so its cached decode restarts from an empty state)."""
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt_ids):]


@torch.inference_mode()
def hf_stepwise_logits(model, token_ids: list[int]) -> torch.Tensor:
    """Logits at every position from transformers' cached decode, one token per call (its recurrent form)."""
    out = model(torch.tensor([token_ids[:1]]), use_cache=True)
    past, rows = out.past_key_values, [out.logits[0, -1]]
    for t in token_ids[1:]:
        out = model(torch.tensor([[t]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        rows.append(out.logits[0, -1])
    return torch.stack(rows)
