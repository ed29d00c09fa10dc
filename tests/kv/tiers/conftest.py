import pytest


@pytest.fixture(scope="session")
def tiny_mla_loaded(tmp_path_factory):
    from tiny_models import write_tiny_model

    from kvforge.models.loader import load_model

    d = tmp_path_factory.mktemp("tiny-deepseek-v2")
    write_tiny_model("deepseek-v2", d)
    return load_model(str(d))
