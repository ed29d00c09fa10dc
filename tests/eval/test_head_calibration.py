"""`kvforge calibrate heads` on the tiny model: deterministic scores, stored under the model's identity and read
back by a policy's heads='auto'; the roles split the heads by score."""
import json
import shutil

import pytest
import torch

from kvforge.cli import main
from kvforge.errors import ConfigError
from kvforge.eval.head_calibration import CalibrationConfig, calibrate_heads, copy_attention, copy_case
from kvforge.kv.policies.head_roles import HeadScores, heads_path, load_roles, model_identity

CFG = CalibrationConfig(context=96, needle=8, trials=2)


def test_calibration_is_deterministic_and_scores_every_head(peaky_loaded):
    a, b = calibrate_heads(peaky_loaded, CFG), calibrate_heads(peaky_loaded, CFG)
    assert a.scores.shape == (2, 2) and torch.equal(a.scores, b.scores)
    assert bool(((a.scores > 0) & (a.scores < 1)).all())
    other = calibrate_heads(peaky_loaded, CalibrationConfig(context=96, needle=8, trials=2, seed=1))
    assert not torch.equal(a.scores, other.scores)  # the seed picks the contexts


def test_copy_attention_is_the_attention_on_the_copied_source(peaky_loaded):
    """A hand-built copy case: the score of a head is its attention from the copy's queries onto the needle's next
    token; scored against the wrong sources it changes."""
    ids, at = copy_case(peaky_loaded.config.vocab_size, CFG, 0)
    assert ids[at: at + CFG.needle] == ids[-CFG.needle:]
    s = copy_attention(peaky_loaded.model, ids, at, CFG.needle)
    moved = copy_attention(peaky_loaded.model, ids, at + 1, CFG.needle)  # the wrong sources
    assert not torch.allclose(s, moved)


def test_stored_beside_the_model_and_loaded_by_auto(peaky_loaded, tiny_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert main(["calibrate", "heads", "--model", tiny_dir, "--context", "96", "--needle", "8", "--trials", "2",
                 "--json"]) == 0
    stored = json.loads(capsys.readouterr().out)
    path = heads_path(tiny_dir)
    assert path.parent == tmp_path / "cache" / "kvforge" / "heads" and json.loads(path.read_text()) == stored
    assert stored["model"] == model_identity(tiny_dir) and stored["method"] == "copy-attention"
    # the tiny fixture scales queries in memory only: the file's model is the unscaled one, measured the same way
    from kvforge.models.loader import load_model
    assert torch.allclose(HeadScores.load(path).scores, calibrate_heads(load_model(tiny_dir), CFG).scores, atol=1e-6)
    copy = tmp_path / "copy"
    shutil.copytree(tiny_dir, copy)
    assert heads_path(str(copy)) == path  # a copy of the same files finds the same calibration
    roles = load_roles("auto", str(copy), 0.25, 0.5, 2, 2)
    scores = HeadScores.load(path).scores.flatten()
    assert int(roles.retrieval.flatten().nonzero()) == int(scores.argmax())
    assert set(roles.streaming.flatten().nonzero()[:, 0].tolist()) == set(scores.argsort()[:2].tolist())


def test_missing_or_mismatched_calibration_is_refused(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="kvforge calibrate heads"):
        load_roles("auto", tiny_dir, 0.25, 0.5, 2, 2)
    path = HeadScores(torch.ones(3, 2), "copy-attention", "x", {}).save(tmp_path / "h.json")
    with pytest.raises(ConfigError, match=r"\(3, 2\).*\(2, 2\)"):
        load_roles(str(path), None, 0.25, 0.5, 2, 2)


def test_model_identity_follows_the_bytes_not_the_name(tmp_path):
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    data = bytes(range(256)) * (3 << 12)  # 3 MiB: first and last MiB hashed, with the size
    a.write_bytes(data)
    b.write_bytes(data)
    assert model_identity(str(a)) == model_identity(str(b))
    b.write_bytes(data[:-1] + b"\x00")
    assert model_identity(str(a)) != model_identity(str(b))
