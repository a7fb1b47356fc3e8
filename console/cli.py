"""`eagle3-console`: parse the command line, pick the transport (local agent or SSH), run the app or print a snapshot."""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from backend.profiles import ProfileError, load_profile, resolve_profile_path
from backend.protocol import Request

from console.transport import LocalTransport, SSHTransport, Transport, TransportError

DEFAULT_PROFILE = "tiny"
SNAPSHOT_TIMEOUT_S = 60.0
FIRST_TICK_WAIT_S = 5.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="eagle3-console",
        description="Operations console for EAGLE-3 draft training and serving. Without --host it runs the agent "
        "locally (a laptop without a GPU works) with the 'tiny' profile.",
    )
    parser.add_argument("--host", default="local", help="SSH host (a name from ~/.ssh/config works), or 'local' (default)")
    parser.add_argument("--port", type=int, help="SSH port (default: from ssh config, else 22)")
    parser.add_argument("--user", help="SSH user (default: from ssh config, else your login name)")
    parser.add_argument("--profile", default=DEFAULT_PROFILE, help="profile name (tiny, llama3.1-8b, kimi-k2.5) or path to a TOML file")
    parser.add_argument("--run-dir", help="run directory on the host (default: the profile's paths.run_dir, ~/.eagle3)")
    parser.add_argument("--snapshot", action="store_true", help="print one JSON object (hello, gpus, jobs, latest metrics, disks) and exit")
    parser.add_argument("--accept-new-host-key", action="store_true", help="trust an UNKNOWN host key and append it to known_hosts (a CHANGED key is always refused)")
    parser.add_argument("--identity", help="SSH private key file (default: ssh config / agent / ~/.ssh/id_*)")
    parser.add_argument("--known-hosts", help="known_hosts file (default: ssh config's UserKnownHostsFile, else ~/.ssh/known_hosts)")
    parser.add_argument("--python", help="Python on the host that runs the agent (default: python3; locally: this Python)")
    parser.add_argument("--readonly", action="store_true",
                        help="look, never touch: start, stop, stop & bench, resume, grok and adopt are disabled and hidden (the banner says READ-ONLY)")
    parser.add_argument("--notify", action="store_true",
                        help="ring the terminal bell and send a desktop notification (OSC 9 and OSC 777) when a job exits, a canary turns red, "
                        "grokking onset is detected or a disk runs low (off by default)")
    return parser


def make_transport(args: argparse.Namespace) -> tuple[Transport, str]:
    """The transport the arguments ask for, and the profile argument jobs get; raises ProfileError."""
    profile = load_profile(args.profile)
    run_dir = args.run_dir or profile.paths.run_dir
    if args.host == "local":
        transport = LocalTransport(run_dir, python=args.python or sys.executable)
        return transport, args.profile
    extra = []
    profile_arg = args.profile
    path = resolve_profile_path(args.profile)
    if path.suffix == ".toml" and Path(args.profile).expanduser().exists():
        extra.append((f"profiles/{path.name}", path))  # a custom profile file travels with the backend
        profile_arg = path.stem
    transport = SSHTransport(
        args.host,
        port=args.port,
        user=args.user,
        identity=args.identity,
        known_hosts=args.known_hosts,
        accept_new_host_key=args.accept_new_host_key,
        python=args.python or "python3",
        run_dir=run_dir,
        extra_files=extra,
    )
    return transport, profile_arg


async def snapshot(transport: Transport) -> dict:
    """Connect, ask for one snapshot, disconnect."""
    from console.client import AgentClient

    client = AgentClient(transport, timeout=SNAPSHOT_TIMEOUT_S)
    await client.start()
    try:
        await _first_telemetry(client)
        return await client.request(Request.SNAPSHOT)
    finally:
        await client.close()


async def _first_telemetry(client, wait_s: float = FIRST_TICK_WAIT_S) -> None:
    """Wait until connected and the agent's first disk report (its first tick) so the snapshot is complete."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + SNAPSHOT_TIMEOUT_S
    disk_deadline: float | None = None
    while True:
        now = loop.time()
        if client.status.connected and disk_deadline is None:
            disk_deadline = now + wait_s
        limit = min(deadline, disk_deadline) if disk_deadline is not None else deadline
        if now >= limit:
            if not client.status.connected:
                raise asyncio.TimeoutError
            return
        try:
            event = await asyncio.wait_for(client.next_event(), limit - now)
        except asyncio.TimeoutError:
            continue
        if isinstance(event, dict) and event.get("type") == "disk":
            return
        if getattr(event, "state", None) == "failed":
            raise TransportError(event.detail)


def run_snapshot(transport: Transport) -> int:
    from console.client import AgentError

    try:
        result = asyncio.run(snapshot(transport))
    except (TransportError, AgentError) as exc:
        print(f"eagle3-console: cannot take a snapshot of {transport.label}: {exc}", file=sys.stderr)
        return 2
    except asyncio.TimeoutError:
        print(f"eagle3-console: {transport.label} did not answer within {SNAPSHOT_TIMEOUT_S:g}s", file=sys.stderr)
        return 2
    if getattr(transport, "host_key_added", None):
        print(f"eagle3-console: {transport.host_key_added}", file=sys.stderr)
    print(json.dumps(result, indent=2, sort_keys=True))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        transport, profile_arg = make_transport(args)
    except ProfileError as exc:
        print(f"eagle3-console: {exc}; nothing was started", file=sys.stderr)
        return 2
    if args.snapshot:
        return run_snapshot(transport)
    from console.app import build_app

    app = build_app(transport, profile=profile_arg, readonly=args.readonly, notify_terminal=args.notify)
    app.run()
    status = app.state.connection
    if not status.connected and status.detail and app.state.last_data_at is None:
        print(f"eagle3-console: {status.detail}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
