"""Profiles: TOML files naming the target model, draft shape, training and serving settings, as typed objects.

Validation is strict (a number written as a string, or a float where an integer belongs, is refused, never
coerced; no NaN or infinity) and cross-field (draft vocab within the target vocab, a seq_len the draft's
positions cover and at most 1<<20). Every error names the file, the field, the value and what was expected.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import ErrorDetails

from backend.safetext import unsafe_characters

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 hosts
    import tomli as tomllib

PROFILES_DIR = Path(__file__).resolve().parent.parent / "profiles"


class ProfileError(ValueError):
    """A profile file is missing, unreadable, or has a wrong or missing field."""


MAX_SEQ_LEN = 1 << 20


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


def _field_error(name: str, value, expectation: str) -> ValueError:
    """A cross-field error; `name` is relative to the model raising it ('@' marks it for _describe)."""
    return ValueError(f"@{name} = {value!r}: expected {expectation}")


class TargetConfig(_Strict):
    path: str = Field(description="HF model dir or id on the host; 'builtin:tiny' for the embedded CPU target; 'wheel:NAME' for a known wheel target")
    architecture: str = Field(description="the target's HF/SGLang architecture class")
    hidden_size: int = Field(gt=0)
    num_layers: int = Field(gt=0)
    vocab_size: int = Field(gt=0)
    aux_layer_ids: list[int] = Field(description="output-of-layer ids captured for the draft (3 of them)")
    dtype: Literal["float32", "float16", "bfloat16"] = "bfloat16"

    @model_validator(mode="after")
    def _aux_ids_in_range(self) -> "TargetConfig":
        ids = self.aux_layer_ids
        if len(ids) != 3:
            raise _field_error("aux_layer_ids", ids, f"3 layer ids, got {len(ids)}")
        for layer in ids:
            if not 0 <= layer < self.num_layers:
                raise _field_error(
                    "aux_layer_ids",
                    ids,
                    f"ids within 0..{self.num_layers - 1}: aux layer id {layer} is outside 0..{self.num_layers - 1} (num_layers={self.num_layers})",
                )
        if sorted(set(ids)) != list(ids):
            raise _field_error("aux_layer_ids", ids, "strictly increasing layer ids")
        return self

    @property
    def aux_width(self) -> int:
        return len(self.aux_layer_ids) * self.hidden_size


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """SpecForge/SGLang default, output-of-layer convention: [1, N//2-1, N-4]."""
    return [1, num_layers // 2 - 1, num_layers - 4]


class DraftConfig(_Strict):
    hidden_size: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)
    head_dim: int | None = Field(default=None, gt=0)
    intermediate_size: int = Field(gt=0)
    draft_vocab_size: int = Field(gt=0)
    rms_norm_eps: float = Field(default=1e-6, gt=0)
    rope_theta: float = Field(default=500000.0, gt=0)
    max_position_embeddings: int = Field(default=4096, gt=0)

    @model_validator(mode="after")
    def _heads_divide(self) -> "DraftConfig":
        if self.num_attention_heads % self.num_key_value_heads:
            raise _field_error("num_attention_heads", self.num_attention_heads, f"a multiple of num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise _field_error("hidden_size", self.hidden_size, f"a multiple of num_attention_heads ({self.num_attention_heads}) when head_dim is unset")
        return self


class TrainConfig(_Strict):
    learning_rate: float = Field(default=1e-4, gt=0)
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1)
    warmup_steps: int = Field(default=100, ge=0)
    max_steps: int = Field(default=1000, gt=0)
    batch_size: int = Field(default=1, gt=0)
    seq_len: int = Field(default=2048, gt=1)
    ttt_length: int = Field(default=7, gt=0)
    schedule: Literal["cosine", "constant"] = "cosine"
    grad_clip: float = Field(default=0.5, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    eval_interval: int = Field(default=500, gt=0)
    save_interval: int = Field(default=1000, gt=0)
    log_interval: int = Field(default=10, gt=0)
    grokfast_alpha: float | None = Field(default=None, gt=0, lt=1)
    grokfast_lambda: float = Field(default=2.0, ge=0)
    # the teacher's softmax temperature over the draft vocabulary: 1 is the target's distribution (EAGLE-3's and
    # SpecForge's objective); below 1 a sharper teacher, the argmax (what a greedy chain accepts) weighted more
    teacher_temperature: float = Field(default=1.0, gt=0)
    seed: int = 0
    dtype: Literal["float32", "bfloat16"] = "bfloat16"


class ServeConfig(_Strict):
    engine: Literal["sglang", "reference"] = "sglang"
    host: str = "127.0.0.1"
    port: int = Field(default=30000, gt=0, lt=65536)
    tp_size: int = Field(default=1, gt=0)
    dtype: Literal["float16", "bfloat16", "float32"] = "bfloat16"
    num_steps: int = Field(default=3, gt=0)
    eagle_topk: int = Field(default=1, gt=0)
    num_draft_tokens: int = Field(default=4, gt=0)
    mem_fraction_static: float = Field(default=0.8, gt=0, le=1)
    trust_remote_code: bool = False
    extra_args: list[str] = Field(default_factory=list)
    # options for the reference server (`--engine reference`) beyond what the launcher sets, e.g. ["--compile-steps"]
    reference_args: list[str] = Field(default_factory=list)
    ready_timeout_s: float = Field(default=1200, gt=0)


class PathsConfig(_Strict):
    run_dir: str = "~/.eagle3"
    data_dir: str = "~/.eagle3/data"


class Profile(_Strict):
    name: str
    description: str = ""
    target: TargetConfig
    draft: DraftConfig
    train: TrainConfig = TrainConfig()
    serve: ServeConfig = ServeConfig()
    paths: PathsConfig = PathsConfig()
    source: str = Field(default="", description="file the profile was loaded from")

    @model_validator(mode="after")
    def _fields_agree(self) -> "Profile":
        # name, description and serve.host are shown on terminals and put in command lines: one plain line each
        for field, value in {"name": self.name, "description": self.description, "serve.host": self.serve.host}.items():
            found = unsafe_characters(value)
            if found:
                raise _field_error(field, value, f"one line of plain text, without control, escape or bidi characters (found {', '.join(found)})")
        draft, target, train = self.draft, self.target, self.train
        if draft.draft_vocab_size > target.vocab_size:
            raise _field_error(
                "draft.draft_vocab_size",
                draft.draft_vocab_size,
                f"at most target.vocab_size ({target.vocab_size}): the draft predicts a subset of the target's tokens",
            )
        if train.seq_len > draft.max_position_embeddings:
            raise _field_error("train.seq_len", train.seq_len, f"at most draft.max_position_embeddings ({draft.max_position_embeddings})")
        if train.seq_len > MAX_SEQ_LEN:
            raise _field_error("train.seq_len", train.seq_len, f"at most {MAX_SEQ_LEN} (1<<20) tokens")
        return self


def _describe(error: ErrorDetails, raw: dict) -> str:
    loc = ".".join(str(part) for part in error["loc"]) or "(top level)"
    if error["type"] == "missing":
        return f"field '{loc}' is missing ({error['msg'].lower()})"
    value = error.get("input")
    if error["type"] == "extra_forbidden":
        return f"field '{loc}' = {value!r} is not a known field"
    message = error["msg"]
    if error["type"] == "value_error" and "@" in message:
        relative, rest = message.split("@", 1)[1].split(" = ", 1)
        return f"field '{loc + '.' if error['loc'] else ''}{relative}' = {rest}"
    expectation = message[0].lower() + message[1:]
    if isinstance(value, str) and error["type"] in ("int_type", "float_type", "bool_type"):
        expectation += " (a TOML number or boolean, not a quoted string)"
    return f"field '{loc}' = {value!r}: expected {expectation}"


def parse_profile(raw: dict, source: str) -> Profile:
    try:
        return Profile.model_validate({**raw, "source": source})
    except ValidationError as exc:
        problems = "; ".join(_describe(e, raw) for e in exc.errors())
        raise ProfileError(f"profile {source}: {problems}") from None


def resolve_profile_path(name_or_path: str) -> Path:
    path = Path(name_or_path).expanduser()
    if path.suffix == ".toml" or path.exists():
        return path
    return PROFILES_DIR / f"{name_or_path}.toml"


def load_profile(name_or_path: str) -> Profile:
    """Load `tiny`, `llama3.1-8b`, `kimi-k2.5` (from profiles/) or a path to a TOML file."""
    path = resolve_profile_path(name_or_path)
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in PROFILES_DIR.glob("*.toml")))
        raise ProfileError(f"profile {name_or_path!r}: no file {path} (known profiles: {known})")
    try:
        raw = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise ProfileError(f"profile {path}: cannot read: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"profile {path}: not valid TOML: {exc}") from None
    return parse_profile(raw, str(path))


def available_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("*.toml"))
