"""The hand-over alone (`bench_loader.py --handover`): what the consuming process pays, of its
own CPU, to receive a batch from workers that do no other work. torch's DataLoader, its workers
yielding the small fields a batch of this project carries (keys, state, labels; the pixels
already in shared memory), against pipeline.data.handover.loader with the same fields in its ring. This
is the measured reason the loader runs its own worker processes: the consumer's budget is
0.3 us a sample, 77 us a batch of 256.

Then the stream itself through the loops users write (`run_stream`): one that keeps nothing,
and one that keeps each batch's labels to score the epoch at its end, at 0 and N workers,
C (float32) and C8 (uint8): samples per CPU-second of the whole process tree, and the
consuming process's own CPU a sample."""
import statistics
import tempfile
import time

import numpy as np
import torch

from pipeline.data.handover.loader import make_loader
from pipeline.data.fields.spec import Field, Spec
from pipeline.data.streams.stream import MixedStream, resolve
from pipeline.ordering.topology import Topology, Worker
from pipeline.writers import shards
from pipeline.writers.sources import SyntheticSource

from bench.cpu import tree_cpu
from bench.report import log, spread


def small_fields(i, batch):
    return {"key": [f"cifar10-train-{i * batch + j:07d}" for j in range(batch)], "skipped": 0,
            "state": {"plan": 1, "worker": 0, "batches": i, "positions": [i * batch, i * batch]}}


class _ForDataLoader(torch.utils.data.IterableDataset):
    """What the loader's workers sent through DataLoader before: which ring buffer, labels,
    sources and the small fields; nothing is computed."""

    def __init__(self, batches, batch):
        self.batches, self.batch = batches, batch

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        for i in range(info.id, self.batches, info.num_workers):
            yield {"image": (info.id, i % 6), "label": np.zeros(self.batch, np.int64),
                   "source": np.zeros(self.batch, np.int64), **small_fields(i, self.batch)}


class _ForRing:
    """A stream for pipeline.data.handover.loader that writes nothing into its slots."""

    def __init__(self, batches, batch):
        self.batches_total, self.batch = batches, batch

    def batch_spec(self):
        return Spec([Field("image", np.uint8, (3, 32, 32)), Field("label", np.int64), Field("source", np.int64)],
                    self.batch)

    def __len__(self):
        return self.batches_total

    def batches(self, worker=None, borrow=None, plan=None):
        worker = worker or Worker()
        for i in range(worker.id, self.batches_total, worker.count):
            handle, _ = borrow(self.batch) if borrow else (None, None)
            out = small_fields(i, self.batch)
            if handle is not None:
                out["slot"] = handle
            yield out


def _as_is(batch):
    return batch


def consumer_us(loader):
    """The consuming process's own CPU (all its threads) a batch over one pass, the first batch
    (worker start-up) left out."""
    it = iter(loader)
    next(it)
    t0, n = time.process_time(), 0
    for _ in it:
        n += 1
    return (time.process_time() - t0) / n * 1e6


def stream_consumer(folder, workers, batch, normalize, epochs, keep=False):
    """The consuming process's own CPU a sample of this project's stream (C: float32 batches, C8:
    uint8), and samples per CPU-second of the whole process tree, its loader persisting across
    epochs as in training: each epoch after the first (which pays for forking the workers)
    measured on its own. keep: the loop keeps every batch's labels until the epoch ends."""
    srcs = [resolve(n, folder, "train") for n in ("mnist", "cifar10")]
    s = MixedStream(srcs, {"mnist": 1.0, "cifar10": 1.0}, batch, Topology(), seed=0, normalize=normalize,
                    shuffle_buffer=1000)
    loader = make_loader(s, workers)
    out = []
    for epoch in range(epochs + 1):
        s.set_epoch(epoch)
        kept = []
        (m0, r0), t0, w0, n = tree_cpu(), time.process_time(), time.perf_counter(), 0
        for b in loader:
            n += len(b["key"])
            if keep:
                kept.append(b["label"])
        wall, own, (m1, r1) = time.perf_counter() - w0, time.process_time() - t0, tree_cpu()
        if epoch:
            out.append({"us_per_sample": own / n * 1e6, "samples_per_s": n / wall,
                        "samples_per_cpu_s": n / ((m1 - m0) + (r1 - r0)), "copied": loader.ring.copied})
        del kept
    loader.close()
    return out


