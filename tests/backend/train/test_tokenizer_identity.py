"""tokenizer_behaviour: what a target's fingerprint reads of its tokenizer. Equal for the same tokenizer written
otherwise; another for another decoding, normalizer, special token or chat template."""

import json
from pathlib import Path

from transformers import AutoTokenizer

from backend.train.target import load_tokenizer
from backend.train.tiny import ensure_tiny_target
from backend.train.tokenizer_identity import tokenizer_behaviour
from tests.fixtures.chat import chat_tokenizer


def saved(folder: Path, tokenizer_json: dict | None = None, config: dict | None = None, template: str | None = None) -> str:
    """The fixture's tokenizer saved to `folder` with tokenizer.json and tokenizer_config.json fields replaced (both
    re-indented and ASCII-escaped) and another chat_template.jinja; its behaviour, loaded from there."""
    chat_tokenizer().save_pretrained(folder)
    for file, fields in (("tokenizer.json", tokenizer_json), ("tokenizer_config.json", config)):
        written = json.loads((folder / file).read_text())
        (folder / file).write_text(json.dumps(written | (fields or {}), indent=4, ensure_ascii=True))
    if template is not None:
        (folder / "chat_template.jinja").write_text(template)
    return tokenizer_behaviour(AutoTokenizer.from_pretrained(folder))


def test_the_same_tokenizer_written_otherwise_behaves_alike_and_each_change_that_matters_differs(tmp_path):
    chat_tokenizer().save_pretrained(tmp_path / "here")
    here = tokenizer_behaviour(AutoTokenizer.from_pretrained(tmp_path / "here"))
    # the keys transformers 5.17 adds, an empty normalizer as 5.17 writes SmolLM2's: nothing a conversation meets changes
    assert saved(tmp_path / "rewritten", config={"is_local": True, "local_files_only": False}) == here
    assert saved(tmp_path / "normalizer", tokenizer_json={"normalizer": {"type": "Sequence", "normalizers": []}}) == here
    changes = {
        "decoder": {"tokenizer_json": {"decoder": {"type": "Sequence", "decoders": []}}},  # pieces joined without spaces
        "lowercase": {"tokenizer_json": {"normalizer": {"type": "Lowercase"}}},
        "eos": {"config": {"eos_token": "<|end|>"}},
        "pad": {"config": {"pad_token": "[UNK]"}},
        "template": {"template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"},
    }
    found = {name: saved(tmp_path / name, **change) for name, change in changes.items()}
    assert here not in found.values() and len(set(found.values())) == len(changes), found


def test_a_tokenizer_without_a_fast_backend_has_a_behaviour_too():
    """The tiny target's byte tokenizer (no tokenizers backend): its class and special tokens, the same each load."""
    assert tokenizer_behaviour(load_tokenizer(str(ensure_tiny_target()))) == tokenizer_behaviour(load_tokenizer(str(ensure_tiny_target())))
