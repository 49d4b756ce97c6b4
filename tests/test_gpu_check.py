"""tools/gpu_check.py without a GPU: the steps that need none (the JPEG shards, the stream's
scaling table) run here on tiny data, so that the check a GPU machine runs is known to work
up to its CUDA calls; on CUDA it also checks that every batch arrives pinned."""
import os

import pytest

from helpers import tool_module


@pytest.fixture(scope="module")
def gpu_check():
    return tool_module("gpu_check")


@pytest.mark.slow
def test_the_scaling_table_covers_every_encoding_worker_count_and_batch_kind(gpu_check, tmp_path):
    raw, jpg = str(tmp_path / "raw"), str(tmp_path / "jpg")
    gpu_check.build_synthetic(raw, 1200, 100)
    gpu_check.build_jpeg(jpg, 600, per_shard=200)
    figures = gpu_check.scaling_check({"raw": raw, "jpg": jpg}, 8)
    runs = figures["runs"]
    workers = sorted({0, 4, 8, max(1, (os.cpu_count() or 2) - 2)})
    assert [(r["encoding"], r["workers"], r["method"]) for r in runs] == \
        [(e, w, m) for e in ("raw", "jpg") for w in workers for m in ("C", "C8")]
    assert all(r["samples"] > 0 and r["samples_per_s"] > 0 and r["consumer_us_per_sample"] > 0 for r in runs)
    assert set(figures["targets"]) == {f"raw/C8 at {workers[-1]} workers >= 1,000,000",
                                       f"raw/C at {workers[-1]} workers >= 600,000",
                                       f"jpg/C8 at {workers[-1]} workers >= 150,000"}


def test_without_cuda_it_says_so_and_passes(gpu_check, capsys, monkeypatch):
    monkeypatch.setattr(gpu_check, "cuda_device_count", lambda: 0)
    assert gpu_check.main([]) == 0
    assert "no CUDA device here" in capsys.readouterr().out
