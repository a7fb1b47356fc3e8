"""GPU telemetry: NVML (lazy pynvml) or one long-lived `nvidia-smi -lms` stream, a clean no-driver state, and parsers for nvidia-smi's outputs."""
from __future__ import annotations

import re
import shutil
import subprocess
import threading
import time
import xml.etree.ElementTree as ET
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from backend.protocol import GpuProcess, GpuSample

MIB = 1024 * 1024
QUERY_GPU_FIELDS = ("index", "name", "uuid", "memory.used", "memory.total", "utilization.gpu", "temperature.gpu", "power.draw")
QUERY_APPS_FIELDS = ("pid", "process_name", "used_memory", "gpu_uuid")
_SAMPLE_ATTR = {
    "index": "index",
    "name": "name",
    "uuid": "uuid",
    "memory.used": "memory_used_mib",
    "memory.total": "memory_total_mib",
    "utilization.gpu": "utilization_pct",
    "temperature.gpu": "temperature_c",
    "power.draw": "power_w",
}
_MISSING = {"", "N/A", "[N/A]", "[Not Supported]", "Not Supported", "[Unknown Error]", "[Insufficient Permissions]"}
_UNIT = re.compile(r"^(-?[0-9.]+)\s*(MiB|%|W|C|MHz|KB/s)?$")
DRIVER_PROC_FILE = Path("/proc/driver/nvidia/version")


class GpuParseError(ValueError):
    """An nvidia-smi / NVML text that does not have the expected shape."""


# ---------------------------------------------------------------- value and CSV parsers


def parse_number(text: str) -> float | None:
    """'21455', '0 MiB', '96 %', '695.52 W', '58 C' -> float; N/A-like -> None."""
    text = text.strip()
    if text in _MISSING:
        return None
    match = _UNIT.match(text)
    if not match:
        raise GpuParseError(f"not a number with a known unit: {text!r}")
    return float(match.group(1))


def parse_query_gpu_line(line: str, fields: tuple[str, ...] = QUERY_GPU_FIELDS) -> GpuSample:
    """One line of `nvidia-smi --query-gpu=<fields> --format=csv,noheader[,nounits]`."""
    values = [part.strip() for part in line.split(",")]
    if len(values) != len(fields):
        raise GpuParseError(f"expected {len(fields)} columns ({', '.join(fields)}), got {len(values)}: {line!r}")
    sample = GpuSample(index=-1)
    for name, value in zip(fields, values):
        attr = _SAMPLE_ATTR.get(name)
        if attr is None:
            continue
        if attr == "index":
            if not value.isdigit():
                raise GpuParseError(f"GPU index is not an integer: {value!r} in {line!r}")
            sample.index = int(value)
        elif attr in ("name", "uuid"):
            setattr(sample, attr, value)
        else:
            setattr(sample, attr, parse_number(value))
    if sample.index < 0:
        raise GpuParseError(f"no index column in {fields}")
    return sample


def parse_query_gpu(text: str, fields: tuple[str, ...] = QUERY_GPU_FIELDS) -> list[GpuSample]:
    """Every non-empty line; a streaming (-lms) capture yields one sample per line, several per GPU."""
    return [parse_query_gpu_line(line, fields) for line in text.splitlines() if line.strip()]


def latest_by_index(samples: list[GpuSample]) -> list[GpuSample]:
    """Collapse a stream to the last sample of each GPU, ordered by index."""
    latest: dict[int, GpuSample] = {}
    for sample in samples:
        latest[sample.index] = sample
    return [latest[index] for index in sorted(latest)]


@dataclass
class ComputeApp:
    pid: int
    process_name: str
    used_memory_mib: float | None
    gpu_uuid: str


