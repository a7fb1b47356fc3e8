"""GPU telemetry behind one GpuSource protocol: NVML (lazy pynvml), an `nvidia-smi -lms` stream, one-shot nvidia-smi calls, or none."""

from __future__ import annotations

import re
import shutil
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Protocol

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


class GpuSource(Protocol):
    """Where GPU samples come from; the agent, `eagle3-host gpus`/`holders`, the stop and the chain read GPUs only through this."""

    @property
    def name(self) -> str: ...  # "nvml" | "nvidia-smi" | "none" (HelloInfo.gpu_source)

    @property
    def driver(self) -> str | None: ...  # driver version, None when unknown

    @property
    def nvml(self) -> str: ...  # "ok", or why NVML is not used

    @property
    def message(self) -> str: ...  # one line for the operator: what samples and how

    def sample(self) -> list[GpuSample]:
        """Every visible GPU now, ordered by index, with its compute processes; [] without a driver."""
        ...

    def close(self) -> None:
        """Release what the source holds (NVML, the nvidia-smi stream process); idempotent."""
        ...


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

    def _try(self, call: Callable[..., Any], *args: Any) -> Any:
        try:
            return call(*args)
        except self._nv.NVMLError:
            return None

    def _memory(self, handle: Any) -> Any:
        # v2 reports "used" without the driver-reserved memory, as nvidia-smi does (v1 adds it).
        if self._memory_v2:
            try:
                return self._nv.nvmlDeviceGetMemoryInfo(handle, version=self._nv.nvmlMemory_v2)
            except (self._nv.NVMLError, TypeError):
                self._memory_v2 = False
        return self._try(self._nv.nvmlDeviceGetMemoryInfo, handle)

    def _processes(self, handle: Any) -> list[GpuProcess]:
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
        proc = self._proc
        state = f"pid {proc.pid}" if proc is not None and proc.poll() is None else "stream stopped: " + " | ".join(self.stderr_tail)
        return f"nvidia-smi -lms {self.interval_ms} ({state}; NVML unavailable: {self.nvml})"

    def _start(self) -> None:
        self._started_at = time.monotonic()
        proc = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self._proc = proc
        threading.Thread(target=self._read_stdout, args=(proc,), name="nvidia-smi-stdout", daemon=True).start()
        threading.Thread(target=self._read_stderr, args=(proc,), name="nvidia-smi-stderr", daemon=True).start()

    def _read_stdout(self, proc: subprocess.Popen) -> None:
        for raw in proc.stdout or ():
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
        for raw in proc.stderr or ():
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


def open_gpu_source(stream: bool = True, interval_s: float = 1.0, smi: str | None = None, use_nvml: bool = True) -> GpuSource:
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


def driver_state(source: GpuSource) -> dict[str, Any]:
    """What the GPUS event and `eagle3-host gpus` say about where the numbers come from."""
    return {
        "available": source.name != "none",
        "source": source.name,
        "driver": source.driver,
        "nvml": source.nvml,
        "message": source.message,
    }
