"""tools/gpu_check.py without a GPU: the hand-over cases run on the CPU (device "cpu": the same
code as on CUDA, without the streams), the steps that need no GPU (the JPEG shards, the stream's
scaling table) run on tiny data, so the check a GPU machine runs is known to work up to its CUDA
calls. The cases that exist only with CUDA are skipped here with the reason."""
import inspect
import os

import pytest
import torch

from helpers import tool_module
from pipeline.data.handover.loader import make_loader

NO_DEVICE = "device" not in inspect.signature(make_loader).parameters
NEEDS_DEVICE = pytest.mark.skipif(NO_DEVICE, reason="make_loader has no device= yet (issue 52 item 2): the case "
                                                    "calls make_loader(stream, workers, device=...)")
NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only: make gpu-check runs it")
CPU = torch.device("cpu")
BATCH = 16


@pytest.fixture(scope="module")
def gpu_check():
    return tool_module("gpu_check")


@pytest.fixture(scope="module")
def handover(gpu_check):
    from gpucheck import handover

    return handover


@pytest.mark.slow
def test_the_scaling_table_covers_every_encoding_worker_count_and_batch_kind(gpu_check, tmp_path):
    from gpucheck import data, scaling

    raw, jpg = str(tmp_path / "raw"), str(tmp_path / "jpg")
    data.build_synthetic(raw, 1200, 100)
    data.build_jpeg(jpg, 600, per_shard=200)
    figures = scaling.scaling_check({"raw": raw, "jpg": jpg}, 8)
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


def test_every_case_is_its_own_step_and_every_figure_follows(gpu_check, tmp_path):
    args, _ = gpu_check.parse(["--work", str(tmp_path)])
    names = [s[0] for s in gpu_check.plan(args, 1, str(tmp_path), {"steps": {}}, lambda: 300)]
    assert names[0] == "shards" and names[-1] == "scaling" and len(names) == len(set(names))
    for needle in ("device= at 0 workers", "device= at 4 workers", "default stream at 0 workers",
                   "side stream dropped before any wait", "from a thread", "workers started again",
                   "page-lock refused", "no sync in steps", "train --model cnn", "--model cnn alone",
                   "train --model resnet18", "--model resnet18 alone", "JPEG decoded on the GPU",
                   "--channels-last step"):
        assert sum(needle in n for n in names) == 1, needle


def test_the_channels_last_case_times_both_layouts_on_a_device(gpu_check):
    """The gpu-check case for the trainer's --channels-last, on "cpu" as the CUDA stand-in, tiny."""
    from gpucheck import trainer

    got = trainer.channels_last_check("cpu", cases=(("cnn", 4, 8),), rounds=4, side=8)
    cnn = got["cnn"]
    assert cnn["contiguous_s"] > 0 and cnn["channels_last_s"] > 0, got
    # the ratio is of the unrounded times: its third decimal may differ from the rounded times' (0.899, 0.9)
    assert cnn["ratio"] == pytest.approx(cnn["channels_last_s"] / cnn["contiguous_s"], abs=0.001), got
    assert got["summary"].startswith("--channels-last step time over the contiguous step's (cpu") and "cnn " in got["summary"]


def test_a_tools_module_stays_under_500_lines():
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")
    paths = [os.path.join(root, "gpu_check.py")] + [os.path.join(root, "gpucheck", f)
                                                    for f in os.listdir(os.path.join(root, "gpucheck"))
                                                    if f.endswith(".py")]
    assert {p: n for p in paths if (n := len(open(p).read().splitlines())) > 500} == {}


# ---------------------------------------------------------------- the hand-over cases on the CPU


@pytest.mark.parametrize("workers", [0, 2])
def test_kept_cpu_views_and_their_copies_keep_their_bytes_over_3_epochs(handover, mid_epoch_shards, workers):
    figures = handover.kept_views(str(mid_epoch_shards), CPU, workers, batch=BATCH)
    assert figures["differ"] == 0 and figures["batches"] == 3 * handover.EPOCH_BATCHES
    assert figures["samples"] == 2 * 3 * handover.EPOCH_BATCHES * BATCH  # the views and the copies


