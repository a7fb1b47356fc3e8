"""Hostile host text is inert: escapes shown, never sent to the terminal, in the sanitizer, the console's screens, the CLI
and the profiles (issue 21 item 3)."""

import json
import os
import pty
import select
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
from rich.text import Text
from textual.widgets import DataTable, Log

from backend.profiles import ProfileError, parse_profile
from backend.safetext import say, unsafe_characters, visible
from console.app import build_app
from console.screens.chain import result_panel_text
from console.screens.modals import AdoptModal, StopModal
from console.widgets.curve_plot import CurvePlot
from console.format import inert, inert_text, plain_cell
from backend.protocol import GpuHolder
from tests.fixtures.ssh import screen_shown, wait_until
from tests.fixtures.console_states import chain_records, chain_state
from tests.fixtures.console_states import GROK_JOB, grok_state
from tests.fixtures.console_states import STOP_PLAN, frozen_state, wire_jobs
from tests.fixtures.env import ROOT

PY = sys.executable
SIZE = (150, 45)

OSC52 = "\x1b]52;c;aGVsbG8=\x07"  # writes "hello" to the operator's clipboard
OSC0 = "\x1b]0;pwned\x07"  # sets the terminal's (and tmux pane's) title
CSI_CLEAR = "\x1b[2J"  # clears the screen
BIDI = "\u202e"  # right-to-left override: what follows reads backwards
PAYLOADS = [OSC52, OSC0, CSI_CLEAR, BIDI]
ALL = OSC52 + OSC0 + CSI_CLEAR + BIDI
SHOWN = {OSC52: "\\x1b]52;c;aGVsbG8=\\x07", OSC0: "\\x1b]0;pwned\\x07", CSI_CLEAR: "\\x1b[2J", BIDI: "\\u202e"}
RAW = ("\x1b", "\x07", "\x9b", "\x9d", "\u202e")


def raw_in(text: str) -> list[str]:
    return [ascii(char) for char in RAW if char in text]


# -- the sanitizer -------------------------------------------------------------------------------


@pytest.mark.parametrize("payload", PAYLOADS)
def test_each_payload_is_shown_by_its_escapes(payload):
    shown = visible(f"a{payload}b")
    assert shown == f"a{SHOWN[payload]}b"
    assert not raw_in(shown)


def test_every_control_c1_del_and_bidi_character_is_shown_and_ordinary_text_is_untouched():
    hostile = "".join(map(chr, [*range(0x20), 0x7F, *range(0x80, 0xA0), 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A)]))
    shown = visible(hostile)
    assert shown.isascii() and shown.isprintable()
    assert "\\x1b" in shown and "\\x9b" in shown and "\\x7f" in shown and "\\u2066" in shown and "\\x00" in shown
    ordinary = "step 10 loss 1.5 · τ̂ 3.94 → ok [rank0] C:\\path\\x1b literal 日本語 ✓"
    assert visible(ordinary) is ordinary  # backslashes, brackets and non-Latin text stay exactly as written
    assert visible(12) == "12"


def test_keep_leaves_only_the_named_characters():
    assert visible("a\tb\nc\x1b", keep="\t") == "a\tb\\x0ac\\x1b"
    assert visible("a\nb\x1b", keep="\n") == "a\nb\\x1b"


def test_unsafe_characters_are_named_for_error_messages():
    assert unsafe_characters(ALL) == ["ESC (\\x1b)", "BEL (\\x07)", "U+202E (\\u202e)"]
    assert unsafe_characters("plain") == []


def test_say_prints_escapes_and_keeps_its_own_newlines(capsys):
    say(f"one{OSC0}\ntwo{BIDI}")
    assert capsys.readouterr().out == "one\\x1b]0;pwned\\x07\ntwo\\u202e\n"


def test_inert_keeps_the_styles_and_shows_the_escapes():
    text = Text()
    text.append("ours ", style="green")
    text.append(f"cmd{CSI_CLEAR}", style="dim")
    text.append(" end", style="bold")
    shown = inert(text)
    assert shown.plain == "ours cmd\\x1b[2J end"
    assert [(shown.plain[s.start : s.end], str(s.style)) for s in shown.spans] == [("ours ", "green"), ("cmd\\x1b[2J", "dim"), (" end", "bold")]
    ordinary = Text("nothing to show", style="bold")
    assert inert(ordinary) is ordinary
    assert inert_text(lambda: Text(f"x{BIDI}"))().plain == "x\\u202e"


