"""Options given as JSON text (CLI flags, format specs): parsed to a dict or a ConfigError naming where."""
from __future__ import annotations

import json

from kvforge.errors import ConfigError


def json_object(where: str, text: str | None, example: str) -> dict:
    """The JSON object in `text` ({} when empty)."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where} must be a JSON object, e.g. '{example}': {e}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a JSON object, e.g. '{example}', got {text!r}")
    return value
