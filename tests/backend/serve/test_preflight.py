"""Preflight: each problem code on checkpoints built here by hand, a good checkpoint passes, the CLI contract."""

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from backend.serve import preflight
from backend.serve.preflight import run_preflight
from tests.fixtures.env import ROOT

H, HEADS, INTER, VOCAB, DRAFT_VOCAB, LAYERS = 16, 2, 32, 40, 24, 8
TRAINED_IDS = [1, 3, 4]


def target_config(tmp_path, **overrides):
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": H, "num_hidden_layers": LAYERS, "vocab_size": VOCAB, "torch_dtype": "float32", **overrides}
    path = tmp_path / "target_config.json"
    path.write_text(json.dumps(config))
    return path


def good_tensors(hidden=H, fc_in=3 * H):
    used = sorted(set(range(1, VOCAB, 2)) | {0, 2, 4, 6})  # 24 of 40 target ids, with gaps
    assert len(used) == DRAFT_VOCAB
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[used] = True
    tensors = {
        "fc.weight": torch.zeros(hidden, fc_in),
        "norm.weight": torch.ones(hidden),
        "lm_head.weight": torch.zeros(DRAFT_VOCAB, hidden),
        "d2t": torch.tensor([t - i for i, t in enumerate(used)], dtype=torch.int64),
        "t2d": t2d,
        "midlayer.self_attn.q_proj.weight": torch.zeros(hidden, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": torch.zeros(hidden, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": torch.zeros(hidden, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": torch.zeros(hidden, hidden),
        "midlayer.mlp.gate_proj.weight": torch.zeros(INTER, hidden),
        "midlayer.mlp.up_proj.weight": torch.zeros(INTER, hidden),
        "midlayer.mlp.down_proj.weight": torch.zeros(hidden, INTER),
        "midlayer.hidden_norm.weight": torch.ones(hidden),
        "midlayer.input_layernorm.weight": torch.ones(hidden),
        "midlayer.post_attention_layernorm.weight": torch.ones(hidden),
    }
    return tensors


def good_config(**overrides):
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": H,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "intermediate_size": INTER,
        "num_hidden_layers": 1,
        "vocab_size": VOCAB,
        "draft_vocab_size": DRAFT_VOCAB,
        "torch_dtype": "float32",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": TRAINED_IDS, "use_aux_hidden_state": True},
        "eagle3_console": {"trained_aux_layer_ids": TRAINED_IDS, "trained_aux_width": 3 * H, "val_acc": [0.8, 0.8, 0.8]},
    }
    config.update(overrides)
    return config


def write_draft(tmp_path, tensors=None, config=None, name="draft"):
    draft = tmp_path / name
    draft.mkdir()
    save_file(tensors if tensors is not None else good_tensors(), str(draft / "model.safetensors"))
    (draft / "config.json").write_text(json.dumps(config if config is not None else good_config()))
    return draft


def check(tmp_path, draft, **kwargs):
    kwargs.setdefault("check_sglang", False)
    return run_preflight(draft, target_config(tmp_path), **kwargs)


def only_codes(report):
    return sorted(set(report.codes()))


def test_good_draft_passes(tmp_path):
    report = check(tmp_path, write_draft(tmp_path))
    assert report.ok, report.problems
    assert report.problems == []


def test_layers0_keys_are_key_prefix_with_convert_hint(tmp_path):
    tensors = {k.replace("midlayer.", "layers.0."): v for k, v in good_tensors().items()}
    report = check(tmp_path, write_draft(tmp_path, tensors))
    assert only_codes(report) == ["key_prefix"]
    assert "layers.0." in report.problems[0].message
    assert "eagle3-host convert SRC DST" in report.problems[0].hint
    assert "Nothing was changed" in report.problems[0].message


def test_unknown_key_is_key_prefix(tmp_path):
    tensors = good_tensors() | {"extra_proj.weight": torch.zeros(2, 2)}
    report = check(tmp_path, write_draft(tmp_path, tensors))
    assert only_codes(report) == ["key_prefix"]
    assert "extra_proj.weight" in report.problems[0].message


def test_model_prefixed_keys_load_in_sglang_and_pass(tmp_path):
    tensors = {(f"model.{k}" if k.startswith(("midlayer.", "fc.", "norm.")) else k): v for k, v in good_tensors().items()}
    assert check(tmp_path, write_draft(tmp_path, tensors)).ok


def test_fc_square_for_three_aux_target_names_both_widths(tmp_path):
    report = check(tmp_path, write_draft(tmp_path, good_tensors(fc_in=H)))
    assert only_codes(report) == ["fc_shape"]
    message = report.problems[0].message
    assert f"takes {H} input features" in message and f"= {3 * H}" in message


def sparse_safetensors(path, shapes):
    """A real safetensors layout (header + zero-filled data) without writing the bytes: a sparse file."""
    header, offset = {}, 0
    for name, (dtype, shape, width) in shapes.items():
        size = width
        for dim in shape:
            size *= dim
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(raw)) + raw)
        handle.truncate(8 + len(raw) + offset)


