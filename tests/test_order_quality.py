"""Shards written in class order, as many people write them (walking class folders into
`wds.ShardWriter`): batches must still draw on most classes, at any worker count and world."""
import os

import numpy as np
import pytest
import webdataset as wds

from helpers import encode_pil, make_shards_in_process
from pipeline.data.manifests.manifest import resolve
from pipeline.data.streams.stream import MixedStream
from pipeline.ordering.topology import Topology, Worker

CLASSES, PER_CLASS, PER_SHARD, BATCH = 10, 60, 100, 16


@pytest.fixture(scope="module")
def class_ordered(tmp_path_factory):
    """600 PNGs, class 0's 60 first, then class 1's, ..., 100 to a shard: each shard holds
    one or two classes. Indexed in place."""
    from PIL import Image

    top = tmp_path_factory.mktemp("ordered")
    with wds.ShardWriter(os.path.join(str(top), "ordered-%06d.tar"), maxcount=PER_SHARD, verbose=0) as sink:
        for c in range(CLASSES):
            for i in range(PER_CLASS):
                img = Image.fromarray(np.full((4, 4), c * 20, np.uint8))
                sink.write({"__key__": f"c{c}/{i:04d}", "png": encode_pil(img, "PNG"), "cls": str(c).encode()})
    p = make_shards_in_process(["--index", f"ordered:train={top}/ordered-{{000000..000005}}.tar", "--out", str(top / "m")])
    assert p.returncode == 0, p.stderr
    return resolve("ordered", str(top / "m"), "train")


def classes_per_batch(src, world, workers, **kw):
    seen, keys = [], []
    for rank in range(world):
        s = MixedStream([src], {"ordered": 1}, BATCH, Topology(rank, world), seed=2, **kw)
        s.set_workers(max(workers, 1))
        for w in range(max(workers, 1)):
            for b in s.batches(Worker(w, max(workers, 1))):
                seen.append(len(set(b["label"].tolist())))
                keys += b["key"]
    assert len(keys) == len(set(keys))
    return float(np.mean(seen))


def uniform(n=20_000):
    """Distinct classes in a batch drawn uniformly from the 600 samples, without replacement."""
    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(CLASSES), PER_CLASS)
    return float(np.mean([len(set(rng.choice(labels, BATCH, replace=False))) for _ in range(n // BATCH)]))


@pytest.mark.parametrize("world, workers", [(1, 0), (1, 2), (2, 1), (2, 2)])
def test_batches_of_class_ordered_shards_draw_on_most_classes(class_ordered, world, workers):
    got = classes_per_batch(class_ordered, world, workers, shuffle_buffer=PER_CLASS * CLASSES)
    assert got > uniform() - 0.3, (got, uniform())


def test_a_window_of_one_shard_cannot_mix_them(class_ordered):
    """The check can fail: with a window of one shard a batch sees one or two classes."""
    assert classes_per_batch(class_ordered, 1, 0, shuffle_buffer=1) < 3
