"""Checkpoints and metrics are private: 0700 dirs and 0600 files whatever the umask, a reused output dir tightened,
another user's checkpoints dir or a symbolic link refused, metrics appends never through a link."""

import json
import os
import stat
from pathlib import Path

import pytest

from backend.jsonl import AppendError, append_record
from backend.train.checkpoint import CheckpointError, save_checkpoint
from backend.train.data import TinyDataSettings
from backend.train.trainer import TrainOptions, TrainSetupError, train
from tests.fixtures.drafts import tiny_draft

MINI_DATA = TinyDataSettings(prompt_len=12, total_len=32, train_samples=8, val_samples=4)
FOREIGN_UID = 65534  # nobody


@pytest.fixture
def open_umask():
    """The umask most shells have (0022): the modes below must come from the code, not from the umask."""
    before = os.umask(0o022)
    yield
    os.umask(before)


pytestmark = pytest.mark.usefixtures("limited_torch_threads")


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def tree_modes(root: Path) -> dict[str, int]:
    """Every entry under root (root included) with its permission bits."""
    modes = {".": mode(root)}
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(directory) / name
            modes[str(path.relative_to(root))] = mode(path)
    return modes


def assert_private(root: Path) -> None:
    for name, bits in tree_modes(root).items():
        path = root / name
        wanted = 0o700 if path.is_dir() else 0o600
        assert bits == wanted, f"{path}: {oct(bits)}, wanted {oct(wanted)}"


def become_foreign(path: Path, monkeypatch) -> None:
    """Another user owns `path`: really (chown) when the test runs as root, else as this process sees it."""
    if os.geteuid() == 0:
        os.chown(path, FOREIGN_UID, FOREIGN_UID)
    else:
        real = os.geteuid()
        monkeypatch.setattr(os, "geteuid", lambda: real + 1)


def test_every_saved_checkpoint_dir_is_0700_and_every_file_0600(tmp_path, open_umask):
    tmp_path.chmod(0o755)  # the run dir itself is open: nothing below may rely on it
    draft, config = tiny_draft()
    state = {"optimizer": {"lr": 3e-3}, "step": 1}
    first = save_checkpoint(tmp_path, draft, config, epoch=0, step=1, training_state=state)
    save_checkpoint(tmp_path, draft, config, epoch=0, step=2, training_state=state)
    save_checkpoint(tmp_path, draft, config, epoch=0, step=2, training_state=state)  # the same step again: the swap path
    checkpoints = tmp_path / "checkpoints"
    assert sorted(tree_modes(checkpoints)) == sorted(
        [".", "latest"] + [f"epoch_0_step_{s}{f}" for s in (1, 2) for f in ("", "/config.json", "/model.safetensors", "/training_state.pt")]
    )
    assert_private(checkpoints)
    assert mode(first) == 0o700 and mode(first / "model.safetensors") == 0o600


def mini_options(profile, out: Path, **overrides) -> TrainOptions:
    return TrainOptions(profile=profile, out_dir=out, tiny_data=MINI_DATA, max_steps=1, eval_interval=1, save_interval=1, log_interval=1, **overrides)


def test_the_trainer_tightens_a_reused_checkpoints_dir_and_metrics_file(mini_profile, mini_env, tmp_path, open_umask):
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True, mode=0o755)
    (out / "metrics.jsonl").write_text("")
    (out / "checkpoints").chmod(0o755)
    (out / "metrics.jsonl").chmod(0o644)
    (out / "run.json").write_text("{}")
    (out / "run.json").chmod(0o644)
    assert train(mini_options(mini_profile, out)) == 0
    assert mode(out / "metrics.jsonl") == 0o600 and (out / "metrics.jsonl").read_text().count("\n") >= 2
    assert mode(out / "run.json") == 0o600 and json.loads((out / "run.json").read_text())["profile"] == "mini"
    assert (out / "checkpoints" / "latest").is_file()
    assert_private(out / "checkpoints")


@pytest.mark.parametrize("foreign", ["checkpoints", "metrics.jsonl"])
def test_the_trainer_refuses_another_users_checkpoints_dir_or_metrics_file(mini_profile, mini_env, tmp_path, monkeypatch, foreign):
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / "metrics.jsonl").write_text("")
    (out / "checkpoints").chmod(0o755)
    (out / "metrics.jsonl").chmod(0o644)
    become_foreign(out / foreign, monkeypatch)
    with pytest.raises(TrainSetupError, match=rf"{foreign} belongs to uid \d+, not to this user .*refused, nothing was changed; nothing was trained"):
        train(mini_options(mini_profile, out))
    assert mode(out / foreign) == (0o755 if foreign == "checkpoints" else 0o644)
    assert not list((out / "checkpoints").iterdir()) and (out / "metrics.jsonl").read_text() == ""


def test_a_checkpoints_dir_that_is_a_link_is_refused_and_nothing_is_written(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o755)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoints").symlink_to(elsewhere, target_is_directory=True)
    draft, config = tiny_draft()
    with pytest.raises(CheckpointError, match="checkpoints is a symbolic link"):
        save_checkpoint(tmp_path / "run", draft, config, epoch=0, step=1, training_state={})
    assert not list(elsewhere.iterdir()) and mode(elsewhere) == 0o755


def test_a_metrics_append_never_follows_a_link(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (tmp_path / "metrics.jsonl").symlink_to(victim)
    with pytest.raises(AppendError, match="cannot open"):
        append_record(tmp_path / "metrics.jsonl", {"step": 1})
    assert victim.read_text() == "precious\n"
