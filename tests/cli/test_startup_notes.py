"""What a command says before it works: a KV budget that capped max_model_len (at start-up and in the error), the
chat template (or plain text for a base model), and which technique `eval` compares when none is named."""
from __future__ import annotations

from reuse_model import reuse_loaded_smollm2  # noqa: F401  (autouse fixture)

from kvforge.cli import build_parser, main
from kvforge.cli.eval import resolve_technique
from kvforge.cli.startup import template_note


def test_a_budget_that_caps_max_model_len_says_so(smol_loaded, capsys):
    rc = main(["generate", "word " * 400, "--raw", "--kv-memory", "16MiB", "--max-tokens", "2"])
    err = capsys.readouterr().err
    _, start, budget, error = [line for line in err.splitlines() if line.strip()]
    assert rc == 2
    assert budget.startswith("[kv cache] KV budget 16.0 MiB: blocks 15.") and "other" in budget
    assert "max_model_len 352 (capped from the model's context of 8,192 tokens so that one sequence fits the KV " \
           "budget of 16 MiB; raise kv_cache_memory (--kv-memory)" in start
    assert error.startswith("kvforge: error: prompt has 401 tokens; max_model_len is 352 (capped from the model's")


def test_template_note_names_a_base_model():
    class Plain:
        chat_template = None

    assert template_note(Plain()) == "no chat template (a base model: the prompt is sent as plain text)"


def test_eval_names_a_technique_when_none_is_given(capsys):
    args = build_parser().parse_args(["eval", "ppl"])
    resolve_technique(args)
    assert args.kv_dtype == "int8" and "no technique given: scoring the int8 cache" in capsys.readouterr().err
    args = build_parser().parse_args(["eval", "ppl", "--kv-policy", "h2o"])
    resolve_technique(args)
    assert args.kv_dtype == "fp32"
    assert main(["eval", "passkey"]) == 2
    assert "nothing to compare with the baseline" in capsys.readouterr().err
