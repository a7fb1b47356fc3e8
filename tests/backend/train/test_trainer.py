"""The trainer: schedules, Grokfast, metrics, checkpoints, resume (d2t/t2d kept), width refusal, SIGTERM, torchrun, tiny run."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from backend.cli import main as cli_main
from backend.metrics.records import validate_record
from backend.train.checkpoint import load_checkpoint
from backend.layout import latest_checkpoint, list_checkpoints
from backend.train.data import OnlineSource, Sample, TinyDataSettings, tiny_data_settings, tiny_samples
from backend.train.draft import FeatureWidthError
from backend.train.loss import make_teacher, ttt_loss
from backend.train.schedule import GrokfastEMA, LRSchedule, TimeBudget
from backend.train.extract import extract
from backend.train.target import load_target
from backend.train.trainer import TrainOptions, Trainer, TrainSetupError, module_group, train
from backend.train.tiny import read_corpus
from backend.train.vocab import build_vocab_mapping, count_tokens
from tests.fixtures.env import ROOT, mini_profile_dict, subprocess_env
from tests.fixtures.chat import toml_of

MINI_DATA = TinyDataSettings(prompt_len=12, total_len=32, train_samples=24, val_samples=8)


pytestmark = pytest.mark.usefixtures("limited_torch_threads")


def read_records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


# --- schedules and Grokfast ---------------------------------------------------------------------------


def test_cosine_warms_up_then_decays_to_the_floor():
    schedule = LRSchedule(1e-3, "cosine", warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    assert schedule.lr_at(0) == pytest.approx(1e-4)
    assert schedule.lr_at(9) == pytest.approx(1e-3)
    assert schedule.lr_at(60) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))
    assert schedule.lr_at(110) == pytest.approx(1e-4) and schedule.lr_at(500) == pytest.approx(1e-4)
    lrs = [schedule.lr_at(s) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def test_constant_schedule_stays_at_the_peak_for_grokking_runs():
    schedule = LRSchedule(3e-4, "constant", warmup_steps=5, total_steps=100)
    assert schedule.lr_at(2) < 3e-4 and schedule.lr_at(5) == schedule.lr_at(10_000) == 3e-4


def test_resume_rewarms_linearly_from_the_checkpoint_step():
    base = LRSchedule(1e-3, "cosine", 10, 1000, 0.1)
    rewarmed = LRSchedule(1e-3, "cosine", 10, 1000, 0.1, rewarm_from=400, rewarm_steps=20)
    assert rewarmed.lr_at(400) == pytest.approx(base.lr_at(400) / 20)
    assert rewarmed.lr_at(409) == pytest.approx(base.lr_at(409) * 10 / 20)
    assert rewarmed.lr_at(420) == base.lr_at(420) and rewarmed.lr_at(399) == base.lr_at(399)
    with pytest.raises(ValueError, match="unknown schedule"):
        LRSchedule(1e-3, "linear", 0, 10)


def test_grokfast_adds_lambda_times_the_gradient_ema():
    param = torch.nn.Parameter(torch.zeros(3))
    grokfast = GrokfastEMA(alpha=0.5, lamb=2.0)
    param.grad = torch.tensor([1.0, 2.0, 3.0])
    grokfast.apply([("w", param)])  # mu = g: g + 2g
    assert param.grad.tolist() == [3.0, 6.0, 9.0]
    param.grad = torch.tensor([3.0, 0.0, -1.0])
    grokfast.apply([("w", param)])  # mu = 0.5*[1,2,3] + 0.5*g = [2, 1, 1]
    assert param.grad.tolist() == [7.0, 2.0, 1.0]
    restored = GrokfastEMA(0.5, 2.0)
    restored.load_state_dict(grokfast.state_dict())
    assert torch.equal(restored.ema["w"], grokfast.ema["w"])


def test_a_time_budget_fits_the_cosine_to_the_measured_rate_and_the_seconds_left():
    budget = TimeBudget(10.0, start_step=0, started=100.0, cap=40, settle=2)
    budget.observe(1, 100.5)  # the first steps compile: not measured
    assert budget.fitted_total(1, 100.6) is None
    budget.observe(2, 101.0)  # measured from here
    assert budget.fitted_total(2, 101.0) is None  # no interval yet
    assert budget.fitted_total(6, 102.0) == 6 + 4 * 8  # 4 steps a second, 8 s left
    assert budget.fitted_total(12, 103.0) == 40  # 5 a second would end at 47: capped
    assert budget.fitted_total(30, 111.0) == 31  # past the deadline: one more step at most
    assert not budget.expired(109.99) and budget.expired(110.0)
    resumed = TimeBudget(5.0, start_step=1000, started=0.0, cap=10**9, settle=10)
    resumed.observe(1005, 0.5)
    assert resumed.fitted_total(1009, 0.9) is None  # settling: 10 steps past the resume first
    resumed.observe(1010, 1.0)
    assert resumed.fitted_total(1030, 3.0) == 1030 + 20  # 10 steps a second since step 1,010, 2 s left
    with pytest.raises(ValueError, match="must be positive"):
        TimeBudget(0, 0, 0.0, cap=1)


def test_weight_norm_modules_group_by_sglang_module():
    assert module_group("midlayer.self_attn.q_proj.weight") == "midlayer.self_attn"
    assert module_group("midlayer.mlp.down_proj.weight") == "midlayer.mlp"
    assert module_group("fc.weight") == "fc" and module_group("lm_head.weight") == "lm_head"


# --- short real runs on the mini target -------------------------------------------------------------------


def mini_options(profile, out, **overrides):
    return TrainOptions(profile=profile, out_dir=out, tiny_data=overrides.pop("tiny_data", MINI_DATA), **overrides)


@pytest.mark.slow
def test_a_time_budget_ends_the_run_on_time_with_its_cosine_decayed(mini_profile, mini_env, tmp_path, capfd):
    """--max-seconds 4 and no --max-steps: the run ends after ~4 s of steps, by the budget or at the fitted last step,
    validated and saved as a finished run, its learning rate near the floor (not cut mid-cosine as a SIGTERM leaves it)."""
    out = tmp_path / "run"
    options = mini_options(mini_profile, out, max_seconds=4.0, log_interval=1, eval_interval=10**6, save_interval=10**6)
    assert train(options) == 0
    records = read_records(out)
    steps = [r for r in records if r["split"] == "train"]
    vals = [r for r in records if r["split"] == "val"]
    assert [v["step"] for v in vals] == [0, steps[-1]["step"]] and len(steps) > 20
    assert 3.0 <= steps[-1]["time"] - vals[0]["time"] <= 6.0
    peak, floor = 3e-3, 3e-3 * mini_profile.train.min_lr_ratio
    assert max(r["lr"] for r in steps) > 0.9 * peak
    assert steps[-1]["lr"] <= floor + 0.25 * (peak - floor)  # a SIGTERM after 4 s of a 600-step plan would leave ~peak
    assert latest_checkpoint(out).name.endswith(f"_step_{steps[-1]['step']}")
    err = capfd.readouterr().err
    assert "training 4 s of steps from step 1" in err and f"done: {steps[-1]['step']} steps" in err


@pytest.mark.slow
def test_a_time_budget_counts_across_resumes_as_max_steps_does(mini_profile, mini_env, tmp_path, capfd):
    """--max-seconds is the run's total, like --max-steps: its checkpoint records the seconds of steps spent, the same
    budget resumed trains nothing more, a larger one trains what is left and the checkpoint adds them up."""
    out = tmp_path / "run"
    quiet = {"log_interval": 1, "eval_interval": 10**6, "save_interval": 10**6}
    assert train(mini_options(mini_profile, out, max_seconds=2.0, **quiet)) == 0
    first = latest_checkpoint(out)
    spent = load_checkpoint(first)[3]["seconds_of_steps"]
    assert 1.5 <= spent <= 4.0
    lines = len(read_records(out))
    capfd.readouterr()
    assert train(mini_options(mini_profile, out, max_seconds=2.0, resume="latest", **quiet)) == 0
    assert len(read_records(out)) == lines and latest_checkpoint(out) == first  # nothing trained, nothing written
    assert f"the time budget of 2 s is spent ({spent:.0f} s of steps up to step" in capfd.readouterr().err
    assert train(mini_options(mini_profile, out, max_seconds=spent + 2.0, eval_at_start=False, resume="latest", **quiet)) == 0
    resumed = [r for r in read_records(out)[lines:] if r["split"] == "train"]
    assert resumed and 1.5 <= resumed[-1]["time"] - resumed[0]["time"] + resumed[0]["step_time"] <= 4.0
    total = load_checkpoint(latest_checkpoint(out))[3]["seconds_of_steps"]
    assert spent + 1.5 <= total <= spent + 4.0
    err = capfd.readouterr().err
    assert "s of steps before; d2t/t2d taken from the checkpoint" in err and f"less {spent:.0f} s spent before" in err


def test_a_draft_head_from_the_target_starts_from_its_lm_head_rows_and_final_norm(mini_profile, mini_env, tmp_path, capfd):
    """--draft-head target: the fresh draft's lm_head holds the target's rows of the draft vocabulary and its norm the
    target's final norm (lr 0: the one step leaves them as they started)."""
    out = tmp_path / "run"
    quiet = {"log_interval": 1, "eval_interval": 10**6, "save_interval": 10**6, "eval_at_start": False}
    assert train(mini_options(mini_profile, out, max_steps=1, lr=0.0, weight_decay=0.0, draft_head="target", **quiet)) == 0
    draft = load_checkpoint(latest_checkpoint(out))[0]
    target = load_target(mini_profile)
    rows = target.lm_head_weight().detach()[draft.draft_to_target_ids(torch.arange(draft.config.draft_vocab_size))]
    torch.testing.assert_close(draft.lm_head.weight.detach(), rows)
    torch.testing.assert_close(draft.norm.weight.detach(), target.final_norm_weight().detach())
    assert "draft lm_head: the target's rows of the draft vocabulary; norm: the target's final norm" in capfd.readouterr().err