def parse_query_apps(text: str) -> list[ComputeApp]:
    """`nvidia-smi --query-compute-apps=pid,process_name,used_memory,gpu_uuid --format=csv,noheader[,nounits]`."""
    apps = []
    for line in text.splitlines():
        if not line.strip() or line.startswith("No running"):
            continue
        # process_name may contain commas: pid is first, memory and uuid are last.
        parts = [part.strip() for part in line.split(",")]
        if len(parts) < 4 or not parts[0].isdigit():
            raise GpuParseError(f"expected 'pid, process_name, used_memory, gpu_uuid': {line!r}")
        apps.append(ComputeApp(int(parts[0]), ", ".join(parts[1:-2]), parse_number(parts[-2]), parts[-1]))
    return apps


def attach_apps(samples: list[GpuSample], apps: list[ComputeApp]) -> list[GpuSample]:
    """Copies of samples whose processes come from the compute-apps query, matched by GPU uuid."""
    by_uuid: dict[str, list[GpuProcess]] = {}
    for app in apps:
        by_uuid.setdefault(app.gpu_uuid, []).append(GpuProcess(app.pid, app.used_memory_mib))
    return [replace(sample, processes=by_uuid.get(sample.uuid, [])) for sample in samples]


# ---------------------------------------------------------------- nvidia-smi table, XML, NVML dump, topology


@dataclass
class SmiReport:
    driver: str | None
    cuda: str | None
    gpus: list[GpuSample] = field(default_factory=list)


_TABLE_VERSIONS = re.compile(r"Driver Version:\s*(\S+)\s+CUDA Version:\s*(\S+)")
_TABLE_GPU = re.compile(r"^\|\s+(\d+)\s+(.+?)\s+(?:On|Off)\s+\|\s+[0-9A-Fa-f]+:[0-9A-Fa-f:.]+\s+\S+\s+\|")
_TABLE_STATS = re.compile(
    r"^\|\s*\S+\s+(?P<temp>\d+|N/A)C?\s+\S+\s+(?P<power>\d+|N/A)W?\s*/\s*(?:\d+|N/A)W?\s*\|"
    r"\s*(?P<used>\d+)MiB\s*/\s*(?P<total>\d+)MiB\s*\|\s*(?P<util>\d+|N/A)%?"
)
_TABLE_PROC = re.compile(r"^\|\s+(?P<gpu>\d+)\s+\S+\s+\S+\s+(?P<pid>\d+)\s+\S+\s+.+?\s+(?P<mem>\d+|N/A)(?:MiB)?\s*\|$")


def _num_or_none(text: str) -> float | None:
    return None if text == "N/A" else float(text)


def parse_smi_table(text: str) -> SmiReport:
    """Plain `nvidia-smi` output: per-GPU memory, utilization, temperature, power and the Processes table."""
    versions = _TABLE_VERSIONS.search(text)
    report = SmiReport(versions.group(1) if versions else None, versions.group(2) if versions else None)
    by_index: dict[int, GpuSample] = {}
    lines = text.splitlines()
    in_processes = False
    for number, line in enumerate(lines):
        if line.startswith("| Processes:"):
            in_processes = True
            continue
        if in_processes:
            proc = _TABLE_PROC.match(line)
            if proc and int(proc.group("gpu")) in by_index:
                by_index[int(proc.group("gpu"))].processes.append(GpuProcess(int(proc.group("pid")), _num_or_none(proc.group("mem"))))
            continue
        gpu = _TABLE_GPU.match(line)
        if not gpu:
            continue
        stats = _TABLE_STATS.match(lines[number + 1]) if number + 1 < len(lines) else None
        if not stats:
            raise GpuParseError(f"GPU {gpu.group(1)} line is not followed by a stats line: {lines[number + 1:number + 2]!r}")
        sample = GpuSample(
            index=int(gpu.group(1)),
            name=gpu.group(2).strip(),
            memory_used_mib=float(stats.group("used")),
            memory_total_mib=float(stats.group("total")),
            utilization_pct=_num_or_none(stats.group("util")),
            temperature_c=_num_or_none(stats.group("temp")),
            power_w=_num_or_none(stats.group("power")),
        )
        by_index[sample.index] = sample
        report.gpus.append(sample)
    if not report.gpus:
        raise GpuParseError("no GPU rows found in the nvidia-smi table")
    return report


