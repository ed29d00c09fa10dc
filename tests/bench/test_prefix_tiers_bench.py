"""`kvforge bench prefix --kv-tiers disk` on a tiny Granite-hybrid: a second process reuses the KV blocks and state
checkpoints the first stored on disk, with the outputs of both processes equal to caching off."""
import json

from tiny_models import write_tiny_model

from kvforge.cli import main


def test_a_second_process_hits_the_disk_tier(tmp_path, capsys):
    write_tiny_model("granite-hybrid", tmp_path / "model")
    assert main(["bench", "prefix", "--model", str(tmp_path / "model"), "--num-requests", "4", "--system-len", "64",
                 "--question-len", "4", "12", "--max-tokens", "4", "--budget", "4MiB", "--max-num-seqs", "4",
                 "--conversations", "1", "--turns", "2", "--kv-tiers", "disk", "--no-progress", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    tiers = r["tiers"]
    assert tiers["outputs_identical"] and r["outputs_identical"]
    assert tiers["second_hit_rate"] == 1.0  # every whole block of every prompt, from the first process's entries
    # every prompt's last whole block is the system prompt's end (64): one checkpoint from disk, then from memory
    assert tiers["second"]["state_checkpoints_from_tiers"] == 1 and tiers["first"]["state_checkpoints_to_tiers"] > 0
    assert tiers["first"]["tier_hit_tokens"] < tiers["second"]["tier_hit_tokens"]
