"""The lab's cell cache is keyed by the model's weights fingerprint and config (as the KV tiers are) and the
package's real version: new weights of the same size at the same path are measured again."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from tiny_models import write_tiny_model

from kvforge.lab import LabOptions
from kvforge.lab.cache import CellCache
from kvforge.lab.cells import quality_cell
from kvforge.lab.runner import prepare
from kvforge.version import package_version

RESULT = {"ppl": 1.5}


def key_context(model: Path, text: str, out: Path) -> dict:
    return prepare(LabOptions(model=str(model), text=text, out=str(out), tokens=256, formats=["fp16"],
                              progress=False))[2]


def cached(model: Path, text: str, out: Path) -> dict | None:
    return CellCache(str(out), key_context(model, text, out)).get(quality_cell(256, "fp16"))


def test_new_weights_or_config_at_the_same_path_reuse_no_cell(lab_model, lab_text, tmp_path):
    model, out = tmp_path / "model", tmp_path / "lab"
    shutil.copytree(lab_model, model)
    context = key_context(model, lab_text, out)
    assert context["kvforge"] == package_version()
    CellCache(str(out), context).put(quality_cell(256, "fp16"), RESULT, 1.0)
    assert cached(model, lab_text, out)["result"] == RESULT  # same model: reused

    sizes = sorted(p.stat().st_size for p in model.iterdir())
    write_tiny_model("llama-gqa", model, seed=1)  # other weights, same shapes and file sizes
    assert sorted(p.stat().st_size for p in model.iterdir()) == sizes
    assert cached(model, lab_text, out) is None

    shutil.copytree(lab_model, model, dirs_exist_ok=True)
    assert cached(model, lab_text, out)["result"] == RESULT
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "rope_theta": 500.0}))
    assert cached(model, lab_text, out) is None
