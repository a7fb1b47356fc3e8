"""SGLang-format checkpoints: exact key set and shapes, bit-exact round trip, strict load, atomic save under SIGKILL,
disk full (refused up front and mid-save) with `latest` intact, weights_only resume, the re-save window closed."""

import errno
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from backend.train.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from backend.layout import latest_checkpoint, list_checkpoints
from backend.train.draft import DraftModelConfig, Eagle3Draft
from tests.fixtures.drafts import SYMLINK_KINDS, symlinked_destination, tiny_draft, tree_listing
from tests.fixtures.env import ROOT


# Reference sglang-eagle3.md section 2.3 for the tiny profile: H = Ht = 128, 4 heads x 32, I 512, V 259, Vd 192.
TINY_KEYS = {
    "fc.weight": ([128, 384], torch.float32),
    "midlayer.self_attn.q_proj.weight": ([128, 256], torch.float32),
    "midlayer.self_attn.k_proj.weight": ([128, 256], torch.float32),
    "midlayer.self_attn.v_proj.weight": ([128, 256], torch.float32),
    "midlayer.self_attn.o_proj.weight": ([128, 128], torch.float32),
    "midlayer.mlp.gate_proj.weight": ([512, 128], torch.float32),
    "midlayer.mlp.up_proj.weight": ([512, 128], torch.float32),
    "midlayer.mlp.down_proj.weight": ([128, 512], torch.float32),
    "midlayer.input_layernorm.weight": ([128], torch.float32),
    "midlayer.hidden_norm.weight": ([128], torch.float32),
    "midlayer.post_attention_layernorm.weight": ([128], torch.float32),
    "norm.weight": ([128], torch.float32),
    "lm_head.weight": ([192, 128], torch.float32),
    "d2t": ([192], torch.int64),
    "t2d": ([259], torch.bool),
}


def test_checkpoint_has_exactly_the_sglang_key_set_shapes_and_config(tmp_path):
    draft, config = tiny_draft()
    state = {"optimizer": {"lr": 3e-3}, "global_step": 100}
    path = save_checkpoint(tmp_path, draft, config, epoch=0, step=100, training_state=state, extra_meta={"val_acc": [0.8, 0.79, 0.78], "val_acc_step": 100})
    assert path == tmp_path / "checkpoints" / "epoch_0_step_100"
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors", "training_state.pt"]
    with safe_open(str(path / "model.safetensors"), framework="pt") as handle:
        got = {key: (list(handle.get_slice(key).get_shape()), handle.get_tensor(key).dtype) for key in handle.keys()}
    assert got == TINY_KEYS
    hf = json.loads((path / "config.json").read_text())
    assert hf["architectures"] == ["LlamaForCausalLMEagle3"] and hf["model_type"] == "llama"
    assert hf["num_hidden_layers"] == 1 and hf["tie_word_embeddings"] is False
    assert hf["draft_vocab_size"] == 192 and hf["target_hidden_size"] == 128 and hf["vocab_size"] == 259
    assert hf["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 3, 4], "use_aux_hidden_state": True}
    block = hf["eagle3_console"]
    assert block["trained_aux_width"] == 384 and block["trained_aux_layer_ids"] == [1, 3, 4] and block["ttt_length"] == 7
    assert block["val_acc"] == [0.8, 0.79, 0.78] and block["val_acc_step"] == 100 and block["step"] == 100
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "epoch_0_step_100"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_bit_exact(tmp_path, dtype):
    draft, config = tiny_draft(seed=3)
    draft.to(dtype)
    embedding = draft.embed_tokens.weight.detach().clone()
    state = {"optimizer": {"exp_avg": torch.randn(7, 3)}, "global_step": 5, "rng": torch.get_rng_state()}
    path = save_checkpoint(tmp_path, draft, config, epoch=1, step=5, training_state=state, extra_meta={"note": "x"})
    loaded, loaded_config, meta, loaded_state = load_checkpoint(path, target_embedding=embedding)
    assert loaded_config == config
    original, restored = draft.state_dict(), loaded.state_dict()
    assert set(original) == set(restored)
    for name, tensor in original.items():
        assert restored[name].dtype == tensor.dtype and torch.equal(restored[name], tensor), name
    assert torch.equal(loaded_state["optimizer"]["exp_avg"], state["optimizer"]["exp_avg"])
    assert loaded_state["global_step"] == 5 and torch.equal(loaded_state["rng"], state["rng"])
    assert meta["epoch"] == 1 and meta["step"] == 5 and meta["note"] == "x"
    assert not loaded.embed_tokens.weight.requires_grad


def test_load_refuses_missing_unexpected_and_misshapen_keys(tmp_path):
    draft, config = tiny_draft()
    path = save_checkpoint(tmp_path, draft, config, epoch=0, step=1, training_state={})
    tensors = load_file(str(path / "model.safetensors"))
    tensors["layers.0.hidden_norm.weight"] = tensors.pop("midlayer.hidden_norm.weight")
    tensors["lm_head.weight"] = tensors["lm_head.weight"][:100].contiguous()
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    message = str(info.value)
    assert "missing keys: midlayer.hidden_norm.weight" in message
    assert "unexpected keys: layers.0.hidden_norm.weight" in message
    assert "lm_head.weight: shape [100, 128], config says [192, 128]" in message
    with pytest.raises(CheckpointError, match="lacks config.json, model.safetensors.*latest_checkpoint"):
        load_checkpoint(tmp_path)


def test_latest_and_listing_order_skip_temp_dirs_and_fall_back(tmp_path):
    draft, config = tiny_draft()
    for epoch, step in [(0, 900), (0, 1000), (1, 50)]:
        save_checkpoint(tmp_path, draft, config, epoch=epoch, step=step, training_state={"step": step})
    checkpoints = tmp_path / "checkpoints"
    assert [p.name for p in list_checkpoints(tmp_path)] == ["epoch_0_step_900", "epoch_0_step_1000", "epoch_1_step_50"]
    assert latest_checkpoint(tmp_path) == checkpoints / "epoch_1_step_50"
    assert latest_checkpoint(checkpoints) == checkpoints / "epoch_1_step_50"
    assert latest_checkpoint(checkpoints / "latest") == checkpoints / "epoch_1_step_50"  # the pointer file, as a shell completes it
    # a save killed half-way leaves a temp dir owned by a dead pid: readers ignore it, the next save removes it
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout.strip()
    stale = checkpoints / f".tmp-epoch_2_step_0-{dead}-abcd1234"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"partial")
    assert latest_checkpoint(tmp_path) == checkpoints / "epoch_1_step_50"
    save_checkpoint(tmp_path, draft, config, epoch=1, step=60, training_state={})
    assert not stale.exists()
    # a pointer naming a missing dir falls back to the newest complete checkpoint
    (checkpoints / "latest").write_text("epoch_9_step_9\n")
    assert latest_checkpoint(tmp_path) == checkpoints / "epoch_1_step_60"
    assert latest_checkpoint(tmp_path / "nowhere") is None