def test_kimi_shaped_fc_7168_vs_21504(tmp_path):
    draft = tmp_path / "kimi"
    draft.mkdir()
    hidden, inter, vd = 7168, 40960, 32000
    shapes = {
        "fc.weight": ("BF16", [hidden, hidden], 2),  # the broken export: one layer's width
        "norm.weight": ("BF16", [hidden], 2),
        "lm_head.weight": ("BF16", [vd, hidden], 2),
        "d2t": ("I64", [vd], 8),  # zeros: identity mapping onto the first 32000 ids, valid
        "midlayer.self_attn.q_proj.weight": ("BF16", [7168, 2 * hidden], 2),
        "midlayer.self_attn.k_proj.weight": ("BF16", [1024, 2 * hidden], 2),
        "midlayer.self_attn.v_proj.weight": ("BF16", [1024, 2 * hidden], 2),
        "midlayer.self_attn.o_proj.weight": ("BF16", [hidden, 7168], 2),
        "midlayer.mlp.gate_proj.weight": ("BF16", [inter, hidden], 2),
        "midlayer.mlp.up_proj.weight": ("BF16", [inter, hidden], 2),
        "midlayer.mlp.down_proj.weight": ("BF16", [hidden, inter], 2),
        "midlayer.hidden_norm.weight": ("BF16", [hidden], 2),
        "midlayer.input_layernorm.weight": ("BF16", [hidden], 2),
        "midlayer.post_attention_layernorm.weight": ("BF16", [hidden], 2),
    }
    sparse_safetensors(draft / "model.safetensors", shapes)
    config = good_config(
        hidden_size=hidden,
        num_attention_heads=56,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=inter,
        vocab_size=163840,
        draft_vocab_size=vd,
        torch_dtype="bfloat16",
        eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 29, 57]},
    )
    config.pop("eagle3_console")
    (draft / "config.json").write_text(json.dumps(config))
    target = tmp_path / "kimi_target.json"
    target.write_text(
        json.dumps(
            {
                "architectures": ["KimiK25ForConditionalGeneration"],
                "torch_dtype": "bfloat16",
                "text_config": {"hidden_size": hidden, "num_hidden_layers": 61, "vocab_size": 163840},
            }
        )
    )
    report = run_preflight(draft, target, check_sglang=False)
    assert only_codes(report) == ["fc_shape"]
    assert "7168" in report.problems[0].message and "21504" in report.problems[0].message
    assert "one layer's width" in report.problems[0].message


def test_missing_d2t_with_smaller_draft_vocab(tmp_path):
    tensors = good_tensors()
    del tensors["d2t"]
    report = check(tmp_path, write_draft(tmp_path, tensors))
    assert only_codes(report) == ["vocab_map"]
    assert "no d2t" in report.problems[0].message


def test_d2t_absolute_ids_are_not_increasing(tmp_path):
    tensors = good_tensors()
    tensors["d2t"] = tensors["d2t"] + torch.arange(DRAFT_VOCAB)  # absolute ids instead of offsets
    report = check(tmp_path, write_draft(tmp_path, tensors))
    assert "vocab_map" in report.codes()


def test_d2t_out_of_order(tmp_path):
    tensors = good_tensors()
    tensors["d2t"] = torch.flip(tensors["d2t"], [0])
    report = check(tmp_path, write_draft(tmp_path, tensors))
    assert only_codes(report) == ["vocab_map"]
    assert "strictly increasing" in report.problems[0].message


