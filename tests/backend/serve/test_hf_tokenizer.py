"""The byte tokenizer's tokenizer.json is built by the `tokenizers` package, and that build decodes every id as the server does."""

from __future__ import annotations

import random

from tokenizers import Tokenizer

from backend.serve.reference import hf_tokenizer
from backend.train.tiny import BOS_ID, EOS_ID, PAD_ID, ByteTokenizer


def test_tokenizer_json_is_what_the_tokenizers_package_writes(tmp_path):
    hf_tokenizer.write_tokenizer_files(tmp_path)
    text = (tmp_path / hf_tokenizer.TOKENIZER_JSON).read_text(encoding="utf-8")
    built = hf_tokenizer.byte_level_tokenizer()
    assert text == built.to_str(pretty=True) + "\n"
    loaded = Tokenizer.from_file(str(tmp_path / hf_tokenizer.TOKENIZER_JSON))
    assert loaded.get_vocab_size() == 259
    assert [loaded.token_to_id(t) for t in ("<bos>", "<eos>", "<pad>")] == [BOS_ID, EOS_ID, PAD_ID]
    every_byte = bytes(range(128)).decode("ascii") + "".join(chr(c) for c in (0xE9, 0x2713, 0x1D11E))
    assert loaded.encode(every_byte, add_special_tokens=False).ids == list(every_byte.encode("utf-8"))


def test_any_id_sequence_decodes_as_the_byte_tokenizer_decodes_it():
    """Model output is any id sequence (lone continuation bytes, cut characters, specials): the text must be the server's."""
    built, byte, rng = hf_tokenizer.byte_level_tokenizer(), ByteTokenizer(), random.Random(0)
    for _ in range(300):
        ids = [rng.randrange(259) for _ in range(rng.randint(0, 24))]
        for skip in (True, False):
            assert built.decode(ids, skip_special_tokens=skip) == byte.decode(ids, skip_special_tokens=skip), (ids, skip)
