"""GPU telemetry: every real H200 capture parses to the right numbers; the nvidia-smi stream is one process; no driver is a clean state."""

import stat
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.fixtures import gpu_parsers
from backend.host import gpu
from backend.host.holders import FuserOutputError, parse_fuser_pids
from tests.fixtures.env import needs_shared
from tests.fixtures.env import SHARED

FIXTURES = SHARED / "fixtures"
needs_fixtures = needs_shared("fixtures")  # real H200 captures

H200_UUID = "GPU-493f06b3-7f9b-2754-0c40-9463d7a56064"
X2_UUIDS = ["GPU-00305e01-35c7-4ba9-89b5-8caeba953379", "GPU-86dae54b-5286-7365-9e58-45a3db949f0e"]


def read(name: str) -> str:
    return (FIXTURES / name).read_text()


def parse_fixture(path: Path):
    """The parser each capture goes through; a new capture without one fails test_every_fixture_file_parses."""
    text = path.read_text()
    name = path.name
    if name == "query-gpu_after_kill.csv":
        return gpu.parse_query_gpu(text, ("index", "memory.used"))
    if name == "query-gpu_lms500_stream.csv":
        return gpu.parse_query_gpu(text, ("index", "memory.used", "utilization.gpu"))
    if name.startswith("query-gpu_"):
        return gpu.parse_query_gpu(text)
    if name.startswith("query-apps_"):
        return gpu.parse_query_apps(text)
    if name.endswith(".xml"):
        return gpu_parsers.parse_smi_xml(text)
    if name.startswith("nvidia-smi_"):
        return gpu_parsers.parse_smi_table(text)
    if name == "nvml_dump.txt":
        return gpu_parsers.parse_nvml_dump(text)
    if name == "topo.txt":
        return gpu_parsers.parse_topo(text)
    if name.startswith("fuser") and name.endswith("stdout.txt"):
        return parse_fuser_pids(text)
    if name.startswith("fuser") and name.endswith("stderr.txt"):
        # stderr is labels and noise: it is counted, never parsed, and cannot pass for a PID list.
        with pytest.raises(FuserOutputError):
            parse_fuser_pids(text)
        return text.splitlines()
    raise AssertionError(f"no parser for fixture {path}")


@needs_fixtures
@pytest.mark.parametrize("host", ["h200", "h200x2"])
def test_every_fixture_file_parses(host):
    files = sorted((FIXTURES / host).iterdir())
    assert files, f"no captures in {FIXTURES / host}"
    for path in files:
        parsed = parse_fixture(path)
        assert parsed, f"{path.name} parsed to nothing"


@needs_fixtures
def test_query_gpu_busy_and_idle_h200():
    (busy,) = gpu.parse_query_gpu(read("h200/query-gpu_busy.csv"))
    assert (busy.index, busy.name, busy.uuid) == (0, "NVIDIA H200", H200_UUID)
    assert (busy.memory_used_mib, busy.memory_total_mib) == (21455, 143771)
    assert (busy.utilization_pct, busy.temperature_c, busy.power_w) == (96, 58, 695.52)
    (idle,) = gpu.parse_query_gpu(read("h200/query-gpu_idle.csv"))
    assert (idle.memory_used_mib, idle.utilization_pct, idle.temperature_c, idle.power_w) == (0, 0, 38, 81.22)


@needs_fixtures
def test_after_kill_line_with_units():
    (sample,) = gpu.parse_query_gpu(read("h200/query-gpu_after_kill.csv"), ("index", "memory.used"))
    assert (sample.index, sample.memory_used_mib) == (0, 0.0)
    # The same text with the default eight columns is refused, not silently misread.
    with pytest.raises(gpu.GpuParseError, match="expected 8 columns"):
        gpu.parse_query_gpu(read("h200/query-gpu_after_kill.csv"))


@needs_fixtures
def test_garbled_terminal_line_is_refused():
    """fuser's PIDs glued to the next command's output: '865010, 0 MiB' must not become GPU 865010."""
    with pytest.raises(gpu.GpuParseError):
        gpu.parse_query_gpu("86501 86501 865010, 0 MiB", ("index", "memory.used"))


