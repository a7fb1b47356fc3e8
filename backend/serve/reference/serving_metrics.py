"""The reference engine's Prometheus /metrics (served with --enable-metrics): SGLang 0.5.23's metric names for what it counts.

SGLang exports these through prometheus_client; this engine keeps the few it has numbers for and writes them in the
same text exposition format (version 0.0.4) and under the same names and labels (model_name, engine_type; the token,
request and latency series also carry is_streaming). Counters never reset (a /flush_cache resets only the averages
/get_server_info reports); the spec gauges are the average since start or the last flush, as internal_states is.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Iterable

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# SGLang's default buckets for sglang:e2e_request_latency_seconds (metrics_collector.py)
E2E_LATENCY_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200, 1800, 2400)
STREAMING = ("false", "true")


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    observed: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        self.observed += 1
        self.total += value
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1


def _label_text(labels: dict[str, str]) -> str:
    escaped = (value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") for value in labels.values())
    return "{" + ",".join(f'{name}="{value}"' for name, value in zip(labels, escaped)) + "}"


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


class ServingMetrics:
    """Counts of finished and abandoned requests, kept by the HTTP layer; render() is the /metrics body."""

    def __init__(self, model_name: str):
        self.lock = threading.Lock()
        self.model_name = model_name
        self.prompt_tokens = {s: 0 for s in STREAMING}
        self.generation_tokens = {s: 0 for s in STREAMING}
        self.requests = {s: 0 for s in STREAMING}
        self.latency = {s: Histogram(E2E_LATENCY_BUCKETS) for s in STREAMING}
        self.verify_calls = 0
        self.aborted = 0

    def labels(self, **extra: str) -> dict[str, str]:
        return {"model_name": self.model_name, "engine_type": "unified", **extra}

    def finished(self, prompt_tokens: int, generation_tokens: int, verify_ct: int, latency_s: float, streaming: bool) -> None:
        key = STREAMING[streaming]
        with self.lock:
            self.prompt_tokens[key] += prompt_tokens
            self.generation_tokens[key] += generation_tokens
            self.requests[key] += 1
            self.latency[key].observe(latency_s)
            self.verify_calls += verify_ct

    def abandoned(self) -> None:
        with self.lock:
            self.aborted += 1

    def render(self, gauges: dict[str, tuple[str, float | None]]) -> str:
        """The exposition text; gauges maps a metric name to (help, value), a None value leaves the series out."""
        lines: list[str] = []
        with self.lock:
            for name, (text, value) in gauges.items():
                self._family(lines, name, "gauge", text, [] if value is None else [(self.labels(), value)])
            self._counter(lines, "sglang:prompt_tokens_total", "Number of prefill tokens processed.", self.prompt_tokens)
            self._counter(lines, "sglang:generation_tokens_total", "Number of generation tokens processed.", self.generation_tokens)
            self._counter(lines, "sglang:num_requests_total", "Number of requests processed.", self.requests)
            verify = [(self.labels(), float(self.verify_calls))]
            self._family(lines, "sglang:spec_verify_calls_total", "counter", "Number of speculative decoding verification calls.", verify)
            self._family(lines, "sglang:num_aborted_requests_total", "counter", "Number of requests aborted.", [(self.labels(), float(self.aborted))])
            self._histogram(lines, "sglang:e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds")
        return "\n".join(lines) + "\n"

    @staticmethod
    def _family(lines: list[str], name: str, kind: str, text: str, samples: Iterable[tuple[dict[str, str], float]]) -> None:
        lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
        lines += [f"{name}{_label_text(labels)} {_number(value)}" for labels, value in samples]

    def _counter(self, lines: list[str], name: str, text: str, values: dict[str, int]) -> None:
        self._family(lines, name, "counter", text, [(self.labels(is_streaming=key), float(values[key])) for key in STREAMING])

    def _histogram(self, lines: list[str], name: str, text: str) -> None:
        lines += [f"# HELP {name} {text}", f"# TYPE {name} histogram"]
        for key in STREAMING:
            hist = self.latency[key]
            for bound, count in zip(hist.buckets, hist.counts):
                lines.append(f"{name}_bucket{_label_text(self.labels(is_streaming=key, le=_number(bound)))} {_number(count)}")
            lines.append(f"{name}_bucket{_label_text(self.labels(is_streaming=key, le='+Inf'))} {_number(hist.observed)}")
            lines.append(f"{name}_count{_label_text(self.labels(is_streaming=key))} {_number(hist.observed)}")
            lines.append(f"{name}_sum{_label_text(self.labels(is_streaming=key))} {_number(hist.total)}")
