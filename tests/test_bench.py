"""Benchmark: prompt files, statistics, result documents; the slow test benchmarks real reference servers on 127.0.0.1."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from backend.bench import client, results
from backend.bench.client import percentile
from backend.jobs.registry import JobRegistry
from backend.serve.launch import launch
from backend.serve.preflight import resolve_draft_dir
from backend.serve.prompts import PromptFileError, load_prompts

ROOT = Path(__file__).resolve().parent.parent


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
    path.write_text(
        "\n".join(
            [
                json.dumps({"prompt": "a"}),
                json.dumps({"text": "b"}),
                json.dumps({"id": 1, "conversations": [{"role": "system", "content": "s"}, {"role": "user", "content": "c"}]}),
                json.dumps({"conversations": [{"from": "human", "value": "d"}, {"from": "gpt", "value": "x"}]}),
                "",
            ]
        )
    )
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
    return client.RequestResult(index=index, ok=True, completion_tokens=tokens, verify_ct=verify, ttft_s=ttft, latency_s=latency, chunk_gaps_s=gaps, text=text)


def test_summarize_and_document(tmp_path):
    spec = client.summarize(
        1,
        [stream_result(0, 10, 4, 0.1, 1.0, [0.2, 0.3], "x"), stream_result(1, 20, 6, 0.2, 2.0, [0.1], "y")],
        4.0,
        {"internal_states": [{"avg_spec_accept_length": 2.9}]},
    )
    assert spec.output_tokens == 30 and spec.output_tok_per_s == pytest.approx(7.5)
    assert spec.accept_length == pytest.approx(3.0) and spec.server_avg_accept_length == 2.9
    assert spec.tpot_p50_s == pytest.approx(((1.0 - 0.1) / 9 + (2.0 - 0.2) / 19) / 2)
    base = client.summarize(1, [stream_result(0, 10, 0, 0.1, 2.0, [], "x"), stream_result(1, 20, 0, 0.1, 4.0, [], "z")], 10.0, {})
    assert base.accept_length is None
    prompts = load_prompts(limit=2)
    doc = results.build_document(
        url="http://127.0.0.1:1",
        server_info={"speculative_algorithm": "EAGLE3", "x": 1},
        levels=[spec],
        prompts=prompts,
        max_new_tokens=16,
        concurrency=[1],
        baseline_url="http://127.0.0.1:2",
        baseline_info={},
        baseline_levels=[base],
    )
    assert doc["speedup"][0]["speedup"] == pytest.approx(7.5 / 3.0)
    assert doc["outputs_equal"] == {"concurrency": 1, "compared": 2, "equal": 1, "first_different_prompt": 1}
    assert doc["prompts"]["sha256"] == prompts.sha256 and "x" not in doc["server"]
    path = results.save(doc, tmp_path / "deep" / "r.json")
    assert results.load(path)["levels"][0]["accept_length"] == pytest.approx(3.0)
    assert "texts" not in results.load(path)["levels"][0]
    assert "speedup at concurrency 1: 2.50x" in results.table(doc)
    assert [p.name for p in (tmp_path / "deep").iterdir()] == ["r.json"]  # no temp file left


@pytest.mark.slow
def test_bench_against_reference_servers_with_baseline(tmp_path, tiny_profile, trained_tiny_run):
    """Both servers come up through launch(): the speculative one (canary skipped) and the --baseline one."""
    run_dir = tmp_path / "run"
    common = dict(engine="reference", run_dir=run_dir, env={"OMP_NUM_THREADS": os.environ.get("EAGLE3_TEST_THREADS", "1")}, log=lambda line: None)
    started = [
        launch(tiny_profile, trained_tiny_run, job_name="spec", run_canary=False, **common),
        launch(tiny_profile, None, job_name="base", speculative=False, **common),
    ]
    try:
        assert [r.state for r in started] == ["ready", "ready"] and all(r.ok for r in started), [r.message for r in started]
        assert started[1].server_info["speculative_algorithm"] is None and started[1].preflight is None
        spec, base = (r.url for r in started)
        out_file = tmp_path / "result.json"
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "backend",
                "bench",
                "--url",
                spec,
                "--baseline-url",
                base,
                "--tag",
                "code",
                "--num-prompts",
                "4",
                "--concurrency",
                "1,2",
                "--max-new-tokens",
                "48",
                "--out",
                str(out_file),
                "--json",
                "--run-dir",
                str(tmp_path / "run"),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert out.returncode == 0, out.stderr
        doc = json.loads(out.stdout)
        assert results.load(out_file)["levels"] == doc["levels"]
        assert doc["url"] == spec and doc["baseline"]["url"] == base
        assert doc["server"]["speculative_algorithm"] == "EAGLE3" and doc["baseline"]["server"]["speculative_algorithm"] is None
        assert doc["checkpoint"].endswith(resolve_draft_dir(trained_tiny_run).name)
        assert doc["prompts"]["count"] == 4 and len(doc["prompts"]["sha256"]) == 64
        assert doc["concurrency"] == [1, 2] and doc["max_new_tokens"] == 48
        for level in doc["levels"]:
            assert level["failed"] == 0 and level["output_tokens"] == 4 * 48
            assert level["accept_length"] > 1.5 and level["server_avg_accept_length"] > 1.5
            for key in ("output_tok_per_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "tpot_p50_s"):
                assert level[key] > 0, key
        for level in doc["baseline"]["levels"]:
            assert level["failed"] == 0 and level["accept_length"] is None
        assert [row["concurrency"] for row in doc["speedup"]] == [1, 2]
        assert all(row["speedup"] > 0 for row in doc["speedup"])
        assert doc["outputs_equal"]["equal"] == doc["outputs_equal"]["compared"] == 4
        print("\n" + results.table(doc))
    finally:
        JobRegistry(run_dir).stop([r.job_name for r in started if r.job_name], grace=15)


def histogram_result(index, tokens, verify, histogram):
    result = stream_result(index, tokens, verify, 0.1, 1.0, [], "t")
    result.histogram = histogram
    return result


def test_levels_report_both_definitions_and_positions_and_the_document_compares_with_validation(tmp_path):
    # request 0: 2 steps, both accepted 3 drafts (short, accepts a lot); request 1: 8 steps, 2 of them accepted 1.
    level = client.summarize(1, [histogram_result(0, 9, 2, [0, 0, 0, 2]), histogram_result(1, 11, 8, [6, 2])], 2.0, {"speculative_num_steps": 3})
    assert level.accept_length == pytest.approx(20 / 10)  # pooled over verify steps
    assert level.accept_length_mean_of_request_means == pytest.approx((9 / 2 + 11 / 8) / 2)
    acceptance = level.acceptance
    assert acceptance["histogram"] == [6, 2, 0, 2]
    assert [r["reached"] for r in acceptance["per_position"]] == pytest.approx([0.4, 0.2, 0.2])
    assert [r["conditional"] for r in acceptance["per_position"]] == pytest.approx([0.4, 0.5, 1.0])
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"eagle3_console": {"val_acc": [0.9, 0.9, 0.9]}}))
    doc = results.build_document(
        url="u",
        server_info={"speculative_draft_model_path": str(checkpoint), "speculative_num_steps": 3},
        levels=[level],
        prompts=load_prompts(limit=2),
        max_new_tokens=16,
        concurrency=[1],
    )
    assert doc["validation"]["val_acc"] == [0.9, 0.9, 0.9] and doc["validation"]["tau_hat"] == pytest.approx(1 + 0.9 + 0.81 + 0.729)
    saved = doc["levels"][0]["acceptance"]
    # 10 steps reached position 0: below MIN_STEPS_AT_POSITION, so nothing is judged
    assert saved["break"] is None and saved["break_line"].startswith("too few verify steps")
    assert [r["predicted"] for r in saved["per_position"]] == [0.9, 0.9, 0.9]
    text = results.table(doc)
    assert "pooled over verify steps" in text and "mean of per-request means" in text and "val acc 0.90 0.90 0.90" in text


def test_a_server_without_histogram_gives_the_pooled_number_and_a_note():
    result = stream_result(0, 30, 10, 0.1, 1.0, [], "t")
    result.histogram_note = "the server reports no spec_correct_drafts_histogram (SGLang before 0.5.14, or another engine)"
    level = client.summarize(1, [result], 1.0, {"speculative_num_steps": 3})
    assert level.accept_length == pytest.approx(3.0) and level.acceptance["per_position"] == []
    assert any("no spec_correct_drafts_histogram" in n for n in level.acceptance["notes"])
    doc = results.build_document(
        url="u",
        server_info={"speculative_draft_model_path": "/nonexistent"},
        levels=[level],
        prompts=load_prompts(limit=1),
        max_new_tokens=16,
        concurrency=[1],
        val_acc=[0.8],
    )
    assert doc["levels"][0]["acceptance"]["break"] is None and "note:" in results.table(doc)


async def test_streamed_histogram_from_the_reference_engine(mini_servers):
    url = mini_servers["spec"].url
    level = await client.run_level(url, ["def f(x):\n", "import sys\n"], 2, 16)
    assert level.failed == 0
    acceptance = level.acceptance
    assert acceptance["notes"] == [] and sum(acceptance["histogram"]) == acceptance["sum_verify_ct"] > 0
    assert len(acceptance["per_position"]) == mini_servers["profile"].serve.num_steps
    assert acceptance["pooled"] == pytest.approx(level.accept_length)
    assert level.accept_length_mean_of_request_means is not None
