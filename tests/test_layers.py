"""The layering rule of DESIGN.md: backend/ never imports console/ or Textual; the agent path is stdlib-only."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
AGENT_PATH_MODULES = [
    "backend.agent.server",
    "backend.protocol",
    "backend.layout",
    "backend.jsonl",
    "backend.host.gpu",
    "backend.jobs.records",
    "backend.jobs.registry",
    "backend.jobs.discovery",
    "backend.jobs.stop",
    "backend.jobs.watcher",
    "backend.jobs.logs",
    "backend.host.holders",
    "backend.metrics.records",
    "backend.metrics.scan",
    "backend.metrics.index",
    "backend.metrics.series",
    "backend.metrics.signals",
    "backend.smoothing",
    "backend.external.reader",
    "backend.host.datascale",
    "backend.chain.run",
    "backend.safetext",
]
# backend.smoothing: the one EMA, so a curve the console smooths and a signal the agent computes agree (stdlib, no state).
# backend.safetext: the one sanitizer of host text, so the console and the CLI show a hostile string the same inert way.
CONSOLE_MAY_IMPORT = {"backend.protocol", "backend.layout", "backend.commands", "backend.profiles", "backend.smoothing", "backend.safetext", "backend"}


def imported_names(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_backend_never_imports_console_or_textual():
    offenders = []
    for path in (ROOT / "backend").rglob("*.py"):
        for name in imported_names(path):
            top = name.split(".")[0]
            if top in {"console", "textual", "textual_plotext", "plotext"}:
                offenders.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not offenders, offenders


def test_console_reaches_backend_only_through_the_contract_modules():
    allowed = CONSOLE_MAY_IMPORT
    offenders = []
    for path in (ROOT / "console").rglob("*.py"):
        for name in imported_names(path):
            if name.split(".")[0] == "backend" and name not in allowed:
                offenders.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not offenders, offenders


def test_agent_path_imports_only_the_standard_library():
    """Import the agent path in a fresh interpreter and list every third-party module it loaded."""
    present = [m for m in AGENT_PATH_MODULES if (ROOT / (m.replace(".", "/") + ".py")).exists()]
    code = (
        "import sys, importlib\n"
        "before = set(sys.modules)\n"
        f"for m in {present!r}: importlib.import_module(m)\n"
        "std = set(sys.stdlib_module_names)\n"
        "print(sorted({n.split('.')[0] for n in set(sys.modules) - before} - std - {'backend'}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", f"agent path imported non-stdlib modules: {out.stdout}"


def test_the_agent_loads_no_chain_training_or_serving_code():
    code = (
        "import sys, backend.agent\n"
        "print(sorted(m for m in sys.modules if m == 'backend.chain.run' or m.startswith(('backend.train', 'backend.serve', 'backend.bench'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", f"the agent imported: {out.stdout}"
