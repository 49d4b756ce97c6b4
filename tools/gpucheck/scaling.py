"""The stream alone, at 0, 4, 8 and cores-2 workers, raw and JPEG shards, float (C) and uint8
(C8) batches: samples/s, busy cores and the consuming process's CPU a sample, against the
issue-45 targets of the 16-core, one-GPU machine (reported as met or missed, never failed)."""
import os
import time

import torch

from bench.cpu import tree_cpu  # the process tree's CPU, as bench_loader counts it
from gpucheck.data import BATCH, SHAPES, train_sources
from gpucheck.handover import host_loader
from gpucheck.runner import Failed
from pipeline.data.streams.stream import MixedStream

TARGETS = {("raw", "C8"): 1_000_000, ("raw", "C"): 600_000, ("jpg", "C8"): 150_000}


def stream_rate(folder, workers, normalize, seconds):
    """The stream alone through make_loader with pinned memory: the first batch's time (worker
    start-up), then samples/s, busy cores and the consuming process's own CPU a sample over a
    timed window that starts once the workers are warm (a quarter of `seconds` later)."""
    ms = MixedStream(train_sources(folder), dict.fromkeys(SHAPES, 1.0), BATCH, epoch_samples=BATCH * 2000,
                     shuffle_buffer=2000, normalize=normalize)
    loader = host_loader(ms, workers)
    pinned = torch.cuda.is_available()  # (the steps that need no GPU run on a CPU in tests/test_gpu_check.py)
    epoch = [0]

    def batches():
        while True:
            ms.set_epoch(epoch[0])
            yield from loader
            epoch[0] += 1

    it = batches()
    t0 = time.perf_counter()
    next(it)
    first = time.perf_counter() - t0
    while time.perf_counter() - t0 < first + seconds / 4:
        next(it)
    (m0, r0), c0, t1, n, unpinned = tree_cpu(), time.process_time(), time.perf_counter(), 0, 0
    while time.perf_counter() - t1 < seconds * 3 / 4:
        b = next(it)
        n += len(b["key"])
        unpinned += pinned and not b["image"].is_pinned()
    wall, (m1, r1), consumer = time.perf_counter() - t1, tree_cpu(), time.process_time() - c0
    it.close()
    loader.close()
    return {"workers": workers, "first_batch_s": round(first, 3), "samples": n, "samples_per_s": round(n / wall, 1),
            "busy_cores": round(((m1 - m0) + (r1 - r0)) / wall, 2),
            "consumer_us_per_sample": round(consumer / max(n, 1) * 1e6, 3), "unpinned": unpinned,
            "startup_share": round(first / (first + seconds), 3)}


def scaling_check(folders, seconds):
    """stream_rate for every encoding, worker count (0, 4, 8, cores-2) and batch kind (C: float32,
    C8: uint8), within `seconds` in all; the targets of the 16-core, one-GPU machine reported."""
    counts = sorted({0, 4, 8, max(1, (os.cpu_count() or 2) - 2)})
    configs = [(enc, w, m) for enc in folders for w in counts for m in ("C", "C8")]
    per = max(2.0, seconds / len(configs) - 1.5)
    rows = []
    for enc, w, method in configs:
        r = stream_rate(folders[enc], w, method == "C", per)
        rows.append(dict(r, encoding=enc, method=method))
        print(f"   {enc:<4} {method:<3} {w:>2} workers: {r['samples_per_s']:>12,.0f} samples/s, {r['busy_cores']:5.2f} "
              f"cores, consumer {r['consumer_us_per_sample']:.3f} us/sample, first batch {r['first_batch_s']} s",
              flush=True)
    top = max(counts)
    met = {f"{enc}/{m} at {top} workers >= {t:,}": next(r["samples_per_s"] for r in rows if r["encoding"] == enc
                                                          and r["method"] == m and r["workers"] == top) >= t
           for (enc, m), t in ((k, v) for k, v in TARGETS.items() if isinstance(k, tuple) and k[0] in folders)}
    figures = {"runs": rows, "targets": met,
               "summary": "; ".join(f"{r['encoding']}/{r['method']} {r['workers']}w {r['samples_per_s']:,.0f}/s"
                                    for r in rows if r["workers"] in (0, top))
                          + "; targets " + ", ".join(f"{k}: {'met' if v else 'missed'}" for k, v in met.items())}
    bad = [f"{r['encoding']}/{r['method']} {r['workers']} workers: {r['unpinned']} batches not pinned"
           for r in rows if r["unpinned"]]
    if bad:
        raise Failed("; ".join(bad), figures)
    return figures
