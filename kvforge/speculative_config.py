"""SpeculativeConfig: the `speculative` engine option, in the shape vLLM users know; EngineConfig parses it once."""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

from kvforge.engine.step_cost import ROW_COST
from kvforge.errors import ConfigError

METHODS = ("ngram", "layer_skip", "draft")
_INTS = ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size", "probe_interval",
         "max_probe_interval")


@dataclass(frozen=True)
class SpeculativeConfig:
    """method: 'ngram' (prompt lookup over the sequence's own prompt and output), 'layer_skip' (the target's
    own first `num_layers` layers, or the given `layers`, plus final norm and LM head) or 'draft' (the model at
    `model`, whose tokenizer must match the target's).
    num_speculative_tokens: most tokens drafted per sequence and step.
    prompt_lookup_min / prompt_lookup_max: n-gram lengths tried, longest first (ngram).
    disable_by_batch_size: no drafting while this many sequences run (verification then costs more than it saves).
    adaptive: plan each step's drafts from each sequence's acceptance and the batch (engine/speculative/planner.py);
    False drafts num_speculative_tokens for every sequence whenever the drafter has them.
    verify_row_cost: the planner's cost of one more row in a step, as a fraction of a step's fixed cost
    (`kvforge bench spec --verify-cost` fits it on a machine; the default is this project's CPU measurement).
    bridge_jump / bridge_row_cost: where the layer bridge serves the model, a step of more rows than it takes
    (the model runner's row limit, ModelRunner.step_cost) costs 1 + bridge_jump + bridge_row_cost x rows in the same
    unit (fitted by the same command).
    acceptance_smoothing: weight of each verified draft position in a sequence's moving-average acceptance (0.5:
    text moves in and out of repeating its context within a few steps; chosen on grounded prompts of three texts,
    confirmed on three others, docs/results.md).
    probe_interval / max_probe_interval: steps a sequence left without drafts waits before it drafts one token
    to re-measure its acceptance; each failed probe doubles the wait up to the maximum.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 5
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    disable_by_batch_size: int = 16
    adaptive: bool = True
    verify_row_cost: float = ROW_COST
    bridge_jump: float = 0.02
    bridge_row_cost: float = ROW_COST
    acceptance_smoothing: float = 0.5
    probe_interval: int = 4
    max_probe_interval: int = 64
    num_layers: int | None = None
    layers: tuple[int, ...] | None = None
    model: str | None = None

    def __post_init__(self):
        if not isinstance(self.method, str) or self.method not in METHODS:
            raise ConfigError(f"speculative method {self.method!r} is not supported; allowed: {', '.join(METHODS)}")
        ints = {n: getattr(self, n) for n in _INTS}
        if self.num_layers is not None:
            ints["num_layers"] = self.num_layers
        bad = [n for n, v in ints.items() if not _positive_int(v)]
        if bad:
            raise ConfigError(f"speculative: {', '.join(bad)} must be integers >= 1 (not booleans or floats), got "
                              + ", ".join(f"{n}={ints[n]!r}" for n in bad))
        self._check_adaptive()
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(f"speculative: prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                              f"prompt_lookup_max ({self.prompt_lookup_max})")
        if self.layers is not None:
            object.__setattr__(self, "layers", _layer_indices(self.layers))
        self._check_method_options()

    def _check_adaptive(self) -> None:
        if not isinstance(self.adaptive, bool):
            raise ConfigError(f"speculative: adaptive must be true or false, got {self.adaptive!r}")
        w = self.acceptance_smoothing
        for name in ("verify_row_cost", "bridge_jump", "bridge_row_cost"):
            cost = getattr(self, name)
            if not _number(cost) or not 0 <= cost < float("inf"):
                raise ConfigError(f"speculative: {name} must be a finite number >= 0, got {cost!r}")
        if not _number(w) or not 0 < w <= 1:
            raise ConfigError(f"speculative: acceptance_smoothing must be a number in (0, 1], got {w!r}")
        if self.probe_interval > self.max_probe_interval:
            raise ConfigError(f"speculative: probe_interval ({self.probe_interval}) must be <= max_probe_interval "
                              f"({self.max_probe_interval})")

    def _check_method_options(self) -> None:
        layer_opts = self.num_layers is not None or self.layers is not None
        if self.method == "layer_skip" and (self.num_layers is None) == (self.layers is None):
            raise ConfigError("speculative method 'layer_skip' needs exactly one of num_layers (the first N layers) "
                              "or layers (a list of layer indices)")
        if self.method != "layer_skip" and layer_opts:
            raise ConfigError(f"speculative: num_layers / layers belong to method 'layer_skip', not {self.method!r}")
        if self.method == "draft" and not (isinstance(self.model, str) and self.model):
            raise ConfigError("speculative method 'draft' needs model: the path of a draft model kvforge can load")
        if self.method != "draft" and self.model is not None:
            raise ConfigError(f"speculative: model belongs to method 'draft', not {self.method!r}")

    def drafted_layers(self, num_layers: int) -> tuple[int, ...]:
        """The target layers a layer_skip drafter runs; ConfigError when they do not exist."""
        layers = self.layers if self.layers is not None else tuple(range(self.num_layers))
        if layers[-1] >= num_layers or len(layers) >= num_layers:
            raise ConfigError(f"speculative layer_skip: the target has {num_layers} layers; the drafter must run a "
                              f"proper subset of layers 0..{num_layers - 1}, got {list(layers)}")
        return layers

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | None) -> SpeculativeConfig | None:
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"speculative must be a dict such as {{'method': 'ngram', 'num_speculative_tokens': 5}}, "
                              f"got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(repr(k) for k in value if k not in known)  # keys may be of any type
        if unknown:
            raise ConfigError(f"speculative: unknown options {', '.join(unknown)}; allowed: {', '.join(sorted(known))}")
        return cls(**value)


def _layer_indices(layers) -> tuple[int, ...]:
    """layers as a tuple; ConfigError unless a non-empty ascending list of distinct integer indices >= 0."""
    items = list(layers) if isinstance(layers, (list, tuple)) else []
    if not items or not all(_int(i) and i >= 0 for i in items) or items != sorted(set(items)):
        raise ConfigError(f"speculative: layers must be a non-empty ascending list of distinct layer indices "
                          f"(integers >= 0, not booleans or floats), got {layers!r}")
    return tuple(items)


def _number(v) -> bool:
    """A finite int or float (not a bool; not an int too large for a float)."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _positive_int(v) -> bool:
    return _int(v) and v >= 1
