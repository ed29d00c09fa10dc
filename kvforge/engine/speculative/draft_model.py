"""Draft-model speculation: a separate, smaller model with the target's tokenizer drafts the tokens.

Its paged KV lives in a second pool with the target's block ids: one block of the engine's budget holds a
block of target K/V and the same block of draft K/V (the memory formula sums both per block), so every
allocation, prefix-cache hit, preemption and rollback of the target applies to the draft unchanged and the
draft can never run out of blocks on its own. The draft mirrors every target forward (prefill, decode,
verification) into its pool, so its cache is complete wherever the target's is.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from kvforge.attention import AttentionMetadata
from kvforge.engine.speculative.model_drafter import ModelDrafter
from kvforge.errors import ConfigError, TokenizerMismatchError
from kvforge.kv.groups import KVGroup
from kvforge.kv.layer_format import KVFormat
from kvforge.kv.memory import bytes_per_block, side_bytes
from kvforge.kv.pool import KVPool
from kvforge.kv.spec import KVCacheSpec
from kvforge.models.loader import LoadedModel, load_model


class DraftModelDrafter(ModelDrafter):
    def __init__(self, model: torch.nn.Module, pool: KVPool, cost_fraction: float):
        self.pool = pool
        super().__init__(lambda ids, meta: model(ids, meta, pool), model.compute_logits, cost_fraction)

    @torch.inference_mode()
    def observe(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> None:
        self.forward(input_ids, replace(meta, stats=None))

    def rollback(self, seq, cache_len: int, table: list[int], block_size: int) -> None:
        if cache_len % block_size:
            self.pool.forget_rows(table[cache_len // block_size], cache_len % block_size)

    def stats(self) -> dict:
        return {"spec_draft_kv_bytes": self.pool.allocated_bytes()}


def load_draft(path: str, target: LoadedModel, device: torch.device, max_model_len: int) -> LoadedModel:
    """Load the draft model at path; TokenizerMismatchError unless it tokenizes exactly like the target."""
    draft = load_model(path, device)
    check_same_tokenizer(target, draft)
    if draft.config.max_position_embeddings < max_model_len:
        raise ConfigError(f"draft model {path} handles {draft.config.max_position_embeddings} positions, fewer than "
                          f"max_model_len={max_model_len}; lower max_model_len or pick another draft")
    return draft


def check_same_tokenizer(target: LoadedModel, draft: LoadedModel) -> None:
    a, b = target.tokenizer, draft.tokenizer
    where = f"draft model {draft.path} vs target {target.path}"
    if target.config.vocab_size != draft.config.vocab_size:
        raise TokenizerMismatchError(f"{where}: vocabularies of {draft.config.vocab_size} and "
                                     f"{target.config.vocab_size} tokens; a draft must share the target's tokenizer")
    if (a is None) != (b is None):
        raise TokenizerMismatchError(f"{where}: one has a tokenizer and the other not; both need the same one")
    if a is None:
        return
    if (a.vocab_size, a.bos_token, a.eos_token) != (b.vocab_size, b.bos_token, b.eos_token):
        raise TokenizerMismatchError(f"{where}: tokenizers differ (vocab {b.vocab_size} vs {a.vocab_size}, bos "
                                     f"{b.bos_token!r} vs {a.bos_token!r}, eos {b.eos_token!r} vs {a.eos_token!r})")
    differ = next((i for i in range(a.vocab_size) if a.id_to_token(i) != b.id_to_token(i)), None)
    if differ is not None:
        raise TokenizerMismatchError(f"{where}: token {differ} is {b.id_to_token(differ)!r} in the draft and "
                                     f"{a.id_to_token(differ)!r} in the target; a draft must share the target's tokenizer")


def shared_num_blocks(target: KVCacheSpec, groups: list[KVGroup] | None, draft: KVCacheSpec, fmt: KVFormat,
                      block_size: int, budget: int, max_num_seqs: int) -> int:
    """Blocks of the one budget when each holds target and draft K/V (both pools' side buffers come first)."""
    usable = (budget - side_bytes(target, fmt, block_size, max_num_seqs, groups)
              - side_bytes(draft, fmt, block_size, max_num_seqs))
    per_block = bytes_per_block(target, fmt, block_size, groups) + bytes_per_block(draft, fmt, block_size)
    return max(0, int(usable // per_block))