def test_t2d_from_another_mapping(tmp_path):
    tensors = good_tensors()
    tensors["t2d"] = torch.roll(tensors["t2d"], 1)
    report = check(tmp_path, write_draft(tmp_path, tensors))
    assert only_codes(report) == ["vocab_map"]
    assert "t2d" in report.problems[0].message


def test_lm_head_rows_differ_from_draft_vocab(tmp_path):
    report = check(tmp_path, write_draft(tmp_path, config=good_config(draft_vocab_size=DRAFT_VOCAB + 1)))
    assert "vocab_map" in report.codes()
    assert any("lm_head.weight has" in p.message for p in report.problems)


def test_missing_draft_vocab_size(tmp_path):
    config = good_config()
    del config["draft_vocab_size"]
    assert only_codes(check(tmp_path, write_draft(tmp_path, config=config))) == ["vocab_map"]


def test_target_architecture_is_not_a_draft_class(tmp_path):
    report = check(tmp_path, write_draft(tmp_path, config=good_config(architectures=["LlamaForCausalLM"])))
    assert only_codes(report) == ["architecture"]


def test_use_aux_hidden_state_false(tmp_path):
    config = good_config(eagle_config={"eagle_aux_hidden_state_layer_ids": TRAINED_IDS, "use_aux_hidden_state": False})
    assert only_codes(check(tmp_path, write_draft(tmp_path, config=config))) == ["aux_disabled"]


def test_aux_ids_differ_from_trained(tmp_path):
    config = good_config(eagle_config={"eagle_aux_hidden_state_layer_ids": [2, 4, 5]})
    report = check(tmp_path, write_draft(tmp_path, config=config))
    assert only_codes(report) == ["aux_layers"]
    assert "[2, 4, 5]" in report.problems[0].message and "[1, 3, 4]" in report.problems[0].message


def test_aux_ids_missing_but_trained_on_non_default(tmp_path):
    config = good_config(eagle_config={}, eagle3_console={"trained_aux_layer_ids": [0, 2, 5]})
    report = check(tmp_path, write_draft(tmp_path, config=config))
    assert only_codes(report) == ["aux_layers"]


def test_aux_ids_count_and_range(tmp_path):
    config = good_config(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 7]}, eagle3_console={})
    report = check(tmp_path, write_draft(tmp_path, config=config))
    assert only_codes(report) == ["aux_layers"]
    assert len(report.problems) == 2  # two ids, and 7 is past the last capturable layer of 8


def test_truncated_file_is_corrupt(tmp_path):
    draft = write_draft(tmp_path)
    weights = draft / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    report = check(tmp_path, draft)
    assert only_codes(report) == ["corrupt"]
    assert "truncated" in report.problems[0].message


def test_garbage_header_and_missing_files_are_corrupt(tmp_path):
    draft = write_draft(tmp_path)
    (draft / "model.safetensors").write_bytes(struct.pack("<Q", 10) + b"not json!!" + b"\0" * 10)
    assert only_codes(check(tmp_path, draft)) == ["corrupt"]
    (draft / "model.safetensors").unlink()
    assert only_codes(check(tmp_path, draft)) == ["corrupt"]
    assert only_codes(check(tmp_path, tmp_path / "nowhere")) == ["corrupt"]
    (draft / "config.json").write_text("{broken")
    assert only_codes(check(tmp_path, draft)) == ["corrupt"]


def test_layer_shape_mismatch(tmp_path):
    tensors = good_tensors()
    tensors["midlayer.self_attn.q_proj.weight"] = torch.zeros(H, H)  # 1 x H input instead of embed + hidden
    report = check(tmp_path, write_draft(tmp_path, tensors))
    assert only_codes(report) == ["layer_shape"]


def serving_argv(**changes):
    flags = {
        "--model-path": "t",
        "--speculative-algorithm": "EAGLE3",
        "--speculative-draft-model-path": "d",
        "--speculative-num-steps": "3",
        "--speculative-eagle-topk": "1",
        "--speculative-num-draft-tokens": "4",
        "--dtype": "float32",
    }
    flags.update(changes)
    argv = ["python", "-m", "sglang.launch_server"]
    for flag, value in flags.items():
        if value is not None:
            argv += [flag, value]
    return argv


def test_serving_flags_good(tmp_path):
    assert check(tmp_path, write_draft(tmp_path), serving_argv=serving_argv()).ok


