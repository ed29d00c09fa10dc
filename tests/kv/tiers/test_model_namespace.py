"""One disk tier shared by engines of different model configs or weights modes: they never read each other's
blocks and each decodes exactly what it decodes without tiers; engines of the same model still share."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from tier_helpers import ask_each, docs, engine

from kvforge.models.loader import load_model


@pytest.fixture(scope="module")
def retheta_loaded(tiny_dir, tmp_path_factory):
    """The tiny model's very safetensors with only rope_theta edited in config.json."""
    d = tmp_path_factory.mktemp("tiny-retheta")
    shutil.copytree(tiny_dir, d, dirs_exist_ok=True)
    config = json.loads((Path(d) / "config.json").read_text())
    config["rope_theta"] = 500.0
    (Path(d) / "config.json").write_text(json.dumps(config))
    return load_model(str(d))


def fill_disk(loaded, tiers: list[str], **kw) -> list:
    """Ask every document once, then push every cached block into the tiers; returns the outputs."""
    e = engine(loaded, tiers=tiers, **kw)
    outs = ask_each(e, docs())
    e.kv.reset_prefix_cache()
    e.close()
    return outs


def reader(loaded, tiers: list[str], **kw) -> tuple[list, int]:
    """(outputs, prompt tokens loaded from the tiers) of a fresh engine asking every document."""
    e = engine(loaded, tiers=tiers, **kw)
    outs = ask_each(e, docs())
    hits = e.kv.connector.hit_tokens
    e.close()
    return outs, hits


def tokens(outs: list) -> list[list[int]]:
    return [o.token_ids for o in outs]


def test_configs_differing_only_in_rope_theta_share_no_block(tiny_loaded, retheta_loaded, tmp_path):
    tiers = [f"disk:{tmp_path}:16MiB"]
    alone = tokens(ask_each(engine(retheta_loaded), docs()))
    fill_disk(tiny_loaded, tiers)
    outs, hits = reader(retheta_loaded, tiers)
    assert hits == 0 and tokens(outs) == alone


def test_int8_and_fp32_weights_share_no_block(tiny_loaded, tmp_path):
    tiers = [f"disk:{tmp_path}:16MiB"]
    alone = tokens(ask_each(engine(tiny_loaded, weights="int8"), docs()))
    fill_disk(tiny_loaded, tiers)
    outs, hits = reader(tiny_loaded, tiers, weights="int8")
    assert hits == 0 and tokens(outs) == alone


@pytest.mark.parametrize("weights", ["fp32", "int8"])
def test_same_model_in_two_engines_still_shares(retheta_loaded, weights, tmp_path):
    tiers = [f"disk:{tmp_path}:16MiB"]
    written = fill_disk(retheta_loaded, tiers, weights=weights)
    outs, hits = reader(retheta_loaded, tiers, weights=weights)
    assert hits == 4 * 32 and tokens(outs) == tokens(written)
