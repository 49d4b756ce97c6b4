"""Hostile fields (pipeline.data.fields.schema): a 100 MB caption, a .npy of objects, a .npy claiming
2^40 elements, a crop larger than its image, a .json path into a list of a million items. Each
is one skipped, counted sample with its reason, the others stream on, and the process's peak
memory stays far below what any of them claims."""
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile

import numpy as np
import pytest
from PIL import Image

from helpers import encode_pil

CAPTION = 100 << 20


class Repeated:
    """A file object of `n` bytes of `byte`, made as they are read (tarfile copies in blocks)."""

    def __init__(self, n, byte=b"a"):
        self.left, self.byte = n, byte

    def read(self, n=-1):
        n = self.left if n < 0 else min(n, self.left)
        self.left -= n
        return self.byte * n


def npy(a, **kw):
    buf = io.BytesIO()
    np.save(buf, a, **kw)
    return buf.getvalue()


def claimed_npy(shape):
    """A .npy whose header claims `shape` of float32, followed by 16 bytes."""
    from numpy.lib import format as npformat

    buf = io.BytesIO()
    npformat.write_array_header_1_0(buf, {"descr": "<f4", "fortran_order": False, "shape": shape})
    return buf.getvalue() + bytes(16)


def members(key, side=24, caption=None, emb=None, tags=None):
    img = np.random.default_rng(len(key)).integers(0, 256, (side, side, 3), dtype=np.uint8)
    return [(key + ".png", encode_pil(Image.fromarray(img), "PNG")),
            (key + ".txt", caption if caption is not None else f"caption of {key}".encode()),
            (key + ".json", json.dumps({"tags": tags if tags is not None else [1, 2, 3]}).encode()),
            (key + ".npy", emb if emb is not None else npy(np.ones((4, 2), np.float32)))]


HOSTILE = {
    "big_caption": ("field caption: .txt of 104857600 bytes, more than its cap of 65536",
                    dict(caption=Repeated(CAPTION))),
    "object_npy": ("field emb: .npy holds object, not numbers",
                   dict(emb=npy(np.array([{"a": 1}, None], dtype=object), allow_pickle=True))),
    "huge_npy": ("field emb: .npy of shape (1048576, 1048576), the field takes at most (4, 2)",
                 dict(emb=claimed_npy((1 << 20, 1 << 20)))),
    "small_image": ("image of 8x8 is smaller than the 16x16 crop of RandomCrop('image')", dict(side=8)),
    "million_tags": ("field tags: .json of 7888900 bytes, more than its cap of 1048576 "
                     "(pipeline.data.fields.schema.MAX_JSON_BYTES)", dict(tags=list(range(1_000_000)))),
}


def write(path, samples):
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for key, kw in samples:
            for name, data in members(key, **kw):
                info = tarfile.TarInfo(name)
                if isinstance(data, Repeated):
                    info.size = data.left
                    tar.addfile(info, data)
                else:
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    out = tmp_path_factory.mktemp("hostile")
    good = [(f"good{i:02d}", {}) for i in range(20)]
    bad = [(k, kw) for k, (_, kw) in HOSTILE.items()]
    shards = [good[:7] + bad[:2], good[7:14] + bad[2:4], good[14:] + bad[4:]]
    entries = []
    for k, samples in enumerate(shards):
        path = out / f"h-{k}.tar"
        write(path, samples)
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        entries.append({"name": path.name, "samples": len(samples), "bytes": os.path.getsize(path),
                        "sha256": digest.hexdigest()})
    fields = [{"name": "image", "type": "image", "member": "png", "fit": "native", "size": [64, 64]},
              {"name": "caption", "type": "text", "member": "txt"},
              {"name": "tags", "type": "int", "member": "json:tags", "length": 3},
              {"name": "emb", "type": "array", "member": "npy", "shape": [4, 2]}]
    manifest = {"format": "pipeline-shards/2", "dataset": "h", "split": "train", "fields": fields, "shards": entries}
    (out / "h-train.json").write_text(json.dumps(manifest))
    return str(out)


SCRIPT = r'''
import dataclasses, json, resource, sys, warnings
from pipeline.data.fields import augment
from pipeline.data.manifests.manifest import resolve
from pipeline.data.streams.stream import MixedStream
from pipeline.data.handover.loader import make_loader

src = resolve("h", sys.argv[1], "train")
src = dataclasses.replace(src, schema=type(src.schema)(src.schema.columns, [augment.RandomCrop("image", 16)]))
stream = MixedStream([src], {"h": 1}, 4, seed=0, epoch_samples=28)  # the 25 samples' pass whole, and 3 more
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
keys, skipped = [], 0
with warnings.catch_warnings(record=True) as said:
    warnings.simplefilter("always")
    for b in make_loader(stream, int(sys.argv[2])):
        keys += b["key"]
        skipped += b["skipped"]
        assert b["image"].shape == (4, 3, 16, 16) and b["emb"].shape == (4, 4, 2)
        assert all(c == "caption of " + k for k, c in zip(b["key"], b["caption"]))
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps({"keys": keys, "skipped": skipped, "said": [str(w.message) for w in said], "grown_kb": grown}))
'''


@pytest.mark.slow
def test_each_hostile_field_is_one_skipped_counted_sample_and_memory_stays_flat(hostile):
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=repo, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, hostile, "0"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout)
    assert set(got["keys"]) <= {f"good{i:02d}" for i in range(20)} and len(got["keys"]) == 28
    for key, (reason, _) in HOSTILE.items():
        lines = [s for s in got["said"] if f"sample {key}:" in s]
        assert lines and all(reason in line for line in lines), (key, lines)
    assert got["skipped"] == sum(1 for s in got["said"] if "skipped sample" in s) >= len(HOSTILE)
    print(f"peak RSS grew {got['grown_kb'] >> 10} MiB")
    assert got["grown_kb"] < 48 << 10, f"peak RSS grew {got['grown_kb'] >> 10} MiB reading a 100 MB caption"
