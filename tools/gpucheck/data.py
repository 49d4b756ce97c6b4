"""The shards every step reads: synthetic MNIST/CIFAR10 look-alikes in the real shapes, written
by the project's own writer (raw), and the same shapes as JPEG files in tar shards another tool
could have written, indexed in place (the decode-bound case of the scaling table)."""
import os

from pipeline.data.streams.stream import resolve
from pipeline.writers import shards
from pipeline.writers.sources import SyntheticSource

SHAPES = {"mnist": (1, 28, 28), "cifar10": (3, 32, 32)}
TRAIN_N, TEST_N = 20000, 2000
BATCH = 256


def build_synthetic(folder, train_n=TRAIN_N, test_n=TEST_N):
    """Look-alikes in the real shapes, written by the project's own writer, so that the
    check needs no data set on the GPU machine."""
    workers = min(8, os.cpu_count() or 1)
    for name, shape in SHAPES.items():
        for split, n in (("train", train_n), ("test", test_n)):
            shards.build(SyntheticSource(name, split, n, shape), folder, encoding="raw", maxcount=500,
                         workers=workers, progress=False)


def build_jpeg(folder, n=TRAIN_N, per_shard=500):
    """The same shapes as JPEG files (quality 90) in tar shards another tool could have written
    (one .jpg and one .cls member a sample), indexed in place: the decode-bound case."""
    import io
    import tarfile

    import numpy as np
    from PIL import Image

    from pipeline.writers import index

    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    for name, (c, h, w) in SHAPES.items():
        count = -(-n // per_shard)
        for k in range(count):
            with tarfile.open(os.path.join(folder, f"{name}-train-{k:06d}.tar"), "w", format=tarfile.USTAR_FORMAT) as tar:
                for i in range(k * per_shard, min(n, (k + 1) * per_shard)):
                    pixels = rng.integers(0, 256, (h, w, 3) if c == 3 else (h, w), dtype=np.uint8)
                    buf = io.BytesIO()
                    Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
                    for ext, data in (("jpg", buf.getvalue()), ("cls", str(i % 10).encode())):
                        info = tarfile.TarInfo(f"{name}{i:07d}.{ext}")
                        info.size, info.mtime, info.mode = len(data), 0, 0o644
                        tar.addfile(info, io.BytesIO(data))
        index.index(name, "train", os.path.join(folder, f"{name}-train-{{000000..{count - 1:06d}}}.tar"), folder,
                    shape=(c, h, w), workers=min(8, os.cpu_count() or 1), progress=False)


def describe_shards(folder):
    """Resolve every split the trainer will read, so a missing or damaged manifest fails
    here in one line rather than inside torchrun."""
    found = {f"{n}-{s}": resolve(n, folder, s) for n in SHAPES for s in ("train", "test")}
    synthetic = all(src.synthetic for src in found.values())
    count = sum(len(src.urls) for src in found.values())
    samples = {k: src.total for k, src in found.items()}
    return {"folder": folder, "synthetic": synthetic, "shards": count, "samples": samples,
            "summary": f"{'synthetic' if synthetic else 'real'} data, {count} shards: "
                       + ", ".join(f"{k} {v}" for k, v in samples.items())}


def train_sources(folder):
    return [resolve(n, folder, "train") for n in SHAPES]
