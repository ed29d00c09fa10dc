"""The recurrent hybrid vs its all-attention twin under one budget: the engine's measured peak of sequences
decoding at once equals the formula's count for each, so the ratios agree; the twin has the hybrid's width and
depth with every layer attention."""
import json

import pytest

from kvforge.bench.recurrent_memory import attention_twin_config, run_with_twin
from kvforge.bench.recurrent_model import CONFIG, write_recurrent_model
from kvforge.errors import ConfigError

SMALL = dict(CONFIG, hidden_size=64, intermediate_size=64, shared_intermediate_size=64, num_attention_heads=4,
             num_key_value_heads=2, mamba_n_heads=2, mamba_d_head=64, mamba_d_state=16, vocab_size=128,
             num_hidden_layers=6, layer_types=["mamba", "mamba", "full_attention", "mamba", "mamba", "mamba"])


def test_measured_sequences_match_the_formula(tmp_path):
    directory = write_recurrent_model(tmp_path / "hybrid", config=SMALL)
    r = run_with_twin(str(directory), seq_len=512, budget_seqs=2, chunk=256, show_progress=False)
    h, a = r["hybrid"], r["attention"]
    assert r["layers_attention"] == 1 and r["layers"] == 6
    assert a["sequences_that_fit"] == a["peak_decoding_seqs"] == 2
    assert h["peak_decoding_seqs"] == h["sequences_that_fit"] > 2 * a["sequences_that_fit"]
    assert r["measured_ratio"] == r["formula_ratio"] and a["state_bytes_per_sequence"] == 0
    assert h["bytes_per_sequence"] == 512 * h["kv_bytes_per_token"] + h["state_bytes_per_sequence"]
    assert r["budget_bytes"] // h["bytes_per_sequence"] == h["sequences_that_fit"]
    saved = json.loads((directory / "config.json").read_text())
    assert attention_twin_config(saved)["layer_types"] == ["full_attention"] * 6


def test_a_model_without_mamba_layers_is_refused():
    with pytest.raises(ConfigError, match="layer_types"):
        attention_twin_config({"model_type": "llama", "num_hidden_layers": 2})
