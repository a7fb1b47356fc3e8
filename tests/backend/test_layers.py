"""The layering at run time: the agent path loads only the standard library, and the contracts can fail.

The rules themselves are import-linter contracts in pyproject.toml (checked by `lint-imports` in CI). These tests
prove what a static reading cannot: that importing every module of the agent path's folders in a fresh interpreter
loads nothing outside the standard library, that a planted violation breaks the contracts, and that every
function-local import has its reason listed.
"""

import ast
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from tests.fixtures.env import ROOT

AGENT_PATH_FOLDERS = ("agent", "host", "jobs", "metrics", "external")
NOT_ON_THE_AGENT_PATH = {"profiles", "__main__"}  # profiles: pydantic, read by the console and the jobs, never the agent


def agent_path_modules() -> list[str]:
    """Every module of the agent path's folders, and the top-level vocabulary but profiles, by walking the tree."""
    backend = ROOT / "backend"
    top = [f"backend.{p.stem}" for p in sorted(backend.glob("*.py")) if p.stem not in NOT_ON_THE_AGENT_PATH and p.stem != "__init__"]
    folders = [
        ".".join(p.relative_to(ROOT).with_suffix("").parts)
        for folder in AGENT_PATH_FOLDERS
        for p in sorted((backend / folder).rglob("*.py"))
        if p.stem != "__main__"
    ]
    return top + [name.removesuffix(".__init__") for name in folders]


def loaded_after_importing(modules: list[str]) -> list[str]:
    code = (
        "import sys, importlib\n"
        "before = set(sys.modules)\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print('\\n'.join(sorted(set(sys.modules) - before)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_the_agent_path_loads_only_the_standard_library():
    modules = agent_path_modules()
    assert {"backend.agent.server", "backend.jobs.stop", "backend.metrics.index", "backend.external.reader", "backend.host.gpu"} <= set(modules)
    top_levels = {name.split(".")[0] for name in loaded_after_importing(modules)}
    assert top_levels - set(sys.stdlib_module_names) - {"backend"} == set()


def test_the_agent_loads_no_chain_training_serving_or_profile_code():
    loaded = loaded_after_importing(["backend.agent.server"])
    off_path = ("backend.train", "backend.serve", "backend.bench", "backend.chain", "backend.profiles")
    assert [name for name in loaded if name.startswith(off_path)] == []


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(Path(sys.executable).parent / "lint-imports")], cwd=root, capture_output=True, text=True, timeout=300)


def test_the_contracts_hold_and_a_planted_violation_breaks_them(tmp_path):
    copy = tmp_path / "tree"
    for part in ("backend", "console"):
        shutil.copytree(ROOT / part, copy / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
    kept = lint_imports(copy)
    assert kept.returncode == 0, kept.stdout[-3000:]
    with open(copy / "backend" / "jobs" / "records.py", "a") as handle:
        handle.write("\n\ndef _planted():\n    from backend.serve import launch  # a deferred import is an import\n\n    return launch\n")
    with open(copy / "console" / "state.py", "a") as handle:
        handle.write("\nfrom backend.jobs import registry  # noqa: E402\n")
    broken = lint_imports(copy)
    assert broken.returncode != 0
    assert "backend components are layered: a folder imports only the folders below it BROKEN" in broken.stdout
    assert "the agent path loads only the standard library BROKEN" in broken.stdout
    assert "the console imports only backend's contract modules BROKEN" in broken.stdout


def deferred_project_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import of backend/console made inside a function of `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for inner in ast.walk(node):
                names = (
                    [inner.module]
                    if isinstance(inner, ast.ImportFrom) and inner.module
                    else [a.name for a in getattr(inner, "names", [])]
                    if isinstance(inner, ast.Import)
                    else []
                )
                found += [(inner.lineno, name) for name in names if name.split(".")[0] in ("backend", "console")]
    return sorted(set(found))


def test_every_deferred_import_is_listed_with_its_reason():
    """A function-local import hides an edge from a reader; pyproject.toml [tool.eagle3-console.deferred-imports] says
    why each file has them, and an entry goes when its file no longer needs one."""
    listed = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["eagle3-console"]["deferred-imports"]
    deferring = {}
    for path in sorted([*(ROOT / "backend").rglob("*.py"), *(ROOT / "console").rglob("*.py")]):
        imports = deferred_project_imports(path)
        if imports:
            deferring[path.relative_to(ROOT).as_posix()] = imports
    unlisted = {name: imports for name, imports in deferring.items() if name not in listed}
    assert not unlisted, f"function-local imports without a reason in pyproject.toml: {unlisted}"
    assert not set(listed) - set(deferring), f"entries whose file defers no import any more: {sorted(set(listed) - set(deferring))}"
    assert all(isinstance(reason, str) and len(reason) > 20 for reason in listed.values())