def test_saving_the_same_step_again_replaces_it(tmp_path):
    first, config = tiny_draft(seed=1)
    second, _ = tiny_draft(seed=2)
    save_checkpoint(tmp_path, first, config, epoch=0, step=10, training_state={"which": 1})
    path = save_checkpoint(tmp_path, second, config, epoch=0, step=10, training_state={"which": 2})
    loaded, _, _, state = load_checkpoint(path)
    assert state == {"which": 2} and torch.equal(loaded.fc.weight, second.fc.weight)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["epoch_0_step_10", "latest"]


def test_save_refuses_a_draft_that_does_not_match_the_config(tmp_path):
    draft, config = tiny_draft()
    other = DraftModelConfig(**{**config.as_dict(), "draft_vocab_size": 100})
    with pytest.raises(CheckpointError, match="lm_head.weight: shape \\[192, 128\\], config says \\[100, 128\\].*nothing was saved"):
        save_checkpoint(tmp_path, draft, other, epoch=0, step=1, training_state={})
    assert list((tmp_path / "checkpoints").iterdir()) == []


SAVER = textwrap.dedent(
    """
    import sys, torch
    from backend.train.checkpoint import latest_checkpoint, save_checkpoint
    from backend.train.draft import DraftModelConfig, Eagle3Draft

    out, first_step = sys.argv[1], int(sys.argv[2])
    config = DraftModelConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=4, head_dim=64,
        intermediate_size=1024, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=512, vocab_size=300,
        draft_vocab_size=200, target_hidden_size=256, aux_layer_ids=[1, 2, 3], torch_dtype="float32")
    step = first_step
    while True:
        torch.manual_seed(step)
        draft = Eagle3Draft(config)
        state = {"step": step, "blob": torch.full((6_000_000,), float(step))}  # ~24 MB: a save takes a while
        save_checkpoint(out, draft, config, epoch=0, step=step, training_state=state)
        print(step, flush=True)
        step += 1
    """
)