def test_eagle_algorithm_flag(tmp_path):
    report = check(tmp_path, write_draft(tmp_path), serving_argv=serving_argv(**{"--speculative-algorithm": "EAGLE"}))
    assert only_codes(report) == ["algorithm"]
    assert "'EAGLE'" in report.problems[0].message


def test_extra_args_override_is_seen(tmp_path):
    argv = serving_argv() + ["--speculative-algorithm", "NEXTN"]
    assert only_codes(check(tmp_path, write_draft(tmp_path), serving_argv=argv)) == ["algorithm"]


def test_partial_spec_settings(tmp_path):
    argv = serving_argv(**{"--speculative-eagle-topk": None, "--speculative-num-draft-tokens": None})
    report = check(tmp_path, write_draft(tmp_path), serving_argv=argv)
    assert only_codes(report) == ["algorithm"]
    assert "all three" in report.problems[0].message


def test_float32_draft_with_dtype_auto(tmp_path):
    report = check(tmp_path, write_draft(tmp_path), serving_argv=serving_argv(**{"--dtype": "auto"}))
    assert only_codes(report) == ["dtype"]
    assert "float16" in report.problems[0].message
    argv = serving_argv(**{"--dtype": None})  # no --dtype: SGLang's default is auto
    report = check(tmp_path, write_draft(tmp_path, name="d2", config=good_config(torch_dtype="bfloat16")), serving_argv=argv)
    assert only_codes(report) == ["dtype"]
    assert "bfloat16 differs from the target's float32" in report.problems[0].message


class CapturingTarget:
    def set_eagle3_layers_to_capture(self, ids):
        self.ids = ids


class WrapperWithoutCapture:
    pass


def test_target_support_uses_the_sglang_class(tmp_path):
    draft = write_draft(tmp_path)
    bad = run_preflight(draft, target_config(tmp_path), resolve_class=lambda archs: WrapperWithoutCapture)
    assert only_codes(bad) == ["target_support"]
    good = run_preflight(draft, target_config(tmp_path), resolve_class=lambda archs: CapturingTarget)
    assert good.ok


def test_target_support_skipped_without_sglang(tmp_path):
    pytest.importorskip("torch")
    report = run_preflight(write_draft(tmp_path), target_config(tmp_path))
    try:
        import sglang  # noqa: F401  # imported only to see whether it is there
    except ImportError:
        assert report.ok and any("target_support not checked" in n for n in report.notes)


