"""The console's config file: hosts, each host's watched runs and the theme, read at start and saved back at quit.

$XDG_CONFIG_HOME/eagle3-console/config.toml (~/.config/... when XDG_CONFIG_HOME is unset), or --config FILE:

    hosts = ["gpu-box", "root@10.0.0.5:2222"]     # as --host values; --host / --hosts-file on the command line win
    theme = "nord"                                 # Textual's theme; changing it in the palette saves it here

    [[watch]]                                      # re-watched on that host after each connect
    host = "gpu-box"
    name = "specforge"                             # shown as ext:specforge
    path = "/data/sf/runs"
    line_format = 'it=(?P<step>\\d+) L=(?P<loss>\\S+)'   # optional

A file that cannot be used is one ConfigError naming the file and the key; nothing reads it half.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from backend.durable import write_atomic
from console.state import EXTERNAL_PREFIX

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the console's Python 3.10 installs tomli (pyproject)
    import tomli as tomllib

DEFAULT_THEME = "textual-dark"  # Textual's own default: not written to the file unless chosen
TOP_KEYS = ("hosts", "theme", "watch")
WATCH_KEYS = ("host", "name", "path", "line_format")
HEADER = "# eagle3-console: hosts (as --host values), watched runs per host, the theme. Saved back by the console at quit.\n"


class ConfigError(ValueError):
    """A config file the console cannot use: the message names the file and the key."""


@dataclass(frozen=True)
class Watch:
    """One watched run of one host (`w` registers it; it is re-registered after each connect)."""

    host: str
    name: str
    path: str
    line_format: str | None = None

    @property
    def job(self) -> str:
        return f"{EXTERNAL_PREFIX}{self.name}"


@dataclass
class ConsoleConfig:
    path: Path
    hosts: list[str] = field(default_factory=list)
    theme: str | None = None
    watches: list[Watch] = field(default_factory=list)


def default_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base).expanduser() / "eagle3-console" / "config.toml"


def load_config(path: Path | None = None, themes: Iterable[str] | None = None) -> ConsoleConfig:
    """The config at `path` (default_path() when None); an empty one when the file does not exist. `themes`: the
    names a theme may have (default: Textual's built-in themes)."""
    path = Path(path).expanduser() if path is not None else default_path()
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return ConsoleConfig(path)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    if themes is None:
        from textual.theme import BUILTIN_THEMES  # imported here: --snapshot and a missing file never load Textual

        themes = BUILTIN_THEMES
    return parse_config(path, data, set(themes))


def parse_config(path: Path, data: dict[str, Any], themes: set[str]) -> ConsoleConfig:
    def bad(key: str, problem: str) -> ConfigError:
        return ConfigError(f"{path}: {key}: {problem}")

    unknown = [key for key in data if key not in TOP_KEYS]
    if unknown:
        raise bad(unknown[0], f"unknown key (known: {', '.join(TOP_KEYS)})")
    hosts = data.get("hosts", [])
    if not isinstance(hosts, list) or not all(isinstance(h, str) and h.strip() for h in hosts):
        raise bad("hosts", 'expected a list of host names, e.g. hosts = ["gpu-box", "root@10.0.0.5:2222"]')
    theme = data.get("theme")
    if theme is not None and (not isinstance(theme, str) or theme not in themes):
        raise bad("theme", f"{theme!r} is not a theme; known: {', '.join(sorted(themes))}")
    entries = data.get("watch", [])
    if not isinstance(entries, list):
        raise bad("watch", "expected [[watch]] tables (host, name, path, optional line_format)")
    watches = [_watch(entry, f"watch[{i}]", bad) for i, entry in enumerate(entries)]
    return ConsoleConfig(path, [h.strip() for h in hosts], theme, watches)


def _watch(entry: Any, where: str, bad: Any) -> Watch:
    if not isinstance(entry, dict):
        raise bad(where, "expected a table with host, name, path")
    unknown = [key for key in entry if key not in WATCH_KEYS]
    if unknown:
        raise bad(f"{where}.{unknown[0]}", f"unknown key (known: {', '.join(WATCH_KEYS)})")
    for key in ("host", "name", "path"):
        if not isinstance(entry.get(key), str) or not entry[key].strip():
            raise bad(f"{where}.{key}", "missing" if key not in entry else "expected a non-empty string")
    from console.screens.modals import WATCH_NAME  # the w modal's rule for a name; imported here like Textual above

    if not WATCH_NAME.match(entry["name"]):
        raise bad(f"{where}.name", f"{entry['name']!r} is not usable (letters, digits, '.', '_', '-'; at most 56)")
    line_format = entry.get("line_format")
    if line_format is not None:
        if not isinstance(line_format, str):
            raise bad(f"{where}.line_format", "expected a string (a line regex with a named group step)")
        try:
            re.compile(line_format)
        except re.error as exc:
            raise bad(f"{where}.line_format", f"not a regex: {exc}") from None
    return Watch(entry["host"].strip(), entry["name"], entry["path"], line_format or None)


def watches_for(config: ConsoleConfig, names: Iterable[str]) -> list[Watch]:
    """The config's watches of a host known by any of `names` (its --host value, its label)."""
    wanted = set(names)
    return [watch for watch in config.watches if watch.host in wanted]


def apply_config(config: ConsoleConfig, app: Any, entries: list[str]) -> dict[str, list[Watch]]:
    """Before the app runs: its theme, and each host's watches listed as ext: rows (the session registers them with the
    agent after each connect). `entries` are the --host values of the app's sessions, in order. Returns what was applied
    per host, to tell at quit what the operator changed."""
    if config.theme:
        app.theme = config.theme
    applied = {}
    for session, entry in zip(app.sessions, entries):
        applied[entry] = watches_for(config, {entry, session.name})
        for watch in applied[entry]:
            session.state.add_external(watch.job, watch.path, line_format=watch.line_format)
    return applied


def session_watches(app: Any, entries: list[str]) -> dict[str, list[Watch]]:
    """Each host's watched runs now, keyed by its --host value (what the file names hosts by)."""
    found = {}
    for session, entry in zip(app.sessions, entries):
        state = session.state
        found[entry] = [Watch(entry, job.removeprefix(EXTERNAL_PREFIX), path, state.external_formats.get(job)) for job, path in state.externals.items()]
    return found


def updated_config(
    fresh: ConsoleConfig, started: ConsoleConfig, theme: str | None, applied: dict[str, list[Watch]], now: dict[str, list[Watch]]
) -> ConsoleConfig:
    """The file as re-read at quit (`fresh`) with what the operator changed in this session: the theme when it differs
    from the one it started with, a host's watches when they differ from those applied at start. An edit made to the
    file meanwhile stays wherever the session changed nothing."""
    if theme is None or theme == (started.theme or DEFAULT_THEME):
        theme = fresh.theme
    watches = list(fresh.watches)
    for entry, current in now.items():
        if {(w.name, w.path, w.line_format) for w in current} != {(w.name, w.path, w.line_format) for w in applied.get(entry, [])}:
            named = {entry} | {w.host for w in applied.get(entry, [])}  # a watch the file keyed by the host's label too
            watches = [w for w in watches if w.host not in named] + current
    return ConsoleConfig(fresh.path, list(fresh.hosts), None if theme == DEFAULT_THEME and not fresh.theme else theme, watches)


def save_config(config: ConsoleConfig) -> None:
    """Write `config` atomically and durably (backend.durable: a crash leaves the old file or the new one, never half;
    a link planted at the temporary name is not followed). 0600: it names hosts and paths. Comments are not kept."""
    config.path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(config.path, config_text(config).encode("utf-8"))


def config_text(config: ConsoleConfig) -> str:
    lines = [HEADER.rstrip("\n")]
    if config.hosts:
        lines.append(f"hosts = [{', '.join(toml_string(h) for h in config.hosts)}]")
    if config.theme:
        lines.append(f"theme = {toml_string(config.theme)}")
    for watch in config.watches:
        lines += ["", "[[watch]]", f"host = {toml_string(watch.host)}", f"name = {toml_string(watch.name)}", f"path = {toml_string(watch.path)}"]
        if watch.line_format:
            lines.append(f"line_format = {toml_string(watch.line_format)}")
    return "\n".join(lines) + "\n"


def toml_string(value: str) -> str:
    """A TOML basic string: JSON's escapes are TOML's, except that TOML also wants DEL escaped and has no surrogates."""
    return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