def _xml_number(node: ET.Element | None, path: str) -> float | None:
    found = node.find(path) if node is not None else None
    return parse_number(found.text or "") if found is not None else None


def parse_smi_xml(text: str) -> SmiReport:
    """`nvidia-smi -q -x`: GPUs in document order (= nvidia-smi index) with their compute processes."""
    try:
        root = ET.fromstring(text)
    except ET.ParseError as exc:
        raise GpuParseError(f"nvidia-smi XML does not parse: {exc}") from None
    report = SmiReport(root.findtext("driver_version"), root.findtext("cuda_version"))
    for index, gpu in enumerate(root.findall("gpu")):
        power = gpu.find("gpu_power_readings")
        power_w = None
        for tag in ("power_draw", "average_power_draw", "instant_power_draw"):
            power_w = _xml_number(power, tag)
            if power_w is not None:
                break
        sample = GpuSample(
            index=index,
            name=gpu.findtext("product_name", ""),
            uuid=gpu.findtext("uuid", ""),
            memory_used_mib=_xml_number(gpu, "fb_memory_usage/used"),
            memory_total_mib=_xml_number(gpu, "fb_memory_usage/total"),
            utilization_pct=_xml_number(gpu, "utilization/gpu_util"),
            temperature_c=_xml_number(gpu, "temperature/gpu_temp"),
            power_w=power_w,
        )
        for info in gpu.findall("processes/process_info"):
            sample.processes.append(GpuProcess(int(info.findtext("pid", "0")), _xml_number(info, "used_memory")))
        report.gpus.append(sample)
    return report


@dataclass
class NvmlDump:
    """What a small pynvml script printed (fixtures' nvml_dump.txt): bytes converted to MiB."""

    driver: str | None = None
    nvml: str | None = None
    count: int | None = None
    gpus: list[GpuSample] = field(default_factory=list)
    timings_ms: dict[str, float] = field(default_factory=dict)


_DUMP_GPU = re.compile(r"^(\d+)\s+(.+?)\s+mem\s+(\d+)\s+(\d+)(.*)$")
_DUMP_PAIR = re.compile(r"\((\d+),\s*(\d+)\)")


def parse_nvml_dump(text: str) -> NvmlDump:
    dump = NvmlDump()
    current: GpuSample | None = None
    for line in text.splitlines():
        words = line.split()
        if not words:
            continue
        if words[0] == "driver":
            dump.driver = words[1]
            dump.nvml = words[3] if len(words) > 3 and words[2] == "nvml" else None
        elif words[0] == "count":
            dump.count = int(words[1])
        elif words[0] == "proc" and current is not None:
            current.processes.append(GpuProcess(int(words[1]), int(words[2]) / MIB))
        elif words[0].endswith("_ms"):
            dump.timings_ms[words[0]] = float(words[2] if words[1] == "median" else words[1])
        elif match := _DUMP_GPU.match(line):
            current = GpuSample(int(match.group(1)), match.group(2), memory_used_mib=int(match.group(3)) / MIB, memory_total_mib=int(match.group(4)) / MIB)
            _dump_extras(current, match.group(5))
            dump.gpus.append(current)
        else:
            raise GpuParseError(f"unrecognised NVML dump line: {line!r}")
    return dump