@pytest.fixture(scope="module")
def mini_run(mini_profile, mini_cache, tmp_path_factory):
    """6 steps (log every 2, eval/save every 3), TensorBoard on."""
    out = tmp_path_factory.mktemp("mini-run")
    before = os.environ.get("EAGLE3_CACHE_DIR")
    os.environ["EAGLE3_CACHE_DIR"] = str(mini_cache)
    try:
        assert train(mini_options(mini_profile, out, tensorboard=True)) == 0
    finally:
        os.environ.pop("EAGLE3_CACHE_DIR") if before is None else os.environ.__setitem__("EAGLE3_CACHE_DIR", before)
    return out


def test_metrics_follow_the_schema_and_cover_every_ttt_step(mini_run):
    records = read_records(mini_run)
    for record in records:
        validate_record(record)
    train_records = [r for r in records if r["split"] == "train"]
    val_records = [r for r in records if r["split"] == "val"]
    assert [r["step"] for r in train_records] == [2, 4, 6]
    assert [r["step"] for r in val_records] == [0, 3, 6]
    last = train_records[-1]
    assert len(last["ploss"]) == len(last["acc"]) == 7
    assert last["loss"] == pytest.approx(sum(0.8**k * p for k, p in enumerate(last["ploss"])), rel=1e-6)
    assert set(last["weight_norm_modules"]) >= {"fc", "midlayer.self_attn", "midlayer.mlp", "lm_head", "norm"}
    assert last["weight_norm"] == pytest.approx(math.sqrt(sum(v * v for v in last["weight_norm_modules"].values())))
    assert last["tokens"] == 6 * 4 * 32 and last["grad_norm"] > 0 and last["step_time"] > 0
    assert last["lr"] < 3e-3 and 0 < last["epoch"] <= 6 * 4 / 24
    assert list((mini_run / "tensorboard").glob("events.out.tfevents.*"))


