"""Block keys: stable across processes, different across model, format, options, block size and salt."""
from __future__ import annotations

import subprocess
import sys

import torch

from kvforge.kv.formats import get_format
from kvforge.kv.spec import KVCacheSpec
from kvforge.kv.tiers.keys import KeySpace, weights_fingerprint

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, v_head_dim=16)
TOKENS = list(range(100, 140))
SCRIPT = """
from kvforge.kv.formats import get_format
from kvforge.kv.spec import KVCacheSpec
from kvforge.kv.tiers.keys import KeySpace
ks = KeySpace("w", get_format("int4", group_size=8), 8, KVCacheSpec(2, 2, 16, 16))
print(",".join(k.name for k in ks.chain(list(range(100, 140)), "tenant")))
"""


def names(ks: KeySpace, salt=None, tokens=TOKENS) -> list[str]:
    return [k.name for k in ks.chain(tokens, salt)]


def test_keys_are_the_same_in_another_process():
    here = names(KeySpace("w", get_format("int4", group_size=8), 8, SPEC), "tenant")
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PATH": ""}).stdout.strip()
    assert out.split(",") == here and len(here) == 5


def test_keys_chain_the_prefix_and_skip_partial_blocks():
    ks = KeySpace("w", get_format("fp16"), 8, SPEC)
    a = names(ks, tokens=TOKENS[:20])
    assert len(a) == 2 and a == names(ks)[:2]
    changed = [TOKENS[0] + 1] + TOKENS[1:]
    assert not set(names(ks, tokens=changed)) & set(names(ks))  # one changed token renames every later block


def test_keys_differ_by_model_format_options_block_size_spec_and_salt():
    base = KeySpace("w", get_format("int4", group_size=8), 8, SPEC)
    others = [KeySpace("w2", get_format("int4", group_size=8), 8, SPEC),
              KeySpace("w", get_format("int8"), 8, SPEC),
              KeySpace("w", get_format("int4", group_size=16), 8, SPEC),
              KeySpace("w", get_format("int4", group_size=8), 4, SPEC),
              KeySpace("w", get_format("int4", group_size=8), 8, KVCacheSpec(3, 2, 16, 16))]
    first = names(base)[0]
    assert all(names(o)[0] != first for o in others)
    assert names(base, "a")[0] != names(base, "b")[0] != first


def test_weights_fingerprint_sees_a_changed_weight():
    model = torch.nn.Linear(8, 8)
    before = weights_fingerprint(model)
    assert weights_fingerprint(model) == before
    with torch.no_grad():
        model.weight[0, 0] += 1
    assert weights_fingerprint(model) != before
