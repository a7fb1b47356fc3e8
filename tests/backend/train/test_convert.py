"""convert: a layers.0.* / prefixed / alias-arch checkpoint becomes SGLang's midlayer.* format, or is refused untouched."""

import argparse
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from backend.train.checkpoint import load_checkpoint, save_checkpoint
from backend.train.convert import ConvertError, convert_checkpoint, register_convert
from tests.fixtures.env import ROOT
from tests.fixtures.drafts import SYMLINK_KINDS, symlinked_destination, tiny_draft, tree_listing


def broken_checkpoint(tmp_path, mutate_keys=None, mutate_config=None):
    """A checkpoint as a buggy exporter would write it, plus the original tensors to compare against."""
    draft, config = tiny_draft(seed=4)
    good = save_checkpoint(tmp_path / "run", draft, config, epoch=0, step=7, training_state={"global_step": 7})
    tensors = load_file(str(good / "model.safetensors"))
    src = tmp_path / "bad"
    src.mkdir()
    bad = {}
    for key, tensor in tensors.items():
        if key.startswith("midlayer."):
            key = "layers.0." + key[len("midlayer.") :]
        if key == "fc.weight":
            key = "draft_model.fc.weight"
        if key == "norm.weight":
            key = "model.norm.weight"
        if key != "t2d":
            bad[key] = tensor
    bad["embed_tokens.weight"] = torch.randn(259, 128)
    if mutate_keys:
        mutate_keys(bad)
    save_file(bad, str(src / "model.safetensors"))
    hf = json.loads((good / "config.json").read_text())
    hf["architectures"] = ["Eagle3LlamaForCausalLM"]
    if mutate_config:
        mutate_config(hf)
    (src / "config.json").write_text(json.dumps(hf))
    (src / "training_state.pt").write_bytes((good / "training_state.pt").read_bytes())
    (src / "README.md").write_text("notes")
    return src, tensors