def test_checkpoints_carry_validation_accuracy_aux_width_and_target(mini_run, mini_profile):
    assert [p.name for p in list_checkpoints(mini_run)] == ["epoch_0_step_3", "epoch_1_step_6"]
    latest = latest_checkpoint(mini_run)
    config = json.loads((latest / "config.json").read_text())
    meta = config["eagle3_console"]
    val = [r for r in read_records(mini_run) if r["split"] == "val"][-1]
    assert meta["val_acc"] == val["acc"] and meta["val_acc_step"] == 6
    assert meta["val_rounds"] == val["rounds"] and set(val["rounds"]) == {"3", "7"}  # the profile serves 3 steps; TTT 7
    for steps, histogram in val["rounds"].items():
        assert len(histogram) == int(steps) + 1 and sum(histogram) > 0
        assert val["accept_sim"][steps] == pytest.approx(1 + sum(i * n for i, n in enumerate(histogram)) / sum(histogram))
    assert meta["trained_aux_width"] == 96 and config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    assert meta["target"]["resolved_path"] == mini_profile.target.path
    assert meta["target"]["architecture"] == "LlamaForCausalLM" and meta["target"]["hidden_size"] == 32
    state = torch.load(latest / "training_state.pt", weights_only=False)
    assert state["step"] == 6 and "optimizer" in state and state["sampler"]["num_samples"] == 24
    assert json.loads((mini_run / "run.json").read_text())["profile"] == "mini"


def test_resume_keeps_the_checkpoints_vocab_mapping_even_when_the_data_disagrees(mini_run, mini_profile, mini_env, tmp_path):
    first = load_file(str(latest_checkpoint(mini_run) / "model.safetensors"))
    # Other data: corpus text trained everywhere, a token mix unlike the target's own continuations.
    corpus = read_corpus(mini_profile.target.path, "train")
    windows = [torch.tensor(list(corpus[i * 32 : (i + 1) * 32])) for i in range(32)]
    splits = {
        "train": [Sample(w, torch.ones(32, dtype=torch.uint8)) for w in windows[:24]],
        "val": [Sample(w, torch.ones(32, dtype=torch.uint8)) for w in windows[24:]],
    }
    extract(load_target(mini_profile), splits, tmp_path / "shards")
    counts = count_tokens(((s.input_ids, s.loss_mask) for s in splits["train"]), 259)
    assert not torch.equal(build_vocab_mapping(counts, 48)[1], first["t2d"]), "precondition: the new data implies another mapping"
    out = tmp_path / "resumed"
    options = mini_options(
        mini_profile, out, data_dir=tmp_path / "shards", resume=str(mini_run), max_steps=8, rewarm_steps=4, log_interval=1, eval_at_start=False
    )
    assert train(options) == 0
    resumed = load_file(str(latest_checkpoint(out) / "model.safetensors"))
    assert latest_checkpoint(out).name.endswith("_step_8")
    assert torch.equal(resumed["d2t"], first["d2t"]) and torch.equal(resumed["t2d"], first["t2d"])
    records = [r for r in read_records(out) if r["split"] == "train"]
    assert [r["step"] for r in records] == [7, 8]  # continued from step 6
    base = LRSchedule(3e-3, "cosine", 2, 8, 0.1)
    assert records[0]["lr"] == pytest.approx(base.lr_at(6) / 4) and records[1]["lr"] == pytest.approx(base.lr_at(7) / 2)