def test_host_text_in_markup_places_shows_as_written():
    """DataTable str cells are Rich markup: a job detail '[red]' or '[/]' must neither style the row nor raise."""
    for hostile in ("[bold red]boom[/]", "[/]", "[rank0]: RuntimeError", f"[link=x]{OSC52}"):
        assert Text.from_markup(plain_cell(hostile)).plain == visible(hostile)
    assert plain_cell("exit 0") == "exit 0"


def test_json_output_escapes_every_unsafe_character():
    """The CLI's --json output (json.dumps, ensure_ascii) already carries no raw control, C1 or bidi character."""
    hostile = "".join(map(chr, [*range(0x20), 0x7F, *range(0x80, 0xA0), 0x202E, 0x2066]))
    dumped = json.dumps({"detail": hostile})
    assert dumped.isascii() and dumped.isprintable() and json.loads(dumped)["detail"] == hostile


# -- the console ---------------------------------------------------------------------------------


def hostile_state():
    """frozen_state() whose host sent escapes in a GPU name, a holder's user and command line, a job's detail, log
    lines, the agent's stderr, a disk path and a note."""
    state = frozen_state()
    samples = [
        {"index": i, "name": f"NVIDIA H200{OSC0}", "memory_used_mib": 1000.0, "memory_total_mib": 143771.0, "utilization_pct": 5.0, "processes": []}
        for i in range(2)
    ]
    state.apply({"type": "gpus", "gpus": samples, "driver": {"available": True, "message": f"NVML{CSI_CLEAR}"}})
    state.apply_holders(
        [
            {"pid": 1234, "owned": True, "job": "train-kimi", "user": "root", "cmdline": "python -m backend train", "gpu_indices": [0], "used_memory_mib": 9.0},
            {"pid": 448, "owned": False, "user": f"bob{BIDI}", "cmdline": f"{OSC52} serve.py", "gpu_indices": [0], "used_memory_mib": 40960.0},
            {"pid": 449, "owned": False, "user": f"bob{BIDI}", "cmdline": f"{OSC52} serve.py", "gpu_indices": [0], "used_memory_mib": 0.0},
        ]
    )
    jobs = wire_jobs(state)
    next(job for job in jobs if job["name"] == "train-kimi")["detail"] = f"{CSI_CLEAR}[bold red]boom[/]"
    state.apply({"type": "jobs", "jobs": jobs})
    state.apply({"type": "log", "job": "train-kimi", "stream": "stdout", "lines": [f"step 1 {line}" for line in PAYLOADS]})
    state.apply({"type": "log", "job": "train-kimi", "stream": "stderr", "lines": [f"warn {ALL}"]})
    state.agent_stderr.append(f"agent: {OSC0}")
    state.note_action(f"stop train-kimi: {OSC52}")
    return state


def text_of(app, selector: str) -> str:
    return str(app.screen.query_one(selector).render())


async def shown(pilot, *keys: str) -> str:
    """The screen after `keys`, as exported (what a terminal would be sent, in SVG)."""
    for key in keys:
        await pilot.press(key)
        await pilot.pause()
    pilot.app.redraw_now()
    await pilot.pause()
    return pilot.app.export_screenshot()


async def test_dashboard_and_logs_show_hostile_host_text_inert():
    app = build_app(state=hostile_state(), poll_interval=None, refresh_throttle=0)
    async with app.run_test(size=SIZE) as pilot:
        app.select_job("train-kimi")
        await pilot.pause()
        app.note(f"stop train-kimi: {OSC0} [bold]x[/]")  # a note embeds host text: a toast and an Actions line
        screen = await shown(pilot, "h")
        assert not raw_in(screen)
        gpus = text_of(app, "#gpus")
        assert "H200\\x1b]0;p" in gpus and "\\x1b]52;c;aGV" in gpus and "bob\\u202e" in gpus  # cut to the panel's width
        row = app.screen.query_one("#jobs", DataTable).get_row_at(0)
        assert Text.from_markup(row[-1]).plain == "\\x1b[2J[bold red]boom[/]"[:40]
        assert SHOWN[OSC52] in text_of(app, "#actions")

        screen = await shown(pilot, "3")
        assert not raw_in(screen)
        stdout = "\n".join(app.screen.query_one("#log-stdout", Log).lines)
        assert all(f"step 1 {SHOWN[p]}" in stdout for p in PAYLOADS)
        assert SHOWN[OSC0] in text_of(app, "#agent-stderr")


