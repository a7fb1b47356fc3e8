"""Hugging Face tokenizer files for the tiny byte tokenizer, so AutoTokenizer clients (SGLang's bench_serving) load the served ids.

The byte tokenizer (backend/train/tiny.py) maps byte b to token b and has three special tokens (bos 256, eos 257,
pad 258). Its Hugging Face form is built with the `tokenizers` package: a BPE model over the 256 GPT-2 byte
characters (transformers' own bytes_to_unicode table) with no merges, a ByteLevel pre-tokenizer and decoder without
regex splitting or a prefix space, and no post-processor, so `AutoTokenizer(...)(text).input_ids ==
list(text.encode("utf-8"))` exactly as the server encodes it. `tokenizers` writes tokenizer.json (this replaced a
hand-written JSON document and byte table). The special tokens are never parsed out of text (split_special_tokens),
as the server never does either. The chat template renders the same `role: content` transcript the server uses for
a tokenizer without one. tokenizer_config.json stays a small hand-written file naming PreTrainedTokenizerFast: what
transformers 5's save_pretrained writes instead ("TokenizersBackend", chat_template.jinja) does not load in the
transformers 4.x that SGLang's side venv may run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from backend.durable import write_atomic
from backend.train.tiny import BOS_ID, BYTE_VOCAB, EOS_ID, PAD_ID, TINY_VOCAB_SIZE, cache_root, is_tiny_target_dir

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
SPECIAL_TOKENS = {BOS_ID: "<bos>", EOS_ID: "<eos>", PAD_ID: "<pad>"}  # what ByteTokenizer.decode(skip_special_tokens=False) writes
# The server's chat transcript (transcript() below) as a Jinja chat template.
CHAT_TEMPLATE = "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
FALLBACK_DIR_NAME = "hf-byte-tokenizer"


def transcript(messages: list[dict[str, str]]) -> str:
    """A chat as `role: content` lines and the assistant's prompt (the byte tokenizer has no chat template of its own)."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "


def byte_level_tokenizer():
    """The byte tokenizer as a `tokenizers.Tokenizer`: id b < 256 is byte b, then the special tokens in id order."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {char: byte for byte, char in bytes_to_unicode().items()}
    assert sorted(vocab.values()) == list(range(BYTE_VOCAB))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    specials = [AddedToken(text, special=True, normalized=False) for _, text in sorted(SPECIAL_TOKENS.items())]
    tokenizer.add_special_tokens(specials)
    assert [tokenizer.token_to_id(t.content) for t in specials] == sorted(SPECIAL_TOKENS)
    return tokenizer


def tokenizer_files() -> dict[str, str]:
    """File name -> text of the byte tokenizer's Hugging Face form."""
    special = {"bos_token": SPECIAL_TOKENS[BOS_ID], "eos_token": SPECIAL_TOKENS[EOS_ID], "pad_token": SPECIAL_TOKENS[PAD_ID]}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": True,
        "chat_template": CHAT_TEMPLATE,
        "vocab_size": TINY_VOCAB_SIZE,
        "eagle3_console": "byte tokenizer: token i < 256 is byte i (UTF-8); 256 <bos>, 257 <eos>, 258 <pad>",
    }
    return {
        TOKENIZER_JSON: byte_level_tokenizer().to_str(pretty=True) + "\n",
        TOKENIZER_CONFIG: json.dumps(config, indent=1) + "\n",
        SPECIAL_TOKENS_MAP: json.dumps(special, indent=1) + "\n",
    }


def write_tokenizer_files(directory: Path) -> bool:
    """Write the files that are missing or differ (each atomically); True when any was written."""
    wrote = False
    for name, text in tokenizer_files().items():
        path = directory / name
        try:
            if path.read_text(encoding="utf-8") == text:
                continue
        except (OSError, UnicodeDecodeError):
            pass
        write_atomic(path, text.encode("utf-8"))
        wrote = True
    return wrote


def exposed_tokenizer_dir(target_path: str, log: Callable[[str], None]) -> str | None:
    """The directory AutoTokenizer loads the served tokenizer from (reported as tokenizer_path).

    A Hugging Face target ships its tokenizer: its own dir. A byte-tokenizer target gets the files written beside
    its weights (so the model id loads too), or, when that dir is read-only, into the user cache. None when neither
    can be written (the server still serves; clients that need a tokenizer must be given one).
    """
    if not is_tiny_target_dir(target_path):
        return target_path
    for directory in (Path(target_path), cache_root() / FALLBACK_DIR_NAME):
        try:
            directory.mkdir(parents=True, exist_ok=True)
            if write_tokenizer_files(directory):
                log(f"wrote the byte tokenizer's Hugging Face files to {directory}")
            return str(directory)
        except OSError as exc:
            log(f"could not write the byte tokenizer's Hugging Face files to {directory}: {exc}")
    return None
