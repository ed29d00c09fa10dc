"""SpeculativeConfig: the `speculative` engine option, in the shape vLLM users know."""
from __future__ import annotations

from dataclasses import dataclass, fields

from kvforge.errors import ConfigError

METHODS = ("ngram",)


@dataclass(frozen=True)
class SpeculativeConfig:
    """method: 'ngram' (prompt lookup over the sequence's own prompt and output).
    num_speculative_tokens: most tokens drafted per sequence and step.
    prompt_lookup_min / prompt_lookup_max: n-gram lengths tried, longest first.
    disable_by_batch_size: no drafting while this many sequences run (verification then costs more than it saves).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 5
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    disable_by_batch_size: int = 16

    def __post_init__(self):
        if self.method not in METHODS:
            raise ConfigError(f"speculative method {self.method!r} is not supported; allowed: {', '.join(METHODS)}")
        ints = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "method"}
        bad = [n for n, v in ints.items() if not isinstance(v, int) or isinstance(v, bool) or v < 1]
        if bad:
            raise ConfigError(f"speculative: {', '.join(bad)} must be integers >= 1, got "
                              + ", ".join(f"{n}={ints[n]!r}" for n in bad))
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(f"speculative: prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                              f"prompt_lookup_max ({self.prompt_lookup_max})")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | None) -> SpeculativeConfig | None:
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"speculative must be a dict such as {{'method': 'ngram', 'num_speculative_tokens': 5}}, "
                              f"got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"speculative: unknown options {unknown}; allowed: {sorted(known)}")
        return cls(**value)
