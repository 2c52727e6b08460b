"""A few chat formats by name (--chat-template NAME), as Jinja2 sources rendered by server.chat.ChatFormatter.

Each renders `messages` and, with `add_generation_prompt`, the opening of the assistant's turn. Newlines are
written inside expressions because the formatter's environment trims the newline after a block tag.
"""

from __future__ import annotations

from pathlib import Path

from powerinfer.errors import InputError
from powerinfer.textfile import read_text_file

_CHATML = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_LLAMA3 = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim }}"
    "{{ '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
_ZEPHYR = (
    "{% for m in messages %}"
    "{{ '<|' + m['role'] + '|>\\n' + m['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
# Gemma has no system role: a system message is written at the start of the first user turn
_GEMMA = (
    "{{ bos_token }}"
    "{% set ns = namespace(system='') %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% set ns.system = m['content'] + '\\n\\n' %}"
    "{% else %}"
    "{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + ns.system + m['content'] | trim + '<end_of_turn>\\n' }}"
    "{% set ns.system = '' %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)

BUILTIN_TEMPLATES = {"chatml": _CHATML, "llama3": _LLAMA3, "zephyr": _ZEPHYR, "gemma": _GEMMA}
# text that ends an assistant turn, a stop string besides the vocabulary's end-of-generation tokens
BUILTIN_STOPS = {
    "chatml": ("<|im_end|>",),
    "llama3": ("<|eot_id|>",),
    "zephyr": (),
    "gemma": ("<end_of_turn>",),
}


def chat_template_source(name_or_file: str) -> tuple[str, tuple[str, ...]]:
    """--chat-template: a built-in name or a Jinja2 file; the template source and its stop strings."""
    if name_or_file in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[name_or_file], BUILTIN_STOPS[name_or_file]
    path = Path(name_or_file)
    if path.is_file():
        return read_text_file(path, "chat template"), ()
    names = ", ".join(sorted(BUILTIN_TEMPLATES))
    raise InputError(f"--chat-template {name_or_file!r} is neither a built-in template ({names}) nor a file")
