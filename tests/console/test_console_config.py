"""The config file (issue 26): hosts, per-host watches and the theme survive a restart; flags win; a bad file is one line."""

import tomllib

import pytest

from console import cli
from console.app import build_app
from console.config import ConsoleConfig, Watch, apply_config, config_text, default_path, load_config, save_config, toml_string
from tests.fixtures.ssh import connected, wait_until
from tests.fixtures.console_apps import live_app

GOOD = """\
hosts = ["gpu-box", "root@10.0.0.5:2222"]
theme = "nord"

[[watch]]
host = "gpu-box"
name = "specforge"
path = "/data/sf/runs"

[[watch]]
host = "local"
name = "mine"
path = "/tmp/x.log"
line_format = 'it=(?P<step>\\d+) L=(?P<loss>\\S+)'
"""


def test_the_default_file_follows_xdg_config_home(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert default_path() == tmp_path / "xdg" / "eagle3-console" / "config.toml"
    monkeypatch.delenv("XDG_CONFIG_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_path() == tmp_path / "home" / ".config" / "eagle3-console" / "config.toml"
    assert load_config(default_path()) == ConsoleConfig(default_path())  # no file: nothing configured, no error


def test_a_good_file_gives_hosts_theme_and_watches(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text(GOOD)
    config = load_config(path)
    assert config.hosts == ["gpu-box", "root@10.0.0.5:2222"] and config.theme == "nord"
    assert config.watches == [
        Watch("gpu-box", "specforge", "/data/sf/runs"),
        Watch("local", "mine", "/tmp/x.log", r"it=(?P<step>\d+) L=(?P<loss>\S+)"),
    ]
    assert load_config(path) == config
    path.unlink()  # a new file: private, as durable.write_atomic creates it
    save_config(config)
    assert load_config(path) == config  # what the console writes it reads back unchanged
    assert path.stat().st_mode & 0o777 == 0o600 and not list(tmp_path.glob(".config.toml.*"))


@pytest.mark.parametrize(
    "text,key",
    [
        ("hosts = [", "not valid TOML"),
        ('hosts = "gpu-box"', "hosts: expected a list of host names"),
        ('theme = "no-such-theme"', "theme: 'no-such-theme' is not a theme; known: "),
        ('colour = "red"', "colour: unknown key (known: hosts, theme, watch)"),
        ('[[watch]]\nhost = "a"\nname = "n"', "watch[0].path: missing"),
        ('[[watch]]\nhost = "a"\nname = "bad name"\npath = "/p"', "watch[0].name: 'bad name' is not usable"),
        ('[[watch]]\nhost = "a"\nname = "n"\npath = "/p"\nline_format = "(?P<step"', "watch[0].line_format: not a regex"),
        ('[[watch]]\nhost = "a"\nname = "n"\npath = "/p"\nfile = "/q"', "watch[0].file: unknown key"),
        ('hosts = ["gpu-box:99999"]', "hosts[0]: bad port in host 'gpu-box:99999'"),
    ],
)
def test_a_bad_file_is_one_line_naming_the_file_and_the_key_and_nothing_starts(tmp_path, capsys, monkeypatch, text, key):
    path = tmp_path / "config.toml"
    path.write_text(text)
    monkeypatch.setattr(cli, "make_transports", lambda args: pytest.fail("a host was connected with a bad config"))
    assert cli.main(["--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"eagle3-console: {path}: ") and key in err and err.rstrip().endswith("nothing was started")


def test_command_line_hosts_win_over_the_files(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text(GOOD)
    args = cli.build_parser().parse_args(["--config", str(path)])
    args.config_hosts = cli.read_config(args).hosts
    assert cli.host_list(args) == ["gpu-box", "root@10.0.0.5:2222"]
    args = cli.build_parser().parse_args(["--config", str(path), "--host", "other"])
    args.config_hosts = cli.read_config(args).hosts
    assert cli.host_list(args) == ["other"]


def test_strings_are_written_so_that_toml_reads_them_back(tmp_path):
    tricky = ["plain", 'quote " and \\ back', "tab\tnew\nline", "del\x7f", "ünï · 😀", r"(?P<step>\d+)\s+\S"]
    for value in tricky:
        assert tomllib.loads(f"x = {toml_string(value)}")["x"] == value
    config = ConsoleConfig(tmp_path / "c.toml", ["a"], "nord", [Watch("a", "n", tricky[1], tricky[5])])
    assert tomllib.loads(config_text(config))["watch"][0]["path"] == tricky[1]


async def test_watches_and_theme_survive_a_restart(tmp_path):
    """Start with a file naming a watch of the local host and a theme: the run is re-watched once connected. Change the
    theme and add a watch; at quit both are written back, and the next start brings them again."""
    first, second = tmp_path / "first.log", tmp_path / "second.log"
    first.write_text("epoch 1 step 200 loss 8.38 acc0 0.246 lr 1.2e-04\n")
    second.write_text("[train] step 260/300 loss 6.4713 acc0 0.784 lr 4.40e-04\n")
    path = tmp_path / "xdg" / "eagle3-console" / "config.toml"
    path.parent.mkdir(parents=True)
    path.write_text(f'theme = "nord"\n\n[[watch]]\nhost = "local"\nname = "first"\npath = {toml_string(str(first))}\n')
    config = load_config(path)

    app = live_app(tmp_path)
    applied = apply_config(config, app, ["local"])
    async with app.run_test(size=(120, 40)) as pilot:
        assert app.theme == "nord" and "ext:first" in app.state.jobs  # listed before the host answers
        await connected(app)
        await wait_until(lambda: "ext:first" in app.state.metrics and app.state.metrics["ext:first"].records, what="the re-applied watch's records")
        app.theme = "gruvbox"  # what the palette's theme picker does
        await pilot.press("w")
        await pilot.pause()
        await pilot.press(*str(second), "tab", *"second", "enter")
        await wait_until(lambda: "ext:second" in app.state.externals, what="the new watch")
    cli.save_session(config, app, ["local"], applied)

    saved = load_config(path)
    assert saved.theme == "gruvbox"
    assert saved.watches == [Watch("local", "first", str(first)), Watch("local", "second", str(second))]

    again = build_app(state=None, poll_interval=None, refresh_throttle=0)
    apply_config(saved, again, ["local"])
    assert again.theme == "gruvbox" and {"ext:first", "ext:second"} <= set(again.state.externals)


def test_an_unchanged_session_leaves_the_file_alone(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text("# my comment\n" + GOOD)
    config = load_config(path)
    app = build_app(state=None, poll_interval=None, refresh_throttle=0)
    applied = apply_config(config, app, ["local"])
    cli.save_session(config, app, ["local"], applied)
    assert path.read_text().startswith("# my comment\n")  # nothing changed: not rewritten


def test_a_file_broken_meanwhile_is_not_overwritten(tmp_path, capsys):
    path = tmp_path / "config.toml"
    path.write_text(GOOD)
    config = load_config(path)
    app = build_app(state=None, poll_interval=None, refresh_throttle=0)
    applied = apply_config(config, app, ["local"])
    app.theme = "gruvbox"
    path.write_text("hosts = [")
    cli.save_session(config, app, ["local"], applied)
    assert path.read_text() == "hosts = [" and "the config file was not saved" in capsys.readouterr().err
