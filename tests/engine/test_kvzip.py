"""kvzip in the engine: its scoring pass against a naive dense reference, blocks freed, decode on the compiled operator."""
from __future__ import annotations

import math

import pytest
import torch

from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.errors import ConfigError
from kvforge.kv.policies.base import top_with_recent
from kvforge.sampling_params import SamplingParams

PROMPT = [int(t) for t in torch.randint(1, 90, (43,), generator=torch.Generator().manual_seed(3))]
REPEAT = [7, 8, 9, 10]


def _rope(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    ang = pos.double()[:, None] * inv_freq.double()
    cos, sin = ang.cos().float()[:, None], ang.sin().float()[:, None]
    a, b = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


@torch.inference_mode()
def dense(model, tokens: list[int], allowed=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [n, vocab] and per-layer attention [layers, heads, n, n] of a dense causal pass; allowed: [layers,
    kv heads, n, n] bool, which keys each query may see (default causal)."""
    cfg, inv_freq = model.config, model.rotary.inv_freq
    heads, group, n = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, len(tokens)
    pos = torch.arange(n)
    causal = pos[None, :] <= pos[:, None]
    x, probs_all = model.model.embed_tokens(torch.tensor(tokens)), []
    for li, layer in enumerate(model.model.layers):
        att, h = layer.self_attn, layer.input_layernorm(x)
        q = _rope(att.q_proj(h).view(n, cfg.num_heads, cfg.head_dim), pos, inv_freq)
        k = _rope(att.k_proj(h).view(n, heads, cfg.head_dim), pos, inv_freq).repeat_interleave(group, 1)
        v = att.v_proj(h).view(n, heads, cfg.head_dim).repeat_interleave(group, 1)
        mask = causal if allowed is None else allowed[li].repeat_interleave(group, 0) & causal
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(cfg.head_dim)
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1)
        probs_all.append(probs)
        x = x + att.o_proj(torch.einsum("hqk,khd->qhd", probs, v).reshape(n, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.compute_logits(model.model.norm(x)), torch.stack(probs_all)


def reference_keep(model, prompt: list[int], budget: int, sinks: int, chunk: int) -> torch.Tensor:
    """KVzip by hand: for each chunk of the prompt, prompt + repeat + chunk densely; each prompt pair's max attention
    from the repeat queries (over them, the chunks and the query heads of its KV head); the top budget per layer and
    KV head, [layers, kv heads, m]."""
    n, heads = len(prompt), model.config.num_kv_heads
    scores = None
    for start in range(0, n, chunk):
        _, probs = dense(model, prompt + REPEAT + prompt[start: start + chunk])
        best = probs[:, :, n:, :n].amax(2).unflatten(1, (heads, -1)).amax(2)  # [layers, kv heads, n]
        scores = best if scores is None else torch.maximum(scores, best)
    return top_with_recent(scores, budget, 0, sinks)


def _engine(loaded, **kw) -> LLMEngine:
    cfg = {"kv_cache_memory": 4_000_000, "block_size": 8, "kv_policy": "kvzip",
           "kv_policy_options": {"budget": 0.5, "repeat_prompt": REPEAT, "chunk": 16}}
    return LLMEngine(EngineConfig(**{**cfg, **kw}), loaded)


def _generate(engine, prompt, max_tokens):
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=1))
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o if o.finished else out
        s = engine.stats()
        assert s["kv_blocks_used"] + s["kv_blocks_free"] == s["kv_blocks_total"]
    return out


@pytest.mark.parametrize("loaded_name", ["tiny_loaded", "peaky_loaded"])
def test_kvzip_matches_dense_reference_and_frees_blocks(request, loaded_name):
    loaded = request.getfixturevalue(loaded_name)
    engine = _engine(loaded)
    out = _generate(engine, PROMPT, 12)
    stats = engine.stats()
    assert stats["kv_compactions"] == 1 and stats["kv_evicted_tokens"] == len(PROMPT) - len(PROMPT) // 2
    assert stats["kv_blocks_used"] == 0 and engine.kv.allocator.num_used == 0
    assert stats["kv_blocks_used_peak"] <= math.ceil((len(PROMPT) + len(REPEAT) + 16) / 8)  # context + one chunk's pass

    n, ids = len(PROMPT), list(out.token_ids)
    keep = reference_keep(loaded.model, PROMPT, n // 2, 4, 16)
    tokens = PROMPT + ids[:-1]
    allowed = torch.ones(keep.shape[0], keep.shape[1], len(tokens), len(tokens), dtype=torch.bool)
    allowed[:, :, n:, :n] = False  # generated tokens see only the kept prompt pairs (and each other)
    for li in range(keep.shape[0]):
        for h in range(keep.shape[1]):
            allowed[li, h, n:, keep[li, h]] = True
    allowed[:, :, n - 1, :n] = True  # the first token is sampled before the compression
    logits, _ = dense(loaded.model, tokens, allowed)
    ref_ids = logits[n - 1:].argmax(-1).tolist()
    assert ids == ref_ids
    ref_lp = torch.log_softmax(logits[n - 1:], -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
    got_lp = torch.tensor([lp["logprob"] for lp in out.logprobs])
    torch.testing.assert_close(got_lp, ref_lp, atol=2e-4, rtol=1e-4)
    full_logits, _ = dense(loaded.model, tokens)
    assert (full_logits[n:] - logits[n:]).abs().max() > 1e-2  # the compression changed what was attended


def test_kvzip_decodes_on_the_compiled_operator(tiny_loaded, monkeypatch):
    """Only the scoring pass records attention: every decode step after it keeps the compiled operator."""
    from kvforge import attention

    engine = _engine(tiny_loaded)
    engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    engine.step()  # prefill, scoring pass, compression
    assert engine.stats()["kv_compactions"] == 1
    calls = []
    real = attention._short_rows_compiled
    monkeypatch.setattr(attention, "_short_rows_compiled", lambda *a: calls.append(1) or real(*a))
    while engine.has_unfinished_requests():
        engine.step()
    assert len(calls) >= 9  # each decode step (one call per layer or more)


def test_kvzip_refuses_what_it_cannot_do(tiny_loaded):
    with pytest.raises(ConfigError, match="repeat_prompt is text"):
        _engine(tiny_loaded, kv_policy_options={"budget": 0.5})  # the tiny model has no tokenizer
    with pytest.raises(ConfigError, match="mirror the scoring pass"):
        _engine(tiny_loaded, speculative={"method": "layer_skip", "num_layers": 1})
    with pytest.raises(ConfigError, match="chunk must be"):
        _engine(tiny_loaded, kv_policy_options={"chunk": 0, "repeat_prompt": REPEAT})


def test_kvzip_pass_halves_its_chunk_to_fit(tiny_loaded):
    """8 blocks hold the prompt (43 rows), the instruction and 16 repeated tokens, not 32: a chunk of 64 halves to
    16 and the answer is the one chunk 16 gives."""
    block_bytes = _engine(tiny_loaded).kv.block_bytes
    tight = _engine(tiny_loaded, kv_cache_memory=8 * block_bytes,
                    kv_policy_options={"budget": 0.5, "repeat_prompt": REPEAT, "chunk": 64})
    assert tight.kv.num_blocks == 8
    roomy = _engine(tiny_loaded)
    assert _generate(tight, PROMPT, 8).token_ids == _generate(roomy, PROMPT, 8).token_ids
    assert tight.stats()["kv_blocks_used_peak"] == 8