@pytest.mark.parametrize("case", ["side_stream_dropped", "from_thread"])
def test_a_users_copies_dropped_at_once_keep_their_bytes(handover, mid_epoch_shards, case):
    figures = getattr(handover, case)(str(mid_epoch_shards), CPU, 2, batch=BATCH)
    assert figures["differ"] == 0 and figures["batches"] == 3 * handover.EPOCH_BATCHES


def test_the_comparison_sees_a_batch_overwritten_after_it_was_kept(handover, mid_epoch_shards):
    """The verdict can fail: a kept batch whose bytes are written over (as a worker writing into
    a slot released too early would) is counted, one row a sample."""
    folder = str(mid_epoch_shards)
    ms = handover.case_stream(folder, BATCH)
    loader = make_loader(ms, 0)
    ms.set_epoch(0)
    held = [(0, list(b["key"]), [(b["image"].clone(), b["label"].clone())]) for b in loader]
    held[3][2][0][0][5] = held[3][2][0][0][5] ^ 1  # one sample's pixels
    held[7][2][0][1][0] += 1  # another's label
    with pytest.raises(handover.Failed) as e:
        handover.verdict("test", held, folder, BATCH, 1, CPU)
    assert e.value.figures["differ"] == 2 and "2 of" in str(e.value)
    with pytest.raises(handover.Failed, match="epochs \\[1\\] hold other keys"):
        handover.verdict("test", held[1:], folder, BATCH, 1, CPU)


@NEEDS_DEVICE
@pytest.mark.parametrize("workers", [0, 2])
def test_kept_device_batches_keep_their_bytes_over_3_epochs(handover, mid_epoch_shards, workers):
    figures = handover.kept_on_device(str(mid_epoch_shards), CPU, workers, batch=BATCH)
    assert figures["differ"] == 0 and figures["batches"] == 3 * handover.EPOCH_BATCHES


@NEEDS_DEVICE
def test_workers_started_again_after_close_read_the_same_bytes(handover, mid_epoch_shards):
    figures = handover.workers_restarted(str(mid_epoch_shards), CPU, 2, batch=BATCH)
    assert figures["differ"] == 0 and figures["batches"] == 2 * handover.EPOCH_BATCHES


@NEEDS_CUDA
@NEEDS_DEVICE
def test_a_refused_page_lock_is_one_warning_and_the_batches_are_whole(handover, mid_epoch_shards):
    figures = handover.refused_page_lock(str(mid_epoch_shards), torch.device("cuda", 0), batch=BATCH)
    assert len(figures["warnings"]) == 1


def test_the_gpu_jpeg_case_compares_the_device_decode_with_the_hosts(gpu_check, tmp_path):
    """decode="device" beside "host" at 0 and 2 workers on the CPU: the same batches, every JPEG
    of the set decoded after the hand-over, a rate for each; a batch that differs fails the case."""
    from gpucheck import jpegdecode

    jpegdecode.build(str(tmp_path), n=240, per_shard=60)
    figures = jpegdecode.decode_rate(str(tmp_path), CPU, workers=(0, 2), batches=3, batch=32)
    assert [r["workers"] for r in figures["runs"]] == [0, 2]
    assert all(r["host"] > 0 and r["device"] > 0 for r in figures["runs"])
    assert figures["jpegs_decoded_on_device"] == 2 * 4 * 32  # every image of a batch, both worker counts
    keys, labels, images = [f"k{i}" for i in range(4)], torch.zeros(4, dtype=torch.int64), torch.zeros(4, 3, 8, 8)
    assert jpegdecode._compared([(keys, labels, images)], [(keys, labels, images + 4)]) == \
        ["batch 0: images differ by 4.0 levels"]
    assert jpegdecode._compared([(keys, labels, images)], [(keys[::-1], labels, images)]) == \
        ["batch 0: other keys or labels"]
