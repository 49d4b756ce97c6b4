"""pipeline.shards on tiny synthetic data: format, reader, determinism, rebuilds, parts, verify."""
import hashlib
import json
import os
import re
import tarfile

import numpy as np
import pytest
from PIL import Image

from helpers import CLASSES, array_source, build_source
from pipeline.writers import shards, sources
from pipeline.writers import verify

def tar_files(folder):
    return sorted(f for f in os.listdir(folder) if ".tar" in f)


def folder_bytes(folder):
    return {f: (folder / f).read_bytes() for f in sorted(os.listdir(folder))}


def check_plain_ustar(path):
    """Every header is a plain USTAR regular-file header with mtime 0, members back to back."""
    raw = path.read_bytes()
    with tarfile.open(path) as tar:
        members = tar.getmembers()
        assert tar.pax_headers == {}
    assert members
    offset = 0
    for m in members:
        assert m.type == tarfile.REGTYPE
        assert m.mtime == 0 and type(m.mtime) is int
        # tarfile points a PAX member's offset at its 'x' header: a plain member's data follows its own header
        assert m.offset == offset and m.offset_data == offset + 512
        header = raw[m.offset:m.offset + 512]
        assert header[257:265] == b"ustar\x0000"
        assert header[156:157] == b"0"
        assert header[136:148] == b"00000000000\x00"  # mtime field
        offset = m.offset_data + (m.size + 511) // 512 * 512
    assert raw[offset:offset + 1024] == bytes(1024)  # end-of-archive blocks
    assert not raw[offset:].strip(b"\0")


# ---------------------------------------------------------------- round trip


@pytest.mark.parametrize("shape", [(1, 8, 8), (3, 5, 7)])
@pytest.mark.parametrize("encoding", shards.ENCODINGS)
def test_round_trip(tmp_path, read_tar, decode_image, encoding, shape):
    n = 23
    src = array_source(n, shape, name="toy_set", split="train")
    m = build_source(src, tmp_path, encoding=encoding, maxcount=5, seed=1)

    assert json.loads((tmp_path / "toy_set-train.json").read_text()) == m
    assert sorted(os.listdir(tmp_path)) == sorted([s["name"] for s in m["shards"]] + ["toy_set-train.json"])
    assert [s["name"] for s in m["shards"]] == [f"toy_set-train-{k:06d}.tar" for k in range(5)]
    assert [s["samples"] for s in m["shards"]] == [5, 5, 5, 5, 3]
    assert (m["total"], m["shape"], m["encoding"], m["classes"]) == (n, list(shape), encoding, CLASSES)

    seen = set()
    for entry in m["shards"]:
        path = tmp_path / entry["name"]
        data = path.read_bytes()
        assert entry["bytes"] == len(data)
        assert entry["sha256"] == hashlib.sha256(data).hexdigest()
        check_plain_ustar(path)
        samples = read_tar(path)
        assert len(samples) == entry["samples"]
        with tarfile.open(path) as tar:
            assert len(tar.getmembers()) == 2 * entry["samples"]
        for key, sample in samples:
            assert re.fullmatch(r"toy_set-train-\d{7}", key), key
            assert set(sample) == {encoding, "cls"}
            i = int(key.rsplit("-", 1)[1])
            assert i not in seen
            seen.add(i)
            np.testing.assert_array_equal(decode_image(sample[encoding], encoding, m["shape"]), src.images[i])
            assert sample["cls"] == str(src.labels[i]).encode()
    assert seen == set(range(n))

    x = src.images.reshape(n, shape[0], -1).transpose(1, 0, 2).reshape(shape[0], -1) / 255.0
    np.testing.assert_allclose(m["mean"], x.mean(1), atol=1e-5)
    np.testing.assert_allclose(m["std"], x.std(1), atol=1e-5)


def test_build_rejects_bad_settings(tmp_path):
    with pytest.raises(shards.ShardError, match="encoding"):
        build_source(array_source(3), tmp_path, encoding="jpg")
    with pytest.raises(shards.ShardError, match="dataset name"):
        build_source(array_source(3, name="a.b"), tmp_path)
    with pytest.raises(shards.ShardError, match="maxcount"):
        build_source(array_source(3), tmp_path, maxcount=0)
    with pytest.raises(shards.ShardError, match="no samples"):
        build_source(array_source(0), tmp_path)
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------- determinism and shuffling


