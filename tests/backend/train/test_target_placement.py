"""A target larger than one device: --target-device-map / --target-max-memory / --target-offload-folder parsed and refused
in one line; a map that puts layers on the CPU and on disk gives the plain load's aux states, logits, greedy tokens and
extracted shards; online training runs with it."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from backend.cli import main as cli_main
from backend.train.target import TargetPlacement, TargetPlacementError, load_target, parse_max_memory, parse_placement
from tests.fixtures.env import mini_profile_dict
from tests.fixtures.chat import toml_of

# Float32 on one CPU either way: the same kernels run on the same numbers, so the results are expected bit-identical;
# the tolerance only allows for a different summation order should accelerate ever split a matmul.
ATOL = 1e-6


pytestmark = pytest.mark.usefixtures("limited_torch_threads")


def split_map(num_layers: int = 4) -> dict[str, str]:
    """Embedding and head on disk, even layers in CPU memory, odd layers on disk (the mini target has 4 layers)."""
    device_map = {"model.embed_tokens": "disk", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "disk"}
    device_map.update({f"model.layers.{i}": "cpu" if i % 2 == 0 else "disk" for i in range(num_layers)})
    return device_map


@pytest.fixture
def map_file(tmp_path) -> Path:
    path = tmp_path / "device_map.json"
    path.write_text(json.dumps(split_map()))
    return path


# --- the flags ---------------------------------------------------------------------------------------------


def test_strategies_files_and_memory_caps_parse_into_a_placement(map_file, tmp_path):
    assert parse_placement(None) is None
    assert parse_placement("auto", "cuda:0=60GiB, 1=70GiB,cpu=200GiB") == TargetPlacement("auto", {0: "60GiB", 1: "70GiB", "cpu": "200GiB"})
    placed = parse_placement(str(map_file), None, tmp_path / "offload")
    assert placed is not None and placed.device_map == split_map() and placed.offload_folder == str(tmp_path / "offload")
    gpus = tmp_path / "gpus.json"
    gpus.write_text(json.dumps({"model.embed_tokens": "cuda:0", "model.layers.0": 1, "lm_head": "cpu"}))
    assert parse_placement(str(gpus)).device_map == {"model.embed_tokens": 0, "model.layers.0": 1, "lm_head": "cpu"}
    assert parse_max_memory("cpu=500MB") == {"cpu": "500MB"} and parse_max_memory("0=1000000") == {0: "1000000"}


@pytest.mark.parametrize(
    "device_map, max_memory, message",
    [
        ("nowhere.json", None, "neither one of auto, balanced"),
        ("bad.json", None, r"'lm_head' -> 'gpu0'; a device is a GPU index"),
        (None, "cpu=1GiB", "need --target-device-map"),
        ("auto", "tpu:0=1GiB", "device 'tpu:0' is not cuda:N"),
        ("auto", "cuda:0=lots", "size 'lots' for cuda:0"),
    ],
)
def test_placements_that_cannot_work_are_refused_naming_the_flag(map_file, tmp_path, device_map, max_memory, message):
    (tmp_path / "bad.json").write_text(json.dumps({"lm_head": "gpu0"}))
    spec = {"map": str(map_file), "nowhere.json": str(tmp_path / "nowhere.json"), "bad.json": str(tmp_path / "bad.json")}.get(device_map, device_map)
    with pytest.raises(TargetPlacementError, match=message):
        parse_placement(spec, max_memory)


# --- the same numbers, placed ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_target_split_over_cpu_and_disk_captures_what_the_plain_load_captures(mini_profile, tmp_path, map_file, dtype):
    offload = tmp_path / "offload"
    plain = load_target(mini_profile, dtype=dtype)
    placed = load_target(mini_profile, dtype=dtype, placement=parse_placement(str(map_file), None, offload))
    assert placed.placement() == "disk 4, cpu 4"
    assert placed.model.model.layers[0].mlp.up_proj.weight.device.type == "cpu"
    for module in (placed.model.model.layers[1].mlp.up_proj, placed.model.get_input_embeddings(), placed.model.lm_head):
        assert module.weight.device.type == "meta"  # offloaded: read from disk at each forward
        assert type(module._hf_hook.weights_map.dataset).__name__ == "OffloadedWeightsLoader"  # (safetensors read in place)
    tolerance = {"rtol": 0.0, "atol": ATOL if dtype == "float32" else 0.0}
    torch.testing.assert_close(placed.embed_weight(), plain.embed_weight(), **tolerance)
    torch.testing.assert_close(placed.lm_head_weight(), plain.lm_head_weight(), **tolerance)
    ids = torch.randint(0, 256, (3, 40), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 30:] = 0
    want, got = plain.capture(ids, mask, with_logits=True), placed.capture(ids, mask, with_logits=True)
    assert got.aux_hidden.shape == (3, 40, 3 * 32) and got.aux_hidden.device.type == "cpu"
    torch.testing.assert_close(got.aux_hidden, want.aux_hidden, **tolerance)
    torch.testing.assert_close(got.logits, want.logits, **tolerance)
    torch.testing.assert_close(placed.capture(ids, mask, with_logits=False).last_hidden, plain.capture(ids, mask, with_logits=False).last_hidden, **tolerance)
    assert torch.equal(placed.greedy_generate(ids[:, :12], 10), plain.greedy_generate(ids[:, :12], 10))


def extract_cli(profile_file: Path, out: Path, *extra: str) -> int:
    argv = ["extract", "--profile", str(profile_file), "--out", str(out), "--samples", "6", "--val-samples", "2", "--batch-size", "3"]
    return cli_main([*argv, "--shard-samples", "4", "--keep-free-gb", "0", "--device", "cpu", "--threads", "1", *extra])


def shard_tensors(out: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(out.rglob("*.safetensors")):
        tensors.update({f"{path.relative_to(out)}:{key}": value for key, value in load_file(str(path)).items()})
    return tensors


def test_extract_with_a_cpu_and_disk_map_writes_the_plain_extracts_shards(mini_profile, mini_env, tmp_path, map_file, capsys):
    profile_file = tmp_path / "mini.toml"
    profile_file.write_text(toml_of(mini_profile_dict(Path(mini_profile.target.path))))
    assert extract_cli(profile_file, tmp_path / "plain") == 0
    assert extract_cli(profile_file, tmp_path / "placed", "--target-device-map", str(map_file), "--target-offload-folder", str(tmp_path / "off")) == 0
    assert "extract: target placed by device_map a map of 8 modules, offload folder" in capsys.readouterr().err
    want, got = shard_tensors(tmp_path / "plain"), shard_tensors(tmp_path / "placed")
    assert sorted(got) == sorted(want) and any(key.endswith("aux_hidden_states") for key in got) and "target_head.safetensors:lm_head.weight" in got
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0.0, atol=ATOL, msg=key)
    meta = [json.loads((tmp_path / name / "meta.json").read_text()) for name in ("plain", "placed")]
    assert meta[0]["splits"] == meta[1]["splits"] and meta[0]["target"] == meta[1]["target"]


def test_online_training_with_a_placed_target_trains_and_says_where_it_sits(mini_profile, mini_env, tmp_path, map_file, capsys):
    profile_file = tmp_path / "mini.toml"
    profile_file.write_text(toml_of(mini_profile_dict(Path(mini_profile.target.path))))
    common = ["train", "--profile", str(profile_file), "--max-steps", "2", "--log-interval", "1", "--eval-interval", "2", "--save-interval", "2"]
    common += ["--device", "cpu", "--threads", "1", "--attn-backend", "sdpa"]
    assert cli_main([*common, "--out", str(tmp_path / "plain")]) == 0
    placed = ["--target-device-map", str(map_file), "--target-offload-folder", str(tmp_path / "off")]
    assert cli_main([*common, "--out", str(tmp_path / "placed"), *placed]) == 0
    assert "target placed by device_map a map of 8 modules" in capsys.readouterr().err
    records = {
        name: [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines() if '"split":"train"' in line]
        for name in ("plain", "placed")
    }
    assert [r["step"] for r in records["placed"]] == [1, 2]
    for want, got in zip(records["plain"], records["placed"]):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-6)
    assert (tmp_path / "placed" / "checkpoints" / "latest").is_file()


@pytest.mark.parametrize("case", ["offline data", "several ranks on one host"])
def test_a_device_map_where_it_cannot_apply_is_refused_in_one_line(mini_profile, mini_env, tmp_path, map_file, capsys, monkeypatch, case):
    profile_file = tmp_path / "mini.toml"
    profile_file.write_text(toml_of(mini_profile_dict(Path(mini_profile.target.path))))
    argv = ["train", "--profile", str(profile_file), "--out", str(tmp_path / "run"), "--target-device-map", "auto"]
    if case == "offline data":
        argv += ["--data", str(tmp_path / "shards")]
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: --target-device-map")
    assert not (tmp_path / "run").exists()


# --- on a GPU: layers on cuda:0, in CPU memory (streamed to the GPU each forward) and on disk ---------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the lent H200)")


def gpu_cpu_disk_map() -> dict[str, int | str]:
    device_map: dict[str, int | str] = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.norm": 0, "lm_head": "cpu"}
    device_map.update({"model.layers.0": 0, "model.layers.1": "cpu", "model.layers.2": "disk", "model.layers.3": 0})
    return device_map


@needs_cuda
def test_on_a_gpu_layers_in_cpu_memory_and_on_disk_capture_what_the_whole_gpu_load_captures(mini_profile, tmp_path):
    plain = load_target(mini_profile, device="cuda", dtype="float32")
    placed = load_target(mini_profile, device="cuda", dtype="float32", placement=TargetPlacement(gpu_cpu_disk_map(), None, str(tmp_path / "off")))
    assert placed.placement() == "cuda:0 5, cpu 2, disk 1"
    assert placed.model.model.layers[1].mlp.up_proj.weight.device.type == "meta"  # kept in CPU memory, streamed per forward
    ids = torch.randint(0, 256, (3, 40), generator=torch.Generator().manual_seed(1))
    want, got = plain.capture(ids, with_logits=True), placed.capture(ids, with_logits=True)
    assert got.aux_hidden.device.type == "cuda" and got.logits.device.type == "cuda"
    torch.testing.assert_close(got.aux_hidden, want.aux_hidden, rtol=0.0, atol=1e-5)
    torch.testing.assert_close(got.logits, want.logits, rtol=0.0, atol=1e-5)
    torch.testing.assert_close(placed.lm_head_weight().cpu(), plain.lm_head_weight().cpu(), rtol=0.0, atol=0.0)


@needs_cuda
def test_a_target_kept_on_the_cpu_hands_its_states_to_the_drafts_gpu(mini_profile):
    on_cpu = load_target(mini_profile, dtype="float32")
    placed = load_target(mini_profile, device="cuda:0", dtype="float32", placement=TargetPlacement("cpu"))
    assert placed.device.type == "cpu" and placed.output_device == "cuda:0"
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(2))
    got = placed.capture(ids, with_logits=True)
    assert got.aux_hidden.device.type == "cuda" and got.logits.device.type == "cuda"
    want = on_cpu.capture(ids, with_logits=True)
    torch.testing.assert_close(got.aux_hidden.cpu(), want.aux_hidden, rtol=0.0, atol=0.0)  # the same CPU forward, moved
    torch.testing.assert_close(got.logits.cpu(), want.logits, rtol=0.0, atol=0.0)


@needs_cuda
def test_online_training_on_a_gpu_with_part_of_the_target_on_the_cpu(mini_profile, mini_env, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("EAGLE3_COMPILE", "0")
    profile_file = tmp_path / "mini.toml"
    profile_file.write_text(toml_of(mini_profile_dict(Path(mini_profile.target.path))))
    (tmp_path / "map.json").write_text(json.dumps(gpu_cpu_disk_map()))
    argv = ["train", "--profile", str(profile_file), "--out", str(tmp_path / "run"), "--max-steps", "2", "--log-interval", "1", "--device", "cuda"]
    argv += ["--attn-backend", "sdpa", "--target-device-map", str(tmp_path / "map.json"), "--target-offload-folder", str(tmp_path / "off")]
    assert cli_main(argv) == 0
    assert "target placed by device_map a map of 8 modules" in capsys.readouterr().err
    assert (tmp_path / "run" / "checkpoints" / "latest").is_file()