def expected_draft(step):
    config = DraftModelConfig(
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=64,
        intermediate_size=1024,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=512,
        vocab_size=300,
        draft_vocab_size=200,
        target_hidden_size=256,
        aux_layer_ids=[1, 2, 3],
        torch_dtype="float32",
    )
    torch.manual_seed(step)
    return Eagle3Draft(config)


@pytest.mark.slow
def test_sigkill_during_saves_never_leaves_latest_pointing_at_an_incomplete_checkpoint(tmp_path):
    script = tmp_path / "saver.py"
    script.write_text(SAVER)
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    rng = random.Random(1234)
    next_step, saw_partial, kills = 0, 0, 0
    # at least 5 kills, and more (up to 20) until one lands inside a save: on a loaded machine 5 random ones can all miss
    while kills < 5 or (not saw_partial and kills < 20):
        kills += 1
        proc = subprocess.Popen(
            [sys.executable, str(script), str(out), str(next_step)], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        try:
            assert proc.stdout.readline(), proc.stderr.read()  # at least one save finished in this run
            time.sleep(rng.uniform(0.0, 0.6))
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        checkpoints = out / "checkpoints"
        saw_partial += any(p.name.startswith(".tmp-") for p in checkpoints.iterdir())
        named = [p for p in checkpoints.iterdir() if p.name.startswith("epoch_")]
        assert named and all(sorted(f.name for f in p.iterdir()) == ["config.json", "model.safetensors", "training_state.pt"] for p in named)
        latest = latest_checkpoint(out)
        assert latest is not None and (checkpoints / "latest").read_text().strip() == latest.name
        draft, _, meta, state = load_checkpoint(latest)
        step = meta["step"]
        assert state["step"] == step and torch.equal(state["blob"], torch.full((6_000_000,), float(step)))
        reference = expected_draft(step).state_dict()
        for name, tensor in draft.state_dict().items():
            if name != "embed_tokens.weight":
                assert torch.equal(tensor, reference[name]), (step, name)
        next_step = step + 1
    assert saw_partial >= 1, "no kill landed during a save; the test did not exercise the atomic path"
    save_checkpoint(out, expected_draft(10_000), expected_config(), epoch=0, step=10_000, training_state={})
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".tmp-")]


def expected_config():
    return expected_draft(0).config


# --- full disk, weights_only resume, the re-save window --------------------------------------------------


def adam_state(draft):
    """What the trainer saves: a real AdamW state after one step, both RNG states, a Path, numpy numbers."""
    import numpy

    optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-3, betas=(0.9, 0.95))
    for param in draft.parameters():
        if param.requires_grad:
            param.grad = torch.ones_like(param)
    optimizer.step()
    return {
        "step": 7,
        "epoch": 0.5,
        "optimizer": optimizer.state_dict(),
        "sampler": {"epoch": 0, "cursor": 3},
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        "latest_val": {"acc": [0.5, 0.25]},
        "settings": {"out": Path("/x/run"), "lr": numpy.float64(1e-3), "dtype": torch.float32},
        "grokfast": None,
    }


def test_resume_state_loads_with_weights_only(tmp_path):
    draft, config = tiny_draft()
    state = adam_state(draft)
    path = save_checkpoint(tmp_path, draft, config, epoch=0, step=7, training_state=state)
    raw = torch.load(path / "training_state.pt", weights_only=True)  # what resume does: no arbitrary unpickling
    _, _, _, loaded = load_checkpoint(path)
    assert loaded.keys() == raw.keys() == state.keys()
    assert loaded["settings"] == {"out": "/x/run", "lr": 1e-3, "dtype": "torch.float32"} and type(loaded["settings"]["lr"]) is float
    random.setstate(loaded["rng"]["python"])  # tuples stay tuples, as random.setstate needs
    assert torch.equal(loaded["rng"]["torch"], state["rng"]["torch"])
    resumed = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-3)
    resumed.load_state_dict(loaded["optimizer"])
    assert torch.equal(resumed.state_dict()["state"][0]["exp_avg"], state["optimizer"]["state"][0]["exp_avg"])


