"""Per-model KV format defaults (kv/model_defaults.py): used for the model they were measured on, overridden key by
key by the options a user gives, never for another model, and within 5% of the format's bytes per token."""
from types import SimpleNamespace

import pytest

from kvforge.kv.formats import format_for_model, get_format
from kvforge.kv.memory import bytes_per_token
from kvforge.kv.model_defaults import MODEL_KV_DEFAULTS, model_format_options
from kvforge.kv.spec import KVCacheSpec

GEMMA_270M = SimpleNamespace(arch="gemma3", hidden_size=640)
GEMMA_SPEC = KVCacheSpec(num_layers=18, num_kv_heads=1, head_dim=256, v_head_dim=256)


def test_the_model_gets_its_measured_options_and_the_user_wins_key_by_key():
    assert format_for_model("kivi2", None, GEMMA_270M) == get_format("kivi2", window=256)
    assert format_for_model("int8", None, GEMMA_270M) == get_format("int8", window=16)
    assert format_for_model("kivi2", {"window": 64, "sinks": 0}, GEMMA_270M) == get_format("kivi2", window=64, sinks=0)
    assert format_for_model("int4", None, GEMMA_270M) == get_format("int4")  # no entry for int4: its own defaults


@pytest.mark.parametrize("config", [None, SimpleNamespace(arch="gemma3", hidden_size=1152),
                                    SimpleNamespace(arch="llama", hidden_size=640)])
def test_other_models_keep_the_format_defaults(config):
    for name in ("int8", "kivi2"):
        assert format_for_model(name, None, config) == get_format(name)
    assert model_format_options("kivi2", {"group_size": 16}, "llama", 576) == {"group_size": 16}


def test_recorded_defaults_keep_bytes_per_token_within_five_percent():
    for entry in MODEL_KV_DEFAULTS:
        for name, options in entry.formats.items():
            plain, tuned = get_format(name), get_format(name, **options)
            ratio = bytes_per_token(GEMMA_SPEC, tuned) / bytes_per_token(GEMMA_SPEC, plain)
            assert 0.95 <= ratio <= 1.05, (entry.arch, name, ratio)
    assert bytes_per_token(GEMMA_SPEC, format_for_model("kivi2", None, GEMMA_270M)) == 3694.5  # the window is fp16
    assert bytes_per_token(GEMMA_SPEC, format_for_model("int8", None, GEMMA_270M)) == 9292.5  # + a staging map
