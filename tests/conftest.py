import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="session")
def smol_path():
    from kvforge.models.loader import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smol_loaded(smol_path):
    """kvforge's own load of the embedded SmolLM2 (shared by engines in one session)."""
    from kvforge.models.loader import load_model

    return load_model(smol_path)


@pytest.fixture(scope="session")
def hf_smol(smol_path):
    """transformers' load of the same GGUF: the reference for correctness."""
    from transformers import AutoModelForCausalLM

    d, name = os.path.split(smol_path)
    return AutoModelForCausalLM.from_pretrained(d, gguf_file=name, torch_dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    from tiny_models import write_tiny_model

    d = tmp_path_factory.mktemp("tiny-llama-gqa")
    write_tiny_model("llama-gqa", d)
    return str(d)


@pytest.fixture(scope="session")
def tiny_loaded(tiny_dir):
    from kvforge.models.loader import load_model

    return load_model(tiny_dir)


@pytest.fixture(scope="session")
def peaky_loaded(tiny_dir):
    """The tiny model with queries scaled up: its attention is near uniform, so heads would rarely disagree and
    eviction scores would rarely separate."""
    from kvforge.models.loader import load_model

    loaded = load_model(tiny_dir)
    with torch.no_grad():
        for layer in loaded.model.model.layers:
            layer.self_attn.q_proj.weight.mul_(30.0)
    return loaded
