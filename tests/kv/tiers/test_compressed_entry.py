"""A compressed prompt's tier key (one per prompt length, naming the policy namespace and salt) and its entry (rows,
tokens, policy statistics, block payloads) read back exactly; an entry of another length or a cut one is refused."""
from __future__ import annotations

import pytest
import torch

from kvforge.kv.formats import get_format
from kvforge.kv.policies.base import PolicyState
from kvforge.kv.spec import KVCacheSpec
from kvforge.kv.tiers.compressed_tiers import decode, encode
from kvforge.kv.tiers.keys import COMPRESSED_GROUP, KeySpace, ModelKey

KEYS = KeySpace(ModelKey("w", {"layers": 2}), get_format("fp32"), 8, KVCacheSpec(2, 2, 16, 16))
TOKENS = list(range(100, 140))


def test_keys_name_policy_salt_and_length():
    lengths = list(range(1, len(TOKENS)))
    keys = KEYS.compressed_keys("kvzip:{budget: 0.5}", None, TOKENS, lengths)
    assert all(k.group == COMPRESSED_GROUP for k in keys) and len({k.digest for k in keys}) == len(lengths)
    one = [KEYS.compressed_keys("kvzip:{budget: 0.5}", None, TOKENS[:n], [n])[0] for n in (8, 33)]
    assert one == [keys[7], keys[32]]  # one incremental hash gives what each length alone gives
    assert KEYS.compressed_keys("kvzip:{budget: 0.25}", None, TOKENS, [33])[0] != keys[32]
    assert KEYS.compressed_keys("kvzip:{budget: 0.5}", "tenant", TOKENS, [33])[0] != keys[32]
    assert KEYS.chain(TOKENS, None)[3].digest != keys[31].digest  # never a block's key


def test_an_entry_reads_back_exactly():
    state = PolicyState(scores=torch.rand(2, 2, 16), selected=True, values=torch.rand(2, 2, 16))
    payloads = [bytes(range(i, i + 40)) for i in range(2)]
    got = decode(encode(16, 37, state, payloads), 37, 8)
    assert (got.rows, got.num_tokens, got.payloads) == (16, 37, payloads)
    assert torch.equal(got.policy_state.scores, state.scores) and torch.equal(got.policy_state.values, state.values)
    assert got.policy_state.selected and not got.policy_state.pending and got.policy_state.history is None


def test_another_length_or_a_cut_entry_is_refused():
    data = encode(16, 37, PolicyState(scores=torch.rand(2, 2, 16)), [b"x" * 40, b"y" * 40])
    with pytest.raises(ValueError, match="expected 36 tokens"):
        decode(data, 36, 8)
    with pytest.raises(ValueError, match="header says"):
        decode(data[:-1], 37, 8)
