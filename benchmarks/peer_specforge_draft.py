#!/usr/bin/env python3
"""SpecForge's own draft class loads our trained tiny checkpoint: missing/unexpected keys, logits over the TTT steps, argmax.

    .venv/bin/python benchmarks/peer_specforge_draft.py [--checkpoint DIR] [--specforge-src DIR] [--ttt-length N]
                                                          [--out FILE]

This file holds no SpecForge code. It runs in two processes:
1. Here (the project venv): a side venv, PEER_SPECFORGE_VENV or <cache>/peer-specforge, with SpecForge installed from
   PyPI with --no-deps (specforge==0.2.0, the newest release there) plus the one package its import chain adds to
   what the project venv already has (triton, for its LogSoftmaxLoss kernel, run by TRITON_INTERPRET=1 on the CPU).
   The side venv reads the project venv's packages (torch, transformers, safetensors) through a .pth line, so both
   models run on the same torch. --specforge-src DIR puts a SpecForge source tree (e.g. a `git archive` of v0.3.0,
   commit 2768619e) ahead of the installed one instead.
2. In the side venv (--inside): our checkpoint (default: the newest cached trained tiny test run, else one trained
   now) is loaded twice:
   - ours: backend.train.checkpoint.load_checkpoint, Eagle3Draft.ttt_forward;
   - SpecForge's: AutoDraftModelConfig.from_file(config.json) -> AutoDraftModel.from_config (its
     LlamaForCausalLMEagle3, sdpa), load_state_dict(model.safetensors, strict=False), load_embedding(target dir),
     and its own TTT loop, OnlineEagle3Model.forward, on input ids and teacher shifted by its own padding() as
     TargetHead.preprocess shifts them.
     The logits of each TTT step are read from a forward hook on its lm_head (nothing of SpecForge is replaced).
   Both read the same batch: two held-out windows of the tiny target's corpus, with the target's aux hidden states.
   The result names missing and unexpected keys (the embedding is the only key allowed missing: SpecForge's
   exporter drops it and serving takes the target's), shape and dtype differences, d2t/t2d meaning, and per TTT step
   the max abs logit difference and the argmax agreement (all positions, and positions whose label is inside the
   window). Written to --out (default benchmarks/results/peer_specforge_draft.json); exit 1 when the contract breaks.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
SPECFORGE_VERSION = "0.2.0"
EXTRA_PACKAGES = ["triton"]  # what `import specforge.algorithms.eagle3.model` needs beyond the project venv
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "peer_specforge_draft.json"
LOGIT_TOLERANCE = 1e-4  # float32 on CPU: the two implementations sum in different orders
ALLOWED_MISSING = ("embed_tokens.weight",)
SEQ_LEN, BATCH = 128, 2


def log(message: str) -> None:
    print(f"peer_specforge_draft: {message}", file=sys.stderr, flush=True)


def cache_root() -> Path:
    from backend.train.tiny import cache_root as root

    return root()


# --------------------------------------------------------------------------- 1. the side venv (project venv side)


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def ensure_venv(venv: Path, specforge_src: Path | None) -> None:
    import sysconfig

    project_site = sysconfig.get_paths()["purelib"]
    stamp = f"specforge=={SPECFORGE_VERSION} {' '.join(EXTRA_PACKAGES)} over {project_site}"
    python = venv_python(venv)
    stamp_file = venv / ".eagle3-stamp"
    if python.exists() and stamp_file.is_file() and stamp_file.read_text() == stamp and _imports(python, specforge_src):
        log(f"reusing the side venv {venv}")
        return
    log(f"building the side venv {venv}: specforge=={SPECFORGE_VERSION} --no-deps + {', '.join(EXTRA_PACKAGES)}")
    if not python.exists():
        subprocess.run(["python3", "-m", "venv", str(venv)], check=True)
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], check=True, capture_output=True, text=True
    ).stdout.strip()
    # the project's torch/transformers/safetensors (and this repo's backend) are what both drafts run on
    Path(site, "eagle3_project_venv.pth").write_text(f"import site; site.addsitedir({project_site!r})\n")
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    for argv in (pip + ["--no-deps", f"specforge=={SPECFORGE_VERSION}"], pip + EXTRA_PACKAGES):
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"peer_specforge_draft: pip failed ({' '.join(argv[3:])}):\n{done.stderr[-2000:]}")
    if not _imports(python, specforge_src):
        raise SystemExit(f"peer_specforge_draft: the side venv {venv} still cannot import specforge's EAGLE-3 model")
    stamp_file.write_text(stamp)


def inner_env(specforge_src: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    paths = ([str(specforge_src)] if specforge_src else []) + [str(ROOT)]
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["TRITON_INTERPRET"] = "1"  # SpecForge's triton loss kernel, interpreted on the CPU
    env.setdefault("OMP_NUM_THREADS", os.environ.get("EAGLE3_THREADS", "1"))
    return env


def _imports(python: Path, specforge_src: Path | None) -> bool:
    done = subprocess.run(
        [str(python), "-W", "ignore", "-c", "import specforge.algorithms.eagle3.model"], env=inner_env(specforge_src), capture_output=True, text=True
    )
    return done.returncode == 0


def default_checkpoint() -> Path:
    """The newest cached trained tiny test run (tests/conftest.py), else a run trained now."""
    from backend.serve.preflight import resolve_draft_dir

    runs = sorted((cache_root() / "test-runs").glob("trained-tiny-*"), key=lambda p: p.stat().st_mtime, reverse=True)
    for run in runs:
        if (run / "checkpoints" / "latest").is_file():
            return resolve_draft_dir(run)
    run = cache_root() / "peer-specforge-run"
    if not (run / "checkpoints" / "latest").is_file():
        log(f"no trained tiny run cached: training one (300 steps) into {run}")
        subprocess.run(
            [sys.executable, "-m", "backend", "train", "--profile", "tiny", "--out", str(run), "--max-steps", "300"],
            cwd=ROOT,
            check=True,
            env={**os.environ, "OMP_NUM_THREADS": os.environ.get("EAGLE3_THREADS", "1")},
        )
    return resolve_draft_dir(run)


# --------------------------------------------------------------------------- 2. the comparison (side venv)


def batch_from_target(profile_name: str, seq_len: int, batch: int):
    """Two held-out corpus windows of the tiny target, their aux hidden states and teacher logits."""
    import torch

    from backend.profiles import load_profile
    from backend.train.target import load_target
    from backend.train.tiny import read_corpus

    target = load_target(load_profile(profile_name))
    text = read_corpus(target.path, "val")
    stride = (len(text) - seq_len) // max(batch, 1)
    ids = torch.tensor([list(text[i * stride : i * stride + seq_len]) for i in range(batch)], dtype=torch.long)
    captured = target.capture(ids)
    return target, ids, captured.aux_hidden.float(), captured.logits.float()


def tensor_facts(state: dict) -> dict[str, tuple[list[int], str]]:
    return {name: (list(t.shape), str(t.dtype).replace("torch.", "")) for name, t in state.items()}


def compare(checkpoint: Path, profile_name: str, ttt_length: int) -> dict:
    import specforge
    import torch
    from safetensors.torch import load_file
    from specforge.algorithms.eagle3.model import OnlineEagle3Model
    from specforge.modeling.auto import AutoDraftModel, AutoDraftModelConfig
    from specforge.utils import padding

    from backend.train.checkpoint import load_checkpoint

    torch.manual_seed(0)
    target, ids, aux, teacher = batch_from_target(profile_name, SEQ_LEN, BATCH)
    started = time.monotonic()

    # ours
    ours, config, _meta, _state = load_checkpoint(checkpoint, target_embedding=target.embed_weight())
    ours.eval().float()
    with torch.no_grad():
        our_logits = ours.ttt_forward(aux, ids, ttt_length, pad_token_id=0)

    # SpecForge's class, from the files alone
    sf_config = AutoDraftModelConfig.from_file(str(checkpoint / "config.json"))
    sf = AutoDraftModel.from_config(sf_config, torch_dtype=torch.float32, attention_backend="sdpa")
    expected = tensor_facts(sf.state_dict())
    saved = load_file(str(checkpoint / "model.safetensors"))
    got = tensor_facts(saved)
    shape_or_dtype = {name: {"specforge": expected[name], "ours": got[name]} for name in sorted(set(expected) & set(got)) if expected[name] != got[name]}
    load_error = None
    try:
        missing, unexpected = sf.load_state_dict(saved, strict=False)
    except RuntimeError as exc:  # size mismatches raise even with strict=False
        missing, unexpected, load_error = sorted(set(expected) - set(got)), sorted(set(got) - set(expected)), str(exc)
    sf.load_embedding(str(target.path), embedding_key="model.embed_tokens.weight")
    sf.eval()

    draft_ids = torch.arange(sf.draft_vocab_size)
    mapping = {
        "d2t_target_ids_equal": bool(torch.equal(draft_ids + sf.d2t, ours.draft_to_target_ids(draft_ids))),
        "t2d_equal": bool(torch.equal(sf.t2d.bool(), ours.t2d.bool())),
        "t2d_marks_d2t_targets": bool(sf.t2d[draft_ids + sf.d2t].all()),
        "embedding_equal": bool(torch.equal(sf.embed_tokens.weight, ours.embed_tokens.weight.float())),
    }

    # SpecForge's TTT loop, logits read at its lm_head
    captured: list = []
    hook = sf.lm_head.register_forward_hook(lambda _m, _i, out: captured.append(out.detach()))
    # TargetHead.preprocess's shift: the draft reads token t+1 at position t, the teacher row likewise
    sf_ids, sf_target, loss_mask = padding(ids, left=False), padding(teacher, left=False), torch.ones_like(ids)[..., None]
    model = OnlineEagle3Model(sf, length=ttt_length, attention_backend="sdpa")
    with torch.no_grad():
        model(input_ids=sf_ids, attention_mask=torch.ones_like(ids), target=sf_target, loss_mask=loss_mask, hidden_states=aux)
    hook.remove()

    steps = []
    for k, (mine, theirs) in enumerate(zip(our_logits, captured)):
        valid = SEQ_LEN - 1 - k  # positions t whose label t+1+k lies inside the window
        agree = (mine.argmax(-1) == theirs.argmax(-1)).float()
        steps.append(
            {
                "step": k,
                "max_abs_diff": float((mine - theirs).abs().max()),
                "argmax_agreement": float(agree.mean()),
                "argmax_agreement_labelled": float(agree[:, :valid].mean()),
                "logit_scale": float(theirs.abs().max()),
            }
        )
    missing_other = [k for k in missing if k not in ALLOWED_MISSING]
    ok = (
        not missing_other
        and not unexpected
        and not shape_or_dtype
        and load_error is None
        and all(mapping.values())
        and len(captured) == ttt_length
        and all(s["max_abs_diff"] <= LOGIT_TOLERANCE and s["argmax_agreement"] == 1.0 for s in steps)
    )
    return {
        "ok": ok,
        "specforge": {
            "version": getattr(specforge, "__version__", None) or _dist_version("specforge"),
            "source": str(Path(specforge.__file__).parent),
            "commit": _tree_commit(Path(specforge.__file__).parent.parent),
            "draft_class": f"{type(sf).__module__}.{type(sf).__name__}",
            "ttt_loop": "OnlineEagle3Model.forward (sdpa)",
        },
        "checkpoint": str(checkpoint),
        "batch": {"windows": BATCH, "seq_len": SEQ_LEN, "source": "the tiny target's held-out corpus", "ttt_length": ttt_length},
        "keys": {
            "specforge": len(expected),
            "ours": len(got),
            "missing": sorted(missing),
            "unexpected": sorted(unexpected),
            "missing_allowed": list(ALLOWED_MISSING),
            "shape_or_dtype_differences": shape_or_dtype,
            "load_error": load_error,
        },
        "vocab_mapping": mapping,
        "ttt_steps_captured": len(captured),
        "tolerance": LOGIT_TOLERANCE,
        "max_abs_diff": max((s["max_abs_diff"] for s in steps), default=None),
        "argmax_agreement": min((s["argmax_agreement"] for s in steps), default=None),
        "steps": steps,
        "compare_s": round(time.monotonic() - started, 2),
    }


def _tree_commit(tree: Path) -> str | None:
    """The commit a `git archive` export was made from, when its SPECFORGE_COMMIT file says (None for the PyPI release)."""
    marker = tree / "SPECFORGE_COMMIT"
    return marker.read_text().strip() if marker.is_file() else None


def _dist_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


# --------------------------------------------------------------------------- entry


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, help="our draft checkpoint (or run) dir; default: a trained tiny run")
    parser.add_argument("--profile", default="tiny", help="profile of the target the draft was trained on (default tiny)")
    parser.add_argument("--specforge-src", type=Path, help="a SpecForge source tree to import instead of the PyPI release")
    parser.add_argument("--ttt-length", type=int, default=7)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.specforge_src and not (args.specforge_src / "specforge" / "algorithms" / "eagle3" / "model.py").is_file():
        parser.error(f"--specforge-src {args.specforge_src} holds no specforge/algorithms/eagle3/model.py; nothing was run")
    if args.ttt_length < 1:
        parser.error("--ttt-length must be >= 1")
    if args.inside:
        import warnings

        warnings.filterwarnings("ignore", message=".*flash_attn.*")
        result = compare(args.checkpoint, args.profile, args.ttt_length)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        return 0

    from backend.serve.preflight import resolve_draft_dir

    checkpoint = resolve_draft_dir(args.checkpoint.expanduser()) if args.checkpoint else default_checkpoint()
    if not (checkpoint / "config.json").is_file() or not (checkpoint / "model.safetensors").is_file():
        parser.error(f"{checkpoint} holds no config.json + model.safetensors checkpoint; nothing was run")
    venv = Path(os.environ.get("PEER_SPECFORGE_VENV") or cache_root() / "peer-specforge")
    ensure_venv(venv, args.specforge_src)
    inner_out = args.out.with_name(f".{args.out.name}.{os.getpid()}.tmp")
    argv_inner = [
        str(venv_python(venv)),
        str(Path(__file__).resolve()),
        "--inside",
        "--checkpoint",
        str(checkpoint),
        "--profile",
        args.profile,
        "--ttt-length",
        str(args.ttt_length),
        "--out",
        str(inner_out),
    ]
    log(f"comparing {checkpoint} in SpecForge's LlamaForCausalLMEagle3 with ours ({args.ttt_length} TTT steps)")
    done = subprocess.run(argv_inner, cwd=ROOT, env=inner_env(args.specforge_src), capture_output=True, text=True)
    if done.returncode != 0:
        inner_out.unlink(missing_ok=True)
        log(f"the comparison failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
        return 1
    result = json.loads(inner_out.read_text())
    result.update(
        {
            "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": {"host": platform.node(), "cpus": os.cpu_count()},
            "command": "python benchmarks/peer_specforge_draft.py" + (f" --specforge-src {args.specforge_src}" if args.specforge_src else ""),
        }
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    inner_out.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(inner_out, args.out)
    keys = result["keys"]
    tree = f" (tree {result['specforge']['commit'][:8]})" if result["specforge"].get("commit") else ""
    print(
        f"SpecForge {result['specforge']['version']}{tree} {result['specforge']['draft_class'].rsplit('.', 1)[-1]} loads {checkpoint.name}: "
        f"{len(keys['missing'])} missing {keys['missing']}, {len(keys['unexpected'])} unexpected, "
        f"{len(keys['shape_or_dtype_differences'])} shape/dtype differences"
    )
    print(
        f"  d2t/t2d same meaning: {all(result['vocab_mapping'].values())}; TTT steps: {result['ttt_steps_captured']}; "
        f"max abs logit diff {result['max_abs_diff']:.2e} (tolerance {LOGIT_TOLERANCE:g}); "
        f"argmax agreement {100 * result['argmax_agreement']:.1f} %"
    )
    print(f"  {'OK' if result['ok'] else 'CONTRACT BROKEN'}; saved {args.out}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