def test_same_seed_gives_identical_bytes(tmp_path):
    src = array_source(40, (3, 6, 6))
    build_source(src, tmp_path / "a", maxcount=8, seed=5)
    build_source(src, tmp_path / "b", maxcount=8, seed=5)
    build_source(src, tmp_path / "c", maxcount=8, seed=5, workers=2)
    a = folder_bytes(tmp_path / "a")
    assert len(a) == 6
    assert folder_bytes(tmp_path / "b") == a
    assert folder_bytes(tmp_path / "c") == a


def test_different_seed_gives_different_order(tmp_path, read_tar):
    src = array_source(40, (1, 4, 4))
    keys = {}
    for seed in (0, 1):
        m = build_source(src, tmp_path / str(seed), maxcount=8, seed=seed)
        keys[seed] = [k for s in m["shards"] for k, _ in read_tar(tmp_path / str(seed) / s["name"])]
    assert keys[0] != keys[1]
    assert sorted(keys[0]) == sorted(keys[1])


def test_class_sorted_imagefolder_is_shuffled_across_shards(tmp_path, read_tar):
    rng = np.random.default_rng(0)
    for c in "abc":
        (tmp_path / "in" / c).mkdir(parents=True)
        for i in range(12):
            Image.fromarray(rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)).save(tmp_path / "in" / c / f"{i}.png")
    src = sources.ImageFolderSource("pets", "train", str(tmp_path / "in"))
    labels = [src.label(i) for i in range(len(src))]
    assert labels == sorted(labels)  # the source really is class-sorted
    m = build_source(src, tmp_path / "out", maxcount=6)
    assert len(m["shards"]) == 6
    for s in m["shards"]:
        shard_labels = {x["cls"] for _, x in read_tar(tmp_path / "out" / s["name"])}
        assert len(shard_labels) >= 2, f"{s['name']} holds one class only"


# ---------------------------------------------------------------- rebuilds


def test_rebuild_with_fewer_samples_removes_stale_shards(tmp_path):
    src = array_source(50)
    build_source(src, tmp_path, maxcount=10)
    other = build_source(array_source(10, split="test"), tmp_path, maxcount=10)
    (tmp_path / "toy-train-000009.tar.tmp").write_bytes(b"left over")
    assert len(tar_files(tmp_path)) == 7
    m = build_source(src, tmp_path, maxcount=10, limit=15)
    assert m["total"] == 15
    listed = {s["name"] for s in m["shards"]} | {s["name"] for s in other["shards"]}
    assert set(tar_files(tmp_path)) == listed  # other splits' shards are kept
    assert len(listed) == 3
    assert verify.verify(str(tmp_path)) == []


class FailingSource:
    """Wraps a source; image(bad) raises, as a crash or Ctrl-C mid-build would."""

    def __init__(self, base, bad):
        self.base, self.bad = base, bad
        self.name, self.split, self.classes, self.shape = base.name, base.split, base.classes, base.shape

    def __len__(self):
        return len(self.base)

    def image(self, i):
        if i == self.bad:
            raise RuntimeError("disk on fire")
        return self.base.image(i)

    def label(self, i):
        return self.base.label(i)


@pytest.mark.parametrize("workers", [1, 2])
def test_interrupted_build_leaves_the_old_set_whole_and_no_temporary_file(tmp_path, workers):
    """A rebuild that fails half way (a bad sample here; a full disk in test_make_shards) changes
    nothing a reader sees: the old manifest and every old shard stay, byte for byte."""
    src = array_source(30)
    build_source(src, tmp_path, maxcount=10, seed=0)
    old_bytes = folder_bytes(tmp_path)
    bad = shards.plan_shards(30, 10, 7)[1][1][4]  # 5th sample of the second shard in the new order
    with pytest.raises(RuntimeError, match="disk on fire"):
        build_source(FailingSource(src, bad), tmp_path, maxcount=10, seed=7, workers=workers)

    assert folder_bytes(tmp_path) == old_bytes  # the old manifest still vouches for the same shards
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]
    assert verify.verify(str(tmp_path)) == []

    m = build_source(src, tmp_path, maxcount=10, seed=7)  # a rerun replaces it
    assert tar_files(tmp_path) == [s["name"] for s in m["shards"]]
    assert verify.verify(str(tmp_path)) == []