def test_grok_style_resume_runs_past_the_plan_with_its_own_lr_and_weight_decay(mini_run, mini_profile, mini_env, tmp_path):
    out = tmp_path / "grok"
    options = mini_options(mini_profile, out, resume=str(mini_run), schedule="constant", lr=1e-3, weight_decay=0.1, eval_at_start=False, log_interval=3)
    assert train(options) == 0  # no --max-steps, checkpoint at the profile's 6: another 6 steps
    latest = latest_checkpoint(out)
    assert latest.name.endswith("_step_12")
    state = torch.load(latest / "training_state.pt", weights_only=False)
    assert [g["weight_decay"] for g in state["optimizer"]["param_groups"]] == [0.1]
    records = [r for r in read_records(out) if r["split"] == "train"]
    assert [r["step"] for r in records] == [9, 12] and records[-1]["lr"] == pytest.approx(1e-3)


def test_one_layer_features_are_refused_at_load_naming_both_widths(mini_profile, mini_env, tmp_path, capsys):
    single_layer = load_target(mini_profile, aux_layer_ids=[2])
    splits = tiny_samples(single_layer, MINI_DATA)
    extract(single_layer, splits, tmp_path / "shards")
    with pytest.raises(FeatureWidthError, match=r"32 wide \(one layer's hidden state.*expects 96"):
        Trainer(mini_options(mini_profile, tmp_path / "run", data_dir=tmp_path / "shards")).run()
    assert not list((tmp_path / "run").glob("checkpoints/*"))
    profile_file = tmp_path / "mini.toml"
    profile_file.write_text(toml_of(mini_profile_dict(Path(mini_profile.target.path))))
    code = cli_main(["train", "--profile", str(profile_file), "--data", str(tmp_path / "shards"), "--out", str(tmp_path / "cli")])
    err = capsys.readouterr().err
    assert code == 2 and "error:" in err and "32" in err and "96" in err


def test_offline_shards_train_like_the_online_target(mini_profile, mini_env, tmp_path):
    target = load_target(mini_profile)
    extract(target, tiny_samples(target, MINI_DATA), tmp_path / "shards")  # equal lengths: extraction keeps the order
    common = dict(max_steps=3, log_interval=1, eval_at_start=False)
    assert train(mini_options(mini_profile, tmp_path / "offline", data_dir=tmp_path / "shards", **common)) == 0
    assert train(mini_options(mini_profile, tmp_path / "online", **common)) == 0
    offline = [r for r in read_records(tmp_path / "offline") if r["split"] == "train"]
    online = [r for r in read_records(tmp_path / "online") if r["split"] == "train"]
    assert [r["loss"] for r in offline] == pytest.approx([r["loss"] for r in online], rel=1e-4)
    state = torch.load(latest_checkpoint(tmp_path / "offline") / "training_state.pt", weights_only=False)
    assert (state["sampler"]["epoch"], state["sampler"]["cursor"]) == (0, 3)  # the batch read ahead is not skipped on resume


# --- the real tiny run (slow; shared with the serving tests through conftest) ------------------------------

TINY_KEYS = {  # reference sglang-eagle3.md 2.3 at the tiny shape: H = Ht = 128, 4 x 32 heads, I 512, V 259, Vd 192
    "fc.weight": [128, 384],
    "midlayer.self_attn.q_proj.weight": [128, 256],
    "midlayer.self_attn.k_proj.weight": [128, 256],
    "midlayer.self_attn.v_proj.weight": [128, 256],
    "midlayer.self_attn.o_proj.weight": [128, 128],
    "midlayer.mlp.gate_proj.weight": [512, 128],
    "midlayer.mlp.up_proj.weight": [512, 128],
    "midlayer.mlp.down_proj.weight": [128, 512],
    "midlayer.input_layernorm.weight": [128],
    "midlayer.hidden_norm.weight": [128],
    "midlayer.post_attention_layernorm.weight": [128],
    "norm.weight": [128],
    "lm_head.weight": [192, 128],
    "d2t": [192],
    "t2d": [259],
}


@pytest.mark.slow
def test_tiny_training_lowers_the_loss_and_learns_far_above_chance(trained_tiny_run):
    records = read_records(trained_tiny_run)
    train_records = [r for r in records if r["split"] == "train"]
    val_records = [r for r in records if r["split"] == "val"]
    assert train_records[-1]["step"] == 300
    early = sum(r["loss"] for r in train_records[:3]) / 3
    late = sum(r["loss"] for r in train_records[-3:]) / 3
    assert late < 0.5 * early, (early, late)
    assert val_records[0]["step"] == 0 and val_records[-1]["step"] == 300
    assert val_records[-1]["acc"][0] > 0.4  # chance is 1/192; the feasibility run reached 0.82
    assert val_records[-1]["acc"][0] > val_records[0]["acc"][0] + 0.3
    assert val_records[-1]["loss"] < val_records[0]["loss"]


