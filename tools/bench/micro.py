"""What one part costs, beside the timed runs: cProfile of C, the read ceiling of the shards,
the two tar formats, the stages written here against webdataset's, the thread switch of
normalize, and the JPEG decoders pipeline.data.decoding.decode chooses between."""
import cProfile
import itertools
import os
import pstats
import shutil
import statistics
import tempfile
import time

import numpy as np
import torch

from pipeline.data.shards import read
from pipeline.writers import shards, sources

from bench import ROOT
from bench.cpu import host_ticks, steal_fields, tree_cpu
from bench.inputs import project_sources, warm_page_cache
from bench.methods import batches_c
from bench.report import spread


def profile_c(setup, encoding, top=15, normalize=True):
    """cProfile of one C run (C8 with normalize=False) in this process (workers=0): the
    functions holding the time."""
    srcs = project_sources(setup.shards[encoding])
    prof = cProfile.Profile()
    prof.enable()
    n = sum(batches_c(srcs, setup, 0, 0, normalize=normalize))
    prof.disable()
    stats = pstats.Stats(prof)
    rows = []
    for (path, line, func), (cc, nc, tt, ct, _) in stats.stats.items():
        if path == "~":
            where = func
        else:
            where = f"{os.path.relpath(path, ROOT) if path.startswith(ROOT) else short(path)}:{line}({func})"
        rows.append({"function": where, "calls": nc, "tottime_s": round(tt, 4), "cumtime_s": round(ct, 4)})
    rows.sort(key=lambda r: -r["tottime_s"])
    return {"method": "C" if normalize else "C8", "encoding": encoding, "samples": n,
            "total_s": round(stats.total_tt, 3), "top": rows[:top]}


def short(path):
    parts = path.split(os.sep)
    return os.sep.join(parts[-2:]) if "site-packages" in parts or "lib" in parts else path


def read_ceiling(setup, encoding, repeats=3):
    """Samples/s of nothing but reading every train shard's bytes (page cache); counts from manifests."""
    srcs = project_sources(setup.shards[encoding])
    paths = [u for s in srcs for u in s.urls]
    total = sum(s.total for s in srcs)
    nbytes = sum(os.path.getsize(p) for p in paths)
    warm_page_cache(paths)
    runs = []
    for _ in range(repeats):
        ticks0 = host_ticks()
        c0, t0 = sum(tree_cpu()), time.perf_counter()
        warm_page_cache(paths)
        wall, cpu = time.perf_counter() - t0, sum(tree_cpu()) - c0
        runs.append({"wall_s": wall, "cpu_s": cpu, "samples_per_s": total / wall,
                     **steal_fields(ticks0, host_ticks())})
    return {"encoding": encoding, "samples": total, "bytes": nbytes, "runs": runs,
            "samples_per_s": spread([r["samples_per_s"] for r in runs]),
            "mb_per_s": statistics.median(nbytes / 1e6 / r["wall_s"] for r in runs)}