def test_parts_rebuilt_over_a_whole_set_in_one_folder_replace_it(tmp_path):
    """Parts built where a whole set of more shards stands: each part may rewrite the names the
    old manifest listed (carried in the part manifests once it is gone), the merge removes
    the old shards no part wrote, and a file no manifest named stays."""
    build_source(array_source(47, (3, 4, 4)), tmp_path, maxcount=5)  # 10 shards
    (tmp_path / "toy-train-000077.tar").write_bytes(b"mine")
    src = array_source(23, (3, 4, 4))
    for i in range(3):
        build_source(src, tmp_path, maxcount=5, part=(i, 3))
    merged = shards.merge_parts(str(tmp_path), "toy", "train")
    assert tar_files(tmp_path) == sorted([s["name"] for s in merged["shards"]] + ["toy-train-000077.tar"])
    assert "replaces" not in merged and verify.verify(str(tmp_path)) == []


# ---------------------------------------------------------------- parts and merge


def test_parts_merge_to_the_whole_build(tmp_path):
    src = array_source(47, (3, 4, 4))
    whole = build_source(src, tmp_path / "whole", maxcount=5, seed=3)
    for i in range(3):
        p = build_source(src, tmp_path / "parts", maxcount=5, seed=3, part=(i, 3))
        assert p["part"] == [i, 3] and [int(s["name"][-10:-4]) % 3 for s in p["shards"]] == [i] * len(p["shards"])
    assert not (tmp_path / "parts" / "toy-train.json").exists()
    merged = shards.merge_parts(str(tmp_path / "parts"), "toy", "train")
    assert merged == whole
    assert folder_bytes(tmp_path / "parts") == folder_bytes(tmp_path / "whole")


def test_merge_needs_every_part(tmp_path):
    src = array_source(20)
    for i in (0, 2):
        build_source(src, tmp_path, maxcount=5, part=(i, 3))
    with pytest.raises(shards.ShardError, match="need 0..2 of 3"):
        shards.merge_parts(str(tmp_path), "toy", "train")
    build_source(src, tmp_path, maxcount=5, seed=9, part=(1, 3))
    with pytest.raises(shards.ShardError, match="different settings"):
        shards.merge_parts(str(tmp_path), "toy", "train")
    assert not (tmp_path / "toy-train.json").exists()


def test_part_build_removes_the_whole_manifest(tmp_path):
    src = array_source(20)
    build_source(src, tmp_path, maxcount=5, seed=0)
    build_source(src, tmp_path, maxcount=5, seed=1, part=(0, 2))  # rewrites shards 0 and 2 in another order
    assert not (tmp_path / "toy-train.json").exists()  # else it would list shards it no longer matches


# ---------------------------------------------------------------- verify


def test_verify(tmp_path):
    m = build_source(array_source(20), tmp_path, maxcount=5)
    build_source(array_source(6, split="test"), tmp_path, maxcount=5)
    assert verify.verify(str(tmp_path)) == []

    first, second = (tmp_path / s["name"] for s in m["shards"][:2])
    data = bytearray(first.read_bytes())
    data[700] ^= 1  # one bit of pixel data, same size
    first.write_bytes(bytes(data))
    second.unlink()
    problems = verify.verify(str(tmp_path))
    assert len(problems) == 2
    assert f"toy-train.json: {first.name}: sha256 differs from the manifest" in problems
    assert f"toy-train.json: {second.name}: missing" in problems


def test_verify_reports_size_and_empty_folder(tmp_path):
    m = build_source(array_source(10), tmp_path, maxcount=5)
    path = tmp_path / m["shards"][1]["name"]
    path.write_bytes(path.read_bytes()[:-512])
    assert verify.verify(str(tmp_path)) == [f"toy-train.json: {path.name}: {m['shards'][1]['bytes'] - 512} bytes, "
                                            f"the manifest says {m['shards'][1]['bytes']}"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert len(verify.verify(str(empty))) == 1
    assert verify.verify(str(tmp_path / "gone")) == [f"{tmp_path / 'gone'}: no such folder"]


def _nap(seconds):
    import time

    time.sleep(seconds)
    return seconds


class _Stop(BaseException):
    """Stands in for the trainer's stop (stop.Interrupted): a BaseException, not an Exception."""


def test_a_stop_ends_the_forked_pool_without_waiting_for_its_queued_tasks():
    """An index on first use over HTTP waited, after a stop signal, for every queued shard read,
    stalled ones and their retries too (hostileP): the pool's join waited for them. A stop now
    terminates the pool; an ordinary error still closes it, letting the tasks finish."""
    import time

    gen = shards.forked_imap(_nap, [0, 60, 60, 60], 2)
    assert next(gen) == 0
    t0 = time.monotonic()
    with pytest.raises(_Stop):
        gen.throw(_Stop())
    took = time.monotonic() - t0
    assert took < 30, f"the pool waited {took:.1f} s for tasks of 60 s"  # a hang guard: it takes well under 1 s