def synthetic_shards(folder, n):
    """MNIST- and CIFAR10-shaped synthetic samples in raw shards, as make_shards writes them."""
    for name, shape in (("mnist", (1, 28, 28)), ("cifar10", (3, 32, 32))):
        shards.build(SyntheticSource(name, "train", n, shape, 0), folder, encoding="raw", maxcount=1000, seed=0,
                     progress=False)


def run_stream(workers=2, batch=256, repeats=3, samples=20000, epochs=2):
    """C and C8 at 0 and `workers` workers, each loop (keep nothing, keep labels) run back to back
    within a repeat; medians over every measured epoch of the repeats."""
    runs = {}
    with tempfile.TemporaryDirectory(prefix="bench-handover-") as folder:
        synthetic_shards(folder, samples)
        for _ in range(repeats):
            for w in sorted({0, workers}):
                for method, normalize in (("C", True), ("C8", False)):
                    for loop in ("keep nothing", "keep labels"):
                        runs.setdefault((method, w, loop), []).extend(
                            stream_consumer(folder, w, batch, normalize, epochs, keep=loop == "keep labels"))
    rows = []
    for (method, w, loop), rs in runs.items():
        us, rate = spread([r["us_per_sample"] for r in rs]), spread([r["samples_per_s"] for r in rs])
        per_cpu = spread([r["samples_per_cpu_s"] for r in rs])
        rows.append({"method": method, "workers": w, "loop": loop, "us_per_sample": us, "samples_per_s": rate,
                     "samples_per_cpu_s": per_cpu, "copied": max(r["copied"] for r in rs), "epochs": len(rs)})
        log(f"  {method:<3} {w} workers, {loop:<12}: {per_cpu['median']:9,.0f} samples/cpu-s "
            f"[{per_cpu['min']:,.0f}-{per_cpu['max']:,.0f}], consumer {us['median']:.3f} us a sample "
            f"[{us['min']:.3f}-{us['max']:.3f}], {rate['median']:,.0f} samples/s, batches copied out "
            f"{rows[-1]['copied']} ({len(rs)} epochs of {2 * samples})")
    return rows


def run(workers=2, batches=2000, batch=256, repeats=5):
    rows = {"DataLoader": [], "pipeline.data.handover.loader": []}
    for rep in range(repeats):
        dl = torch.utils.data.DataLoader(_ForDataLoader(batches, batch), batch_size=None, num_workers=workers,
                                         collate_fn=_as_is, prefetch_factor=4, persistent_workers=False)
        rows["DataLoader"].append(consumer_us(dl))
        ours = make_loader(_ForRing(batches, batch), workers)
        rows["pipeline.data.handover.loader"].append(consumer_us(ours))
        ours.close()
        log(f"  repeat {rep + 1}/{repeats}: " + ", ".join(f"{k} {v[-1]:.1f} us" for k, v in rows.items()))
    out = []
    log(f"\nthe consuming process's CPU a batch of {batch} from {workers} workers that do no work "
        f"({batches} batches a run, medians of {repeats} [min-max])")
    for name, values in rows.items():
        s = spread(values)
        out.append({"loader": name, "us_per_batch": s, "us_per_sample": spread([v / batch for v in values])})
        log(f"  {name:<22} {s['median']:7.1f} us a batch [{s['min']:.1f}-{s['max']:.1f}], "
            f"{s['median'] / batch:.3f} us a sample")
    ratio = statistics.median(a / b for a, b in zip(rows["DataLoader"], rows["pipeline.data.handover.loader"]))
    log(f"  DataLoader / pipeline.data.handover.loader: {ratio:.2f}x (median of the paired repeats)")
    log(f"\nthe stream (synthetic MNIST + CIFAR10 shapes, raw shards, batches of {batch}), loader kept across epochs:")
    streams = run_stream(workers, batch, repeats)
    return {"workers": workers, "batches": batches, "batch": batch, "rows": out, "ratio": ratio, "stream": streams}
