"""Chat templates by name (chatml, llama3, qwen) or from a Jinja file, and the refusal when a tokenizer has none."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from backend.train.conversations import DataError

# Each template renders a conversation so that rendering a prefix of it (with add_generation_prompt after a
# user turn) is a prefix of rendering the whole: the loss mask finds each answer's tokens that way.
CHATML = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)

LLAMA3 = (
    "{%- if bos_token %}{{ bos_token }}{%- endif %}"
    "{%- for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

# ChatML with Qwen2's default system prompt when the conversation brings none.
QWEN = "{%- if not messages or messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}" + CHATML

BUILTIN_TEMPLATES = {"chatml": CHATML, "llama3": LLAMA3, "qwen": QWEN}


@dataclass(frozen=True)
class ChatTemplate:
    """A template chosen on the command line: its name (built-in name or file path) and its Jinja text."""

    name: str
    text: str

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()[:16]


def resolve_chat_template(spec: str | os.PathLike | None) -> ChatTemplate | None:
    """`--chat-template NAME|FILE`: a built-in name, else a Jinja file; None when none was given."""
    if spec is None or str(spec) == "":
        return None
    name = str(spec)
    if name in BUILTIN_TEMPLATES:
        return ChatTemplate(name, BUILTIN_TEMPLATES[name])
    path = Path(name).expanduser()
    if not path.is_file():
        raise DataError(f"--chat-template {name}: neither a built-in template ({', '.join(BUILTIN_TEMPLATES)}) nor a file; nothing was tokenized")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"--chat-template {path}: cannot read it ({exc}); nothing was tokenized") from None
    if "messages" not in text:
        raise DataError(f"--chat-template {path}: does not look like a Jinja chat template (it never mentions 'messages'); nothing was tokenized")
    return ChatTemplate(str(path), text)


def tokenizer_name(tokenizer) -> str:
    return str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)


def template_text(tokenizer, template: ChatTemplate | None) -> str:
    """The Jinja text that will render conversations: the one given, else the tokenizer's own; refused when neither exists."""
    if template is not None:
        return template.text
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, dict):  # several named templates: transformers uses "default"
        own = own.get("default")
    if not own:
        raise DataError(
            f"the tokenizer of {tokenizer_name(tokenizer)} has no chat template; pass --chat-template "
            f"{'|'.join(BUILTIN_TEMPLATES)} or a Jinja file (nothing was tokenized)"
        )
    return str(own)


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool, template: str | None, tokenize: bool):
    """The conversation through the template: its text, or (tokenize) its token ids as a list."""
    rendered = tokenizer.apply_chat_template(messages, tokenize=tokenize, add_generation_prompt=add_generation_prompt, chat_template=template)
    if tokenize and (isinstance(rendered, dict) or hasattr(rendered, "keys")):
        rendered = rendered["input_ids"]
    return list(rendered) if tokenize else rendered


def template_ids(tokenizer, messages: list[dict], add_generation_prompt: bool, template: str | None = None) -> list[int]:
    return render_chat(tokenizer, messages, add_generation_prompt, template, tokenize=True)
