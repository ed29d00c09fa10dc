"""`kvforge memory` on hybrid and recurrent config.json files: KV bytes per token of the attention layers, the
constant state bytes per sequence, and what fits, by the formula the engine sizes its pools with."""
import pytest
from tiny_models import write_tiny_model

from kvforge.cli.memory import format_report
from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.memcalc import memory_report
from kvforge.models.loader import load_model


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    out = {}
    for kind in ("granite-hybrid", "mamba2", "lfm2", "rwkv", "qwen3-next"):
        d = tmp_path_factory.mktemp(kind)
        model = write_tiny_model(kind, d)
        out[kind] = (d, sum(p.numel() for p in model.parameters()))
    return out


def test_hybrid_report_counts_attention_kv_and_state(dirs):
    directory, params = dirs["granite-hybrid"]
    report = memory_report(str(directory / "config.json"), seq_len=300, batch=3, kv_dtype="fp32",
                           memory=8 << 20, weights=0)
    engine = LLMEngine(EngineConfig(kv_cache_memory=8 << 20, max_num_seqs=3), load_model(str(directory)))
    assert report.parameters == params
    assert report.recurrent_layers == 3 and report.full_attention_layers == 1
    assert report.state_bytes_per_sequence == engine.kv.state_pool.slot_bytes() == engine.state_bytes
    assert report.per_token_bytes == engine.kv.block_bytes / 16 == 2 * 2 * 16 * 4  # one layer, 2 KV heads of 16
    assert report.per_sequence_bytes == 19 * engine.kv.block_bytes + engine.state_bytes  # 300 tokens: 19 blocks
    assert report.fits.num_blocks == engine.kv.num_blocks  # the same budget after checkpoints and three states
    assert engine.kv.checkpoints.budget_bytes == 1 << 20
    assert any("recurrent" in n for n in report.notes)
    text = format_report(report)  # what `kvforge memory DIR` prints
    assert "bytes per token             256 B" in text
    assert f"of which state        30.75 KiB  ({engine.state_bytes:,} B)  (3 recurrent layers, any length)" in text


def test_pure_mamba2_holds_only_state(dirs):
    directory, params = dirs["mamba2"]
    report = memory_report(str(directory), seq_len=8192, kv_dtype="fp32", memory=1 << 20, weights=0)
    assert report.parameters == params
    assert report.attention_kind == "none" and report.per_token_bytes == 0
    assert report.per_sequence_bytes == report.state_bytes_per_sequence > 0
    assert report.fits.max_batch == ((1 << 20) - (1 << 17)) // report.state_bytes_per_sequence  # 1/8: checkpoints


def test_short_conv_state_is_its_window(dirs):
    directory, params = dirs["lfm2"]
    report = memory_report(str(directory), seq_len=64, kv_dtype="fp32")
    assert report.parameters == params
    assert report.recurrent_layers == 3 and report.state_bytes_per_sequence == 3 * 2 * 64 * 4  # L - 1 = 2 rows


def test_rwkv_state_is_five_vectors_per_layer(dirs):
    directory, params = dirs["rwkv"]
    report = memory_report(str(directory), seq_len=64, kv_dtype="fp32")
    assert report.parameters == params
    assert report.state_bytes_per_sequence == 4 * 5 * 64 * 4  # 4 layers x (2 shifts + num, den, max) x 64 x fp32


def test_gated_delta_net_state_and_parameters(dirs):
    directory, params = dirs["qwen3-next"]
    report = memory_report(str(directory), seq_len=64, kv_dtype="fp32")
    assert report.parameters == params
    conv, delta = 3 * (2 * 2 * 16 + 4 * 8), 4 * 16 * 8  # [K - 1, q + k + v] and [value heads, key dim, value dim]
    assert report.recurrent_layers == 3 and report.state_bytes_per_sequence == 3 * 4 * (conv + delta)
