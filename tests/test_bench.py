"""Benchmark: prompt files, statistics, result documents; the slow test benchmarks real reference servers on 127.0.0.1."""
import json

import pytest

from backend.bench import client, results
from backend.bench.client import LevelResult, PromptFileError, load_prompts, percentile


def test_shipped_prompts_load_with_tags():
    everything = load_prompts()
    assert 40 <= len(everything.prompts) <= 60
    code = load_prompts(tag="code")
    chat = load_prompts(tag="chat")
    assert len(code.prompts) >= 10 and len(chat.prompts) >= 20
    assert len(code.prompts) + len(chat.prompts) == len(everything.prompts)
    assert code.sha256 != chat.sha256 and len(everything.sha256) == 64
    assert load_prompts(limit=3).prompts == everything.prompts[:3]


def test_prompt_file_formats(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join([
        json.dumps({"prompt": "a"}),
        json.dumps({"text": "b"}),
        json.dumps({"id": 1, "conversations": [{"role": "system", "content": "s"}, {"role": "user", "content": "c"}]}),
        json.dumps({"conversations": [{"from": "human", "value": "d"}, {"from": "gpt", "value": "x"}]}),
        "",
    ]))
    assert load_prompts(path).prompts == ["a", "b", "c", "d"]


def test_bad_prompt_files_say_where(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n{"nothing": 1}\n')
    with pytest.raises(PromptFileError, match="p.jsonl:2"):
        load_prompts(path)
    path.write_text("not json\n")
    with pytest.raises(PromptFileError, match="not JSON"):
        load_prompts(path)
    with pytest.raises(PromptFileError, match="cannot read"):
        load_prompts(tmp_path / "missing.jsonl")


def test_percentile_interpolates():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile(list(range(101)), 99) == pytest.approx(99.0)


def stream_result(index, tokens, verify, ttft, latency, gaps, text):
    return client.RequestResult(index=index, ok=True, completion_tokens=tokens, verify_ct=verify, ttft_s=ttft,
                                latency_s=latency, chunk_gaps_s=gaps, text=text)


def test_summarize_and_document(tmp_path):
    spec = client.summarize(1, [stream_result(0, 10, 4, 0.1, 1.0, [0.2, 0.3], "x"),
                                stream_result(1, 20, 6, 0.2, 2.0, [0.1], "y")], 4.0,
                            {"internal_states": [{"avg_spec_accept_length": 2.9}]})
    assert spec.output_tokens == 30 and spec.output_tok_per_s == pytest.approx(7.5)
    assert spec.accept_length == pytest.approx(3.0) and spec.server_avg_accept_length == 2.9
    assert spec.tpot_p50_s == pytest.approx(((1.0 - 0.1) / 9 + (2.0 - 0.2) / 19) / 2)
    base = client.summarize(1, [stream_result(0, 10, 0, 0.1, 2.0, [], "x"), stream_result(1, 20, 0, 0.1, 4.0, [], "z")],
                            10.0, {})
    assert base.accept_length is None
    prompts = load_prompts(limit=2)
    doc = results.build_document(url="http://127.0.0.1:1", server_info={"speculative_algorithm": "EAGLE3", "x": 1},
                                 levels=[spec], prompts=prompts, max_new_tokens=16, concurrency=[1],
                                 baseline_url="http://127.0.0.1:2", baseline_info={}, baseline_levels=[base])
    assert doc["speedup"][0]["speedup"] == pytest.approx(7.5 / 3.0)
    assert doc["outputs_equal"] == {"concurrency": 1, "compared": 2, "equal": 1, "first_different_prompt": 1}
    assert doc["prompts"]["sha256"] == prompts.sha256 and "x" not in doc["server"]
    path = results.save(doc, tmp_path / "deep" / "r.json")
    assert results.load(path)["levels"][0]["accept_length"] == pytest.approx(3.0)
    assert "texts" not in results.load(path)["levels"][0]
    assert "speedup at concurrency 1: 2.50x" in results.table(doc)
    assert [p.name for p in (tmp_path / "deep").iterdir()] == ["r.json"]  # no temp file left