def test_save_refuses_state_that_weights_only_cannot_load_and_load_refuses_pickles(tmp_path):
    draft, config = tiny_draft()
    with pytest.raises(CheckpointError, match=r"training_state\['sampler'\]\['hook'\] is a builtins.builtin_function_or_method.*Nothing was saved"):
        save_checkpoint(tmp_path, draft, config, epoch=0, step=1, training_state={"sampler": {"hook": print}})
    assert not [p for p in (tmp_path / "checkpoints").iterdir()]
    path = save_checkpoint(tmp_path, draft, config, epoch=0, step=2, training_state={})
    torch.save({"step": 2, "when": __import__("datetime").date(2024, 1, 1)}, path / "training_state.pt")  # an old-style pickle
    with pytest.raises(CheckpointError, match=r"training_state.pt holds objects other than tensors.*not unpickled, nothing was loaded"):
        load_checkpoint(path)


def test_estimate_covers_what_a_save_writes(tmp_path):
    from backend.train.checkpoint import draft_tensors, estimate_checkpoint_bytes, plain_state

    draft, config = tiny_draft()
    state = adam_state(draft)
    path = save_checkpoint(tmp_path, draft, config, epoch=0, step=1, training_state=state)
    used = sum(f.stat().st_blocks * 512 for f in path.iterdir())
    estimate = estimate_checkpoint_bytes(draft_tensors(draft), plain_state(state), (path / "config.json").stat().st_size)
    assert used <= estimate <= used * 1.05 + 64 * 1024


def assert_latest_intact(run, name, state_step):
    checkpoints = run / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == name
    assert not [p.name for p in checkpoints.iterdir() if p.name.startswith(".tmp-")]
    _, _, meta, state = load_checkpoint(checkpoints / name)
    assert meta["step"] == state["step"] == state_step


def test_disk_full_is_refused_before_writing_and_latest_stays(tmp_path):
    from tests.fixtures.disks import mounted_tmpfs

    from backend.train.checkpoint import CheckpointDiskFullError

    draft, config = tiny_draft()  # ~1.5 MB of tensors: one fits in 2 MiB, two do not
    with mounted_tmpfs(tmp_path, "2m") as disk:
        run = disk / "run"
        save_checkpoint(run, draft, config, epoch=0, step=1, training_state={"step": 1})
        with pytest.raises(CheckpointDiskFullError) as full:
            save_checkpoint(run, draft, config, epoch=0, step=2, training_state={"step": 2})
        error = full.value
        assert error.errno == errno.ENOSPC and error.needed > error.free
        assert str(error).startswith(f"disk full: {error.needed} bytes needed, {error.free} free in {run / 'checkpoints'}")
        assert "epoch_0_step_2 was not saved (nothing was written)" in str(error) and "`latest` still names epoch_0_step_1" in str(error)
        assert_latest_intact(run, "epoch_0_step_1", 1)
        assert not (run / "checkpoints" / "epoch_0_step_2").exists()


@pytest.mark.parametrize("room", ["weights", "state"])
def test_disk_full_mid_save_removes_the_partial_dir_and_latest_stays(tmp_path, room):
    """The disk fills between the space check and the write (another job's data, say): safetensors says
    'os error 28', torch.save only 'unexpected pos'; both come out as disk full, naming the sizes."""
    from tests.fixtures.disks import fill_up, mounted_tmpfs

    from backend.train.checkpoint import CheckpointDiskFullError

    small, config = tiny_draft()
    with mounted_tmpfs(tmp_path, "6m") as disk:
        run = disk / "run"
        save_checkpoint(run, small, config, epoch=0, step=1, training_state={"step": 1})
        filler = fill_up(disk)
        # leave room for config.json and (in the "state" case) the weights, not for the rest
        leave = 64 * 1024 + (1_600_000 if room == "state" else 0)
        os.truncate(filler, max(0, filler.stat().st_size - leave))
        blob = {"step": 2, "blob": torch.zeros(300_000)}
        with pytest.raises(CheckpointDiskFullError) as full:
            save_checkpoint(run, small, config, epoch=0, step=2, training_state=blob, check_space=False)
        message = str(full.value)
        assert message.startswith(f"disk full: {full.value.needed} bytes needed, {full.value.free} free")
        assert "the partial checkpoint was removed" in message and "`latest` still names epoch_0_step_1" in message
        cause = repr(full.value.__cause__)
        assert ("os error 28" in cause) if room == "weights" else ("RuntimeError" in cause)
        assert_latest_intact(run, "epoch_0_step_1", 1)
        filler.unlink()
        save_checkpoint(run, small, config, epoch=0, step=2, training_state=blob)
        assert_latest_intact(run, "epoch_0_step_2", 2)