@needs_fixtures
def test_compute_apps_attach_to_gpus_by_uuid():
    (app,) = gpu.parse_query_apps(read("h200/query-apps_busy.csv"))
    assert (app.pid, app.process_name, app.used_memory_mib, app.gpu_uuid) == (448, "python3", 21446, H200_UUID)
    samples = gpu.attach_apps(gpu.parse_query_gpu(read("h200x2/query-gpu_busy.csv")), gpu.parse_query_apps(read("h200x2/query-apps_busy.csv")))
    assert [s.uuid for s in samples] == X2_UUIDS
    assert [[(p.pid, p.used_memory_mib) for p in s.processes] for s in samples] == [[(565, 10758)], [(566, 15878)]]
    assert [s.memory_used_mib for s in samples] == [10767, 15887]


@needs_fixtures
def test_lms_stream_collapses_to_latest_per_gpu():
    lines = gpu.parse_query_gpu(read("h200x2/query-gpu_lms500_stream.csv"), ("index", "memory.used", "utilization.gpu"))
    assert len(lines) == 12 and [s.index for s in lines[:4]] == [0, 1, 0, 1]
    latest = gpu_parsers.latest_by_index(lines)
    assert [(s.index, s.memory_used_mib, s.utilization_pct) for s in latest] == [(0, 10767, 0), (1, 15887, 0)]


@needs_fixtures
def test_smi_table_busy_and_idle():
    busy = gpu_parsers.parse_smi_table(read("h200/nvidia-smi_busy.txt"))
    assert (busy.driver, busy.cuda) == ("580.159.04", "13.0")
    (sample,) = busy.gpus
    assert (sample.memory_used_mib, sample.memory_total_mib, sample.utilization_pct) == (21455, 143771, 96)
    assert (sample.temperature_c, sample.power_w) == (58, 692)
    assert [(p.pid, p.used_memory_mib) for p in sample.processes] == [(448, 21446)]
    idle = gpu_parsers.parse_smi_table(read("h200/nvidia-smi_idle.txt"))
    assert idle.gpus[0].memory_used_mib == 0 and idle.gpus[0].processes == []
    two = gpu_parsers.parse_smi_table(read("h200x2/nvidia-smi_busy.txt"))
    assert [[p.pid for p in s.processes] for s in two.gpus] == [[565], [566]]
    assert [s.memory_used_mib for s in two.gpus] == [10767, 15887]


@needs_fixtures
def test_smi_xml():
    report = gpu_parsers.parse_smi_xml(read("h200/nvidia-smi_q_x_busy.xml"))
    assert (report.driver, report.cuda) == ("580.159.04", "13.0")
    (sample,) = report.gpus
    assert (sample.uuid, sample.name) == (H200_UUID, "NVIDIA H200")
    assert (sample.memory_used_mib, sample.memory_total_mib, sample.utilization_pct, sample.temperature_c) == (21455, 143771, 95, 58)
    assert sample.power_w == 695.76  # power.draw is the average reading on this driver
    assert [(p.pid, p.used_memory_mib) for p in sample.processes] == [(448, 21446)]


@needs_fixtures
def test_nvml_dump_matches_nvidia_smi():
    dump = gpu_parsers.parse_nvml_dump(read("h200/nvml_dump.txt"))
    assert (dump.driver, dump.count) == ("580.159.04", 1)
    (sample,) = dump.gpus
    assert [(p.pid, p.used_memory_mib) for p in sample.processes] == [(448, 21446.0)]  # bytes -> exactly nvidia-smi's MiB
    # NVML's v1 'used' includes the 616 MiB the driver reserves (nvidia-smi: 21455 used + 616 reserved).
    assert abs(sample.memory_used_mib - (21455 + 616)) < 2
    assert (sample.utilization_pct, sample.temperature_c, sample.power_w) == (95, 59, 698.029)
    assert dump.timings_ms["nvml_poll_ms"] < 1 < dump.timings_ms["nvidia_smi_poll_ms"]
    two = gpu_parsers.parse_nvml_dump(read("h200x2/nvml_dump.txt"))
    assert [[(p.pid, round(p.used_memory_mib)) for p in s.processes] for s in two.gpus] == [[(565, 10758)], [(566, 15878)]]


@needs_fixtures
def test_topology():
    matrix = gpu_parsers.parse_topo(read("h200x2/topo.txt"))
    assert matrix["GPU0"]["GPU1"] == "NV18" and matrix["GPU1"]["GPU0"] == "NV18"
    assert matrix["GPU0"]["CPU Affinity"] == "0-31"


