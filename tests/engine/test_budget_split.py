"""Where the KV budget goes (blocks, per-sequence staging, the rest), and staging sized to what the budget runs."""
import pytest

from kvforge.cli.generate import kv_stats
from kvforge.cli.startup import budget_note
from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.kv.memory import side_bytes
from kvforge.llm import LLM
from kvforge.sampling_params import SamplingParams

MiB = 1 << 20
STAGING_SHARE = EngineConfig.kv_staging_share


def _engine(loaded, dtype: str, budget: int, **options) -> LLMEngine:
    return LLMEngine(EngineConfig(kv_cache_memory=budget, kv_cache_dtype=dtype, **options), loaded)


def test_kivi2_at_256_mib_keeps_most_of_the_budget_for_blocks(smol_loaded):
    engine = _engine(smol_loaded, "kivi2", 256 * MiB, prefill_order="fcfs")  # all start in one step if they may
    split = engine.kv_budget_split()
    assert split["kv_budget_bytes"] == 256 * MiB
    assert split["kv_block_bytes_total"] + split["kv_staging_bytes"] + split["kv_other_bytes"] == 256 * MiB
    assert 0 <= split["kv_other_bytes"] < engine.kv.block_bytes
    assert split["kv_staging_bytes"] <= STAGING_SHARE * 256 * MiB
    assert split["kv_block_bytes_total"] >= (1 - STAGING_SHARE) * 256 * MiB - engine.kv.block_bytes  # was 42 MiB
    assert engine.kv.pool.allocated_bytes() == split["kv_block_bytes_total"] + split["kv_staging_bytes"]
    seqs = split["max_num_seqs"]
    assert seqs < split["max_num_seqs_asked"] == 64 and split["kv_staging_sequences"] == seqs
    assert split["kv_staging_bytes"] == side_bytes(engine.kv_spec, engine.format, 16, seqs)
    assert side_bytes(engine.kv_spec, engine.format, 16, seqs + 1) > STAGING_SHARE * 256 * MiB  # the most that fit

    # No more sequences run at once than there are windows: the others wait, and every request finishes.
    ids = [engine.add_request([1, 2, 3, 4, 5 + i], SamplingParams(max_tokens=2, temperature=0.0))
           for i in range(seqs + 3)]
    engine.step()
    assert len(engine.scheduler.running) == seqs and len(engine.scheduler.waiting) == 3
    while engine.has_unfinished_requests():
        engine.step()
    assert len(set(ids)) == seqs + 3 and engine.stats()["kv_request_states"] == 0
    engine.close()


@pytest.mark.parametrize("dtype", ["fp32", "int4"])
def test_a_budget_that_runs_every_sequence_keeps_max_num_seqs(smol_loaded, dtype):
    engine = _engine(smol_loaded, dtype, 256 * MiB)
    split = engine.kv_budget_split()
    assert split["max_num_seqs"] == split["max_num_seqs_asked"] == 64
    assert (split["kv_staging_bytes"] > 0) == (dtype == "int4")
    note = budget_note(engine)
    assert note.startswith("KV budget 256.0 MiB: blocks ") and ("staging" in note) == (dtype == "int4")
    engine.close()


def test_generate_json_stats_carry_the_split(smol_loaded):
    engine = _engine(smol_loaded, "kivi2", 256 * MiB)
    outs = LLM.from_engine(engine).generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].outputs
    stats = kv_stats(engine, [1, 2, 3], outs)
    for key in ("kv_budget_bytes", "kv_block_bytes_total", "kv_staging_bytes", "kv_staging_sequences",
                "kv_other_bytes", "max_num_seqs", "max_num_seqs_asked"):
        assert stats[key] == engine.kv_budget_split()[key]
    assert "fewer than --max-num-seqs 64" in budget_note(engine)
    engine.close()


def test_staging_share_one_sizes_staging_for_max_num_seqs(smol_loaded):
    engine = _engine(smol_loaded, "kivi2", 256 * MiB, kv_staging_share=1.0)
    split = engine.kv_budget_split()
    assert split["max_num_seqs"] == 64 and split["kv_block_bytes_total"] < 48 * MiB  # the old split
    engine.close()