def test_resaving_the_same_step_never_leaves_latest_naming_a_missing_dir(tmp_path):
    """A reader polls `latest` while another process re-saves that same step. strace delays every rename
    by 0.2 s (fault injection on the real syscalls), which widens a window of microseconds into one the
    reader cannot miss: moving the old dir aside before renaming the new one in fails this test."""
    import shutil

    if shutil.which("strace") is None or subprocess.run(["strace", "-qq", "-o", "/dev/null", "true"]).returncode != 0:
        pytest.skip("needs strace (with ptrace permitted) to stretch the rename window: apt-get install strace")
    script = tmp_path / "resaver.py"
    script.write_text(
        textwrap.dedent("""
        import sys, torch
        sys.path.insert(0, sys.argv[2])
        from tests.fixtures.drafts import tiny_draft
        from backend.train.checkpoint import save_checkpoint
        torch.set_num_threads(1)
        draft, config = tiny_draft()
        for n in range(int(sys.argv[3])):
            save_checkpoint(sys.argv[1], draft, config, epoch=0, step=5, training_state={"n": n})
    """)
    )
    run = tmp_path / "run"
    draft, config = tiny_draft()
    save_checkpoint(run, draft, config, epoch=0, step=5, training_state={"n": -1})
    renames = "rename,renameat,renameat2"
    proc = subprocess.Popen(
        [
            "strace",
            "-f",
            "--seccomp-bpf",
            "-qq",
            "-o",
            "/dev/null",
            "-e",
            f"trace={renames}",
            "-e",
            f"inject={renames}:delay_exit=200000",
            sys.executable,
            str(script),
            str(run),
            str(ROOT),
            "3",
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
        stderr=subprocess.PIPE,
        text=True,
    )
    checkpoints, polls, missing = run / "checkpoints", 0, 0
    while proc.poll() is None:
        name = (checkpoints / "latest").read_text().strip()
        missing += not (checkpoints / name / "model.safetensors").is_file()
        polls += 1
        time.sleep(0.0005)  # leave the saver a core on a small machine
    assert proc.returncode == 0, proc.stderr.read()
    assert polls > 100 and missing == 0
    assert sorted(p.name for p in checkpoints.iterdir()) == ["epoch_0_step_5", "latest"]
    assert load_checkpoint(checkpoints / "epoch_0_step_5")[3] == {"n": 2}


@pytest.mark.slow
def test_kill_checkpoint_benchmark_ci_size():
    """benchmarks/kill_checkpoint.py --trials 10: SIGKILLed saves (mid-save too) on disk and on a 2 MiB tmpfs that fills up."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "kill_checkpoint.py"), "--trials", "10", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
    )
    result = json.loads(done.stdout)
    assert done.returncode == 0, (result["problems"], done.stderr[-2000:])
    assert result["unreadable_latest"] == 0 and result["lost_metrics_records"] == 0 and result["saver_errors"] == 0
    assert result["trials"] == 10 and result["checkpoints_saved"] > 0 and result["kills_mid_save"] > 0


# --- writes never follow a symbolic link -------------------------------------------------------------


@pytest.mark.parametrize("kind", SYMLINK_KINDS)
def test_export_onto_a_symlink_exits_2_with_one_line_and_writes_nothing(tmp_path, kind, capsys):
    from backend.cli import main as cli_main

    draft, config = tiny_draft()
    checkpoint = save_checkpoint(tmp_path / "run", draft, config, epoch=0, step=1, training_state=None)
    destination = symlinked_destination(tmp_path, kind)
    before = tree_listing(tmp_path)
    assert cli_main(["export", str(checkpoint), str(destination)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a symbolic link" in err[0] and "nothing was exported" in err[0], err
    assert tree_listing(tmp_path) == before  # no staging dir, nothing behind the link, the dangling target absent


def test_export_cli_onto_a_dangling_symlink_prints_one_line(tmp_path):
    draft, config = tiny_draft()
    checkpoint = save_checkpoint(tmp_path / "run", draft, config, epoch=0, step=1, training_state=None)
    destination = symlinked_destination(tmp_path, "dangling link")
    result = subprocess.run(
        [sys.executable, "-m", "backend.cli", "export", str(checkpoint), str(destination)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"error: {destination} is a symbolic link;") and line.endswith("nothing was exported"), line
    assert not (tmp_path / "nowhere").exists()


def test_durable_writes_never_follow_a_symlink(tmp_path):
    from backend.train.checkpoint import write_bytes_durably

    target = tmp_path / "precious"
    target.write_text("keep me")
    (tmp_path / "trap").symlink_to(target)
    with pytest.raises(FileExistsError):
        write_bytes_durably(tmp_path / "trap", b"overwritten")
    assert target.read_text() == "keep me"
