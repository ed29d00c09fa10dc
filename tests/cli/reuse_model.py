"""In-process CLI runs build their engine over the session's SmolLM2 (tests import this fixture; no conftest.py
here, so `from conftest import ...` in other test folders finds their own)."""
import pytest


@pytest.fixture(autouse=True)
def reuse_loaded_smollm2(monkeypatch, request):
    """In-process CLI runs build their engine over the session's SmolLM2 instead of loading it again."""
    if "smol_loaded" not in request.fixturenames:
        return
    from kvforge.engine import weights_mode

    loaded = request.getfixturevalue("smol_loaded")
    original = weights_mode.load_model
    monkeypatch.setattr(weights_mode, "load_model",
                        lambda model=None, device=None, weights="fp32": loaded if model is None else original(model, device, weights))
