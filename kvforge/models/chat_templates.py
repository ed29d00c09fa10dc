"""Chat templates for architectures whose GGUF files often ship without `tokenizer.chat_template`.

A fallback applies only to a GGUF whose name says it is an instruct / chat fine-tune: a base model ships no template
because it was never trained on one, and wrapping its prompt in turns makes it babble.
"""
from __future__ import annotations

import re
from typing import Any

# Gemma's turn format: a system message is folded into the first user turn; the assistant's role is "model".
GEMMA = (
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set system = messages[0]['content'] if messages[0]['content'] is string "
    "else messages[0]['content'] | map(attribute='text') | join('') -%}"
    "{%- set system = system ~ '\n\n' -%}{%- set turns = messages[1:] -%}"
    "{%- else -%}{%- set system = '' -%}{%- set turns = messages -%}{%- endif -%}"
    "{%- for message in turns -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set text = message['content'] if message['content'] is string "
    "else message['content'] | map(attribute='text') | join('') -%}"
    "{{ '<start_of_turn>' ~ ('model' if message['role'] == 'assistant' else message['role']) ~ '\n' "
    "~ (system if loop.first else '') ~ text | trim ~ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
_DEFAULTS = {"gemma": GEMMA, "gemma2": GEMMA, "gemma3": GEMMA}


BUILT_IN = {"gemma": GEMMA}  # names `--chat-template` takes
TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")  # a template writing one stops there
_INSTRUCT_WORDS = {"it", "instruct", "chat", "sft", "dpo", "rlhf"}


def looks_instruct(meta: dict[str, Any]) -> bool:
    """The GGUF's general.name / general.finetune name an instruct or chat fine-tune (e.g. "Gemma 3 270m It")."""
    text = " ".join(str(meta.get(k, "")) for k in ("general.name", "general.finetune")).lower()
    return bool(_INSTRUCT_WORDS & set(re.split(r"[^a-z0-9]+", text)))


def default_chat_template(arch: str | None, meta: dict[str, Any] | None = None) -> str | None:
    """The template to use when a model file has none: its architecture's standard one for an instruct model;
    None for a base model or an architecture without one."""
    return _DEFAULTS.get(arch or "") if meta is None or looks_instruct(meta) else None