def tar_format(mnist_root, n=10000, repeats=3):
    """The same MNIST samples (png) as webdataset's TarWriter writes them (a PAX header per
    member, float mtimes) and as pipeline.writers.shards writes them (plain USTAR): file size, and
    samples/s read by stock webdataset (tarfile) and by `read.iter_samples`, no decoding."""
    import webdataset as wds

    src = sources.torchvision_source("mnist", "train", mnist_root)
    n = min(n, len(src))
    tmp = tempfile.mkdtemp(prefix="bench-tar-")
    try:
        ustar = os.path.join(tmp, "ustar.tar")
        shards.write_shard(ustar, src, range(n), "png")
        pax = os.path.join(tmp, "pax.tar")
        with wds.TarWriter(pax) as w:
            for i in range(n):
                w.write({"__key__": f"mnist-train-{i:07d}", "png": shards.encode_image(src.image(i), "png"),
                         "cls": str(src.label(i)).encode()})

        def stock(path):
            return sum(1 for _ in wds.WebDataset(path, shardshuffle=False, empty_check=False))

        def lean(path):
            with open(path, "rb") as f:
                return sum(1 for _ in read.iter_samples(f))

        rows = []
        for fmt, path in (("pax (wds.TarWriter)", pax), ("ustar (pipeline.writers.shards)", ustar)):
            row = {"format": fmt, "samples": n, "bytes": os.path.getsize(path)}
            warm_page_cache([path])
            for reader, count in (("webdataset", stock), ("pipeline_read", lean)):
                rates = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    got = count(path)
                    rates.append(got / (time.perf_counter() - t0))
                    if got != n:
                        raise RuntimeError(f"{fmt}: {reader} read {got} samples, expected {n}")
                row[f"{reader}_samples_per_s"] = spread(rates)
            rows.append(row)
        return rows
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def stage_costs(n=200_000, repeats=3):
    """Per-sample cost of two of the stages written here rather than taken from webdataset
    (tar reading, the third, is measured by `tar_format`): the shuffle (wds.shuffle's buffer
    of 1000, against one seeded permutation per window of 1000) and the mix (wds.RandomMix,
    one draw per sample, against pipeline.ordering.deal.Choices taking a batch of 256 sources
    at once from an exact, seeded mix)."""
    import random

    import webdataset as wds

    from pipeline.ordering.deal import Choices

    samples = [{"__key__": str(i)} for i in range(n)]

    def wds_shuffle():
        return sum(1 for _ in wds.filters._shuffle(iter(samples), 1000, 1000, rng=random.Random(0)))

    def window_shuffle():
        rng, k = np.random.default_rng(0), 0
        for start in range(0, n, 1000):
            k += len([samples[start + i] for i in rng.permutation(min(1000, n - start)).tolist()])
        return k

    def wds_mix():
        mix = wds.RandomMix([itertools.repeat(samples[0]), itertools.repeat(samples[1])], [0.5, 0.5])
        return sum(1 for _ in itertools.islice(iter(mix), n))

    def our_mix():
        mix = Choices([n // 2, n - n // 2], (0,))
        return sum(len(mix.take(at, at + 256)) for at in range(0, n - 255, 256))

    rows = []
    for stage, theirs, ours in (("shuffle", wds_shuffle, window_shuffle), ("mix", wds_mix, our_mix)):
        row = {"stage": stage}
        for who, fn in (("webdataset", theirs), ("pipeline", ours)):
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                k = fn()
                times.append((time.perf_counter() - t0) / k * 1e6)
            row[f"{who}_us_per_sample"] = spread(times)
        rows.append(row)
    return rows


def thread_switch(repeats=5, normalizes=200, steps=5):
    """Why `Layout.normalize` runs torch in one thread: CPU us to normalise a 256-batch with
    numpy (its route before) and with torch switched to one thread and back (torch in all its
    threads looks cheap in this tight loop, but in the stream its idle threads spin between
    batches: C/raw's figure shows it); and ms of CPU for one CPU training step of the
    trainer's model at batch 64, with and without that switch before it (the switch was
    thought to clear oneDNN's caches)."""
    from pipeline.data.fields.batch import one_torch_thread, by_numpy, by_torch
    from pipeline.train.model import Net

    rng = np.random.default_rng(0)
    image = torch.from_numpy(rng.integers(0, 256, (256, 3, 32, 32), dtype=np.uint8))
    source = torch.from_numpy(rng.integers(0, 2, 256))
    scale, shift = torch.rand(2, 3, 1, 1) / 64, torch.rand(2, 3, 1, 1)

    def numpy_route():
        by_numpy(torch.empty(image.shape), image, scale[source], shift[source])

    def one_thread():
        by_torch(torch.empty(image.shape), image, scale[source], shift[source])

    torch.manual_seed(0)
    net = Net(20)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    x, y = torch.randn(64, 3, 32, 32), torch.randint(0, 20, (64,))

    def step(switch):
        if switch:
            with one_torch_thread():
                pass
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()

    pairs = ((("normalize, numpy", numpy_route), ("normalize, torch one thread", one_thread), normalizes, 1e6, "us"),
             (("CPU step", lambda: step(False)), ("CPU step after a switch", lambda: step(True)), steps, 1e3, "ms"))
    rows = []
    for first, second, k, unit, label in pairs:
        for _, fn in (first, second):  # warm up, then alternate the two, so a drifting machine moves both alike
            for _ in range(3):
                fn()
        times = {first[0]: [], second[0]: []}
        for _ in range(repeats):
            for name, fn in (first, second):
                c0 = time.process_time()
                for _ in range(k):
                    fn()
                times[name].append((time.process_time() - c0) / k * unit)
        rows += [{"what": name, "cpu": spread(times[name]), "unit": label} for name in times]
    return rows
