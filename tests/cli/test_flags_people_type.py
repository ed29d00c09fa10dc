"""vLLM's and llama.cpp's flags work or are refused in one line that names the flag; errors say what to do."""
from __future__ import annotations

import pytest
from reuse_model import reuse_loaded_smollm2  # noqa: F401  (autouse fixture)

from kvforge.cli import build_parser, main
from kvforge.cli.common import engine_kwargs


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


def test_vllm_and_llama_cpp_aliases():
    a = parse("serve", "--enable-prefix-caching", "-c", "2048", "--dtype", "auto", "--tensor-parallel-size", "1",
              "--chat-template", "gemma")
    kw = engine_kwargs(a if a.model else _with_model(a))
    assert kw["enable_prefix_caching"] and kw["max_model_len"] == 2048 and a.chat_template == "gemma"
    assert not engine_kwargs(_with_model(parse("serve", "--no-prefix-caching")))["enable_prefix_caching"]
    assert parse("generate", "-m", "model.gguf", "hi").model == "model.gguf"
    assert parse("chat", "--ctx-size", "512", "--min-p", "0.05").max_model_len == 512


def _with_model(args):
    args.model = getattr(args, "model_path", None) or args.model
    return args


@pytest.mark.parametrize("argv,words", [
    (["serve", "--tensor-parallel-size", "2"], "only 1 is supported"),
    (["serve", "--dtype", "float16"], "kvforge computes in float32"),
    (["serve", "--enable-prefix-caching", "--no-prefix-caching"], "not allowed with argument"),
])
def test_unsupported_values_are_refused_by_argparse(capsys, argv, words):
    with pytest.raises(SystemExit) as e:
        parse(*argv)
    assert e.value.code == 2 and words in capsys.readouterr().err


@pytest.mark.parametrize("argv,words", [
    (["generate", "hi", "--gpu-memory-utilization", "2"], "--gpu-memory-utilization must be in (0, 0.95]"),
    (["generate", "hi", "--device", "cuda"], "no usable CUDA device"),
    (["generate", "hi", "--model", "HuggingFaceTB/SmolLM2-135M-Instruct"], "kvforge never downloads"),
    (["generate", "hi", "--chat-template", "no-such-template"], "neither a file, a Jinja template"),
    (["generate", "hi", "--kv-tier", "disk:/proc/nope:1GiB"], "cannot use it as a writable directory"),
    (["generate", "hi", "--kv-tier", f"disk:{__file__}:1GiB"], "cannot use it as a writable directory"),
])
def test_one_line_errors_name_the_flag(capsys, smol_loaded, argv, words):
    import torch

    if "cuda" in argv and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert main(argv + ["--kv-memory", "16MiB"] if "--gpu-memory-utilization" not in argv else argv) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err
    assert [line for line in err.splitlines() if line.startswith("kvforge: error")] == [err.splitlines()[-1]]


def test_bare_kvforge_prints_the_help(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: kvforge") and "chat" in out and "generate" in out


def test_api_key_from_the_environment(monkeypatch):
    from kvforge.cli.serve import api_keys

    monkeypatch.setenv("KVFORGE_API_KEY", "sk-env")
    assert api_keys([]) == ["sk-env"] and api_keys(["sk-flag"]) == ["sk-flag"]
    monkeypatch.delenv("KVFORGE_API_KEY")
    assert api_keys([]) == []
