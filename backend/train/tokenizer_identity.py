"""A tokenizer's identity as digests (the token cache's key, a target fingerprint's part), alike across transformers."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from backend.train.chat_templates import tokenizer_name
from backend.train.fsutil import file_sha256

# A slow tokenizer's files (no tokenizers backend to read the vocabulary and merges from). tokenizer_config.json is
# left out: what it adds that matters here (special tokens, the template) is in tokenizer_identity's "specials".
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt")
# Text that exercises what turns text into ids besides the vocabulary and merges: runs of spaces, tabs and newlines,
# accents, scripts without spaces, emoji with modifiers and joiners, digits, code, special-token text.
ENCODING_PROBE = (
    "Hello, world!  Two  spaces,\tone tab,\nnew line\r\n\n   and trailing   ",
    "naïve café — “quotes” ‘single’ … ½ ² é vs e\u0301",
    "数据集 日本語のテキスト 한국어 العربية עברית ไทย",
    "emoji 🙂👍🏽 and 👩‍💻 joined",
    "x = f(a_1, b2) ** 3 // 7; print(\"ok\")  # code\n\tif x: return {'k': [1, 2]}",
    "1234567890 3.14159 1e-9 0x1F 2026-12-05",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|><s></s>[INST]",
    "\u00a0no-break\u2009thin\u3000ideographic\u200bzero-width",
)


def tokenizer_source(tokenizer) -> str:
    """The tokenizer's name, or for one loaded from a local dir a digest of what it encodes with: its vocabulary, its
    merges, its added tokens and the ids it gives a probe text. A cache keyed on it holds wherever that dir lies (a
    prepared target lives under each host's cache dir) and whichever transformers wrote its files: 5.17 and 5.25 write
    SmolLM2's tokenizer.json differently (another decoder, an empty normalizer) and encode alike."""
    name = tokenizer_name(tokenizer)
    folder = Path(name).expanduser()
    if not folder.is_dir():
        return name
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a slow tokenizer: its files
        present = [folder / file for file in TOKENIZER_FILES if (folder / file).is_file()]
        if not present:
            return name
        digest = hashlib.sha256()
        for file in present:
            digest.update(file.name.encode() + b"\0" + file_sha256(file).encode() + b"\0")
        return f"files:{digest.hexdigest()[:24]}"
    model = json.loads(backend.to_str()).get("model", {})
    merges = [" ".join(merge) if isinstance(merge, list) else merge for merge in model.get("merges") or []]
    parts = {
        "vocab": sorted(tokenizer.get_vocab().items(), key=lambda item: item[1]),
        "model": model.get("type"),
        "merges": merges,
        "added": sorted((index, str(token)) for token, index in tokenizer.get_added_vocab().items()),
        "probe": tokenizer(list(ENCODING_PROBE), add_special_tokens=False)["input_ids"],
    }
    return f"encodes:{hashlib.sha256(json.dumps(parts, ensure_ascii=False).encode()).hexdigest()[:24]}"


def tokenizer_identity(tokenizer, template_text: str) -> dict:
    """What a tokenization depends on besides the data: the tokenizer (its files), size, special tokens, and the template."""
    specials = json.dumps(
        {
            "special": sorted(str(t) for t in getattr(tokenizer, "all_special_tokens", []) or []),
            "added": sorted(str(t) for t in (getattr(tokenizer, "get_added_vocab", dict)() or {})),
            "template": template_text,
        },
        sort_keys=True,
    )
    return {"name": tokenizer_source(tokenizer), "vocab": len(tokenizer), "specials": hashlib.sha256(specials.encode()).hexdigest()[:16]}


SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")  # the ones generation and padding act on


def tokenizer_behaviour(tokenizer) -> str:
    """A digest of what a loaded tokenizer does to a conversation: what it encodes with (tokenizer_source), its size,
    how it decodes the probe text's ids, its special tokens with their ids and its own chat template. Two copies of
    one tokenizer written by different transformers versions give the same digest (SmolLM2's by 5.17 and 5.25: other
    tokenizer.json and tokenizer_config.json bytes, the same behaviour); another eos, template or vocabulary gives
    another."""
    specials = {name: [str(getattr(tokenizer, name, None)), getattr(tokenizer, f"{name}_id", None)] for name in SPECIAL_TOKENS}
    source = tokenizer_source(tokenizer)
    parts = {
        "source": source,
        "decodes": _decoded_probe(tokenizer) if source.startswith("encodes:") else None,
        "size": len(tokenizer) if hasattr(tokenizer, "__len__") else getattr(tokenizer, "vocab_size", None),
        "specials": specials,
        "template": getattr(tokenizer, "chat_template", None),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, ensure_ascii=False, default=str).encode()).hexdigest()


# Text whose decoding a tokenizer's clean-up changes ("word ." -> "word."): 5.17 and 5.25 keep it as it is for SmolLM2.
CLEAN_UP_PROBE = "Hello , world ! Isn 't it ? yes . do n't I 'm we 're"


def _decoded_probe(tokenizer) -> list[str]:
    """The probe texts' ids decoded back, special tokens kept and dropped: the text a regenerated answer is stored as."""
    ids = tokenizer([*ENCODING_PROBE, CLEAN_UP_PROBE], add_special_tokens=False)["input_ids"]
    return [tokenizer.decode(row, skip_special_tokens=skip) for row in ids for skip in (False, True)]