def test_all_codes_documented():
    text = (ROOT / "docs" / "serving.md").read_text()
    for code in preflight.PROBLEM_CODES:
        assert f"`{code}`" in text, code


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "backend", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_cli_exit_codes_and_json(tmp_path):
    good = write_draft(tmp_path)
    target = target_config(tmp_path)
    out = run_cli("preflight", str(good), "--target-config", str(target), "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["ok"] is True
    bad = write_draft(tmp_path, config=good_config(architectures=["LlamaForCausalLM"]), name="bad")
    out = run_cli("preflight", str(bad), "--target-config", str(target), "--json")
    assert out.returncode == 1
    body = json.loads(out.stdout)
    assert body["ok"] is False and body["problems"][0]["code"] == "architecture"
    assert set(body["problems"][0]) >= {"code", "message", "hint"}
    out = run_cli("preflight", str(bad), "--target-config", str(target))
    assert out.returncode == 1 and "[architecture]" in out.stdout
    out = run_cli("preflight", str(good), "--target-config", str(tmp_path / "missing.json"))
    assert out.returncode == 2 and "missing.json" in out.stderr
    model_dir = tmp_path / "target-model"  # the model dir, as `target profile --from-config` takes it
    model_dir.mkdir()
    target.rename(model_dir / "config.json")
    out = run_cli("preflight", str(good), "--target-config", str(model_dir), "--json")
    assert out.returncode == 0 and json.loads(out.stdout)["target_config"] == str(model_dir / "config.json"), out.stderr
    target = model_dir / "config.json"
    out = run_cli("preflight", str(good), "--target-config", str(target), "--profile", "no-such-profile")
    assert out.returncode == 2


def test_checkpoint_from_the_trainer_passes(tmp_path):
    """A draft saved by backend.train.checkpoint (the trainer's own writer) passes, including the tiny profile's flags."""
    from backend.profiles import load_profile
    from backend.serve.sglang_args import build_sglang_argv
    from backend.train.checkpoint import save_checkpoint
    from backend.train.draft import DraftModelConfig, Eagle3Draft
    from backend.train.vocab import build_vocab_mapping

    profile = load_profile("tiny")
    config = DraftModelConfig.from_profile(profile)
    draft = Eagle3Draft(config)
    counts = torch.arange(config.vocab_size, dtype=torch.float32) % 7
    draft.set_vocab_mapping(*build_vocab_mapping(counts, config.draft_vocab_size))
    path = save_checkpoint(tmp_path / "run", draft, config, epoch=0, step=5, training_state=None, extra_meta={"val_acc": [0.7] * 7})
    target = {"architectures": ["LlamaForCausalLM"], "hidden_size": 128, "num_hidden_layers": 8, "vocab_size": 259, "torch_dtype": "float32"}
    report = run_preflight(path, target, serving_argv=build_sglang_argv(profile, str(path)), check_sglang=False)
    assert report.ok, report.problems
    assert run_preflight(tmp_path / "run", target, check_sglang=False).draft == str(path)  # run dir -> latest


# --- hostile files: deep nesting, huge integers, wrong types -> `corrupt`, exit 1, never a traceback -----------


def nested(depth):
    return "[" * depth + "]" * depth


def cli_json(draft, target):
    out = run_cli("preflight", str(draft), "--target-config", str(target), "--json")
    assert "Traceback" not in out.stderr, out.stderr[-2000:]
    assert out.returncode == 1, (out.returncode, out.stdout[-500:], out.stderr[-500:])
    return json.loads(out.stdout)


@pytest.mark.parametrize("depth", [1_000, 100_000])
def test_deeply_nested_draft_config_is_corrupt_not_a_traceback(tmp_path, depth):
    draft = write_draft(tmp_path)
    (draft / "config.json").write_text('{"architectures": ["LlamaForCausalLMEagle3"], "x": ' + nested(depth) + "}")
    report = check(tmp_path, draft)
    assert only_codes(report) == ["corrupt"]
    assert f"{draft / 'config.json'} is nested too deeply to read" in report.problems[0].message
    if depth == 1_000:
        body = cli_json(draft, target_config(tmp_path))
        assert body["ok"] is False and [p["code"] for p in body["problems"]] == ["corrupt"]
        assert "nested too deeply" in body["problems"][0]["message"] and body["problems"][0]["hint"]


def test_integer_over_4300_digits_in_draft_config_is_corrupt_not_a_traceback(tmp_path):
    draft = write_draft(tmp_path)
    text = json.dumps(good_config())
    (draft / "config.json").write_text(text[:-1] + ', "hidden_size": ' + "7" * 4301 + "}")
    report = check(tmp_path, draft)
    assert only_codes(report) == ["corrupt"]
    message = report.problems[0].message
    assert f"{draft / 'config.json'} holds a number too long to read" in message and "4301 digits" in message
    body = cli_json(draft, target_config(tmp_path))
    assert [p["code"] for p in body["problems"]] == ["corrupt"] and "number too long" in body["problems"][0]["message"]


def test_hostile_target_config_header_and_index_are_corrupt(tmp_path):
    draft = write_draft(tmp_path)
    target = tmp_path / "hostile_target.json"
    target.write_text('{"hidden_size": ' + "1" * 5000 + "}")
    report = run_preflight(draft, target, check_sglang=False)
    assert only_codes(report) == ["corrupt"] and "number too long" in report.problems[0].message
    target.write_text(nested(5_000))
    assert "nested too deeply" in run_preflight(draft, target, check_sglang=False).problems[0].message
    header = ('{"x": ' + nested(3_000) + "}").encode()
    (draft / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    report = check(tmp_path, draft)
    assert only_codes(report) == ["corrupt"] and "header is nested too deeply" in report.problems[0].message
    (draft / "model.safetensors").unlink()
    (draft / "model.safetensors.index.json").write_text('{"weight_map": ' + nested(2_000) + "}")
    report = check(tmp_path, draft)
    assert only_codes(report) == ["corrupt"] and "index.json is nested too deeply" in report.problems[0].message


@pytest.mark.parametrize(
    "field, value, check_name",
    [
        ("hidden_size", "abc", "fc shape"),
        ("draft_vocab_size", 1e400, "vocab"),  # json writes Infinity
        ("eagle_config", {"eagle_aux_hidden_state_layer_ids": [[1], {"a": 1}, None]}, None),
    ],
)
def test_config_values_of_the_wrong_type_are_corrupt_not_a_traceback(tmp_path, field, value, check_name):
    draft = write_draft(tmp_path, config=good_config(**{field: value}))
    report = check(tmp_path, draft)
    assert not report.ok
    if check_name:
        assert any(p.code == "corrupt" and f"the {check_name} check reads has the wrong type" in p.message for p in report.problems)
    cli_json(draft, target_config(tmp_path))


def test_target_config_values_of_the_wrong_type_are_corrupt(tmp_path):
    draft = write_draft(tmp_path)
    for bad in ("4096", 16.5, True, -16, [16]):
        report = run_preflight(draft, target_config(tmp_path, hidden_size=bad), check_sglang=False)
        assert only_codes(report) == ["corrupt"]
        assert f"hidden_size = {bad!r}, expected a positive integer" in report.problems[0].message


# --- a draft exported the way SpecForge exports it ------------------------------------------------------------


def specforge_draft_class():
    """A module with SpecForge's LlamaForCausalLMEagle3 attribute names and shapes (specforge/modeling/draft/
    llama3_eagle.py at v0.2.0 and main): a transformers PreTrainedModel, so save_pretrained writes what SpecForge's
    exporter writes (specforge/export/to_sglang.py: save_pretrained of the state dict minus every "embed" key)."""
    from torch import nn
    from transformers import LlamaConfig, PreTrainedModel

    class Norm(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(width))

    class Attention(nn.Module):
        def __init__(self, config):
            super().__init__()
            head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            self.q_proj = nn.Linear(2 * config.hidden_size, config.num_attention_heads * head_dim, bias=False)
            self.k_proj = nn.Linear(2 * config.hidden_size, config.num_key_value_heads * head_dim, bias=False)
            self.v_proj = nn.Linear(2 * config.hidden_size, config.num_key_value_heads * head_dim, bias=False)
            self.o_proj = nn.Linear(config.num_attention_heads * head_dim, config.hidden_size, bias=False)

    class MLP(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
            self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
            self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    class DecoderLayer(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.self_attn, self.mlp = Attention(config), MLP(config)
            self.hidden_norm, self.input_layernorm = Norm(config.hidden_size), Norm(config.hidden_size)
            self.post_attention_layernorm = Norm(config.hidden_size)

    class LlamaForCausalLMEagle3(PreTrainedModel):
        config_class = LlamaConfig

        def __init__(self, config):
            super().__init__(config)
            target_hidden = getattr(config, "target_hidden_size", config.hidden_size)
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
            self.midlayer = DecoderLayer(config)
            self.fc = nn.Linear(3 * target_hidden, config.hidden_size, bias=False)
            self.norm = Norm(config.hidden_size)
            self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
            self.register_buffer("t2d", torch.ones(config.vocab_size, dtype=torch.bool))
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
            self.post_init()

        def _init_weights(self, module):
            pass

    return LlamaForCausalLMEagle3


def specforge_draft_config(tmp_path):
    """A configs/llama3-8B-eagle3.json-shaped draft config (GQA, torch_dtype, no eagle_config), scaled down."""
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": H,
        "initializer_range": 0.02,
        "intermediate_size": INTER,
        "max_position_embeddings": 256,
        "model_type": "llama",
        "num_attention_heads": HEADS,
        "num_key_value_heads": 1,
        "num_hidden_layers": 1,
        "pad_token_id": 0,
        "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": VOCAB,
        "draft_vocab_size": DRAFT_VOCAB,
    }
    path = tmp_path / "draft_config.json"
    path.write_text(json.dumps(config, indent=2))
    return path


def export_like_specforge(tmp_path, out: Path, max_shard_size=None) -> Path:
    """SpecForge's export: the draft built in bfloat16 from its config file, the vocab mapping loaded into t2d/d2t,
    save_pretrained without the embedding, then its legacy rope fix-up (rope_theta mirrored at top level, keys sorted)."""
    from transformers import LlamaConfig

    config = LlamaConfig.from_json_file(str(specforge_draft_config(tmp_path)))
    torch.manual_seed(0)
    model = specforge_draft_class()(config).to(torch.bfloat16)
    used = good_tensors()["t2d"].nonzero().flatten()
    model.t2d.zero_()
    model.t2d[used] = True
    model.d2t.copy_(used - torch.arange(DRAFT_VOCAB))
    state = {k: v for k, v in model.state_dict().items() if "embed" not in k.lower()}
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(out), state_dict=state, **kwargs)
    saved = json.loads((out / "config.json").read_text())
    theta = (saved.get("rope_parameters") or {}).get("rope_theta")
    if theta is not None and saved.get("rope_theta") != theta:
        saved["rope_theta"] = theta
    (out / "config.json").write_text(json.dumps(saved, indent=2, sort_keys=True))
    return out


def hf_target_config(tmp_path) -> Path:
    from transformers import LlamaConfig

    target = tmp_path / "target"
    LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=H,
        intermediate_size=INTER,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        torch_dtype="bfloat16",
    ).save_pretrained(str(target))
    return target / "config.json"


@pytest.mark.parametrize("layout", ["single", "sharded", "beside_training_state"])
def test_a_specforge_exported_draft_passes(tmp_path, layout):
    out = tmp_path / ("run-step100" if layout == "beside_training_state" else "export")
    export_like_specforge(tmp_path, out, max_shard_size="2KB" if layout == "sharded" else None)
    if layout == "beside_training_state":  # SpecForge's checkpoint files in the same dir: training_state.pt + per rank
        torch.save({"strategy": "eagle3", "global_step": 100, "draft_state_dict": {}}, out / "training_state.pt")
        torch.save({"optimizer": {}}, out / "training_state_rank0.pt")
    files = sorted(p.name for p in out.iterdir())
    if layout == "sharded":
        assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) > 1, files
    else:
        assert "model.safetensors" in files, files
    saved = json.loads((out / "config.json").read_text())
    assert saved["architectures"] == ["LlamaForCausalLMEagle3"] and saved["draft_vocab_size"] == DRAFT_VOCAB
    names = set(preflight.read_draft_header(out))
    assert {"d2t", "t2d", "fc.weight", "midlayer.hidden_norm.weight"} <= names and not any("embed" in n for n in names)

    report = run_preflight(out, hf_target_config(tmp_path), check_sglang=False)
    assert report.ok, report.problems
    assert any("SGLang uses its default" in note for note in report.notes), report.notes  # no eagle_config in SpecForge's
    # the same check through the CLI, as a user runs it
    done = subprocess.run(
        [sys.executable, "-m", "backend", "preflight", str(out), "--target-config", str(tmp_path / "target" / "config.json"), "--no-sglang", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and json.loads(done.stdout)["ok"] is True, done.stdout + done.stderr


def test_a_specforge_export_with_a_broken_vocab_map_still_fails(tmp_path):
    """The pass above is not vacuous: the same export with absolute ids in d2t (a common hand-made mistake) fails."""
    out = export_like_specforge(tmp_path, tmp_path / "export")
    from safetensors.torch import load_file

    tensors = load_file(str(out / "model.safetensors"))
    tensors["d2t"] = tensors["t2d"].nonzero().flatten().to(torch.int64)  # absolute target ids, not offsets
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    report = run_preflight(out, hf_target_config(tmp_path), check_sglang=False)
    assert only_codes(report) == ["vocab_map"], report.problems


@pytest.mark.parametrize("where", ["step_dir", "output_dir"])
def test_a_specforge_training_checkpoint_is_refused_with_the_export_command(tmp_path, where):
    """SpecForge saves training checkpoints as {run_id}-step{N}/training_state.pt; SGLang cannot load those."""
    step = tmp_path / "out" / "run-step100"
    step.mkdir(parents=True)
    torch.save({"strategy": "eagle3", "draft_state_dict": {}}, step / "training_state.pt")
    report = check(tmp_path, step if where == "step_dir" else step.parent)
    assert only_codes(report) == ["corrupt"]
    assert "config.json does not exist" in report.problems[0].message
    assert "specforge.export.to_sglang" in report.problems[0].hint
    assert sorted(p.name for p in step.iterdir()) == ["training_state.pt"]  # nothing written
