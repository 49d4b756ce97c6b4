"""Measure what plain USTAR shards gain over webdataset's own TarWriter output.

    python tools/bench_tar_format.py --root ../shared/data        # real MNIST
    python tools/bench_tar_format.py --synthetic                  # no data needed

Writes the same samples (first --samples MNIST training images, png) once with
`wds.TarWriter` and once with `pipeline.shards.write_shard`, then reports file sizes,
PAX headers found, and read speed with stock `wds.WebDataset` and with our reader.
"""
import argparse
import os
import statistics
import sys
import tarfile
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import webdataset as wds  # noqa: E402

from pipeline import shards, sources  # noqa: E402


def pax_members(path):
    """Count PAX extended-header records by walking the raw 512-byte headers."""
    n = 0
    with open(path, "rb") as f:
        data = f.read()
    pos = 0
    while pos + 512 <= len(data) and data[pos:pos + 512] != bytes(512):
        size = int(data[pos + 124:pos + 136].strip(b"\0 ") or b"0", 8)
        n += data[pos + 156:pos + 157] in (b"x", b"g")
        pos += 512 + (size + 511) // 512 * 512
    return n


def timed(fn, repeats):
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        n = fn()
        times.append(time.perf_counter() - t)
    return n, statistics.median(times), min(times), max(times)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default="data", help="torchvision root holding MNIST/raw")
    p.add_argument("--synthetic", action="store_true", help="use synthetic MNIST look-alikes")
    p.add_argument("--samples", type=int, default=10000)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    src = (sources.synthetic_source("mnist", "train", limit=args.samples) if args.synthetic
           else sources.torchvision_source("mnist", "train", args.root))
    idx = list(range(min(args.samples, len(src))))
    tmp = tempfile.mkdtemp()
    ours = os.path.join(tmp, "ustar.tar")
    theirs = os.path.join(tmp, "wds.tar")
    shards.write_shard(ours, src, idx, "png")
    with wds.TarWriter(theirs) as w:
        for i in idx:
            w.write({"__key__": f"mnist-train-{i:07d}", "png": shards.encode_image(src.image(i), "png"),
                     "cls": str(src.label(i)).encode()})

    def read_wds(path):
        return lambda: sum(1 for _ in wds.WebDataset(path, shardshuffle=False))

    def read_ours(path):
        def go():
            with open(path, "rb") as f:
                return sum(1 for _ in shards.iter_samples(shards.iter_members(f)))
        return go

    rows = []
    for label, path in (("wds.TarWriter (PAX)", theirs), ("shards.write_shard (USTAR)", ours)):
        with tarfile.open(path) as t:
            assert len(t.getmembers()) == 2 * len(idx)
        stock = timed(read_wds(path), args.repeats)
        lean = timed(read_ours(path), args.repeats)
        rows.append((label, os.path.getsize(path), pax_members(path), len(idx) / stock[1], len(idx) / lean[1]))
    print(f"{len(idx)} MNIST samples, png, median of {args.repeats} reads from the page cache")
    print(f"{'writer':<28}{'MB':>8}{'PAX hdrs':>10}{'wds.WebDataset/s':>18}{'iter_members/s':>16}")
    for label, size, pax, a, b in rows:
        print(f"{label:<28}{size / 1e6:>8.2f}{pax:>10}{a:>18.0f}{b:>16.0f}")
    (_, s0, _, r0, _), (_, s1, _, r1, _) = rows
    print(f"USTAR: {100 * (1 - s1 / s0):.0f}% smaller, stock webdataset reads it {r1 / r0:.2f}x faster")
    return 0


if __name__ == "__main__":
    sys.exit(main())