def _dump_extras(sample: GpuSample, tail: str) -> None:
    words = tail.split()
    for key, width in (("util", 2), ("temp", 1), ("power_mW", 1)):
        if key in words:
            values = words[words.index(key) + 1 : words.index(key) + 1 + width]
            if key == "util":
                sample.utilization_pct = float(values[0])
            elif key == "temp":
                sample.temperature_c = float(values[0])
            else:
                sample.power_w = float(values[0]) / 1000
    sample.processes.extend(GpuProcess(int(pid), int(used) / MIB) for pid, used in _DUMP_PAIR.findall(tail))


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def parse_topo(text: str) -> dict[str, dict[str, str]]:
    """`nvidia-smi topo -m`: {"GPU0": {"GPU1": "NV18", "CPU Affinity": "0-31", ...}, ...}."""
    lines = [_ANSI.sub("", line) for line in text.splitlines()]
    header = [cell.strip() for cell in lines[0].split("\t")][1:]
    matrix: dict[str, dict[str, str]] = {}
    for line in lines[1:]:
        if not line.strip():
            break
        # nvidia-smi pads some columns with two tabs: empty cells carry no value.
        cells = [cell.strip() for cell in line.split("\t")]
        values = [cell for cell in cells[1:] if cell]
        matrix[cells[0]] = {column: value for column, value in zip(header, values) if column}
    if not matrix:
        raise GpuParseError("no rows in the topology matrix")
    return matrix


def parse_driver_proc(text: str) -> str | None:
    """Driver version from /proc/driver/nvidia/version ('NVRM version: ... Kernel Module  580.159.04  ...')."""
    match = re.search(r"Kernel Module(?: for \S+)?\s+([0-9][0-9.]+)", text)
    return match.group(1) if match else None


# ---------------------------------------------------------------- sources


def _kernel_driver() -> str | None:
    try:
        return parse_driver_proc(DRIVER_PROC_FILE.read_text())
    except OSError:
        return None


def probe_nvml() -> tuple[Any, str]:
    """(initialised pynvml module or None, status). Status is 'ok', 'no NVIDIA driver (...)' or 'NVML error: ...'."""
    try:
        import pynvml
    except ImportError:
        driver = _kernel_driver()
        if driver is None:
            return None, f"no NVIDIA driver (pynvml not installed; no {DRIVER_PROC_FILE})"
        return None, f"NVML error: pynvml not installed (kernel driver {driver} is loaded)"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound:
        return None, "no NVIDIA driver (libnvidia-ml.so not found)"
    except pynvml.NVMLError as exc:
        return None, f"NVML error: {exc}"
    return pynvml, "ok"


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NvmlSource:
    """Samples every GPU through NVML in-process (about 0.1 ms a GPU on an H200)."""

    name = "nvml"

    def __init__(self, nvml: Any):
        self._nv = nvml
        self._lock = threading.Lock()
        self.nvml = "ok"
        self.driver = _text(nvml.nvmlSystemGetDriverVersion())
        self._handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        self._names = [_text(nvml.nvmlDeviceGetName(h)) for h in self._handles]
        self._uuids = [_text(nvml.nvmlDeviceGetUUID(h)) for h in self._handles]
        self._memory_v2 = hasattr(nvml, "nvmlMemory_v2")
        self.message = f"NVML, driver {self.driver}, {len(self._handles)} GPU(s)"

    def _try(self, call, *args):
        try:
            return call(*args)
        except self._nv.NVMLError:
            return None

    def _memory(self, handle):
        # v2 reports "used" without the driver-reserved memory, as nvidia-smi does (v1 adds it).
        if self._memory_v2:
            try:
                return self._nv.nvmlDeviceGetMemoryInfo(handle, version=self._nv.nvmlMemory_v2)
            except (self._nv.NVMLError, TypeError):
                self._memory_v2 = False
        return self._try(self._nv.nvmlDeviceGetMemoryInfo, handle)

    def _processes(self, handle) -> list[GpuProcess]:
        found = self._try(self._nv.nvmlDeviceGetComputeRunningProcesses, handle) or []
        processes = []
        for proc in found:
            used = getattr(proc, "usedGpuMemory", None)
            processes.append(GpuProcess(int(proc.pid), used / MIB if isinstance(used, int) and used < 1 << 62 else None))
        return processes

    def sample(self) -> list[GpuSample]:
        nv = self._nv
        with self._lock:
            samples = []
            for index, handle in enumerate(self._handles):
                sample = GpuSample(index=index, name=self._names[index], uuid=self._uuids[index])
                memory = self._memory(handle)
                if memory is not None:
                    sample.memory_used_mib, sample.memory_total_mib = memory.used / MIB, memory.total / MIB
                rates = self._try(nv.nvmlDeviceGetUtilizationRates, handle)
                sample.utilization_pct = float(rates.gpu) if rates is not None else None
                temperature = self._try(nv.nvmlDeviceGetTemperature, handle, nv.NVML_TEMPERATURE_GPU)
                sample.temperature_c = float(temperature) if temperature is not None else None
                power = self._try(nv.nvmlDeviceGetPowerUsage, handle)
                sample.power_w = power / 1000 if power is not None else None
                sample.processes = self._processes(handle)
                samples.append(sample)
            return samples

    def close(self) -> None:
        self._try(self._nv.nvmlShutdown)


