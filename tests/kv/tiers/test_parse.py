"""Tier strings are parsed once, into TierSpecs, when EngineConfig is built; `kvforge memory` uses the same parser."""
import dataclasses
import subprocess
import sys

import pytest

from kvforge.cli.memory import tier_capacity
from kvforge.config import EngineConfig
from kvforge.errors import ConfigError
from kvforge.kv.tiers.parse import TierSpec, parse_tier


def test_engine_config_holds_parsed_tier_specs():
    c = EngineConfig(kv_tiers=["host:8GiB", "disk:/var/cache/kv:1.5GiB", "redis://127.0.0.1:6379/2"])
    assert c.kv_tiers == [TierSpec("host", 8 << 30), TierSpec("disk", 3 << 29, path="/var/cache/kv"),
                          TierSpec("redis", None, url="redis://127.0.0.1:6379/2")]
    assert [str(t) for t in c.kv_tiers] == ["host:8GiB", "disk:/var/cache/kv:1.5GiB", "redis://127.0.0.1:6379/2"]
    assert dataclasses.replace(c, kv_tier_fsync=False).kv_tiers == c.kv_tiers  # parsed specs are taken as they are
    assert EngineConfig(kv_tiers="host:1MiB").kv_tiers == [TierSpec("host", 1 << 20)]


@pytest.mark.parametrize("bad, says", [("host:", "bad KV tier"), ("disk::1GiB", "needs a directory"),
                                       ("host:0", "must be positive"), ("nfs:/x:1GiB", "bad KV tier"),
                                       (3, "must be a string"), ("redis://h", "bad Redis tier")])
def test_bad_tier_strings_are_refused_alike_by_config_and_memory(bad, says):
    with pytest.raises(ConfigError, match=says):
        EngineConfig(kv_tiers=[bad])
    with pytest.raises(ConfigError, match=says):
        tier_capacity([bad], 100.0)


def test_memory_reports_the_bytes_the_engine_parses():
    specs = ["host:1GiB", "disk:/a:b:2MiB", "redis://127.0.0.1:6379"]
    rows = tier_capacity(specs, 1024.0)
    assert [(r["tier"], r["bytes"], r["tokens"]) for r in rows] == [
        ("host:1GiB", 1 << 30, 1 << 20), ("disk:/a:b:2MiB", 2 << 20, 2 << 10), ("redis://127.0.0.1:6379", None, None)]
    assert [t.capacity_bytes for t in EngineConfig(kv_tiers=specs).kv_tiers] == [r["bytes"] for r in rows]
    assert parse_tier("disk:/a:b:2MiB").path == "/a:b"


def test_parsing_a_tier_loads_no_model_code():
    """kv/ sits below models/: reading a size must not import kvforge.memcalc (which imports models/)."""
    code = ("import sys; from kvforge.kv.tiers.parse import parse_tier; parse_tier('disk:/x:8GiB'); "
            "print(sorted(m for m in sys.modules if m.startswith(('kvforge.models', 'kvforge.memcalc'))))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "[]"