@pytest.mark.slow
def test_tiny_checkpoint_has_exactly_the_sglang_keys_and_loads_back_bit_exact(trained_tiny_run, tiny_profile, tiny_target):
    latest = latest_checkpoint(trained_tiny_run)
    stored = load_file(str(latest / "model.safetensors"))
    assert {k: list(v.shape) for k, v in stored.items()} == TINY_KEYS
    assert stored["d2t"].dtype == torch.int64 and stored["t2d"].dtype == torch.bool
    draft, config, meta, state = load_checkpoint(latest, target_embedding=tiny_target.embed_weight())
    for name, tensor in draft.state_dict().items():
        if name != "embed_tokens.weight":
            assert torch.equal(tensor, stored[name]), name
    # The reloaded weights reproduce the validation accuracy the run recorded at its last step.
    settings = tiny_data_settings(tiny_profile.train.seq_len, seed=tiny_profile.train.seed)
    source = OnlineSource(tiny_target, tiny_samples(tiny_target, settings))
    hits, counts = [0.0] * 7, [0.0] * 7
    draft.eval()
    with torch.no_grad():
        for start in range(0, source.size("val"), tiny_profile.train.batch_size):
            batch = source.batch("val", list(range(start, min(start + tiny_profile.train.batch_size, source.size("val")))), "cpu")
            result = ttt_loss(draft.ttt_forward(batch.aux_hidden, batch.input_ids, 7), make_teacher(batch.target_logits, batch.loss_mask, draft.t2d))
            for k in range(7):
                hits[k] += float(result.accs[k]) * float(result.counts[k])
                counts[k] += float(result.counts[k])
    assert [h / c for h, c in zip(hits, counts)] == pytest.approx(meta["val_acc"], abs=1e-6)


def wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slow
def test_sigterm_mid_run_writes_a_complete_checkpoint_and_exits_zero(tiny_target_dir, tiny_profile, tiny_target, tmp_path):
    tiny_samples(tiny_target, tiny_data_settings(tiny_profile.train.seq_len, seed=tiny_profile.train.seed))  # data cached first
    out = tmp_path / "run"
    argv = [
        sys.executable,
        "-m",
        "backend",
        "train",
        "--profile",
        "tiny",
        "--out",
        str(out),
        "--max-steps",
        "100000",
        "--log-interval",
        "1",
        "--eval-interval",
        "100000",
        "--save-interval",
        "100000",
    ]
    process = subprocess.Popen(argv, cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: (out / "metrics.jsonl").is_file() and sum(1 for r in read_records(out) if r["split"] == "train") >= 2, 600, "two training steps")
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, err[-3000:]
    assert "received SIGTERM" in err
    latest = latest_checkpoint(out)
    step = int(latest.name.rsplit("_", 1)[1])
    last_logged = max(r["step"] for r in read_records(out) if r["split"] == "train")
    assert step == last_logged  # the step in flight was finished, logged, and saved
    draft, config, meta, state = load_checkpoint(latest)
    assert state["step"] == step and meta["step"] == step
    assert not list((out / "checkpoints").glob(".tmp-*"))


# A step that runs a child process (as Inductor runs ptxas) and, at step 4, waits on one that a stop's group signal kills.
CHILD_IN_STEP = """
import pathlib, subprocess, sys
from backend.train import trainer
step, marker = trainer.Trainer.train_step, pathlib.Path(sys.argv.pop(1))
def train_step(self, index):
    if index == 3:
        marker.touch()
        subprocess.run(["sleep", "120"], check=True)
    return step(self, index)
trainer.Trainer.train_step = train_step
from backend.cli import main
sys.exit(main())
"""


