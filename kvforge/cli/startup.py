"""What `generate` and `chat` say before they start: model, chat template, sampling, length limit, the KV budget's split;
and `--chat-template`, which gives a model the template it lacks (or replaces its own)."""
from __future__ import annotations

import os

from kvforge.errors import ConfigError
from kvforge.models.chat_templates import BUILT_IN, TURN_END_TOKENS


def add_chat_template_option(g) -> None:
    g.add_argument("--chat-template", default=None, metavar="TEMPLATE",
                   help=f"chat template: a Jinja file, a template string, or a built-in name ({', '.join(BUILT_IN)}) "
                        "(default: the model's own; a base model has none and gets plain text)")


def apply_chat_template(tokenizer, template: str | None, eos_token_ids: list[int] | None = None) -> None:
    """Give the tokenizer --chat-template's template (a file, a Jinja string or a built-in name); the turn-end
    tokens it writes (e.g. <end_of_turn>) join eos_token_ids, so answers stop there."""
    if template is None:
        return
    if tokenizer is None:
        raise ConfigError("--chat-template: this model has no tokenizer to apply a template with")
    if template in BUILT_IN:
        text, source = BUILT_IN[template], f"--chat-template {template}"
    elif os.path.isfile(template):
        try:
            with open(template, encoding="utf-8") as f:
                text, source = f.read(), f"--chat-template {template}"
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"--chat-template: cannot read {template!r}: {e}") from None
    elif "{{" in template or "{%" in template:
        text, source = template, "--chat-template (given inline)"
    else:
        raise ConfigError(f"--chat-template {template!r} is neither a file, a Jinja template, nor a built-in name "
                          f"({', '.join(BUILT_IN)})")
    tokenizer.chat_template, tokenizer.chat_template_source = text, source
    if eos_token_ids is not None:
        ends = (tokenizer.token_to_id(t) for t in TURN_END_TOKENS if t in text)
        eos_token_ids.extend(i for i in ends if i is not None and i not in eos_token_ids)


def template_note(tokenizer, raw: bool = False) -> str:
    if raw:
        return "no chat template (--raw)"
    if tokenizer is None or not tokenizer.chat_template:
        return "no chat template (a base model: the prompt is sent as plain text)"
    return f"chat template: {tokenizer.chat_template_source}"


def length_note(engine) -> str:
    return f"max_model_len {engine.max_model_len:,}{engine.capped_note()}"


def say_loading(model: str | None) -> None:
    import sys

    print(f"[kvforge] loading {model or 'the embedded SmolLM2-135M-Instruct'} (Ctrl-C cancels)", file=sys.stderr,
          flush=True)


def budget_note(engine) -> str:
    """Where the KV budget went: blocks, per-sequence staging (fp16 windows, sinks) and the unallocated rest."""
    s, mib = engine.kv_budget_split(), 2**20
    blocks = engine.kv.allocator.num_blocks
    text = (f"KV budget {s['kv_budget_bytes'] / mib:,.1f} MiB: blocks {s['kv_block_bytes_total'] / mib:,.1f} MiB "
            f"({blocks:,} of {engine.kv.block_size} tokens)")
    if s["kv_staging_bytes"]:
        fewer = (f", fewer than --max-num-seqs {s['max_num_seqs_asked']} so that blocks keep at least "
                 f"{1 - engine.config.kv_staging_share:.0%} of the budget" if s["max_num_seqs"] < s["max_num_seqs_asked"] else "")
        text += (f", per-sequence staging {s['kv_staging_bytes'] / mib:,.1f} MiB (the {engine.format.name} fp16 windows "
                 f"of at most {s['max_num_seqs']} sequences running at once{fewer})")
    if s["kv_state_slot_bytes"]:
        text += f", recurrent state {s['kv_state_slot_bytes'] / mib:,.1f} MiB ({s['max_num_seqs']} slots)"
    if s["kv_state_checkpoint_bytes"]:
        text += f", state checkpoints {s['kv_state_checkpoint_bytes'] / mib:,.1f} MiB"
    return text + f", other {s['kv_other_bytes'] / mib:,.2f} MiB (less than a block, unallocated)"


def startup_line(llm, template: str, sampling: str) -> str:
    name = os.path.basename(os.path.normpath(llm.engine.loaded.path))
    return f"[kvforge] {name}; {template}; {sampling}; {length_note(llm.engine)}\n[kv cache] {budget_note(llm.engine)}"