async def test_the_stop_confirmation_shows_hostile_command_lines_inert_and_whole():
    plan = json.loads(json.dumps(STOP_PLAN))
    plan["will_signal"][0]["cmdline"] = f"python -m backend train {OSC52}"
    plan["foreign_gpu_holders"][0].update(user=f"bob{BIDI}", cmdline=f"python3 serve.py {OSC0}{CSI_CLEAR}")
    app = build_app(state=frozen_state(), poll_interval=None, refresh_throttle=0)
    async with app.run_test(size=SIZE) as pilot:
        app.push_screen(StopModal("train-kimi", plan, 30.0))
        await wait_until(lambda: screen_shown(app, StopModal))
        screen = await shown(pilot)
        assert not raw_in(screen)
        text = text_of(app, "#stop-plan")
        assert SHOWN[OSC52] in text and f"bob{SHOWN[BIDI]}" in text and "\\x1b]0;pwned\\x07\\x1b[2J" in text
        assert "Checkpoint first" in text  # what followed the escapes is still there
        app.pop_screen()
        holder = GpuHolder(pid=448, owned=False, user=f"bob{BIDI}", cmdline=f"python3 serve.py {OSC52}", used_memory_mib=1.0)
        app.push_screen(AdoptModal([holder], 448))
        await wait_until(lambda: screen_shown(app, AdoptModal))
        assert not raw_in(await shown(pilot))
        assert SHOWN[OSC52][:20] in text_of(app, "#adopt-candidates")


async def test_chain_stages_and_result_show_hostile_details_inert():
    state = chain_state(chain_records(fail=("canary", f"red: {OSC52} Likely causes, in order: {OSC0}; {CSI_CLEAR}")))
    app = build_app(state=state, poll_interval=None, refresh_throttle=0)
    async with app.run_test(size=SIZE) as pilot:
        app.select_job("train-kimi")
        await pilot.pause()
        screen = await shown(pilot, "5")
        assert not raw_in(screen)
        assert SHOWN[OSC52] in text_of(app, "#chain-result")
        details = [str(app.screen.query_one("#stages", DataTable).get_row_at(i)[-1]) for i in range(8)]
        assert any(SHOWN[OSC52] in detail for detail in details)
    assert SHOWN[CSI_CLEAR] in result_panel_text(chain_records(fail=("stop", CSI_CLEAR))).plain


async def test_grokking_panels_show_hostile_metrics_keys_and_warnings_inert():
    state = grok_state()
    signals = state.signals[GROK_JOB]
    signals.setdefault("weight_norm", {}).setdefault("modules", {})[f"fc{CSI_CLEAR}"] = {"latest": 1.0, "relative_change": 0.1}
    signals["warnings"] = [*(signals.get("warnings") or []), f"warn {OSC52}"]
    state.data_scaling[GROK_JOB] = {"error": f"no shards {OSC0}"}
    modules = state.metrics[GROK_JOB].weight_norm_modules
    modules[f"x{CSI_CLEAR}"] = modules.pop("lm_head")  # a metrics key: the weight-norm plot's legend
    app = build_app(state=state, poll_interval=None, refresh_throttle=0)
    async with app.run_test(size=(170, 50)) as pilot:
        app.select_job(GROK_JOB)
        await pilot.pause()
        screen = await shown(pilot, "4")
        assert not raw_in(screen)
        assert "fc\\x1b[2J" in text_of(app, "#grok-norms")
        assert SHOWN[OSC52] in text_of(app, "#grok-signals")
        assert SHOWN[OSC0] in text_of(app, "#grok-data")
        assert "x\\x1b[2J" in " ".join(app.screen.query_one("#grok-weight", CurvePlot).legend)