def test_number_parsing():
    assert gpu.parse_number("[N/A]") is None and gpu.parse_number("[Not Supported]") is None
    assert gpu.parse_number("695.52 W") == 695.52 and gpu.parse_number("96 %") == 96
    with pytest.raises(gpu.GpuParseError):
        gpu.parse_number("lots")
    assert gpu.parse_driver_proc("NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.159.04  Tue Oct 21 2025\n") == "580.159.04"


def test_no_driver_is_a_clean_state():
    source = gpu.open_gpu_source(stream=True)
    if source.name != "none":
        source.close()
        pytest.skip(f"this machine has GPU telemetry ({source.name}); the no-driver state cannot be shown here")
    state = gpu.driver_state(source)
    assert source.sample() == []
    assert state["available"] is False and state["source"] == "none"
    assert "no NVIDIA driver" in state["message"]
    _, status = gpu.probe_nvml()
    assert status.startswith("no NVIDIA driver") or status.startswith("NVML error")


FAKE_SMI = """\
#!{python}
# Replays real H200 captures as nvidia-smi would print them (this machine has no GPU), logging each call.
import sys, time
with open({log!r}, "a") as log:
    log.write(" ".join(sys.argv[1:]) + "\\n")
args = sys.argv[1:]
if any(a.startswith("--query-compute-apps") for a in args):
    sys.stdout.write(open({apps!r}).read())
    sys.exit(0)
if "--query-gpu=driver_version" in args:
    print("580.159.04")
    sys.exit(0)
lines = open({gpus!r}).read().splitlines()
if "-lms" in args:
    period = int(args[args.index("-lms") + 1]) / 1000
    while True:
        for line in lines:
            print(line, flush=True)
        time.sleep(period)
print("\\n".join(lines))
"""


@needs_fixtures
def test_stream_source_is_one_long_lived_process(tmp_path):
    log = tmp_path / "calls.log"
    smi = tmp_path / "nvidia-smi"
    smi.write_text(
        FAKE_SMI.format(
            python=sys.executable, log=str(log), apps=str(FIXTURES / "h200x2/query-apps_busy.csv"), gpus=str(FIXTURES / "h200x2/query-gpu_busy.csv")
        )
    )
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    source = gpu.SmiStreamSource(str(smi), "test", interval_s=0.1, apps_every_s=3600)
    try:
        assert source.wait_for_line(after=5, timeout=20), f"no stream lines: {source.message}"
        for _ in range(5):
            samples = source.sample()
            time.sleep(0.05)
        assert [(s.index, s.memory_used_mib, s.uuid) for s in samples] == [(0, 10767, X2_UUIDS[0]), (1, 15887, X2_UUIDS[1])]
        assert [[p.pid for p in s.processes] for s in samples] == [[565], [566]]
        calls = log.read_text().splitlines()
        assert len([c for c in calls if "-lms 100" in c]) == 1, calls  # never one spawn per tick
        assert len([c for c in calls if "query-compute-apps" in c]) == 1, calls  # apps at a much lower rate
        assert source.bad_lines == 0
        if not gpu.DRIVER_PROC_FILE.exists():
            assert source.driver == "580.159.04"
        stream_pid = source._proc.pid
    finally:
        source.close()
    assert source._proc.poll() is not None, f"nvidia-smi stream {stream_pid} still runs after close()"


def test_stream_source_restarts_a_dead_stream(tmp_path):
    smi = tmp_path / "nvidia-smi"
    smi.write_text(
        textwrap.dedent(f"""\
        #!{sys.executable}
        import sys
        if any(a.startswith("--query-compute-apps") for a in sys.argv):
            sys.exit(0)
        print("0, NVIDIA H200, GPU-x, 1, 2, 3, 4, 5.5", flush=True)
        sys.stderr.write("stream ended\\n")
        """)
    )
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    source = gpu.SmiStreamSource(str(smi), "test", interval_s=0.1, restart_every_s=0.0)
    try:
        assert source.wait_for_line(after=0, timeout=20)
        source._proc.wait(timeout=20)
        source.sample()
        assert source.restarts == 1
        assert source.wait_for_line(after=1, timeout=20)
        assert source.sample()[0].power_w == 5.5
    finally:
        source.close()