@pytest.mark.slow
def test_a_stop_that_kills_a_child_of_the_step_still_checkpoints_the_last_whole_step(tiny_target_dir, tiny_profile, tiny_target, tmp_path):
    """The safe stop SIGTERMs the job's process group: a child the step waits on dies too and the step raises (a ptxas
    of an Inductor compile did on the H200). The run ends as stopped, with steps 1-3 saved and the data cursor of step 3."""
    tiny_samples(tiny_target, tiny_data_settings(tiny_profile.train.seq_len, seed=tiny_profile.train.seed))  # data cached first
    out, marker = tmp_path / "run", tmp_path / "in-step-4"
    argv = [sys.executable, "-c", CHILD_IN_STEP, str(marker), "train", "--profile", "tiny", "--out", str(out), "--max-steps", "100"]
    argv += ["--log-interval", "1", "--eval-interval", "100000", "--save-interval", "100000"]
    process = subprocess.Popen(argv, cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_for(lambda: marker.exists() or process.poll() is not None, 600, "step 4's child process")
        time.sleep(0.5)
        os.killpg(process.pid, signal.SIGTERM)  # as backend/jobs/stop.py signals a job it started
        _, err = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, err[-3000:]
    assert "train_step after step 3 failed after SIGTERM (CalledProcessError:" in err
    assert "stopped by SIGTERM after step 3; checkpoint written" in err and "Traceback" not in err
    latest = latest_checkpoint(out)
    assert latest.name.endswith("_step_3")
    state = load_checkpoint(latest)[3]
    assert state["step"] == 3 and state["sampler"]["cursor"] == 3  # step 4's batch is trained again on resume
    assert not list((out / "checkpoints").glob(".tmp-*"))


@pytest.mark.slow
def test_two_process_torchrun_on_cpu_trains_and_writes_one_checkpoint(tiny_target_dir, tiny_profile, tiny_target, tmp_path):
    tiny_samples(tiny_target, tiny_data_settings(tiny_profile.train.seq_len, seed=tiny_profile.train.seed))
    out = tmp_path / "ddp"
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "backend",
        "train",
        "--profile",
        "tiny",
        "--out",
        str(out),
        "--max-steps",
        "4",
        "--log-interval",
        "2",
        "--eval-interval",
        "100000",
        "--save-interval",
        "100000",
        "--max-val-batches",
        "1",
    ]
    result = subprocess.run(argv, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    assert [p.name for p in list_checkpoints(out)] == ["epoch_0_step_4"]
    records = read_records(out)
    train_records = [r for r in records if r["split"] == "train"]
    assert [r["step"] for r in train_records] == [2, 4]  # rank 0 alone writes metrics
    assert train_records[-1]["tokens"] == 4 * 2 * tiny_profile.train.batch_size * tiny_profile.train.seq_len
    assert json.loads((out / "run.json").read_text())["world_size"] == 2
    draft, config, meta, state = load_checkpoint(latest_checkpoint(out))
    assert state["world_size"] == 2 and state["step"] == 4


def test_export_copies_the_serving_files_after_checking_keys(mini_run, tmp_path, capsys):
    import shutil

    from safetensors.torch import save_file

    assert cli_main(["export", str(mini_run), str(tmp_path / "serve")]) == 0
    assert sorted(p.name for p in (tmp_path / "serve").iterdir()) == ["config.json", "model.safetensors"]
    latest = latest_checkpoint(mini_run)
    assert (tmp_path / "serve" / "model.safetensors").read_bytes() == (latest / "model.safetensors").read_bytes()
    assert cli_main(["export", str(mini_run / "checkpoints" / "latest"), str(tmp_path / "by-pointer")]) == 0  # the pointer file names it too
    assert (tmp_path / "by-pointer" / "model.safetensors").read_bytes() == (latest / "model.safetensors").read_bytes()
    assert cli_main(["export", str(mini_run), str(tmp_path / "serve")]) == 2  # not empty: refused
    assert "not an empty directory" in capsys.readouterr().err
    broken = tmp_path / "broken"
    shutil.copytree(latest, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    tensors["layers.0.mlp.up_proj.weight"] = tensors.pop("midlayer.mlp.up_proj.weight")
    save_file(tensors, str(broken / "model.safetensors"))
    assert cli_main(["export", str(broken), str(tmp_path / "never")]) == 2
    err = capsys.readouterr().err
    assert "missing keys: midlayer.mlp.up_proj.weight" in err and "unexpected keys: layers.0.mlp.up_proj.weight" in err
    assert not (tmp_path / "never").exists()


def test_benchmark_smoke_on_cpu_and_the_anchor_flop_count(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_trainer
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    flops = bench_trainer.analytic_flops(4096, 14336, 32, 8, 128, 128256, 32000, 2048, 7)
    assert flops["train_step_total"] / 1e12 == pytest.approx(36.21, abs=0.005)  # the anchor's count at the 8B draft shape
    out = tmp_path / "bench.json"
    assert bench_trainer.main(["--small", "--device", "cpu", "--warmup", "1", "--steps", "2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert len(result["losses_first_50"]) == 50 and result["finite"]
    assert result["losses_first_50"][-1] < result["losses_first_50"][0]
    assert result["timed_steps"] == 2 and result["tokens_per_s"] > 0 and 0 < result["mfu"]
    assert set(result["ratios"]) == set(bench_trainer.SPECFORGE_ANCHOR)


def test_a_hugging_face_target_trains_online_on_regenerated_chat_conversations(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from backend.profiles import parse_profile
    from tests.fixtures.chat import chat_tokenizer
    from tests.fixtures.chat import write_jsonl

    tokenizer = chat_tokenizer()
    tokenizer.eos_token = "<|end|>"
    target_dir = tmp_path / "target"
    tokenizer.save_pretrained(target_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(target_dir)
    raw = mini_profile_dict(target_dir, max_steps=2, batch_size=2, log_interval=1)
    raw["target"]["vocab_size"] = len(tokenizer)
    raw["draft"]["draft_vocab_size"] = 8
    profile = parse_profile(raw, "hf-mini")
    words = ["hello there", "how are you ?", "fine thanks", "bye !"]
    records = [{"conversations": [{"role": "user", "content": words[i % 4]}, {"role": "assistant", "content": words[(i + 1) % 4]}]} for i in range(12)]
    conversations = write_jsonl(tmp_path / "chat.jsonl", records)
    out = tmp_path / "run"
    assert train(TrainOptions(profile=profile, out_dir=out, conversations=conversations, regenerate_tokens=3)) == 0
    assert latest_checkpoint(out).name.endswith("_step_2")
    meta = json.loads((latest_checkpoint(out) / "config.json").read_text())["eagle3_console"]
    assert meta["target"]["resolved_path"] == str(target_dir) and len(meta["val_acc"]) == 7


# --- the optimised step against a plain reference step ------------------------------------------------------


def small_bench_trainer(**options):
    """The CPU benchmark shape (H 128, V 1024, Vd 256, seq 128, TTT 7): a Trainer attached to the synthetic offline source."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_trainer
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    from backend.train.draft import DraftModelConfig, Eagle3Draft
    from backend.train.trainer import DistContext

    profile = bench_trainer.profile_for(type("Args", (), {"small": True, "shape": "llama"})())
    source = bench_trainer.SyntheticOffline(profile, torch.device("cpu"), 0, 1, torch.float32)
    torch.manual_seed(0)
    draft = Eagle3Draft(DraftModelConfig.from_profile(profile), attn_backend="sdpa")
    draft.load_target_embedding(source.embed_weight())
    draft.set_vocab_mapping(*source.vocab_mapping())
    trainer = Trainer(TrainOptions(profile=profile, max_steps=1000, **options))
    trainer.attach(DistContext(), source, draft)
    return trainer, source


def test_optimised_step_gives_the_plain_steps_loss_and_gradients():
    """trainer._forward (ttt_hidden + fused chunked lm_head/soft-CE, all rows weighted, no sync) against ttt_forward +
    ttt_loss with autograd over every step's logits: same loss (rel 1e-5) and same gradient of every weight (rel 1e-4 of its max)."""
    trainer, source = small_bench_trainer()
    batch = source.batch("train", [0], "cpu")
    draft = trainer.draft
    reference = ttt_loss(draft.ttt_forward(batch.aux_hidden, batch.input_ids, 7), make_teacher(batch.target_logits, batch.loss_mask, draft.t2d))
    reference.total.backward()
    ref_grads = {n: p.grad.clone() for n, p in draft.named_parameters() if p.requires_grad}
    draft.zero_grad(set_to_none=True)
    fused = trainer._forward(source.batch("train", [0], "cpu"), trainer.model)
    fused.total.backward()
    assert float(fused.total) == pytest.approx(float(reference.total), rel=1e-5)
    assert [float(p) for p in fused.plosses] == pytest.approx([float(p) for p in reference.plosses], rel=1e-5)
    for name, param in draft.named_parameters():
        if param.requires_grad:
            scale = ref_grads[name].abs().max()
            assert (param.grad - ref_grads[name]).abs().max() <= 1e-4 * scale, name


def test_padding_a_batch_to_its_bucket_changes_neither_loss_nor_gradients():
    """Bucketed batches are right-padded (loss_mask 0, so causal attention never lets a real position see a pad): the
    loss and every gradient equal the unpadded batch's; tokens counts only the real positions."""
    from backend.train.data import TrainBatch, bucket_length

    trainer, source = small_bench_trainer()
    draft = trainer.draft
    results = []
    for pad in (0, bucket_length(129) - 128):
        batch = source.batch("train", [0], "cpu")

        def padded(tensor, pad=pad):
            return torch.cat([tensor, torch.zeros((tensor.shape[0], pad, *tensor.shape[2:]), dtype=tensor.dtype)], dim=1)

        batch = TrainBatch(padded(batch.input_ids), padded(batch.loss_mask), padded(batch.aux_hidden), padded(batch.target_logits), tokens=128)
        draft.zero_grad(set_to_none=True)
        result = trainer._forward(batch, trainer.model)
        result.total.backward()
        results.append((float(result.total), {n: p.grad.clone() for n, p in draft.named_parameters() if p.requires_grad}))
    (plain_loss, plain_grads), (padded_loss, padded_grads) = results
    assert padded_loss == pytest.approx(plain_loss, rel=1e-5)
    for name, grad in plain_grads.items():
        assert (padded_grads[name] - grad).abs().max() <= 1e-4 * grad.abs().max(), name


def test_master_weights_keep_fp32_checkpoints_and_the_fp32_loss_curve(tmp_path):
    """bf16 weights + fp32 masters (the CUDA layout, forced here on CPU): the checkpoint view holds the fp32 masters under
    the same keys, shapes and dtypes as an fp32 run, and the first 10 losses stay within 2 % of the fp32 run's."""
    losses = {}
    for mixed in (False, True):
        trainer, _source = small_bench_trainer(master_weights=mixed)
        losses[mixed] = [float(trainer.train_step(step)[0].total) for step in range(10)]
        if mixed:
            assert trainer.draft.fc.weight.dtype == torch.bfloat16 and trainer.draft.embed_tokens.weight.dtype == torch.bfloat16
            state = trainer.checkpoint_module().state_dict()
            masters = dict(trainer.master_named)
            assert all(state[name].dtype == torch.float32 for name in masters)
            # the bf16 weights are the masters rounded
            assert torch.equal(trainer.draft.fc.weight, masters["fc.weight"].to(torch.bfloat16))
        else:
            fp32_state = trainer.draft.state_dict()
    assert {k: (tuple(v.shape), v.dtype) for k, v in state.items() if k != "embed_tokens.weight"} == {
        k: (tuple(v.shape), v.dtype) for k, v in fp32_state.items() if k != "embed_tokens.weight"
    }
    assert losses[True] == pytest.approx(losses[False], rel=0.02)
    assert losses[True][-1] < losses[True][0]


def test_train_records_report_speed_mfu_and_peak_memory(mini_run):
    record = [r for r in read_records(mini_run) if r["split"] == "train"][-1]
    assert record["tokens_per_s"] > 0 and record["peak_mem_gib"] > 0
    assert record["mfu"] is None or 0 < record["mfu"] < 1.5


def test_a_shorter_ttt_length_trains_and_records_that_many_draft_steps(mini_profile, mini_env, tmp_path, capfd):
    """--ttt-length 2 (the profile's 7): every train and val record holds 2 positions, validation replays chains of 2
    steps only, the saved config records 2, and the log says the profile's 3 served steps are more than it trains."""
    from backend.cli import build_parser
    from backend.train.cli import train_options

    args = build_parser().parse_args(["train", "--profile", "tiny", "--ttt-length", "2"])
    assert train_options(args).resolved().ttt_length == 2 and train_options(build_parser().parse_args(["train", "--profile", "tiny"])).ttt_length is None
    out = tmp_path / "run"
    assert train(mini_options(mini_profile, out, max_steps=3, eval_interval=3, log_interval=1, ttt_length=2)) == 0
    records = read_records(out)
    assert {len(r["acc"]) for r in records} == {2} and all(len(r["ploss"]) == 2 for r in records if r["split"] == "train")
    assert all(set(r["accept_sim"]) == {"2"} for r in records if r["split"] == "val")
    config = json.loads((latest_checkpoint(out) / "config.json").read_text())
    assert config["eagle3_console"]["ttt_length"] == 2
    err = capfd.readouterr().err
    assert "TTT 2" in err and "the profile serves 3 draft steps, more than the 2 this run trains" in err


def test_a_ttt_length_below_one_is_refused_before_anything_starts(tmp_path, capfd):
    assert cli_main(["train", "--profile", "tiny", "--ttt-length", "0", "--out", str(tmp_path / "never")]) == 2
    err = capfd.readouterr().err
    assert "error: --ttt-length 0: expected at least 1 draft step (nothing was started)" in err
    assert not (tmp_path / "never").exists()


@pytest.mark.slow  # trains a mini draft a few steps: the default suite trains nothing
def test_a_wider_draft_mlp_trains_exports_its_width_and_resumes_only_with_it(mini_profile, mini_env, tmp_path, capfd):
    """--draft-intermediate-size 96 (the profile's 64): the draft's MLP has that width, the checkpoint's config.json
    says so (what SGLang reads), the same width resumes, and a resume without it is refused naming both widths,
    the checkpoint left as it was."""
    from backend.cli import build_parser
    from backend.train.cli import train_options

    assert mini_profile.draft.intermediate_size != 96
    args = build_parser().parse_args(["train", "--profile", "tiny", "--draft-intermediate-size", "96"])
    assert train_options(args).draft_intermediate_size == 96
    out = tmp_path / "run"
    assert train(mini_options(mini_profile, out, max_steps=2, eval_interval=2, log_interval=1, draft_intermediate_size=96)) == 0
    saved = latest_checkpoint(out)
    assert json.loads((saved / "config.json").read_text())["intermediate_size"] == 96
    before = sorted((p.name, p.stat().st_size) for p in saved.iterdir())
    with pytest.raises(TrainSetupError, match=rf"intermediate_size: 96 vs this run {mini_profile.draft.intermediate_size}.*nothing was resumed"):
        train(mini_options(mini_profile, out, max_steps=3, resume="latest"))
    assert sorted((p.name, p.stat().st_size) for p in latest_checkpoint(out).iterdir()) == before
    assert train(mini_options(mini_profile, out, max_steps=3, resume="latest", log_interval=1, draft_intermediate_size=96)) == 0
    assert [r["step"] for r in read_records(out) if r["split"] == "train"][-1] == 3


@pytest.mark.slow  # trains a mini draft a step: the default suite trains nothing
def test_a_teacher_temperature_reaches_the_loss_and_the_run_records_it(mini_profile, mini_env, tmp_path, capfd):
    """--teacher-temperature 0.5 against the profile's 1, same seed and data: the first step's loss differs (the teacher
    is sharper), its accuracies do not (the argmax is the same), and the run's settings and log say which."""
    from backend.cli import build_parser
    from backend.train.cli import train_options

    assert mini_profile.train.teacher_temperature == 1.0
    args = build_parser().parse_args(["train", "--profile", "tiny", "--teacher-temperature", "0.5"])
    assert train_options(args).teacher_temperature == 0.5
    first = {}
    for temperature in (None, 0.5):
        out = tmp_path / f"run-{temperature}"
        options = mini_options(mini_profile, out, max_steps=1, eval_interval=10**6, log_interval=1, teacher_temperature=temperature)
        assert train(options) == 0
        first[temperature] = next(r for r in read_records(out) if r["split"] == "train")
        assert json.loads((out / "run.json").read_text())["settings"]["teacher_temperature"] == (temperature or 1.0)
    assert first[0.5]["acc"] == first[None]["acc"]
    assert first[0.5]["loss"] != pytest.approx(first[None]["loss"], rel=1e-3)
    err = capfd.readouterr().err
    assert err.count("teacher temperature 0.5") == 1


def test_a_teacher_temperature_not_above_zero_is_refused_before_anything_starts(tmp_path, capfd):
    assert cli_main(["train", "--profile", "tiny", "--teacher-temperature", "0", "--out", str(tmp_path / "never")]) == 2
    assert "error: --teacher-temperature 0: expected a positive temperature (nothing was started)" in capfd.readouterr().err
    assert not (tmp_path / "never").exists()


def test_a_draft_width_below_one_is_refused_before_anything_starts(tmp_path, capfd):
    assert cli_main(["train", "--profile", "tiny", "--draft-intermediate-size", "0", "--out", str(tmp_path / "never")]) == 2
    assert "error: --draft-intermediate-size 0: expected a positive width (nothing was started)" in capfd.readouterr().err
    assert not (tmp_path / "never").exists()
