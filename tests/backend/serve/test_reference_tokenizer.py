"""The byte tokenizer the reference server exposes to AutoTokenizer clients (SGLang's bench_serving): same ids, same text.

Fast: Hugging Face files written to a temp dir and loaded by the real transformers AutoTokenizer, then the mini
reference servers (tests/fixtures/reference.py) report where to load it from and are checked against it.
"""

from __future__ import annotations

import random

import httpx
import pytest
from transformers import AutoTokenizer

from backend.serve.reference import hf_tokenizer
from backend.serve import http
from backend.train.tiny import BOS_ID, EOS_ID, PAD_ID, TOKENIZER_FILE, ByteTokenizer

SAMPLES = [
    "def parse(line):\n    return line.split(',')\n",
    "  leading spaces\tand tabs\r\n",
    "héllo wörld ✓ 𝄞 日本語",
    "<eos> is text here, and so are <bos> and <pad>",
    "\x00\x01\x7f control bytes",
    "",
    " ",
    "Ġ Ċ ÿ",
]


def random_texts(count: int = 50, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    ranges = [(0x20, 0x7E), (0x00, 0x1F), (0xA0, 0x2FF), (0x4E00, 0x4E80), (0x1F300, 0x1F320)]
    texts = []
    for _ in range(count):
        chars = []
        for _ in range(rng.randint(0, 40)):
            low, high = rng.choice(ranges)
            chars.append(chr(rng.randint(low, high)))
        texts.append("".join(chars))
    return texts


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf-byte-tokenizer")
    assert hf_tokenizer.write_tokenizer_files(directory) is True
    return directory


def test_autotokenizer_ids_are_the_utf8_bytes_the_server_encodes(hf_dir):
    tok, byte = AutoTokenizer.from_pretrained(str(hf_dir)), ByteTokenizer()
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, len(tok)) == (BOS_ID, EOS_ID, PAD_ID, 259)
    for text in SAMPLES + random_texts():
        ids = tok(text).input_ids
        assert ids == byte.encode(text) == list(text.encode("utf-8")), text  # no bos, no special tokens parsed out of text
        assert tok.encode(text) == ids
        assert tok.decode(ids) == byte.decode(ids) == text


def test_special_tokens_decode_as_the_byte_tokenizer_does(hf_dir):
    tok, byte = AutoTokenizer.from_pretrained(str(hf_dir)), ByteTokenizer()
    ids = [104, 105, EOS_ID, PAD_ID, BOS_ID, 0xE2, 0x9C, 0x93]
    assert tok.decode(ids, skip_special_tokens=False) == byte.decode(ids, skip_special_tokens=False) == "hi<eos><pad><bos>✓"
    assert tok.decode(ids, skip_special_tokens=True) == byte.decode(ids) == "hi✓"
    assert tok.decode([0xE2, 0x9C]) == byte.decode([0xE2, 0x9C]) == "\ufffd"  # a cut character, replaced alike


def test_chat_template_renders_the_servers_transcript(hf_dir):
    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi ✓"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": ""},
    ]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == hf_tokenizer.transcript(messages) == "system: be brief\nuser: hi ✓\nassistant: hello\nuser: \nassistant: "


def test_files_are_rewritten_only_when_they_differ(tmp_path):
    assert hf_tokenizer.write_tokenizer_files(tmp_path) is True
    before = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    assert hf_tokenizer.write_tokenizer_files(tmp_path) is False
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == before
    (tmp_path / hf_tokenizer.TOKENIZER_CONFIG).write_text("{}")
    assert hf_tokenizer.write_tokenizer_files(tmp_path) is True
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(hf_tokenizer.tokenizer_files())  # no temp files left


def test_exposed_dir_falls_back_to_the_cache_when_the_target_dir_cannot_take_the_files(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE3_CACHE_DIR", str(tmp_path / "cache"))
    target = tmp_path / "target"
    target.mkdir()
    ByteTokenizer().save(target)
    (target / hf_tokenizer.TOKENIZER_JSON).mkdir()  # a directory where the file goes: the rename fails
    lines: list[str] = []
    exposed = hf_tokenizer.exposed_tokenizer_dir(str(target), lines.append)
    assert exposed == str(tmp_path / "cache" / hf_tokenizer.FALLBACK_DIR_NAME)
    assert any(str(target) in line and "could not write" in line for line in lines), lines
    assert AutoTokenizer.from_pretrained(exposed)("ok").input_ids == [111, 107]
    assert sorted(p.name for p in target.iterdir()) == sorted([TOKENIZER_FILE, hf_tokenizer.TOKENIZER_JSON])


def test_a_hugging_face_target_is_its_own_tokenizer_dir_and_gets_nothing_written(tmp_path):
    assert hf_tokenizer.exposed_tokenizer_dir(str(tmp_path), print) == str(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_server_reports_a_tokenizer_whose_ids_match_its_own(mini_servers):
    url = mini_servers["spec"].url
    info = http.get(f"{url}/get_model_info").body
    model_id = http.get(f"{url}/v1/models").body["data"][0]["id"]
    server_info = http.get(f"{url}/get_server_info").body
    assert info["tokenizer_path"] == model_id == server_info["tokenizer_path"] == server_info["served_model_name"]
    # bench_serving loads /model_info's tokenizer_path, and falls back to the model id: both load
    tok = AutoTokenizer.from_pretrained(info["tokenizer_path"])
    prompt = "def parse(line):\n    héllo = "
    with httpx.Client(timeout=120, trust_env=False) as client:
        by_text = client.post(f"{url}/generate", json={"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}}).json()
        by_ids = client.post(
            f"{url}/generate", json={"input_ids": tok(prompt).input_ids, "sampling_params": {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}}
        ).json()
        chat = client.post(
            f"{url}/v1/chat/completions", json={"model": model_id, "temperature": 0, "max_tokens": 4, "messages": [{"role": "user", "content": prompt}]}
        ).json()
    assert by_text["meta_info"]["prompt_tokens"] == len(tok(prompt).input_ids)
    assert by_ids["output_ids"] == by_text["output_ids"] and by_ids["text"] == by_text["text"]
    assert len(by_text["output_ids"]) == 24
    assert tok.decode(by_text["output_ids"], skip_special_tokens=True) == by_text["text"]
    templated = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    assert chat["usage"]["prompt_tokens"] == len(tok(templated).input_ids)  # the server renders chats as the template does
