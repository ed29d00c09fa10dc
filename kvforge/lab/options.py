"""What `kvforge lab` is asked to measure, checked before any model is loaded or cell is run."""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field

from kvforge.errors import ConfigError
from kvforge.kv.formats import get_format, parse_format_spec
from kvforge.kv.policies.base import KVPolicy

MODES = ("quick", "full")
QUICK_FORMATS = ("fp16", "fp8_e4m3", "int8", "int4", "kivi2")
FULL_FORMATS = QUICK_FORMATS + ("bf16", "fp8_e5m2", 'int4:{"group_size": 32}', 'kivi2:{"window": 64}')
QUICK_POLICIES = ("streaming", "h2o", "snapkv")
FULL_POLICIES = ("window", "streaming", "h2o", "scissorhands", "snapkv")
QUICK_TOKENS, FULL_TOKENS = 512, 4096
METHODS = ("keydiff", "tova", "expected_attention", "kvzip")  # the 2025 methods, at shares of the prompt kept
QUICK_FRACTIONS, FULL_FRACTIONS = (0.5,), (0.25, 0.5, 0.75)
QUICK_RETRIEVAL = {"lengths": [512], "contexts": 1, "questions": 2}
FULL_RETRIEVAL = {"lengths": [1024, 2048, 4096], "contexts": 2, "questions": 4}


@dataclass
class LabOptions:
    model: str | None = None  # GGUF file or HF directory; None = the embedded SmolLM2
    text: str = "hamlet"  # a named text (hamlet, macbeth, gpl-3, ...) or a path to a UTF-8 file
    out: str = "kvforge-lab"
    mode: str = "quick"
    tokens: int | None = None  # tokens of text for perplexity (default: quick 1024, full 4096)
    formats: list[str] | None = None  # format specs, e.g. int8, 'int4:{"group_size": 32}'
    policies: list[str] | None = None
    budgets: list[int] | None = None  # KV tokens kept (default: 1/8, 1/4, 1/2 of tokens)
    priority: str = "balanced"  # for the advisor's ranking
    progress: bool = True
    panel: bool = False  # quality cells score every text of kvforge.eval.texts.PANEL (worst and mean reported)
    methods: list[str] | None = None  # policies measured at `fractions` of the sequence kept (default: METHODS)
    fractions: list[float] | None = None  # shares kept by `methods`, in (0, 1) (default: quick 0.5, full 0.25 0.5 0.75)
    retrieval: bool = False  # also the retrieval suite (kvforge eval retrieval) for the full cache and `methods`
    heatmap: str | None = None  # the method whose task x budget heat map is drawn (default: the first of methods)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.tokens is not None and self.tokens < 64:
            raise ConfigError(f"--tokens must be >= 64 for a meaningful perplexity, got {self.tokens}")
        self.formats = list(self.formats or (QUICK_FORMATS if self.mode == "quick" else FULL_FORMATS))
        self.policies = list(self.policies or (QUICK_POLICIES if self.mode == "quick" else FULL_POLICIES))
        for spec in self.formats:
            name, opts = parse_format_spec(spec)
            get_format(name, **opts)  # unknown name or options: ConfigError naming the allowed ones
        allowed = sorted(set(KVPolicy.registry) - {"full"})
        for name in self.policies:
            if name not in allowed:
                raise ConfigError(f"unknown policy {name!r}; allowed: {', '.join(allowed)}")
        self.methods = list(METHODS if self.methods is None else self.methods)
        self.fractions = sorted(self.fractions or (QUICK_FRACTIONS if self.mode == "quick" else FULL_FRACTIONS))
        for name in self.methods:
            if name not in allowed:
                raise ConfigError(f"unknown method {name!r}; allowed: {', '.join(allowed)}")
        for f in self.fractions:
            if not isinstance(f, float) or not 0 < f < 1:
                raise ConfigError(f"--fractions are shares of the sequence kept, in (0, 1), got {f!r}")
        if self.heatmap is not None and self.heatmap not in self.methods:
            raise ConfigError(f"--heatmap {self.heatmap!r} must be one of --methods ({', '.join(self.methods)})")
        for b in self.budgets or []:
            if not isinstance(b, int) or isinstance(b, bool) or b < 8:
                raise ConfigError(f"--budgets are KV token counts >= 8, got {b!r}")

    @property
    def quick(self) -> bool:
        return self.mode == "quick"

    @property
    def lead_policy(self) -> str:
        """The policy the passkey map and the advisor's combination use: StreamingLLM when it is asked for."""
        return "streaming" if "streaming" in self.policies else self.policies[0]

    def check_out_dir(self) -> None:
        """The output folder exists (or can be made) and takes files."""
        try:
            os.makedirs(self.out, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.out, prefix=".write-test-"):
                pass
        except OSError as e:
            raise ConfigError(f"--out {self.out!r} is not a writable folder: {e.strerror or e}") from None


