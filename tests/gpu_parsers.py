"""Parsers for nvidia-smi's table, its XML, an NVML dump and the topology matrix: only the tests read these captures."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

from backend.host.gpu import MIB, GpuParseError, parse_number
from backend.protocol import GpuProcess, GpuSample


def latest_by_index(samples: list[GpuSample]) -> list[GpuSample]:
    """Collapse a stream to the last sample of each GPU, ordered by index."""
    latest: dict[int, GpuSample] = {}
    for sample in samples:
        latest[sample.index] = sample
    return [latest[index] for index in sorted(latest)]


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
            raise GpuParseError(f"GPU {gpu.group(1)} line is not followed by a stats line: {lines[number + 1 : number + 2]!r}")
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