# -- the CLI -------------------------------------------------------------------------------------

FAKE_TORCHRUN = """# a job whose stderr looks like torch.distributed.run's failure summary, with hostile text in it
import sys
bad = sys.argv[1]
print("step 1 " + bad)
print("[rank0]: RuntimeError: " + bad, file=sys.stderr)
print("Root Cause (first observed failure):", file=sys.stderr)
print("  rank      : 0 (local_rank: 0)", file=sys.stderr)
print("  exitcode  : 1 (pid: 4242)", file=sys.stderr)
sys.exit(1)
"""


def host_process(run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PY, "-m", "backend", *args], cwd=ROOT, capture_output=True, text=True, timeout=90, env={**os.environ, "EAGLE3_RUN_DIR": str(run_dir)}
    )


def on_a_terminal(run_dir: Path, *args: str) -> str:
    """`python -m backend ARGS` with its stdout on a pseudo-terminal: what a terminal would be sent."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [PY, "-m", "backend", *args], cwd=ROOT, stdout=follower, stderr=subprocess.STDOUT, env={**os.environ, "EAGLE3_RUN_DIR": str(run_dir)}
    )
    os.close(follower)
    out = b""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ready, _, _ = select.select([leader], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the follower side closed: the process is done
                break
            if not chunk:
                break
            out += chunk
        elif proc.poll() is not None:
            break
    proc.wait(timeout=30)
    os.close(leader)
    return out.decode()


def test_job_list_and_tail_print_hostile_job_text_inert(tmp_path):
    """A real job whose argv, torchrun failure detail and log carry escapes: `job list` shows them as escapes (a
    pipe too), `--json` stays exact JSON, `job tail` shows escapes on a terminal and copies the log exactly into a pipe."""
    started = host_process(tmp_path, "job", "start", "--name", "evil", "--", PY, "-c", "# torch.distributed.run\n" + FAKE_TORCHRUN, ALL)
    assert started.returncode == 0, started.stderr
    from backend.jobs.registry import JobRegistry

    registry = JobRegistry(tmp_path)
    deadline = time.monotonic() + 30
    while registry.get("evil").info.state == "running":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert OSC52 in registry.get("evil").detail  # the host really holds the hostile text

    listing = host_process(tmp_path, "job", "list")
    assert listing.returncode == 0, listing.stderr
    assert not raw_in(listing.stdout)
    assert "RuntimeError: \\x1b]52;c;aGVsbG8=\\x07\\x1b]0;pwned\\x07\\x1b[2J\\u202e" in listing.stdout
    assert not raw_in(on_a_terminal(tmp_path, "job", "list"))

    exact = host_process(tmp_path, "job", "list", "--json")
    assert not raw_in(exact.stdout)
    job = next(j for j in json.loads(exact.stdout) if j["name"] == "evil")
    assert OSC52 in job["detail"] and job["argv"][-1] == ALL

    terminal = on_a_terminal(tmp_path, "job", "tail", "evil")
    assert not raw_in(terminal) and "step 1 " + visible(ALL) in terminal
    assert host_process(tmp_path, "job", "tail", "evil").stdout == f"step 1 {ALL}\n"  # into a pipe: the log as written


# -- profiles ------------------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["name", "description", "serve.host"])
@pytest.mark.parametrize("payload", PAYLOADS)
def test_a_profile_refuses_escapes_in_its_text_fields(field, payload):
    raw = tomllib.loads((ROOT / "profiles" / "tiny.toml").read_text())
    if field == "serve.host":
        raw["serve"] = {**raw.get("serve", {}), "host": f"127.0.0.1{payload}"}
    else:
        raw[field] = f"tiny{payload}"
    with pytest.raises(ProfileError) as caught:
        parse_profile(raw, "evil.toml")
    message = str(caught.value)
    assert f"profile evil.toml: field '{field}'" in message and "without control, escape or bidi characters" in message
    assert ("U+202E (\\u202e)" if payload == BIDI else "ESC (\\x1b)") in message
    assert not raw_in(message)  # the error itself is safe to print
    raw = tomllib.loads((ROOT / "profiles" / "tiny.toml").read_text())
    assert parse_profile(raw, "tiny.toml").name == "tiny"
