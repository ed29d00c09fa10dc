"""Chat templates for architectures whose GGUF files often ship without `tokenizer.chat_template`."""
from __future__ import annotations

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


def default_chat_template(arch: str | None) -> str | None:
    """The template to use when a model file has none; None when the architecture has no standard one."""
    return _DEFAULTS.get(arch or "")