def test_convert_repairs_layers0_keys_and_reports_every_change(tmp_path):
    src, original = broken_checkpoint(tmp_path)
    dst = tmp_path / "fixed"
    report = convert_checkpoint(src, dst)
    assert report.written
    renamed = dict(report.renamed)
    assert renamed["layers.0.self_attn.q_proj.weight"] == "midlayer.self_attn.q_proj.weight"
    assert renamed["layers.0.hidden_norm.weight"] == "midlayer.hidden_norm.weight"
    assert renamed["draft_model.fc.weight"] == "fc.weight" and renamed["model.norm.weight"] == "norm.weight"
    assert len(report.renamed) == 12 and report.unchanged_keys == 2  # lm_head.weight, d2t
    assert [key for key, _ in report.dropped] == ["embed_tokens.weight"]
    assert report.built == ["t2d from d2t (t2d[d2t[i] + i] = True)"]
    assert report.config_changes == ["architectures ['Eagle3LlamaForCausalLM'] -> ['LlamaForCausalLMEagle3']"]
    assert report.copied_files == ["training_state.pt"] and report.skipped_files == ["README.md"]
    text = "\n".join(report.lines())
    assert "renamed  layers.0.mlp.down_proj.weight -> midlayer.mlp.down_proj.weight" in text
    assert "dropped  embed_tokens.weight" in text
    draft, _, meta, state = load_checkpoint(dst)
    assert state == {"global_step": 7} and meta["converted_from"] == str(src)
    restored = {k: v for k, v in draft.state_dict().items() if k != "embed_tokens.weight"}
    assert set(restored) == set(original)
    for key, tensor in original.items():
        assert torch.equal(restored[key], tensor), key
    assert json.loads((dst / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]


def test_convert_refuses_an_unmappable_key_and_leaves_dst_absent(tmp_path):
    def add_second_layer(tensors):
        tensors["layers.1.mlp.up_proj.weight"] = torch.zeros(512, 128)

    src, _ = broken_checkpoint(tmp_path, mutate_keys=add_second_layer)
    dst = tmp_path / "fixed"
    with pytest.raises(ConvertError, match=r"unexpected keys: layers\.1\.mlp\.up_proj\.weight.*fixed not created"):
        convert_checkpoint(src, dst)
    assert not dst.exists() and not list(tmp_path.glob(".tmp-convert-*"))


def test_convert_refuses_unknown_architecture_existing_dst_and_unknown_aux_layers(tmp_path):
    src, _ = broken_checkpoint(tmp_path, mutate_config=lambda hf: hf.update(architectures=["DeepseekV3ForCausalLM"]))
    with pytest.raises(ConvertError, match="not a known alias"):
        convert_checkpoint(src, tmp_path / "a")
    assert not (tmp_path / "a").exists()
    (tmp_path / "exists").mkdir()
    with pytest.raises(ConvertError, match="already exists"):
        convert_checkpoint(src, tmp_path / "exists")

    def no_eagle_config(hf):
        hf.pop("eagle_config")
        hf.pop("eagle3_console")

    src2, _ = broken_checkpoint(tmp_path / "two", mutate_config=no_eagle_config)
    with pytest.raises(ConvertError, match="--aux-layer-ids"):
        convert_checkpoint(src2, tmp_path / "b")
    report = convert_checkpoint(src2, tmp_path / "b", aux_layer_ids=[1, 3, 4])
    assert "eagle_config.eagle_aux_hidden_state_layer_ids None -> [1, 3, 4]" in report.config_changes
    assert load_checkpoint(tmp_path / "b")[1].aux_layer_ids == [1, 3, 4]


def test_convert_splits_sglang_fused_projections(tmp_path):
    def fuse(tensors):
        names = [f"layers.0.self_attn.{p}_proj.weight" for p in "qkv"]
        tensors["model.layers.0.self_attn.qkv_proj.weight"] = torch.cat([tensors.pop(n) for n in names])
        names = ["layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight"]
        tensors["layers.0.mlp.gate_up_proj.weight"] = torch.cat([tensors.pop(n) for n in names])

    src, original = broken_checkpoint(tmp_path, mutate_keys=fuse)
    report = convert_checkpoint(src, tmp_path / "fixed")
    assert any("split midlayer.self_attn.qkv_proj.weight into q_proj, k_proj, v_proj" in b for b in report.built)
    draft = load_checkpoint(tmp_path / "fixed")[0]
    assert torch.equal(draft.midlayer.self_attn.k_proj.weight, original["midlayer.self_attn.k_proj.weight"])
    assert torch.equal(draft.midlayer.mlp.up_proj.weight, original["midlayer.mlp.up_proj.weight"])


def run_cli(argv):
    parser = argparse.ArgumentParser()
    subparsers = parser.add_subparsers(dest="command", required=True)
    register_convert(subparsers, argparse.ArgumentParser(add_help=False))
    args = parser.parse_args(argv)
    return args.handler(args)


def test_cli_dry_run_writes_nothing_and_json_reports(tmp_path, capsys):
    src, _ = broken_checkpoint(tmp_path)
    assert run_cli(["convert", str(src), str(tmp_path / "dry"), "--dry-run"]) == 0
    assert "(dry run: nothing written)" in capsys.readouterr().out and not (tmp_path / "dry").exists()
    assert run_cli(["convert", str(src), str(tmp_path / "out"), "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["ok"] and payload["written"] and ["embed_tokens.weight", payload["dropped"][0][1]] == payload["dropped"][0]
    assert run_cli(["convert", str(src), str(tmp_path / "out")]) == 1
    assert "convert refused:" in capsys.readouterr().err


@pytest.mark.parametrize("kind", SYMLINK_KINDS)
def test_convert_onto_a_symlink_exits_2_with_one_line_and_writes_nothing(tmp_path, kind, capsys):
    src, _ = broken_checkpoint(tmp_path / "source")
    dst = symlinked_destination(tmp_path, kind)
    before = tree_listing(tmp_path)
    assert run_cli(["convert", str(src), str(dst)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a symbolic link" in err[0] and "nothing was written" in err[0], err
    assert tree_listing(tmp_path) == before  # no .tmp-convert-* dir, nothing behind the link


def test_convert_cli_onto_a_dangling_symlink_prints_one_line(tmp_path):
    src, _ = broken_checkpoint(tmp_path / "source")
    dst = symlinked_destination(tmp_path, "dangling link")
    result = subprocess.run([sys.executable, "-m", "backend.cli", "convert", str(src), str(dst)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "is a symbolic link" in result.stderr
    assert not (tmp_path / "nowhere").exists() and not list(tmp_path.glob(".tmp-convert-*"))
