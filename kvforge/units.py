"""Sizes as people write them ('8GiB', '24GB', '512MiB', '1000') -> bytes; a leaf module every floor may use."""
from __future__ import annotations

import re

from kvforge.errors import ConfigError

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str | int) -> int:
    """Bytes from '80GiB', '24GB', '512MiB', '1.5TiB' or plain '1000'."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*", str(text))
    unit = m and _UNITS.get(m.group(2).lower())
    if not m or unit is None:
        units = "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"
        raise ConfigError(f"bad size {text!r}; use a number with an optional unit: {units}")
    return int(float(m.group(1)) * unit)
