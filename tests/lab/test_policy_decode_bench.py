"""`kvforge bench kv-policies` on the tiny model (lab_model: it has a tokenizer, which kvzip's instruction needs):
each policy really compresses, keydiff and kvzip decode without recording attention (the compiled operator),
TOVA records it every step, and the CLI prints the same figures as JSON."""
import json

from kvforge.bench.kv_policies import kv_policies_bench
from kvforge.cli import main
from kvforge.models.loader import load_model


def test_policies_compress_and_keydiff_kvzip_record_no_attention(lab_model):
    r = kv_policies_bench(load_model(lab_model), ["keydiff", "kvzip", "tova"], budget=0.5, context=128, batch=2,
                          steps=4, rounds=2)
    rows = r["policies"]
    assert set(rows) == {"full", "keydiff", "kvzip", "tova"}
    full_cache = rows["full"]["cache_tokens"]
    assert full_cache == [128 + 1 + 8] * 2  # prompt, the warm-up token, 2 rounds x 4 steps
    for name in ("keydiff", "kvzip", "tova"):
        assert max(rows[name]["cache_tokens"]) < full_cache[0] * 0.75  # about half kept (plus the slack)
        assert rows[name]["decode_tok_s"] > 0 and rows[name]["speed_vs_full"] > 0
    assert rows["keydiff"]["decode_steps_recording_attention"] == 0
    assert rows["kvzip"]["decode_steps_recording_attention"] == 0
    assert rows["tova"]["decode_steps_recording_attention"] == rows["tova"]["decode_steps_timed"] == 8
    assert rows["full"]["speed_vs_full"] == 1.0


def test_cli_json(lab_model, capsys):
    assert main(["bench", "kv-policies", "--model", lab_model, "--policies", "keydiff", "--seq-len", "64",
                 "--batch", "1", "--steps", "2", "--rounds", "1", "--budget", "32", "--json", "--no-progress"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["budget"] == 32 and r["context"] == 64
    assert max(r["policies"]["keydiff"]["cache_tokens"]) <= 32 + 16  # a token budget, plus the slack
