"""The JPEG path against its ceilings: this stream's uint8 batches of JPEG WebDatasets beside
each bare decoder on the same JPEGs held in memory, in samples per CPU-second, for small
images (the CIFAR10 JPEGs as they are, 32x32) and large ones (the same made 500x375, quality
90, for a 224x224 target: decode and resize). `tools/bench_loader.py --jpeg` runs only this;
with jpg among --encoding the full benchmark runs it too.

Both sets are written as others write them (wds.ShardWriter: a PAX header a member, keys
`class/name` of differing lengths) and indexed in place. The decoders, each as a user would
call it bare, one torch thread:
  torchvision  torchvision.io.decode_jpeg on lists of a batch's JPEGs (one call a batch)
  simplejpeg   simplejpeg.decode_jpeg, each at its own size (if installed)
  simplejpeg scaled  the same at the smallest DCT scale that covers the target (large only)
  PIL          Image.open + convert (large: draft mode at the target, as pipeline.data.decoding.decode did)
and, for the large set, decode.fit to 224x224 after each (the resize the stream does).
The stream runs whole over the same samples, at each --workers count and in both of make_loader's
memory formats (rows marked NHWC: memory_format="channels_last", the JPEGs decoded straight into
the batch; unmarked: the default NCHW batches), its CPU the process
tree's (bench.cpu.measure), and each run gives two rows: "whole run" (its first batch, start-up
and the workers' start included) and "after 1st batch" (the samples after the first batch over
the tree's CPU after it: the issue's measure, the rate an epoch settles at). Repeats are
interleaved; "of best" is a row over the fastest bare decoder of the same repeat.
"""
import glob
import io
import os
import statistics
import time
import warnings

import numpy as np
import torch

from bench.cpu import measure, tree_cpu
from bench.report import fmt_spread, log, spread

SETS = (("small", (3, 32, 32), None), ("large", (3, 224, 224), (500, 375)))
BATCH = 128
FORMATS = {"contiguous": "", "channels_last": " NHWC"}  # make_loader's memory_format -> the row's mark


def build(cifar_folder, out, name, shape, size=None, limit=None, maxcount=1000):
    """The CIFAR10 JPEGs (made `size` (w, h) at quality 90 when given) as a JPEG WebDataset in
    `out`, written by wds.ShardWriter in a seeded shuffle and indexed in place; kept between runs."""
    import webdataset as wds
    from PIL import Image

    from pipeline.writers import index

    if os.path.exists(os.path.join(out, f"{name}-train.json")):
        return out
    os.makedirs(out, exist_ok=True)
    paths = sorted(glob.glob(os.path.join(cifar_folder, "*", "*.jpg")))
    classes = sorted({os.path.basename(os.path.dirname(p)) for p in paths})
    order = np.random.default_rng(0).permutation(len(paths))[:limit]
    with wds.ShardWriter(os.path.join(out, f"{name}-train-%06d.tar"), maxcount=maxcount, verbose=0) as sink:
        for i in order.tolist():
            path = paths[i]
            with open(path, "rb") as f:
                data = f.read()
            if size is not None:
                buf = io.BytesIO()
                Image.open(io.BytesIO(data)).convert("RGB").resize(size, Image.BILINEAR).save(buf, "JPEG", quality=90)
                data = buf.getvalue()
            label = classes.index(os.path.basename(os.path.dirname(path)))
            key = os.path.relpath(path, cifar_folder).rsplit(".", 1)[0]  # class/name: lengths differ
            sink.write({"__key__": key, "jpg": data, "cls": str(label).encode()})
    count = len(glob.glob(os.path.join(out, f"{name}-train-*.tar")))
    index.index(name, "train", os.path.join(out, f"{name}-train-{{000000..{count - 1:06d}}}.tar"), out,
                shape=list(shape), workers=os.cpu_count() or 1, progress=False)
    return out


def jpegs_of(folder, name):
    """Every .jpg member of the set's shards, in order, as bytes."""
    from pipeline.data.shards import read

    out = []
    for path in sorted(glob.glob(os.path.join(folder, f"{name}-train-*.tar"))):
        with open(path, "rb") as f:
            out += [s["jpg"] for s in read.iter_samples(f, {"jpg"})]
    return out


