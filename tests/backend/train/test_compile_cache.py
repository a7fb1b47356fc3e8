"""torch.compile's artifacts carried between processes (EAGLE3_COMPILE_CACHE): written after a run, hits in the next."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from backend.train.compile_cache import cache_file, load_artifacts

REPO = Path(__file__).resolve().parents[3]


def test_the_file_comes_from_the_environment():
    assert cache_file({}) is None and cache_file({"EAGLE3_COMPILE_CACHE": "  "}) is None
    assert cache_file({"EAGLE3_COMPILE_CACHE": "/tmp/x/artifacts.bin"}) == Path("/tmp/x/artifacts.bin")
    assert cache_file({"EAGLE3_COMPILE_CACHE": "/tmp/x/artifacts.bin"}, "serve") == Path("/tmp/x/artifacts-serve.bin")  # a server's own


def test_a_missing_or_foreign_file_is_only_reported(tmp_path):
    said: list[str] = []
    load_artifacts(tmp_path / "none.bin", said.append)
    (tmp_path / "junk.bin").write_bytes(b"not torch's artifacts")
    load_artifacts(tmp_path / "junk.bin", said.append)
    assert said[0] == f"compile cache: none at {tmp_path / 'none.bin'} yet; this run compiles and writes it"
    assert said[1].startswith(f"compile cache: {tmp_path / 'junk.bin'} ") and said[1].endswith("; compiling as usual")


def test_a_linked_file_is_refused_before_torch_unpickles_it(tmp_path):
    """Loading artifacts runs code from them: a symbolic link (another user could aim it anywhere) is never read."""
    (tmp_path / "elsewhere.bin").write_bytes(b"not torch's artifacts")
    (tmp_path / "artifacts.bin").symlink_to(tmp_path / "elsewhere.bin")
    said: list[str] = []
    load_artifacts(tmp_path / "artifacts.bin", said.append)
    assert said == [
        f"compile cache: {tmp_path / 'artifacts.bin'} is a symbolic link (writes never follow one); refused, nothing was changed; compiling as usual"
    ]


def test_a_process_that_compiled_nothing_writes_nothing(tmp_path):
    """In a fresh process (a test worker may have compiled for other tests before)."""
    code = "import sys; from pathlib import Path; from backend.train.compile_cache import save_artifacts; save_artifacts(Path(sys.argv[1]), print)"
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "artifacts.bin")],
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert not (tmp_path / "artifacts.bin").exists() and done.stdout == ""


COMPILE = textwrap.dedent(
    """
    import sys
    import torch
    from torch._dynamo.utils import counters
    from backend.train.compile_cache import load_artifacts, save_artifacts

    path, step = __import__("pathlib").Path(sys.argv[1]), sys.argv[2]
    if step == "second":
        load_artifacts(path, print)

    def layer(x, w):
        return torch.nn.functional.silu(x @ w) * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)

    x = torch.randn(8, 32, requires_grad=True)
    torch.compile(layer)(x, torch.randn(32, 32)).sum().backward()
    print("hits", counters["inductor"]["fxgraph_cache_hit"], counters["aot_autograd"]["autograd_cache_hit"])
    save_artifacts(path, print)
    """
)


@pytest.mark.slow
def test_the_next_process_on_a_cold_machine_takes_every_graph_from_the_file(tmp_path):
    """Each process gets an empty Inductor cache dir of its own, as a fresh machine would."""
    artifacts = tmp_path / "artifacts.bin"

    def run(step: str) -> list[str]:
        env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / f"inductor-{step}"), "PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
        done = subprocess.run([sys.executable, "-c", COMPILE, str(artifacts), step], env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.splitlines()

    first = run("first")
    assert first[0] == "hits 0 0" and first[1].startswith("compile cache: ") and first[1].endswith(f"written to {artifacts}")
    second = run("second")
    assert second[0].startswith("compile cache: ") and second[0].endswith(f"from {artifacts}")
    graphs, autograd = (int(n) for n in second[1].split()[1:])
    assert graphs >= 2 and autograd == 1  # the forward and backward graphs, and AOTAutograd's entry
