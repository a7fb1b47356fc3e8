"""GPU holders: PIDs come only from fuser's stdout (no trailing newline), never mixed with stderr; owned vs foreign."""

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from backend.host import holders
from backend.host.gpu import attach_apps, parse_query_apps, parse_query_gpu
from backend.jobs.registry import JobRegistry
from tests.fixtures.env import needs_shared
from tests.fixtures.env import SHARED

FIXTURES = SHARED / "fixtures"
needs_fixtures = needs_shared("fixtures")  # real H200 captures
needs_fuser = pytest.mark.skipif(shutil.which("fuser") is None, reason="fuser (psmisc) is not installed; .ci/run installs it")


@needs_fixtures
def test_fuser_stdout_without_newline():
    raw = (FIXTURES / "h200/fuser_stdout.txt").read_bytes()
    assert not raw.endswith(b"\n"), "the capture is the real stream: PIDs with no trailing newline"
    assert holders.parse_fuser_pids(raw.decode()) == [448, 448, 448]
    assert holders.parse_fuser_pids((FIXTURES / "h200/fuser_v_stdout.txt").read_text()) == [448, 448, 448]
    assert holders.parse_fuser_pids((FIXTURES / "h200x2/fuser_stdout.txt").read_text()) == [565, 566] * 4


@needs_fixtures
def test_stdout_glued_to_following_text_is_never_parsed():
    stdout = (FIXTURES / "h200/fuser_stdout.txt").read_text()
    after_kill = (FIXTURES / "h200/query-gpu_after_kill.csv").read_text()
    glued = stdout + after_kill  # what a terminal showed: '   448   448   4480, 0 MiB'
    assert "4480," in glued
    with pytest.raises(holders.FuserOutputError, match="not a PID"):
        holders.parse_fuser_pids(glued)
    with pytest.raises(holders.FuserOutputError):
        holders.parse_fuser_pids("86501 86501 865010, 0 MiB")
    for name in ("h200/fuser_stderr.txt", "h200/fuser_v_stderr.txt", "h200x2/fuser_stderr.txt"):
        with pytest.raises(holders.FuserOutputError):
            holders.parse_fuser_pids((FIXTURES / name).read_text())


def write_fake_fuser(path: Path, stdout: bytes, stderr: bytes, code: int) -> Path:
    """Replays a real fuser capture byte for byte on the two streams (the H200's device files are not here)."""
    path.write_text(
        f"#!{sys.executable}\nimport sys\n"
        f"sys.stdout.buffer.write({stdout!r}); sys.stdout.flush()\n"
        f"sys.stderr.buffer.write({stderr!r}); sys.stderr.flush()\n"
        f"sys.exit({code})\n"
    )
    path.chmod(0o755)
    return path


@needs_fixtures
def test_run_fuser_reads_pids_from_stdout_only(tmp_path):
    noise = b"".join(b"Cannot stat file /proc/1/fd/%d: Permission denied\n" % n for n in range(257))
    stderr = (FIXTURES / "h200x2/fuser_stderr.txt").read_bytes() + noise
    fake = write_fake_fuser(tmp_path / "fuser", (FIXTURES / "h200x2/fuser_stdout.txt").read_bytes(), stderr, 0)
    device = tmp_path / "nvidia0"
    device.touch()
    result = holders.run_fuser([str(device)], str(fake))
    assert result.state == "held"
    assert result.printed_pids == [565, 566] * 4 and result.pids == [565, 566]
    assert result.stderr_lines == 4 + 257  # counted, not parsed: the digits in '/proc/1/fd/N' never become PIDs

    nobody = holders.run_fuser([str(device)], str(write_fake_fuser(tmp_path / "fuser-empty", b"", noise, 1)))
    assert (nobody.state, nobody.pids) == ("nobody", [])

    missing = holders.run_fuser([str(device)], str(tmp_path / "no-such-fuser"))
    assert missing.state == "missing" and "psmisc" in missing.message
    assert holders.run_fuser([], "fuser").state == "no_devices"


@needs_fixtures
def test_collect_holders_merges_sources_and_marks_owners():
    samples = attach_apps(
        parse_query_gpu((FIXTURES / "h200x2/query-gpu_busy.csv").read_text()), parse_query_apps((FIXTURES / "h200x2/query-apps_busy.csv").read_text())
    )
    fuser = holders.FuserResult("held", printed_pids=holders.parse_fuser_pids((FIXTURES / "h200x2/fuser_stdout.txt").read_text()))
    found = holders.collect_holders(samples, "nvidia-smi", fuser, {565: "train-a"})
    assert [(h.pid, h.owned, h.job, h.gpu_indices, h.used_memory_mib) for h in found] == [
        (565, True, "train-a", [0], 10758),
        (566, False, None, [1], 15878),
    ]
    assert all(h.sources == ["nvidia-smi", "fuser"] for h in found)


def hold_file(path: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", f"import time; f = open({str(path)!r}); print('held', flush=True); time.sleep(120)"], stdout=subprocess.PIPE)


@needs_fuser
def test_real_fuser_finds_a_process_holding_a_file(tmp_path):
    device = tmp_path / "nvidia0"
    device.touch()
    holder = hold_file(device)
    try:
        assert holder.stdout.readline() == b"held\n"
        result = holders.run_fuser([str(device)])
        assert result.state == "held" and result.pids == [holder.pid]
        report = holders.list_holders(None, device_glob=str(tmp_path / "nvidia*"))
        (entry,) = report.holders
        assert (entry.pid, entry.owned, entry.sources) == (holder.pid, False, ["fuser"])
        assert "time.sleep(120)" in entry.cmdline and entry.user
    finally:
        holder.kill()
        holder.wait()
    assert holders.run_fuser([str(device)]).state == "nobody"


@needs_fuser
def test_real_fuser_marks_job_processes_owned(tmp_path):
    device = tmp_path / "nvidia0"
    device.touch()
    registry = JobRegistry(tmp_path / "run")
    child = f"import time; f = open({str(device)!r}); time.sleep(120)"
    script = f"import subprocess, sys, time; f = open({str(device)!r}); subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(120)"
    job = registry.start_job("holder", "other", [sys.executable, "-c", script])
    foreign = hold_file(device)
    try:
        assert foreign.stdout.readline() == b"held\n"
        deadline = time.monotonic() + 20
        while len(holders.run_fuser([str(device)]).pids) < 3:
            assert time.monotonic() < deadline, Path(job.stderr_path).read_text()
            time.sleep(0.05)
        report = holders.list_holders(None, owner_lookup=registry.owned_pids, device_glob=str(tmp_path / "nvidia*"))
        owned = {h.pid: h.job for h in report.holders if h.owned}
        assert job.pid in owned and len(owned) == 2 and set(owned.values()) == {"holder"}  # the job and its child
        assert [h.pid for h in report.foreign] == [foreign.pid]
    finally:
        foreign.kill()
        foreign.wait()
        registry.stop(["holder"], grace=5)