def decoders(shape, large):
    """name -> fn(list of JPEG bytes) decoding each to `shape` as a bare decoder would."""
    from PIL import Image
    from torchvision.io import ImageReadMode, decode_jpeg

    from pipeline.data.decoding import decode

    c, h, w = shape
    fit = (lambda a: decode.fit(a, shape)) if large else (lambda a: a)
    warnings.filterwarnings("ignore", "The image decoding and encoding capabilities of TorchVision",
                            DeprecationWarning)

    def tv(datas):
        for i in range(0, len(datas), BATCH):
            for t in decode_jpeg([torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in datas[i:i + BATCH]],
                                 mode=ImageReadMode.RGB):
                fit(t.permute(1, 2, 0).numpy())

    def pil(datas):
        for d in datas:
            img = Image.open(io.BytesIO(d))
            if large:
                img.draft("RGB", (w, h))
            fit(np.asarray(img.convert("RGB")))

    out = {"torchvision": tv, "PIL" + (" draft" if large else ""): pil}
    try:
        import simplejpeg
    except ImportError:
        return out
    out["simplejpeg"] = lambda datas: [fit(simplejpeg.decode_jpeg(d, colorspace="RGB")) for d in datas]
    if large:
        out["simplejpeg scaled"] = lambda datas: [
            fit(simplejpeg.decode_jpeg(d, colorspace="RGB", min_height=h, min_width=w)) for d in datas]
    return out


def stream_run(folder, name, n, workers, memory_format="contiguous"):
    """Batch sizes of one pass of this stream over the set's n samples (uint8 batches, their images
    in `memory_format`: make_loader's)."""
    from pipeline import stream
    from pipeline.ordering.topology import Topology

    src = stream.resolve(name, folder, "train")
    ms = stream.MixedStream([src], {name: 1.0}, BATCH, Topology(0, 1), seed=0, epoch_samples=n // BATCH * BATCH,
                            normalize=False)
    ms.set_epoch(0)
    return (len(b["image"]) for b in stream.make_loader(ms, num_workers=workers, memory_format=memory_format))


def after_first(batches, marks):
    """The batch sizes of `batches`, appending to `marks` (samples, tree CPU seconds) once the
    first batch is out and again at the end: the rate after the first batch is their difference."""
    n = 0
    for size in batches:
        n += size
        yield size
        if len(marks) == 0:
            marks.append((n, sum(tree_cpu())))
    marks.append((n, sum(tree_cpu())))


def run(cifar_folder, work, workers=(0, 2), repeats=3, limits=(20000, 1000)):
    """The table's rows: per set, each decoder and the stream at each worker count, samples per
    CPU-second (median [min-max] over the repeats), and the stream's share of the best decoder."""
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(cifar_folder, work, workers, repeats, limits)
    finally:
        torch.set_num_threads(torch_threads)


def _run(cifar_folder, work, workers, repeats, limits):
    rows = []
    for (name, shape, size), limit in zip(SETS, limits):
        folder = build(cifar_folder, os.path.join(work, f"jpeg-{name}"), f"jpeg{name}", shape, size, limit)
        datas = jpegs_of(folder, f"jpeg{name}")
        n = len(datas) // BATCH * BATCH
        bare = decoders(shape, name == "large")
        for fn in bare.values():  # one-off costs (imports, plugins) before timing
            fn(datas[:BATCH])
        for w in workers:
            for fmt in FORMATS:
                sum(stream_run(folder, f"jpeg{name}", 2 * BATCH, w, fmt))
        rates = {}
        for _ in range(repeats):
            for dec, fn in bare.items():
                t0 = time.process_time()
                fn(datas[:n])
                rates.setdefault(dec, []).append(n / (time.process_time() - t0))
            for w in workers:
                for fmt in FORMATS:
                    marks = []
                    r = measure(after_first(stream_run(folder, f"jpeg{name}", n, w, fmt), marks), n)
                    (n0, c0), (n1, c1) = marks
                    what = f"stream{FORMATS[fmt]}, {w} workers"
                    rates.setdefault(f"{what}, whole run", []).append(r["samples_per_cpu_s"])
                    rates.setdefault(f"{what}, after 1st batch", []).append((n1 - n0) / (c1 - c0))
        best = [max(rates[d][k] for d in bare) for k in range(repeats)]
        for what, rs in rates.items():
            rows.append({"set": name, "images": f"{len(datas)} x {'32x32' if size is None else '%dx%d' % size}",
                         "target": "x".join(map(str, shape)), "what": what, "samples_per_cpu_s": spread(rs),
                         "of_best": statistics.median(r / b for r, b in zip(rs, best))})
    return rows


def report(rows):
    log("\nJPEG path: samples per CPU-second, median [min-max]; 'of best': over the fastest bare decoder, "
        "same repeat (torch threads 1)")
    for r in rows:
        log(f"  {r['set']:<6}{r['images']:<18}-> {r['target']:<10}{r['what']:<42}"
            f"{fmt_spread(r['samples_per_cpu_s']):>28}{r['of_best']:>8.2f}")