def _run_smi(smi: str, *args: str, timeout: float = 15.0) -> str:
    result = subprocess.run([smi, *args], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    if result.returncode != 0:
        raise GpuParseError(f"{smi} {' '.join(args)} failed (exit {result.returncode}): {result.stderr.strip() or result.stdout.strip()}")
    return result.stdout


def query_apps(smi: str) -> list[ComputeApp]:
    return parse_query_apps(_run_smi(smi, "--query-compute-apps=" + ",".join(QUERY_APPS_FIELDS), "--format=csv,noheader,nounits"))


def smi_driver(smi: str) -> str | None:
    """Driver version from /proc, else from one nvidia-smi call (done once, when a source opens)."""
    version = _kernel_driver()
    if version is None:
        try:
            version = _run_smi(smi, "--query-gpu=driver_version", "--format=csv,noheader").split("\n")[0].strip() or None
        except (GpuParseError, OSError, subprocess.TimeoutExpired):
            version = None
    return version


def query_gpus(smi: str) -> list[GpuSample]:
    return parse_query_gpu(_run_smi(smi, "--query-gpu=" + ",".join(QUERY_GPU_FIELDS), "--format=csv,noheader,nounits"))


class SmiOneshotSource:
    """Spawns nvidia-smi on each sample: only for one-shot commands (`eagle3-host gpus`), never for a stream."""

    name = "nvidia-smi"

    def __init__(self, smi: str, nvml_status: str):
        self.smi = smi
        self.nvml = nvml_status
        self.driver = smi_driver(smi)
        self.message = f"nvidia-smi, one call per sample (NVML unavailable: {nvml_status})"

    def sample(self) -> list[GpuSample]:
        return attach_apps(query_gpus(self.smi), query_apps(self.smi))

    def close(self) -> None:
        pass


class SmiStreamSource:
    """One long-lived `nvidia-smi --query-gpu=... -lms N` read line by line in a thread.

    Compute processes come from `--query-compute-apps`, spawned at most once every `apps_every_s`.
    If the stream process dies it is restarted, at most once every `restart_every_s`.
    """

    name = "nvidia-smi"

    def __init__(self, smi: str, nvml_status: str, interval_s: float = 1.0, apps_every_s: float = 10.0, restart_every_s: float = 5.0):
        self.smi = smi
        self.nvml = nvml_status
        self.driver = smi_driver(smi)
        self.interval_ms = max(100, int(interval_s * 1000))
        self.apps_every_s = apps_every_s
        self.restart_every_s = restart_every_s
        self.lines = 0
        self.bad_lines = 0
        self.restarts = 0
        self.stderr_tail: deque[str] = deque(maxlen=5)
        self._latest: dict[int, GpuSample] = {}
        self._apps: list[ComputeApp] = []
        self._apps_at = float("-inf")
        self._started_at = float("-inf")
        self._lock = threading.Lock()
        self._closed = False
        self._line_event = threading.Condition(self._lock)
        self._proc: subprocess.Popen | None = None
        self._start()
        self.wait_for_line(after=0, timeout=5.0)  # so the first tick does not report "no GPUs" while nvidia-smi starts

    @property
    def command(self) -> list[str]:
        fields = "--query-gpu=" + ",".join(QUERY_GPU_FIELDS)
        return [self.smi, fields, "--format=csv,noheader,nounits", "-lms", str(self.interval_ms)]

    @property
    def message(self) -> str:
        alive = self._proc is not None and self._proc.poll() is None
        state = f"pid {self._proc.pid}" if alive else "stream stopped: " + " | ".join(self.stderr_tail)
        return f"nvidia-smi -lms {self.interval_ms} ({state}; NVML unavailable: {self.nvml})"

    def _start(self) -> None:
        self._started_at = time.monotonic()
        proc = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self._proc = proc
        threading.Thread(target=self._read_stdout, args=(proc,), name="nvidia-smi-stdout", daemon=True).start()
        threading.Thread(target=self._read_stderr, args=(proc,), name="nvidia-smi-stderr", daemon=True).start()

    def _read_stdout(self, proc: subprocess.Popen) -> None:
        for raw in proc.stdout:
            line = raw.decode(errors="replace").strip()
            if not line:
                continue
            try:
                sample = parse_query_gpu_line(line)
            except GpuParseError:
                self.bad_lines += 1
                continue
            with self._lock:
                self.lines += 1
                self._latest[sample.index] = sample
                self._line_event.notify_all()

    def _read_stderr(self, proc: subprocess.Popen) -> None:
        for raw in proc.stderr:
            self.stderr_tail.append(raw.decode(errors="replace").strip())

    def wait_for_line(self, after: int, timeout: float) -> bool:
        """Block until more than `after` lines have been read (used by the benchmark)."""
        with self._lock:
            return self._line_event.wait_for(lambda: self.lines > after, timeout)

    def _ensure_running(self) -> None:
        if self._closed or (self._proc is not None and self._proc.poll() is None):
            return
        if time.monotonic() - self._started_at >= self.restart_every_s:
            self.restarts += 1
            self._start()

    def sample(self) -> list[GpuSample]:
        self._ensure_running()
        now = time.monotonic()
        if now - self._apps_at >= self.apps_every_s:
            self._apps_at = now
            try:
                self._apps = query_apps(self.smi)
            except (GpuParseError, OSError, subprocess.TimeoutExpired) as exc:
                self.stderr_tail.append(f"query-compute-apps: {exc}")
        with self._lock:
            samples = [self._latest[index] for index in sorted(self._latest)]
        return attach_apps(samples, self._apps)

    def close(self) -> None:
        self._closed = True
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=3)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class NoGpuSource:
    """The clean 'no NVIDIA driver' state: no samples, and a message saying why."""

    name = "none"

    def __init__(self, nvml_status: str, message: str):
        self.nvml = nvml_status
        self.driver = _kernel_driver()
        self.message = message

    def sample(self) -> list[GpuSample]:
        return []

    def close(self) -> None:
        pass


def open_gpu_source(stream: bool = True, interval_s: float = 1.0, smi: str | None = None, use_nvml: bool = True):
    """NVML when it initialises, else nvidia-smi (a -lms stream, or one-shot spawns when stream=False), else NoGpuSource."""
    nvml, status = probe_nvml() if use_nvml else (None, "NVML not tried")
    if nvml is not None:
        try:
            return NvmlSource(nvml)
        except nvml.NVMLError as exc:
            status = f"NVML error: {exc}"
    smi_path = smi or shutil.which("nvidia-smi")
    if smi_path:
        if stream:
            return SmiStreamSource(smi_path, status, interval_s=interval_s)
        return SmiOneshotSource(smi_path, status)
    if status.startswith("no NVIDIA driver"):
        message = f"{status}; nvidia-smi not found on PATH"
    else:
        message = f"no GPU telemetry: {status}; nvidia-smi not found on PATH"
    return NoGpuSource(status, message)


def driver_state(source) -> dict[str, Any]:
    """What the GPUS event and `eagle3-host gpus` say about where the numbers come from."""
    return {
        "available": source.name != "none",
        "source": source.name,
        "driver": source.driver,
        "nvml": source.nvml,
        "message": source.message,
    }
