"""Data-scaling numbers: measured from an extraction's files, estimated from a profile otherwise."""

import json
import os
import shutil
import time

import pytest

from backend.commands import profile_shape
from backend.host.datascale import data_scaling, estimated
from backend.profiles import load_profile


def make_extract(directory, samples_per_shard=(10, 6), shard_bytes=4096, seconds=8.0):
    directory.mkdir()
    splits = {}
    for split, count in zip(("train", "val"), samples_per_shard):
        (directory / split).mkdir()
        (directory / split / "shard-00000.safetensors").write_bytes(b"\0" * shard_bytes * count)
        splits[split] = {"samples": count, "tokens": count * 128, "shards": [{"file": "shard-00000.safetensors", "samples": count}]}
    meta = directory / "meta.json"
    created = time.time() - seconds
    meta.write_text(json.dumps({"format": "eagle3-console-shards-v1", "created": created, "splits": splits}))
    os.utime(meta, (created + seconds, created + seconds))
    return directory


def test_measured_from_extraction(tmp_path):
    report = data_scaling(make_extract(tmp_path / "data"))
    assert report["kind"] == "measured"
    assert report["samples"] == 16 and report["tokens"] == 16 * 128
    assert report["bytes_per_sample"] == pytest.approx(4096)
    free = shutil.disk_usage(tmp_path).free
    assert report["more_samples_fit"] == pytest.approx(max(free - report["keep_free_bytes"], 0) // 4096, rel=0.01)
    assert report["seconds_per_sample"] == pytest.approx(8.0 / 16, rel=0.05)
    assert report["estimated_seconds_for_fit"] == pytest.approx(report["more_samples_fit"] * report["seconds_per_sample"])


def test_estimated_for_online_run(tmp_path):
    kimi = load_profile("kimi-k2.5")
    report = estimated(profile_shape(kimi), tmp_path / "not-yet")
    per_token = (3 * 7168 + 7168) * 2 + 8 + 1
    assert report["kind"] == "estimated" and report["bytes_per_sample"] == per_token * kimi.train.seq_len
    assert report["free_bytes"] == shutil.disk_usage(tmp_path).free


def test_not_an_extraction_without_profile_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="holds no meta.json"):
        data_scaling(tmp_path)
