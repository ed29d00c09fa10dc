"""SamplingParams: how one request is decoded (vLLM-shaped), validated on construction."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvforge.errors import InvalidRequestError

MAX_LOGPROBS = 20  # top alternatives a request may ask for per token
SAMPLING_EPS = 1e-5  # temperatures below this are greedy (as vLLM's _SAMPLING_EPS): dividing by less overflows
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes
REPETITION_PENALTY_RANGE = (0.01, 100.0)  # beyond it the penalty alone overflows or erases the logits
STRUCTURED_KINDS = ("json", "json_object", "grammar")  # structured_outputs' keys (vLLM's names)


@dataclass
class SamplingParams:
    """temperature=0 (or below SAMPLING_EPS) is greedy. top_k <= 0, top_p == 1 and min_p == 0 disable those filters
    (min_p: drop tokens less likely than min_p times the most likely one).

    The defaults are the OpenAI API's (and vLLM's), shared by the CLI and the server: temperature 1.0,
    top_p 1.0, top_k off, no penalties. n samples per prompt take seeds seed, seed+1, ... when seeded.
    Penalties follow vLLM: presence_penalty and frequency_penalty (-2..2) subtract from the logits of
    tokens already generated (once, or once per occurrence); repetition_penalty (1 = off) divides
    positive and multiplies negative logits of every token in the prompt or the output (CTRL's rule), within
    REPETITION_PENALTY_RANGE. seed: an integer in SEED_RANGE.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int = 16
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # structured output (engine/grammar.py): {"json": SCHEMA}, {"json_object": True} or {"grammar": LARK}
    structured_outputs: dict | None = None
    jump_forward: bool = True  # tokens the grammar forces enter as one prefill chunk (False: one decode step each)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        low, high = REPETITION_PENALTY_RANGE
        checks = [
            (isinstance(self.n, int) and not isinstance(self.n, bool) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}"),
            (isinstance(self.max_tokens, int) and self.max_tokens >= 1, f"max_tokens must be an integer >= 1, got {self.max_tokens!r}"),
            (_number(self.temperature) and self.temperature >= 0, f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}"),
            (_number(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}"),
            (_number(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1] (0 = off), got {self.min_p!r}"),
            (isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 0), f"top_k must be -1 (off), 0 (off) or a positive integer, got {self.top_k!r}"),
            (self.seed is None or (_integer(self.seed) and SEED_RANGE[0] <= self.seed <= SEED_RANGE[1] - _extra(self.n)),
             (f"seed must be None or an integer in [-2**63, 2**64 - 1] (n samples take seeds seed..seed+n-1), "
              f"got {self.seed!r} with n={self.n!r}")),
            (all(isinstance(s, str) and s for s in self.stop), f"stop must be non-empty strings, got {self.stop!r}"),
            (all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), f"stop_token_ids must be token ids >= 0, got {self.stop_token_ids!r}"),
            (self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS), f"logprobs must be None or an integer in 0..{MAX_LOGPROBS}, got {self.logprobs!r}"),
            (_number(self.presence_penalty) and -2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty!r}"),
            (_number(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty!r}"),
            (_number(self.repetition_penalty) and low <= self.repetition_penalty <= high,
             f"repetition_penalty must be in [{low}, {high}] (1 = off), got {self.repetition_penalty!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequestError(message)
        check_structured_outputs(self.structured_outputs)

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def jumps_forward(self) -> bool:
        """Forced grammar tokens enter as one prefill chunk (not when logprobs are asked: forced tokens have none)."""
        return self.structured_outputs is not None and self.jump_forward and self.logprobs is None

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


def _number(x) -> bool:
    """A finite int or float (an int too large for a float is not: torch could not use it)."""
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


def _extra(n) -> int:
    """Seeds past `seed` that n samples take (0 when n is invalid: n's own check reports it)."""
    return n - 1 if _integer(n) and n >= 1 else 0


def _integer(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_structured_outputs(spec) -> None:
    """InvalidRequestError unless spec is None or a dict with exactly one of STRUCTURED_KINDS, of the right type."""
    if spec is None:
        return
    if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in STRUCTURED_KINDS:
        raise InvalidRequestError(f"structured_outputs must be a dict with one of {', '.join(STRUCTURED_KINDS)}, got {spec!r}")
    kind, value = next(iter(spec.items()))
    ok = {"json": isinstance(value, (dict, str, bool)), "json_object": value is True, "grammar": isinstance(value, str)}
    if not ok[kind]:
        raise InvalidRequestError(f"structured_outputs[{kind!r}] must be "
                                  f"{ {'json': 'a JSON schema', 'json_object': 'true', 'grammar': 'a Lark grammar'}[kind]}")
