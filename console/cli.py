"""`eagle3-console`: parse the command line, pick the transport (local agent or SSH), run the app or print a snapshot."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from backend.profiles import ProfileError, load_profile, resolve_profile_path
from backend.protocol import Request

from console.config import ConfigError, ConsoleConfig, apply_config, load_config, save_config, session_watches, updated_config
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
    parser.add_argument(
        "--host",
        action="append",
        dest="hosts",
        metavar="HOST",
        help="SSH host as [user@]name[:port] (a name from ~/.ssh/config works), or 'local' (default); repeat it to watch several hosts in one console",
    )
    parser.add_argument("--hosts-file", help="a file naming more hosts, one [user@]name[:port] per line ('#' starts a comment)")
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="config file: hosts, watched runs per host, theme (default: $XDG_CONFIG_HOME/eagle3-console/config.toml, "
        "else ~/.config/...); --host and --hosts-file win over its hosts",
    )
    parser.add_argument("--port", type=int, help="SSH port for hosts that name none (default: from ssh config, else 22)")
    parser.add_argument("--user", help="SSH user (default: from ssh config, else your login name)")
    parser.add_argument("--profile", default=DEFAULT_PROFILE, help="profile name (tiny, llama3.1-8b, kimi-k2.5) or path to a TOML file")
    parser.add_argument("--run-dir", help="run directory on the host (default: the profile's paths.run_dir, ~/.eagle3)")
    parser.add_argument(
        "--snapshot",
        action="store_true",
        help='print one JSON object (hello, gpus, jobs, latest metrics, disks) and exit; with several hosts, {"hosts": {name: that object or {"error": why}}}',
    )
    parser.add_argument(
        "--accept-new-host-key", action="store_true", help="trust an UNKNOWN host key and append it to known_hosts (a CHANGED key is always refused)"
    )
    parser.add_argument("--identity", help="SSH private key file (default: ssh config / agent / ~/.ssh/id_*)")
    parser.add_argument("--known-hosts", help="known_hosts file (default: ssh config's UserKnownHostsFile, else ~/.ssh/known_hosts)")
    parser.add_argument("--python", help="Python on the host that runs the agent (default: python3; locally: this Python)")
    parser.add_argument(
        "--rdzv-endpoint",
        metavar="HOST:PORT",
        help="rendezvous of a multi-node run (key m): an address of the FIRST host that every other host can reach "
        "(default: the first --host's name and a port in 29400-29999 chosen from the run id)",
    )
    parser.add_argument(
        "--readonly",
        action="store_true",
        help="look, never touch: start, stop, stop & bench, resume, grok and adopt are disabled and hidden (the banner says READ-ONLY)",
    )
    parser.add_argument(
        "--notify",
        action="store_true",
        help="ring the terminal bell and send a desktop notification (OSC 9 and OSC 777) when a job exits, a canary turns red, "
        "grokking onset is detected or a disk runs low (off by default)",
    )
    parser.set_defaults(config_hosts=[])  # the config file's hosts, used when the command line names none
    return parser


class HostListError(ValueError):
    """--host / --hosts-file named a host badly (empty, a bad port, twice)."""


def host_list(args: argparse.Namespace) -> list[str]:
    """The hosts to connect to, in order: every --host, then the hosts file's lines; else the config file's hosts;
    ["local"] when none is named."""
    hosts = list(args.hosts or [])
    if args.hosts_file:
        path = Path(args.hosts_file).expanduser()
        try:
            lines = path.read_text().splitlines()
        except OSError as exc:
            raise HostListError(f"cannot read the hosts file {path}: {exc.strerror or exc}") from None
        hosts += [entry for entry in (line.split("#", 1)[0].strip() for line in lines) if entry]
    hosts = hosts or list(args.config_hosts)
    if not hosts:
        return ["local"]
    labels = [_canonical(host, args.port) for host in hosts]  # raises on a bad entry before anything connects
    twice = sorted({label for label in labels if labels.count(label) > 1})
    if twice:
        raise HostListError(f"host named twice: {', '.join(twice)}")
    return hosts


def split_host(entry: str, default_port: int | None) -> tuple[str | None, str, int | None]:
    """'[user@]name[:port]' -> (user, name, port)."""
    user, _, rest = entry.rpartition("@")
    name, colon, port_text = rest.partition(":") if rest.count(":") == 1 else (rest, "", "")
    if not name or any(ch.isspace() for ch in entry):
        raise HostListError(f"bad host {entry!r}: expected [user@]name[:port]")
    port = default_port
    if colon:
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise HostListError(f"bad port in host {entry!r}: {port_text!r}")
        port = int(port_text)
    return user or None, name, port


def _canonical(entry: str, default_port: int | None) -> str:
    user, name, port = split_host(entry, default_port)
    return f"{user + '@' if user else ''}{name}{':' + str(port) if port else ''}"


def make_transports(args: argparse.Namespace) -> tuple[list[Transport], str]:
    """One transport per host the arguments name, and the profile argument jobs get; raises ProfileError, HostListError."""
    transports = []
    profile_arg = args.profile
    for host in host_list(args):
        transport, profile_arg = make_transport(args, host)
        transports.append(transport)
    return transports, profile_arg


def make_transport(args: argparse.Namespace, host: str = "local") -> tuple[Transport, str]:
    """The transport to one host, and the profile argument jobs get; raises ProfileError."""
    profile = load_profile(args.profile)
    run_dir = args.run_dir or profile.paths.run_dir
    if host == "local":
        return LocalTransport(run_dir, python=args.python or sys.executable), args.profile
    extra = []
    profile_arg = args.profile
    path = resolve_profile_path(args.profile)
    if path.suffix == ".toml" and Path(args.profile).expanduser().exists():
        extra.append((f"profiles/{path.name}", path))  # a custom profile file travels with the backend
        profile_arg = path.stem
    user, name, port = split_host(host, args.port)
    ssh = SSHTransport(
        name,
        port=port,
        user=user or args.user,
        identity=args.identity,
        known_hosts=args.known_hosts,
        accept_new_host_key=args.accept_new_host_key,
        python=args.python or "python3",
        run_dir=run_dir,
        extra_files=extra,
    )
    return ssh, profile_arg


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


async def snapshots(transports: list[Transport]) -> list[dict | BaseException]:
    """One snapshot per host, taken at once; a host that fails gives its exception instead."""
    return list(await asyncio.gather(*(snapshot(t) for t in transports), return_exceptions=True))


def _snapshot_error(transport: Transport, exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return f"{transport.label} did not answer within {SNAPSHOT_TIMEOUT_S:g}s"
    return f"cannot take a snapshot of {transport.label}: {exc}"


def run_snapshot(transports: list[Transport]) -> int:
    """Print the snapshot (one host: its object; several: {"hosts": {name: object or {"error"}}}); 2 when any host failed."""
    from console.client import AgentError

    results = asyncio.run(snapshots(transports))
    failed = False
    by_host: dict[str, dict] = {}
    for transport, result in zip(transports, results):
        if isinstance(result, (TransportError, AgentError, asyncio.TimeoutError)):
            failed = True
            print(f"eagle3-console: {_snapshot_error(transport, result)}", file=sys.stderr)
            by_host[transport.label] = {"error": _snapshot_error(transport, result)}
            continue
        if isinstance(result, BaseException):
            raise result
        added = getattr(transport, "host_key_added", None)
        if added:
            print(f"eagle3-console: {added}", file=sys.stderr)
        by_host[transport.label] = result
    if len(transports) == 1:
        if failed:
            return 2
        print(json.dumps(by_host[transports[0].label], indent=2, sort_keys=True))
        return 0
    print(json.dumps({"hosts": by_host}, indent=2, sort_keys=True))
    return 2 if failed else 0


def read_config(args: argparse.Namespace) -> ConsoleConfig:
    """The config file --config names (or the default one), its hosts checked like --host values; raises ConfigError."""
    config = load_config(Path(args.config) if args.config else None)
    for i, host in enumerate(config.hosts):
        try:
            split_host(host, args.port)
        except HostListError as exc:
            raise ConfigError(f"{config.path}: hosts[{i}]: {exc}") from None
    return config


def save_session(config: ConsoleConfig, app, entries: list[str], applied: dict) -> None:
    """At quit: the theme and each host's watches back into the config file, when the operator changed them (re-read
    first, so an edit made to the file meanwhile is kept). A failure is one line; the console has already quit."""
    try:
        fresh = load_config(config.path)
        theme = getattr(app, "theme", None)  # a stand-in app in a test may have none
        updated = updated_config(fresh, config, theme, applied, session_watches(app, entries))
        if updated != fresh:
            save_config(updated)
    except (ConfigError, OSError) as exc:
        print(f"eagle3-console: the config file was not saved: {exc}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = read_config(args)
    except ConfigError as exc:
        print(f"eagle3-console: {exc}; nothing was started", file=sys.stderr)
        return 2
    args.config_hosts = config.hosts
    try:
        entries = host_list(args)
        transports, profile_arg = make_transports(args)
    except (ProfileError, HostListError) as exc:
        print(f"eagle3-console: {exc}; nothing was started", file=sys.stderr)
        return 2
    if args.snapshot:
        return run_snapshot(transports)
    from console.app import build_app

    app = build_app(
        transports if len(transports) > 1 else transports[0],
        profile=profile_arg,
        readonly=args.readonly,
        notify_terminal=args.notify,
        rdzv_endpoint=args.rdzv_endpoint,
    )
    applied = apply_config(config, app, entries)
    app.run()
    save_session(config, app, entries, applied)
    failed = [s for s in app.sessions if not s.state.connection.connected and s.state.connection.detail and s.state.last_data_at is None]
    for session in failed:
        print(f"eagle3-console: {session.state.connection.detail}", file=sys.stderr)
    return 1 if failed and len(failed) == len(app.sessions) else 0


if __name__ == "__main__":
    sys.exit(main())
