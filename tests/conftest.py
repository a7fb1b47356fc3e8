"""Shared fixtures: the cached tiny target, its profile, a short-trained tiny draft run, and a seconds-to-build mini target.

CPU is scarce: the tiny target is built once into the user cache ($EAGLE3_CACHE_DIR, else ~/.cache/eagle3-console),
and the trained tiny run is cached there too, keyed by a hash of the training code, so it is retrained only when
that code changes (EAGLE3_TEST_RETRAIN=1 forces a fresh run). Subprocesses run with EAGLE3_TEST_THREADS torch
threads (default 1: on a shared 2-core box two OpenMP threads fighting another process run several times slower).
A test that requests one of the tiny-build fixtures without @pytest.mark.slow fails at setup, before anything is built.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

import pytest

from tests.fixtures.env import MINI_SETTINGS, TRAINED_TINY_STEPS, trained_run_key, mini_profile_dict, train_tiny

# Triton's language module is defined for the interpreter or for a GPU when triton is first imported (any import:
# torch's inductor probes for it), so the whole suite sets it here: these machines have no GPU.
os.environ.setdefault("TRITON_INTERPRET", "1")

# Session fixtures that build the tiny target (and train a draft on it): tens of CPU minutes, so slow tests only.
TINY_BUILD_FIXTURES = ("trained_tiny_run", "tiny_target_dir", "tiny_target")
# Everything that decides what `train --profile tiny` produces.


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Fail, before any fixture runs, a test that reaches the tiny build without the slow mark (the fast suite never trains)."""
    heavy = sorted(set(getattr(item, "fixturenames", ())) & set(TINY_BUILD_FIXTURES))
    if heavy and item.get_closest_marker("slow") is None:
        pytest.fail(
            f"{item.nodeid} requests {', '.join(heavy)} (building the tiny target, and training a draft on it, takes "
            'minutes): mark the test @pytest.mark.slow so that `-m "not slow"` never runs it',
            pytrace=False,
        )


@pytest.fixture
def limited_torch_threads():
    """torch on EAGLE3_TEST_THREADS threads (default 1) for one test: tiny models run faster on one thread, and far
    faster when the CPU is shared; a module opts in with pytestmark = pytest.mark.usefixtures("limited_torch_threads")."""
    import torch

    from tests.fixtures.env import threads_for_tests

    before = torch.get_num_threads()
    torch.set_num_threads(int(threads_for_tests()))
    yield
    torch.set_num_threads(before)


@pytest.fixture
def triton_interpreter():
    """Triton's kernels in its interpreter on the CPU (TRITON_INTERPRET=1, set for the whole suite above)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.fail("TRITON_INTERPRET is not 1: the Triton tests need the interpreter (no GPU here)")
    pytest.importorskip("triton", reason="triton is in the dev dependencies: scripts/setup installs it")


@pytest.fixture(scope="session")
def tiny_profile():
    from backend.profiles import load_profile

    return load_profile("tiny")


@pytest.fixture(scope="session")
def tiny_target_dir() -> Path:
    """The cached tiny target (built on first use: ~3 min on 2 free cores)."""
    from backend.train.tiny import ensure_tiny_target

    return ensure_tiny_target()


@pytest.fixture(scope="session")
def tiny_target(tiny_profile, tiny_target_dir):
    from backend.train.target import load_target

    return load_target(tiny_profile)


@pytest.fixture(scope="session")
def trained_tiny_run(tiny_profile, tiny_target_dir, tmp_path_factory) -> Path:
    """A run dir (metrics.jsonl, run.json, checkpoints/latest) of `train --profile tiny --max-steps 300` on CPU.

    Each session gets its own copy; the cached original is never handed out.
    """
    from backend.train.tiny import cache_root

    cached = cache_root() / "test-runs" / f"trained-tiny-{trained_run_key(tiny_profile.source)}"
    if os.environ.get("EAGLE3_TEST_RETRAIN") == "1" and cached.exists():
        shutil.rmtree(cached)
    cached.parent.mkdir(parents=True, exist_ok=True)
    with open(cached.parent / f".{cached.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent sessions wait for one training run instead of each doing it
        if not (cached / "checkpoints" / "latest").is_file():
            staging = cached.parent / f".{cached.name}.{os.getpid()}"
            shutil.rmtree(staging, ignore_errors=True)
            result = train_tiny(staging, "--max-steps", str(TRAINED_TINY_STEPS))
            latest = staging / "checkpoints" / "latest"
            finished = latest.is_file() and latest.read_text().strip().endswith(f"_step_{TRAINED_TINY_STEPS}")
            if result.returncode != 0 or not finished:  # exit 0 after a SIGTERM is a stopped run, not a cacheable one
                shutil.rmtree(staging, ignore_errors=True)
                raise AssertionError(f"tiny training did not finish {TRAINED_TINY_STEPS} steps (exit {result.returncode}):\n{result.stderr[-4000:]}")
            shutil.rmtree(cached, ignore_errors=True)
            os.rename(staging, cached)
    copy = tmp_path_factory.mktemp("trained-tiny") / "run"
    shutil.copytree(cached, copy)
    return copy


# --- the mini target: same recipe as tiny, small enough to build in seconds for fast tests -------------


@pytest.fixture(scope="session")
def mini_cache(tmp_path_factory) -> Path:
    """A private cache dir for mini targets and their generated data."""
    return tmp_path_factory.mktemp("mini-cache")


@pytest.fixture(scope="session")
def mini_target_dir(mini_cache) -> Path:
    from backend.train.tiny import TinySettings, build_tiny_target, tiny_corpus

    settings = TinySettings(**MINI_SETTINGS)
    return build_tiny_target(mini_cache / "mini-target", settings, tiny_corpus(settings), log=lambda _m: None)


@pytest.fixture(scope="session")
def mini_profile(mini_target_dir):
    from backend.profiles import parse_profile

    return parse_profile(mini_profile_dict(mini_target_dir), "mini (tests/conftest.py)")


@pytest.fixture(scope="session")
def mini_servers(tmp_path_factory, mini_target_dir, mini_profile):
    """{"spec", "plain": ServerProcess, "profile", "draft"}: one speculative and one plain reference server per test process.

    Shared by every module (tests/fixtures/reference.py): each test there reads its own requests' results and none
    changes the servers, and starting a pair costs ~10 CPU-s.
    """
    from tests.fixtures.reference import run_mini_servers

    yield from run_mini_servers(tmp_path_factory.mktemp("mini-reference"), mini_target_dir, mini_profile)


@pytest.fixture(scope="session")
def spec_url(mini_servers) -> str:
    """The speculative mini reference server's base URL."""
    return mini_servers["spec"].url


@pytest.fixture(scope="session")
def plain_url(mini_servers) -> str:
    """The plain (no speculation) mini reference server's base URL."""
    return mini_servers["plain"].url


@pytest.fixture
def mini_env(mini_cache, monkeypatch):
    """Generated mini data lands in the session's mini cache, not the user's."""
    monkeypatch.setenv("EAGLE3_CACHE_DIR", str(mini_cache))
    monkeypatch.delenv("EAGLE3_JOB_DIR", raising=False)
    return mini_cache


@pytest.fixture
def utc(monkeypatch):
    """Local time is UTC for the test (snapshots print clock times)."""
    import time

    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


@pytest.fixture
def isolated_home(tmp_path, monkeypatch):
    """asyncssh reads ~/.ssh/config, ~/.ssh/known_hosts and id_* keys under $HOME, and the ssh agent: point all away."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    return home