@dataclass
class Settings:
    """The numbers every cell is measured with, fixed once the model and text are known."""
    tokens: int
    budgets: list[int]
    context: int  # the model's max_position_embeddings
    speed: dict = field(default_factory=dict)  # seq_len, batch, steps, rounds, budget
    long: dict = field(default_factory=dict)  # tokens, segment, chunk_size, budget (StreamingLLM), baseline
    passkey: dict = field(default_factory=dict)  # lengths, depths, trials, policy, budget
    advise: dict = field(default_factory=dict)  # eval_tokens, requests, output_tokens, priority
    speculative: dict = field(default_factory=dict)  # batches, prompts, max_tokens, passage_tokens (bench spec)
    retrieval: dict = field(default_factory=dict)  # tasks, lengths, contexts, questions, chunk_size, seed ({} = off)
    combo_formats: list[str] = field(default_factory=list)
    combo_budgets: list[int] = field(default_factory=list)


def settings_for(options: LabOptions, context: int, text_tokens: int) -> Settings:
    """Derive the matrix's numbers from the mode, the model's context and the text; ConfigError if they clash."""
    if text_tokens < 64:
        raise ConfigError(f"the text has {text_tokens} tokens; the lab needs at least 64 (give a longer --text)")
    preset = QUICK_TOKENS if options.quick else FULL_TOKENS
    if options.tokens is not None and options.tokens > text_tokens:
        raise ConfigError(f"--tokens {options.tokens} is more than the text's {text_tokens} tokens")
    if options.tokens is not None and options.tokens > context:
        raise ConfigError(f"--tokens {options.tokens} is more than the model's context of {context} tokens")
    tokens = options.tokens or min(preset, text_tokens, context)
    budgets = sorted(options.budgets or [tokens // 8, tokens // 4, tokens // 2])
    if budgets[-1] >= tokens:
        raise ConfigError(f"budget {budgets[-1]} is not smaller than the {tokens} tokens of text scored; a policy "
                          f"would evict nothing. Give --budgets below {tokens} or more --tokens")
    mid = budgets[len(budgets) // 2]
    quick = options.quick
    long_tokens = context + context // 4 if quick else 4 * context
    long_budget = min(max(budgets), max(16, context // 16))
    lengths = [n for n in ((256, 512, 1024) if quick else (512, 1024, 2048, 4096, 8192)) if n <= context - 64]
    return Settings(
        tokens=tokens, budgets=budgets, context=context,
        speed={"seq_len": min(512 if quick else 2048, context // 2), "batch": 2 if quick else 4,
               "steps": 4 if quick else 16, "rounds": 2 if quick else 5, "budget": 1 << 30},
        long={"tokens": min(long_tokens, text_tokens), "segment": max(16, context // 8), "budget": long_budget,
              "chunk_size": 128 if context >= 1024 else 16, "baseline": not quick},
        passkey={"lengths": lengths or [max(64, context // 2)], "depths": [0.1, 0.5, 0.9] if quick else
                 [0.0, 0.25, 0.5, 0.75, 1.0], "trials": 1 if quick else 2,
                 "policy": options.lead_policy,
                 "budget": min(budgets)},
        speculative={"batches": [1] if quick else [1, 8], "prompts": 2 if quick else 3,
                     "max_tokens": 32 if quick else 96, "passage_tokens": min(400 if not quick else 200, context // 3)},
        advise={"eval_tokens": tokens, "requests": 2 if quick else 4, "output_tokens": 16 if quick else 32,
                "priority": options.priority},
        retrieval=retrieval_settings(options, context),
        combo_formats=[f for f in (("int4",) if quick else ("int8", "int4", "kivi2")) if f in options.formats]
        or options.formats[-1:],
        combo_budgets=[mid] if quick else budgets,
    )


def retrieval_settings(options: LabOptions, context: int) -> dict:
    """The retrieval suite's cases for this mode: lengths the model's context holds (questions follow the context)."""
    from kvforge.eval.retrieval_tasks import TASKS

    if not options.retrieval:
        return {}
    preset = QUICK_RETRIEVAL if options.quick else FULL_RETRIEVAL
    lengths = [n for n in preset["lengths"] if n <= context - 256] or [max(256, context // 2)]
    return {"tasks": list(TASKS), **preset, "lengths": lengths, "chunk_size": 64, "seed": 0}
