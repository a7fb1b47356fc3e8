"""Whether this project's Triton kernels can run for a device: a CUDA GPU, or Triton's interpreter on the CPU."""

from __future__ import annotations

import os

import torch


def unavailable_reason(device: torch.device) -> str | None:
    """Why Triton kernels cannot run on this device, or None when they can (a CPU without the interpreter is refused
    before Triton is imported: a CPU engine asking for `auto` never imports it)."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"it needs a CUDA device (the target is on {device}; TRITON_INTERPRET=1 runs it, slowly, on the CPU)"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed (it ships with CUDA builds of torch)"
    return None


def next_power_of_two(value: int) -> int:
    return 1 << max(0, value - 1).bit_length()
