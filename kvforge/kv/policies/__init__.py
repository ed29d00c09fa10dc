"""KV eviction policies: full, window, streaming, h2o, scissorhands, snapkv, keydiff, tova, expected_attention, kvzip (one dataclass each).

How they fit the engine:
- Every full-attention layer keeps the same number of rows, so a sequence keeps one block table;
  h2o and scissorhands choose which rows per layer and KV head (scope "head", the default; "layer";
  "sequence" = one kept set, statistics summed over layers and heads). KVCacheManager.cache_len(seq) =
  slots it occupies; num_computed_tokens keeps counting logical tokens; the runner writes and attends
  by cache index. Policies see a SequenceView (cache length, tokens seen, prompt length, their state).
- Positions: window / h2o / scissorhands / snapkv keep keys rotated at their logical position (as in
  their papers); streaming keeps cache-index distances: new tokens at logical positions, and at each
  compaction its sinks turn by +dropped (the recent rows keep theirs), so its cache is bounded and a
  sequence may run past the model's context.
- After each step (and between scoring chunks) the Evictor asks the policy which cache indices to
  keep once the cache passes budget + slack, and compacts: kept rows move to the front through the
  format's LayerKV.move / move_heads (stored codes kept), trailing blocks go back to the allocator.
- Prefix sharing: a compacted block no longer holds its token prefix, so an engine with an evicting
  policy neither matches nor inserts into the prefix tree (shared blocks are never rewritten).
"""
from kvforge.kv.policies.base import FullPolicy, KVPolicy, PolicyState, SequenceView, build_policy, check_policy_groups
from kvforge.kv.policies.evictor import Evictor
from kvforge.kv.policies.expected_attention import ExpectedAttentionPolicy
from kvforge.kv.policies.h2o import H2OPolicy
from kvforge.kv.policies.keydiff import KeyDiffPolicy
from kvforge.kv.policies.kvzip import KVzipPolicy
from kvforge.kv.policies.scissorhands import ScissorhandsPolicy
from kvforge.kv.policies.snapkv import SnapKVPolicy
from kvforge.kv.policies.streaming import StreamingPolicy
from kvforge.kv.policies.tova import TOVAPolicy
from kvforge.kv.policies.window import WindowPolicy

__all__ = ["Evictor", "ExpectedAttentionPolicy", "FullPolicy", "H2OPolicy", "KVPolicy", "KVzipPolicy", "KeyDiffPolicy", "PolicyState", "ScissorhandsPolicy", "SequenceView", "SnapKVPolicy",
           "StreamingPolicy", "TOVAPolicy", "WindowPolicy", "build_policy",
           "check_policy_groups"]
