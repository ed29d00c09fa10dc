"""Every option of every command has a help line stating its default; one sampling-defaults story everywhere."""
from __future__ import annotations

import argparse

import pytest

from kvforge.cli import build_parser, main
from kvforge.cli.formatting import FLAG_ACTIONS, DefaultsHelpFormatter, all_parsers
from kvforge.cli.sampling import OLLAMA_LIKE, sampling_params
from kvforge.sampling_params import SamplingParams
from kvforge.server.protocol import ChatRequest, CompletionRequest
from kvforge.version import package_version

SAMPLING = ("temperature", "top_p", "top_k", "presence_penalty", "frequency_penalty")


def options():
    for parser in all_parsers(build_parser()):
        for action in parser._actions:
            if not isinstance(action, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)):
                yield parser.prog, action


def test_every_option_has_help_that_states_its_default():
    missing, no_default = [], []
    for prog, action in options():
        name = f"{prog} {'/'.join(action.option_strings) or action.dest}"
        if not (action.help or "").strip():
            missing.append(name)
        elif not isinstance(action, FLAG_ACTIONS):
            text = DefaultsHelpFormatter(prog)._get_help_string(action)
            if "default" not in text.lower() and not action.required:
                no_default.append(name)
    assert not missing, f"options without help: {missing}"
    assert not no_default, f"options whose help states no default: {no_default}"


def test_help_renders_defaults_and_version(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = capsys.readouterr().out
    assert "--temperature T, --temp T" in text and "default: the model's recommended" in text
    flat = " ".join(text.split())
    assert "generation_config.json" in flat and "temperature 0.8, top_k 40, top_p 0.9 (as Ollama)" in flat
    assert "--raw, --no-chat" in text
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"kvforge {package_version()}"


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_cli_and_server_sampling_fields_unset_unless_given(command):
    """A sampling field no flag / request sets stays None, so the model's recommended sampling fills it."""
    args = build_parser().parse_args([command, "a prompt"] if command == "generate" else [command])
    for name in (*SAMPLING, "min_p", "repetition_penalty"):
        assert getattr(args, name) is None, name
        assert CompletionRequest.model_fields[name].default is None is ChatRequest.model_fields[name].default, name
    assert args.seed is None is SamplingParams().seed
    given = build_parser().parse_args([command, "--temperature", "0", "--top-k", "5", "--min-p", "0.1"])
    assert sampling_params(given, 4, defaults=OLLAMA_LIKE) == SamplingParams(temperature=0, top_k=5, top_p=0.9,
                                                                            min_p=0.1, max_tokens=4)


def test_vllm_option_names_are_aliases():
    p = build_parser()
    a = p.parse_args(["serve", "model.gguf", "--kv-cache-dtype", "int8", "--max-model-len", "2048",
                      "--gpu-memory-utilization", "0.3"])
    assert (a.model_path, a.kv_dtype, a.max_model_len, a.gpu_memory_utilization) == ("model.gguf", "int8", 2048, 0.3)
    from kvforge.cli.common import engine_kwargs

    a.model = a.model_path
    kw = engine_kwargs(a)
    assert kw["kv_cache_dtype"] == "int8" and kw["kv_cache_memory_fraction"] == 0.3 and kw["kv_cache_memory"] is None
    with pytest.raises(SystemExit):  # a budget and a fraction at once: argparse refuses
        p.parse_args(["serve", "--kv-memory", "1GiB", "--gpu-memory-utilization", "0.3"])
