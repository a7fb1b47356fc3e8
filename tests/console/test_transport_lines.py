"""Agent lines of any length below the cap arrive whole over both transports; a longer one is dropped and reported.

asyncssh's readline returns its partial buffer as a line once its buffer limit (~2 MiB) is hit, and asyncio's raises
past its limit: the transports read with LineReader instead. The "agent" here is a real separate process (a small
Python script run as the transport's agent command) that answers `blob` requests with replies of a chosen size.
"""

import asyncio
import sys
import time

import pytest

import console.transport as transport_module
from console.client import AgentClient, AgentError, ClientNote
from console.transport import LINE_CAP, LineReader, LineTooLong, LocalTransport
from tests.fixtures.ssh import InProcessSSHServer, transport_for, wait_until

BLOB_AGENT = r"""
import json, os, sys
out = sys.stdout.buffer
def send(message):
    out.write(json.dumps(message, separators=(",", ":")).encode() + b"\n")
    out.flush()
send({"type": "hello", "protocol": 2, "host": "fake", "python": "3", "agent_pid": os.getpid(), "run_dir": "/fake",
      "driver": None, "nvml": "none", "gpu_source": "none", "sglang": None})
for line in sys.stdin.buffer:
    request = json.loads(line)
    if request["type"] == "blob":
        # the reply's bytes are written in pieces, as a pipe or an SSH channel delivers a long line
        head = json.dumps({"type": "reply", "id": request["id"], "ok": True}, separators=(",", ":"))[:-1].encode()
        out.write(head + b',"result":{"blob":[')
        pieces = max(1, request["size"] // 4002)  # '"' + 4000 x + '",'
        for start in range(0, pieces, 256):
            out.write(b",".join([b'"' + b"x" * 4000 + b'"'] * min(256, pieces - start)) + (b"," if start + 256 < pieces else b""))
        out.write(b"]}}\n")
        out.flush()
    else:
        send({"type": "reply", "id": request["id"], "ok": True, "result": {"pong": True}})
"""


def agent_command(tmp_path):
    """A stand-in for the host's python: whatever arguments it gets (-m backend.agent --run-dir ...), it runs the blob agent."""
    script = tmp_path / "blob_agent.py"
    script.write_text(BLOB_AGENT)
    wrapper = tmp_path / "blob-python"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} {script} "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


class Notes:
    """Drains the client's events like the session's pump does, keeping the notes."""

    def __init__(self, client):
        self.client = client
        self.notes: list[str] = []
        self.task = asyncio.create_task(self._run())

    async def _run(self):
        while True:
            event = await self.client.next_event()
            if isinstance(event, ClientNote):
                self.notes.append(event.text)

    def stop(self):
        self.task.cancel()


async def blob(client, size, timeout=60):
    """The reply's bytes, from its 4000-character strings (a reply's strings are cut at 4096 characters)."""
    result = await client.request("blob", size=size, timeout=timeout)
    return sum(len(piece) + 2 for piece in result["blob"]) + 1


async def check_lines(transport, sizes, over_cap):
    client = AgentClient(transport, timeout=60)
    await client.start()
    notes = Notes(client)
    try:
        await wait_until(lambda: client.status.connected, what="the blob agent's hello")
        for size in sizes:
            assert await blob(client, size) == max(1, size // 4002) * 4002 + 1
        started = time.monotonic()
        with pytest.raises(AgentError) as dropped:
            await blob(client, over_cap, timeout=120)
        assert dropped.value.code == "reply_too_large" and "blob" in dropped.value.message
        assert time.monotonic() - started < 120  # failed as soon as the line ended, not by the timeout
        assert await blob(client, 1000) == 4003  # the next line is read normally
        assert (await client.ping())["pong"] is True
        await wait_until(lambda: notes.notes, what="the note about the dropped line")
        assert "MiB" in notes.notes[0] and "line cap" in notes.notes[0]
        assert client.status.connected
    finally:
        notes.stop()
        await client.close()


async def test_the_local_transport_reassembles_long_lines_and_drops_one_over_the_cap(tmp_path):
    transport = LocalTransport(tmp_path / "run", python=agent_command(tmp_path), reconnect=False)
    await check_lines(transport, [3 << 20, 20 << 20], over_cap=LINE_CAP + (3 << 20))


async def test_the_ssh_transport_returns_replies_over_2_mib_whole(tmp_path, monkeypatch, isolated_home):
    """The bug: a 2.17 MiB metrics_history reply failed over SSH (asyncssh's partial buffer read as a line) and timed out."""
    server = await InProcessSSHServer(tmp_path / "ssh").start()
    try:
        env = server.env()
        env.pin_host_key()
        transport = transport_for(env, tmp_path, python=agent_command(tmp_path), reconnect=False)
        monkeypatch.setattr(transport_module, "LINE_CAP", 6 << 20)  # a lower cap keeps the dropped line's transfer short
        await check_lines(transport, [int(2.17 * (1 << 20)), 5 << 20], over_cap=9 << 20)
    finally:
        await server.stop()


async def test_line_reader_splits_joins_and_discards_across_reads():
    """Lines cut across many small reads, one over the cap in the middle, and a last line without its newline."""
    long = b"L" * 100
    data = b"a\n" + b"bb" * 20 + b"\n" + long + b"\n\nafter\nlast"
    process = await asyncio.create_subprocess_exec(sys.executable, "-c", f"import sys; sys.stdout.buffer.write({data!r})", stdout=asyncio.subprocess.PIPE)
    reader = LineReader(process.stdout.read, cap=50, chunk=7)
    lines = []
    while line := await reader.next():
        lines.append(line)
    await process.wait()
    assert lines[:2] == [b"a\n", b"bb" * 20 + b"\n"]
    assert isinstance(lines[2], LineTooLong) and lines[2].size == 101 and lines[2].head.startswith(b"LLL")
    assert lines[3:] == [b"\n", b"after\n", b"last"]
