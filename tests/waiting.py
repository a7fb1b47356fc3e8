"""Polling helpers for tests that wait on real processes and files."""

from __future__ import annotations

import time


def wait_for(predicate, timeout: float = 20.0, what: str = "condition"):
    """predicate()'s first truthy value, polled every 20 ms; fails the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
    return value
