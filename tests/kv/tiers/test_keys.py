"""Block keys: stable across processes, different across model (weights, config, weights mode, draft), format,
options, block size and salt."""
from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from kvforge.kv.formats import get_format
from kvforge.kv.spec import KVCacheSpec
from kvforge.kv.tiers.keys import KeySpace, ModelKey, weights_fingerprint
from kvforge.models.config import ModelConfig

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, v_head_dim=16)
TOKENS = list(range(100, 140))
CONFIG = ModelConfig("llama", 96, 64, 128, 2, 4, 2, 16, rope_scaling={"rope_type": "linear", "factor": 2.0},
                     eos_token_ids=[2], extra={"softcap": 30.0})
W = ModelKey("w", CONFIG)
SCRIPT = """
from kvforge.kv.formats import get_format
from kvforge.kv.spec import KVCacheSpec
from kvforge.kv.tiers.keys import KeySpace, ModelKey
from kvforge.models.config import ModelConfig
config = ModelConfig("llama", 96, 64, 128, 2, 4, 2, 16, rope_scaling={"factor": 2.0, "rope_type": "linear"},
                     eos_token_ids=[2], extra={"softcap": 30.0})
ks = KeySpace(ModelKey("w", config), get_format("int4", group_size=8), 8, KVCacheSpec(2, 2, 16, 16))
print(",".join(k.name for k in ks.chain(list(range(100, 140)), "tenant")))
"""


def names(ks: KeySpace, salt=None, tokens=TOKENS) -> list[str]:
    return [k.name for k in ks.chain(tokens, salt)]


def test_keys_are_the_same_in_another_process():
    here = names(KeySpace(W, get_format("int4", group_size=8), 8, SPEC), "tenant")
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PATH": ""}).stdout.strip()
    assert out.split(",") == here and len(here) == 5


def test_keys_chain_the_prefix_and_skip_partial_blocks():
    ks = KeySpace(W, get_format("fp16"), 8, SPEC)
    a = names(ks, tokens=TOKENS[:20])
    assert len(a) == 2 and a == names(ks)[:2]
    changed = [TOKENS[0] + 1] + TOKENS[1:]
    assert not set(names(ks, tokens=changed)) & set(names(ks))  # one changed token renames every later block


def test_keys_differ_by_model_format_options_block_size_spec_and_salt():
    base = KeySpace(W, get_format("int4", group_size=8), 8, SPEC)
    others = [KeySpace(ModelKey("w2", CONFIG), get_format("int4", group_size=8), 8, SPEC),
              KeySpace(W, get_format("int8"), 8, SPEC),
              KeySpace(W, get_format("int4", group_size=16), 8, SPEC),
              KeySpace(W, get_format("int4", group_size=8), 4, SPEC),
              KeySpace(W, get_format("int4", group_size=8), 8, KVCacheSpec(3, 2, 16, 16))]
    first = names(base)[0]
    assert all(names(o)[0] != first for o in others)
    assert names(base, "a")[0] != names(base, "b")[0] != first


@pytest.mark.parametrize("model", [
    ModelKey("w", dataclasses.replace(CONFIG, rope_theta=500.0)),
    ModelKey("w", dataclasses.replace(CONFIG, rope_scaling={"rope_type": "linear", "factor": 4.0})),
    ModelKey("w", dataclasses.replace(CONFIG, rms_norm_eps=1e-5)),
    ModelKey("w", dataclasses.replace(CONFIG, sliding_window=32)),
    ModelKey("w", dataclasses.replace(CONFIG, extra={"softcap": 50.0})),
    ModelKey("w", CONFIG, weights_mode="int8"),
    ModelKey("w", CONFIG, draft=ModelKey("d", CONFIG)),
])
def test_keys_differ_by_any_config_field_weights_mode_and_draft(model):
    fmt = get_format("fp16")
    assert names(KeySpace(model, fmt, 8, SPEC))[0] != names(KeySpace(W, fmt, 8, SPEC))[0]
    same = ModelKey("w", dataclasses.replace(model.config), model.weights_mode, model.draft)
    assert names(KeySpace(model, fmt, 8, SPEC)) == names(KeySpace(same, fmt, 8, SPEC))


def test_weights_fingerprint_sees_a_changed_weight():
    model = torch.nn.Linear(8, 8)
    before = weights_fingerprint(model)
    assert weights_fingerprint(model) == before
    with torch.no_grad():
        model.weight[0, 0] += 1
    assert weights_fingerprint(model) != before
