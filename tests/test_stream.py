"""The stream's guarantees, checked on tiny synthetic shards in one process (any world
size via an explicit Topology) and once under real torchrun processes.

Data (conftest's module fixture `data`, built once a module; helpers.STREAM_SPECS):
    mnist-train    230 raw 1x28x28, 20 a shard -> 12 shards, the last one short
    cifar10-train   50 raw 3x32x32,  8 a shard ->  7 shards: much smaller than mnist
    tiny-train      12 raw 3x32x32,  6 a shard ->  2 shards: fewer than most slot counts
    *-test         png test splits: mnist 50 (3 shards), cifar10 30 (4), tiny 7 (2)
"""
import collections
import io
import json
import os
import pickle
import sys
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from helpers import (HALF, HANG, STREAM_SPECS, build_shards, free_port, key_index, keys_of, read_members, run_capture,
                     run_epoch, sample_key, serve, train_sources, write_tar)
from pipeline.errors import ShardError

from pipeline.data.streams.stream import MixedStream, check_weights, parse_weights, resolve
from pipeline.data.streams.evaluation import EvalStream
from pipeline.data.handover.loader import make_loader
from pipeline.ordering.topology import Topology

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
def run_slot(stream, worker, workers, monkeypatch):
    """One DataLoader worker's batches, run in this process by faking get_worker_info."""
    stream.set_workers(workers)
    with monkeypatch.context() as m:
        m.setattr(torch.utils.data, "get_worker_info", lambda: SimpleNamespace(id=worker, num_workers=workers))
        return [list(b["key"]) for b in stream]


def all_keys(name, split):
    n = STREAM_SPECS[name, split][0]
    return {sample_key(name, split, i) for i in range(n)}


# ---------------------------------------------------------------- 1. equal batch counts


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_equal_batches_uneven_shards_and_small_source(data, world, workers):
    """12 uneven mnist shards and a 50-sample cifar10 source at weight 0.5: the small
    source is drawn ~140 times an epoch, so it must repeat, not end the epoch."""
    sources = train_sources(data.dir)
    counts, cifar_draws = [], 0
    for rank in range(world):
        stream = MixedStream(sources, HALF, 8, Topology(rank, world), seed=3, shuffle_buffer=16)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # enough shards for every slot: make_loader must not warn
            batches = run_epoch(stream, workers)
        assert stream.batches_per_epoch == (230 + 50) // (world * 8)
        assert all(len(b.key) == 8 for b in batches)
        counts.append(len(batches))
        cifar_draws += sum(s == 1 for b in batches for s in b.source)
    assert counts == [(230 + 50) // (world * 8)] * world
    assert cifar_draws > 50  # the small source really was exhausted and repeated


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_equal_batches_fewer_shards_than_pairs(data, world, workers):
    """tiny-train has 2 shards of 6, fewer than the (rank, worker) pairs: each pair reads
    its run of positions from the shards that hold them, nothing warns, every rank yields
    the full count, and tiny's samples are read in turn (each 4 or 5 times in the 60
    draws of tiny's half of the epoch's 120)."""
    sources = train_sources(data.dir, ("mnist", "tiny"))
    weights = {"mnist": 0.5, "tiny": 0.5}
    counts, seen = [], collections.Counter()
    for rank in range(world):
        stream = MixedStream(sources, weights, 5, Topology(rank, world), epoch_samples=120, shuffle_buffer=8)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            loader = make_loader(stream, workers)
        batches = [list(b["key"]) for b in loader]
        assert all(len(b) == 5 for b in batches)
        counts.append(len(batches))
        seen.update(k for b in batches for k in b if k.startswith("tiny"))
    assert counts == [120 // (world * 5)] * world
    assert sorted(set(seen.values())) == [5] and len(seen) == 12


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("epoch_samples", [None, 16])
def test_num_workers_does_not_change_count(data, epoch_samples):
    """The workers split a rank's count between them, including 3 workers for 17
    batches and more workers than batches (epoch_samples=16: one batch a rank)."""
    sources = train_sources(data.dir)
    world = 2
    expected = max(1, (epoch_samples or 280) // (world * 8))
    for workers in (0, 1, 2, 3):
        for rank in range(world):
            stream = MixedStream(sources, HALF, 8, Topology(rank, world), epoch_samples=epoch_samples,
                                 shuffle_buffer=16)
            batches = run_epoch(stream, workers)
            assert len(batches) == expected == len(stream), (workers, rank)
            assert all(len(b.key) == 8 for b in batches)


# ---------------------------------------------------------------- 2. disjointness


def test_no_key_on_two_ranks_or_workers(even, monkeypatch):
    """4 pairs (2 ranks x 2 workers) over 16 + 8 evenly split shards, an epoch of 96
    samples (48 of each source): no key is drawn twice anywhere in the epoch."""
    sources = train_sources(even)
    world, workers = 2, 2
    per_rank = {}
    for rank in range(world):
        stream = MixedStream(sources, HALF, 6, Topology(rank, world), seed=1, epoch_samples=96, shuffle_buffer=5)
        per_rank[rank] = keys_of(run_epoch(stream, workers))
    everything = per_rank[0] + per_rank[1]
    assert len(everything) == 96
    assert len(set(everything)) == 96, [k for k, c in collections.Counter(everything).items() if c > 1]

    # The same epoch with each worker run in this process: the loader's batches are the
    # workers' batches interleaved, and the four pairs' key sets are pairwise disjoint.
    slot_keys = []
    for rank in range(world):
        stream = MixedStream(sources, HALF, 6, Topology(rank, world), seed=1, epoch_samples=96, shuffle_buffer=5)
        per_worker = [run_slot(stream, w, workers, monkeypatch) for w in range(workers)]
        interleaved = [k for pair in zip(*per_worker) for batch in pair for k in batch]
        assert interleaved == per_rank[rank]
        slot_keys += [{k for batch in batches for k in batch} for batches in per_worker]
    assert sum(len(s) for s in slot_keys) == len(set().union(*slot_keys)) == 96


@pytest.mark.parametrize("world", [2, 3])
def test_a_source_that_repeats_reads_every_sample_before_any_again(data, world):
    """cifar10 holds 50 samples and draws about half of an epoch of mnist's 200 + 50: over
    all ranks, each of its samples is read as often as any other, give or take one."""
    sources = train_sources(data.dir)
    seen = collections.Counter()
    for r in range(world):
        seen.update(k for k in keys_of(run_epoch(MixedStream(sources, HALF, 8, Topology(r, world), shuffle_buffer=8),
                                                  2)) if k.startswith("cifar10"))
    assert len(seen) == 50 and max(seen.values()) - min(seen.values()) <= 1 and max(seen.values()) >= 2


# ---------------------------------------------------------------- 3. mixture shares


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.slow
def test_mixture_shares_follow_weights(data, world):
    """10,000 samples a rank at 0.7/0.3: each source's share within 2 points, on every
    rank; new weights from set_epoch take effect."""
    sources = train_sources(data.dir)
    for weights, epoch in (({"mnist": 0.7, "cifar10": 0.3}, 0), ({"mnist": 0.2, "cifar10": 0.8}, 1)):
        for rank in range(world):
            stream = MixedStream(sources, {"mnist": 0.5, "cifar10": 0.5}, 100, Topology(rank, world),
                                 epoch_samples=10_000 * world, shuffle_buffer=20, normalize=False)
            stream.set_epoch(epoch, weights)
            n = mnist = 0
            for batch in stream:
                n += len(batch["source"])
                mnist += int((batch["source"] == 0).sum())
            assert n == 10_000
            assert abs(mnist / n - weights["mnist"]) < 0.02, (rank, mnist / n)


# ---------------------------------------------------------------- 4. determinism


@pytest.mark.parametrize("workers", [0, 2])
def test_same_seed_same_order_other_epoch_or_seed_differs(data, workers):
    sources = train_sources(data.dir)

    def epoch_keys(rank, seed=0, epoch=0):
        stream = MixedStream(sources, HALF, 8, Topology(rank, 2), seed=seed, shuffle_buffer=16)
        stream.set_epoch(epoch)
        batches = run_epoch(stream, workers)
        return keys_of(batches), [s for b in batches for s in b.source]

    for rank in range(2):
        keys, choices = epoch_keys(rank)
        assert epoch_keys(rank) == (keys, choices)
        for other in (epoch_keys(rank, epoch=1), epoch_keys(rank, seed=1)):
            assert other[0] != keys  # sample order
            assert other[1] != choices  # and the per-batch source draws
    assert epoch_keys(0)[0] != epoch_keys(1)[0]


# ---------------------------------------------------------------- 5. batch format


@pytest.mark.parametrize("workers", [0, 2])  # workers collate into reused ring buffers, every byte rewritten by collate
def test_batch_format_shapes_labels_and_normalize(data, workers):
    sources = train_sources(data.dir)
    mnist_m, cifar_m = data.manifests["mnist", "train"], data.manifests["cifar10", "train"]
    floats = MixedStream(sources, HALF, 16, seed=5, epoch_samples=64)
    bytes_ = MixedStream(sources, HALF, 16, seed=5, epoch_samples=64, normalize=False)
    layout = bytes_.layout
    assert layout.num_classes == 20 and list(layout.offsets) == [0, 10]
    seen_sources = set()
    for fb, ub in zip(make_loader(floats, workers), make_loader(bytes_, workers)):
        assert fb["key"] == ub["key"]
        assert fb["image"].dtype == torch.float32 and fb["image"].shape == (16, 3, 32, 32)
        assert ub["image"].dtype == torch.uint8 and ub["image"].shape == (16, 3, 32, 32)
        assert fb["label"].dtype == ub["source"].dtype == torch.int64 and isinstance(ub["source"], torch.Tensor)
        assert torch.allclose(layout.normalize(ub["image"], ub["source"]), fb["image"], atol=1e-5)
        for i, (key, src, label) in enumerate(zip(ub["key"], ub["source"].tolist(), ub["label"].tolist())):
            seen_sources.add(src)
            name = ("mnist", "cifar10")[src]
            assert key.startswith(f"{name}-train-")
            synth = data.synth[name, "train"]
            original = synth.image(key_index(key))
            assert label == synth.label(key_index(key)) + 10 * src  # mnist 0-9, cifar10 10-19
            img = ub["image"][i].numpy()
            if src == 0:  # 1x28x28 grey: centred in 32x32 with a 2-pixel zero border, repeated to RGB
                assert (img[:, 2:30, 2:30] == original[0]).all()
                inner = np.zeros((32, 32), bool)
                inner[2:30, 2:30] = True
                assert (img[:, ~inner] == 0).all()
                mean, std = mnist_m["mean"][0], mnist_m["std"][0]
                expect = (original[0] / 255.0 - mean) / std
                assert np.allclose(fb["image"][i, :, 2:30, 2:30].numpy(), expect, atol=1e-4)
            else:
                assert (img == original).all()
                mean = np.array(cifar_m["mean"])[:, None, None]
                std = np.array(cifar_m["std"])[:, None, None]
                assert np.allclose(fb["image"][i].numpy(), (original / 255.0 - mean) / std, atol=1e-4)
    assert seen_sources == {0, 1}


def test_eval_batches_decode_png_like_training(data):
    """Test splits are PNG: decoded pixels and labels match the originals, in the
    training stream's layout (label offset 10 for cifar10)."""
    stream = MixedStream(train_sources(data.dir), HALF, 8, normalize=False)
    for name, offset in (("mnist", 0), ("cifar10", 10)):
        seen = 0
        for b in stream.eval_stream(resolve(name, data.dir, "test")):
            for i, key in enumerate(b["key"]):
                synth = data.synth[name, "test"]
                original = synth.image(key_index(key))
                img = b["image"][i].numpy()
                assert (img[:, 2:30, 2:30] == original[0]).all() if name == "mnist" else (img == original).all()
                assert int(b["label"][i]) == synth.label(key_index(key)) + offset
                seen += 1
        assert seen == STREAM_SPECS[name, "test"][0]


def test_eval_split_of_another_shape_is_resized_unless_raw(data, tmp_path):
    """Test images decode to the shape the model trains on; raw pixels can't be resized."""
    build_shards(tmp_path / "raw", "mnist", "test", 10, shape=(1, 20, 20), maxcount=10)
    build_shards(tmp_path / "png", "mnist", "test", 10, shape=(1, 20, 20), encoding="png", maxcount=10)
    stream = MixedStream(train_sources(data.dir), HALF, 8, normalize=False)
    with pytest.raises(ShardError, match=r"\(1, 20, 20\).*cannot be resized"):
        stream.eval_stream(resolve("mnist", str(tmp_path / "raw"), "test"))
    batches = list(stream.eval_stream(resolve("mnist", str(tmp_path / "png"), "test")))
    assert sum(len(b["key"]) for b in batches) == 10
    for b in batches:  # 28x28 (the training shape) centred in the 32x32 batch, zero border
        assert b["image"][:, :, 2:30, 2:30].float().mean() > 0 and b["image"][:, :, :2].sum() == 0


# ---------------------------------------------------------------- 6. sources and URLs


def test_http_streams_same_keys_as_local_and_caches(data, tmp_path):
    local = train_sources(data.dir)
    cache = tmp_path / "cache"

    def ranks(sources, **kw):
        return [keys_of(run_epoch(MixedStream(sources, HALF, 8, Topology(r, 2), shuffle_buffer=16, **kw)))
                for r in range(2)]

    want = ranks(local)
    with serve(data.dir) as base:
        assert base.endswith("/")
        remote = [resolve("mnist", base, "train"), resolve("cifar10", base + "cifar10-train.json", "train")]
        assert all(u.startswith(base) for s in remote for u in s.urls)
        assert [s.counts for s in remote] == [s.counts for s in local]
        assert ranks(remote) == want
        assert ranks(remote, cache_dir=str(cache)) == want
        pattern = resolve("mnist", base + "mnist-train-{000000..000001}.tar", "train")
        assert pattern.urls == [base + "mnist-train-000000.tar", base + "mnist-train-000001.tar"]
        with warnings.catch_warnings(), pytest.raises(ShardError, match="cannot read manifest"):
            warnings.simplefilter("ignore")  # a retry may warn first
            resolve("mnist", base + "nothing/", "train")
    cached = os.listdir(cache)
    assert cached and not [f for f in cached if f.endswith(".tmp")]
    for f in cached:
        shard = f.split("-", 1)[1]
        assert shard.endswith(".tar")
        with open(cache / f, "rb") as a, open(os.path.join(data.dir, shard), "rb") as b:
            assert a.read() == b.read()
    # The server is gone: the same epoch streams from the cache alone.
    assert ranks(remote, cache_dir=str(cache)) == want


def test_pipe_spec_streams_same_keys_as_local(data):
    local = train_sources(data.dir)
    piped = [resolve("mnist", f"pipe:cat {data.dir}/mnist-train.json", "train"),
             resolve("cifar10", f"pipe:cat {data.dir}/cifar10-train.json", "train")]
    assert piped[0].urls[0] == f"pipe:cat {data.dir}/mnist-train-000000.tar"
    for rank in range(2):
        a = keys_of(run_epoch(MixedStream(local, HALF, 8, Topology(rank, 2), shuffle_buffer=16)))
        b = keys_of(run_epoch(MixedStream(piped, HALF, 8, Topology(rank, 2), shuffle_buffer=16)))
        assert a == b


# ---------------------------------------------------------------- 7. untrusted input


class Payload:
    """Unpickling this calls open(path, 'w'): it creates a file."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_pickle_and_pth_members_are_never_loaded(tmp_path):
    canary = tmp_path / "canary"
    pickle.loads(pickle.dumps(Payload(str(canary)))).close()
    assert canary.exists()  # the payload is live: loading it would create its file

    pwned = tmp_path / "pwned"
    folder = tmp_path / "shards"
    build_shards(folder, "evil", "train", 12, maxcount=6)
    shard = folder / "evil-train-000000.tar"
    members, keys = [], []
    for name, body in read_members(shard):
        members.append((name, body))
        if name.endswith(".cls"):  # after each sample's last member: its hostile extras
            key = name.split(".", 1)[0]
            keys.append(key)
            pth = tmp_path / "x.pth"
            torch.save(Payload(str(pwned)), pth)
            members += [(f"{key}.pyd", pickle.dumps(Payload(str(pwned)))), (f"{key}.pth", pth.read_bytes()),
                        (f"{key}.pickle", pickle.dumps(Payload(str(pwned))))]
    write_tar(shard, members)
    assert len(keys) == 6 and len(read_members(shard)) == 6 * 5

    src = resolve("evil", str(folder), "train")
    stream = MixedStream([src], {"evil": 1}, 4, epoch_samples=24, shuffle_buffer=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # extra members are not damage
        batches = run_epoch(stream)
        evals = [k for b in stream.eval_stream(src) for k in b["key"]]
    assert len(batches) == 6 and all(b.skipped == 0 and len(b.key) == 4 for b in batches)
    assert sorted(evals) == sorted(sample_key("evil", "train", i) for i in range(12))
    assert set(keys) <= set(keys_of(batches)) | set(evals)
    assert not pwned.exists()


# ---------------------------------------------------------------- 8. corrupt data


@pytest.fixture
def truncated(tmp_path):
    """mnist-train: 3 shards of 20; shard 1 cut in the middle of a member."""
    build_shards(tmp_path, "mnist", "train", 60, maxcount=20)
    path = tmp_path / "mnist-train-000001.tar"
    size = os.path.getsize(path)
    os.truncate(path, 7 * 2560 + 700)  # 7 samples (header+784 raw+header+cls) and part of the 8th image
    assert os.path.getsize(path) < size
    return str(tmp_path)


def test_truncated_shard_skipped_with_warning(truncated):
    src = resolve("mnist", truncated, "train")
    stream = MixedStream([src], {"mnist": 1}, 10, epoch_samples=150, shuffle_buffer=5)
    with pytest.warns(UserWarning, match="mnist-train-000001.tar: truncated"):
        batches = run_epoch(stream)
    assert len(batches) == 15 and all(len(b.key) == 10 for b in batches)
    assert sum(b.skipped for b in batches) >= 13  # 20 listed, at most 7 readable

    ev = stream.eval_stream(src)
    with pytest.warns(UserWarning, match="truncated"):
        out = list(ev)
    keys = [k for b in out for k in b["key"]]
    assert len(keys) == len(set(keys))
    assert len(keys) + sum(b["skipped"] for b in out) == 60  # every listed sample: read or counted


def test_shard_cut_between_members_counts_its_lost_samples(tmp_path):
    """Cut exactly at a member boundary, a tar reads as webdataset reads it: every whole
    member, no end-of-archive block needed. Only the manifest's count tells what is lost,
    and the lost samples must be reported, not silently dropped."""
    build_shards(tmp_path, "mnist", "train", 40, maxcount=20)
    os.truncate(tmp_path / "mnist-train-000000.tar", 12 * 2560)
    src = resolve("mnist", str(tmp_path), "train")
    with pytest.warns(UserWarning, match="12 samples, the manifest says 20; the 8 missing counted as skipped"):
        out = list(MixedStream([src], {"mnist": 1}, 8).eval_stream(src))
    read = sum(len(b["key"]) for b in out)
    assert read < 40 and read + sum(b["skipped"] for b in out) == 40
    with pytest.raises(ShardError, match="12 samples, the manifest says 20: the tar ends early"):
        list(MixedStream([src], {"mnist": 1}, 8, strict=True).eval_stream(src))


def test_truncated_shard_strict_raises(truncated):
    src = resolve("mnist", truncated, "train")
    with pytest.raises(ShardError, match="truncated"):
        run_epoch(MixedStream([src], {"mnist": 1}, 10, epoch_samples=150, shuffle_buffer=5, strict=True))
    with pytest.raises(ShardError, match="truncated"):
        list(MixedStream([src], {"mnist": 1}, 10, strict=True).eval_stream(src))


@pytest.fixture
def bad_samples(tmp_path):
    """PNG 'bad' data set, 2 shards of 10; in shard 0 one sample lacks .cls, one has
    garbage instead of a PNG, one a label out of range; and one a PNG of another size,
    which is not damage: it is resized to the source's shape."""
    build_shards(tmp_path, "bad", "train", 20, shape=(3, 32, 32), encoding="png", maxcount=10)
    shard = tmp_path / "bad-train-000000.tar"
    members = read_members(shard)
    keys = list(dict.fromkeys(n.split(".", 1)[0] for n, _ in members))
    buf = io.BytesIO()
    Image.new("RGB", (16, 16)).save(buf, format="PNG")
    broken = {keys[1]: "missing cls", keys[3]: "garbage", keys[5]: "label", keys[7]: "size"}
    out = []
    for name, body in members:
        key, ext = name.split(".", 1)
        what = broken.get(key)
        if what == "missing cls" and ext == "cls":
            continue
        if what == "garbage" and ext == "png":
            body = b"\x89PNG\r\n\x1a\n" + b"not really a png" * 8
        if what == "label" and ext == "cls":
            body = b"99"
        if what == "size" and ext == "png":
            body = buf.getvalue()
        out.append((name, body))
    write_tar(shard, out)
    return SimpleNamespace(dir=str(tmp_path), broken={k for k, what in broken.items() if what != "size"},
                           resized=keys[7])


def test_bad_samples_skipped_with_warning(bad_samples):
    src = resolve("bad", bad_samples.dir, "train")
    stream = MixedStream([src], {"bad": 1}, 4, epoch_samples=40, shuffle_buffer=4)
    with pytest.warns(UserWarning) as record:
        batches = run_epoch(stream)
    messages = " ".join(str(w.message) for w in record)
    for what in ("no .cls member", "undecodable image", "label 99 outside"):
        assert what in messages
    assert len(batches) == 10 and all(len(b.key) == 4 for b in batches)
    assert "16x16" not in messages
    assert sum(b.skipped for b in batches) >= 3
    assert not set(keys_of(batches)) & bad_samples.broken

    with pytest.warns(UserWarning):
        out = list(stream.eval_stream(src))
    keys = [k for b in out for k in b["key"]]
    good = {sample_key("bad", "train", i) for i in range(20)} - bad_samples.broken
    assert sorted(keys) == sorted(good)
    assert sum(b["skipped"] for b in out) == 3 and bad_samples.resized in keys


def test_bad_samples_strict_raises(bad_samples):
    src = resolve("bad", bad_samples.dir, "train")
    with pytest.raises(ShardError, match="sample bad-train-"):
        run_epoch(MixedStream([src], {"bad": 1}, 4, epoch_samples=40, shuffle_buffer=4, strict=True))
    with pytest.raises(ShardError):
        list(MixedStream([src], {"bad": 1}, 4, strict=True).eval_stream(src))


def test_one_error_policy_for_the_whole_chain(bad_samples):
    """on_error="skip" skips and counts exactly what "warn" does, without a line; "raise"
    is strict=True; a policy that is none of them, or one that contradicts strict, is refused."""
    src = resolve("bad", bad_samples.dir, "train")

    def run(**kw):
        return run_epoch(MixedStream([src], {"bad": 1}, 4, epoch_samples=40, shuffle_buffer=4, **kw))

    with pytest.warns(UserWarning):
        warned = run(on_error="warn")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quiet = run(on_error="skip")
    assert [(b.key, b.skipped) for b in quiet] == [(b.key, b.skipped) for b in warned]
    assert sum(b.skipped for b in quiet) >= 3
    with pytest.raises(ShardError, match="sample bad-train-"):
        run(on_error="raise")
    for bad in ({"on_error": "ignore"}, {"on_error": "skip", "strict": True}):
        with pytest.raises(ValueError):
            MixedStream([src], {"bad": 1}, 4, **bad)


def test_unreadable_source_raises_instead_of_hanging(tmp_path):
    """Every shard garbage: even without strict the stream must fail, not spin forever."""
    build_shards(tmp_path, "mnist", "train", 20, maxcount=10)
    for i in range(2):
        (tmp_path / f"mnist-train-00000{i}.tar").write_bytes(b"\x01" * 4096)
    src = resolve("mnist", str(tmp_path), "train")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ShardError, match="no readable samples.*; check them with make-shards --verify$"):
            run_epoch(MixedStream([src], {"mnist": 1}, 4, epoch_samples=40))


# ---------------------------------------------------------------- 9. evaluation


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_eval_covers_every_test_sample_once(data, world, workers):
    train = train_sources(data.dir, ("mnist", "cifar10", "tiny"))
    weights = {"mnist": 1, "cifar10": 1, "tiny": 1}
    for name in ("mnist", "cifar10", "tiny"):  # tiny-test: 2 shards, fewer than 3 ranks
        test = resolve(name, data.dir, "test")
        keys = []
        for rank in range(world):
            stream = MixedStream(train, weights, 8, Topology(rank, world))
            ev = stream.eval_stream(test, batch_size=6)
            assert isinstance(ev, EvalStream)
            for b in make_loader(ev, workers):
                assert 0 < len(b["key"]) <= 6 and b["skipped"] == 0
                keys += b["key"]
        assert len(keys) == test.total == data.manifests[name, "test"]["total"]
        assert set(keys) == all_keys(name, "test") and len(set(keys)) == len(keys)


# ---------------------------------------------------------------- 10. real processes

SCRIPT = r'''
import json, os, sys
import torch
from pipeline.train.dist import Topology, all_reduce_sum, distributed
from pipeline.data.streams.stream import MixedStream, resolve
from pipeline.data.handover.loader import make_loader



def main(data, out):
    with distributed(timeout_s=60) as (topo, device):
        assert topo == Topology.from_env() and topo.world == 2
        sources = [resolve("mnist", data, "train"), resolve("cifar10", data, "train")]
        stream = MixedStream(sources, {"mnist": 0.5, "cifar10": 0.5}, 8, topo, shuffle_buffer=16)
        keys, batches = [], 0
        for batch in make_loader(stream, num_workers=2):
            all_reduce_sum(torch.ones(1))  # what a DDP step does: a short rank would leave the other hanging
            batches += 1
            keys += batch["key"]
        total = all_reduce_sum(torch.tensor([batches])).item()
    with open(os.path.join(out, f"rank{topo.rank}.json"), "w") as f:
        json.dump({"rank": topo.rank, "batches": batches, "total": total, "expected": len(stream), "keys": keys}, f)


if __name__ == "__main__":  # the guard make_loader(start_method="forkserver") would need
    main(sys.argv[1], sys.argv[2])
'''


@pytest.mark.slow
def test_torchrun_two_ranks_equal_counts_disjoint_keys(data, tmp_path):
    script = tmp_path / "stream_ranks.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(script), data.dir, str(out)]
    proc = run_capture(cmd, env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=HANG)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert ranks[0]["batches"] == ranks[1]["batches"] == ranks[0]["expected"] == 280 // 16
    assert ranks[0]["total"] == ranks[1]["total"] == 2 * (280 // 16)
    assert len(ranks[0]["keys"]) == len(ranks[1]["keys"]) == 8 * (280 // 16)
    # 140 of each source: mnist's 230 once at most, cifar10's 50 read in turn (2 or 3 times each), across ranks
    counts = collections.Counter(ranks[0]["keys"] + ranks[1]["keys"])
    assert max(c for k, c in counts.items() if k.startswith("mnist")) == 1
    cifar = [counts.get(f"cifar10-train-{i:07d}", 0) for i in range(50)]
    assert max(cifar) - min(cifar) <= 1 and sum(cifar) == sum(1 for k in ranks[0]["keys"] + ranks[1]["keys"]
                                                             if k.startswith("cifar10"))


# ---------------------------------------------------------------- 11. weights


def test_parse_weights():
    assert parse_weights("mnist=0.5,cifar10=0.5") == {"mnist": 0.5, "cifar10": 0.5}
    assert parse_weights(" mnist = 2 , cifar10=1,") == {"mnist": 2.0, "cifar10": 1.0}
    for bad in ("mnist", "mnist=", "=0.5", "mnist=abc", "mnist:0.5", "mnist=0.5;cifar10=0.5", "mnist=1=2"):
        with pytest.raises(ValueError):
            parse_weights(bad)


def test_check_weights():
    names = ["mnist", "cifar10"]
    assert check_weights({"mnist": 3, "cifar10": 1}, names) == [0.75, 0.25]
    assert check_weights({"cifar10": 1}, names) == [0.0, 1.0]  # an unnamed source gets weight 0
    bad = [{"mnist": -0.5, "cifar10": 1.5}, {"mnist": 0, "cifar10": 0}, {}, {"svhn": 1},
           {"mnist": 1, "Mnist": 1}, {"mnist": float("nan"), "cifar10": 1}, {"mnist": float("inf"), "cifar10": 1}]
    for weights in bad:
        with pytest.raises(ValueError):
            check_weights(weights, names)
    for text in ("mnist=-1,cifar10=1", "mnist=0,cifar10=0", "svhn=1", "mnist=inf,cifar10=1"):
        with pytest.raises(ValueError):
            check_weights(parse_weights(text), names)


def test_stream_rejects_bad_settings(data):
    sources = train_sources(data.dir)
    with pytest.raises(ValueError):
        MixedStream(sources, HALF, 0)
    with pytest.raises(ValueError):
        MixedStream(sources, {"mnist": 1, "svhn": 1}, 8)
    stream = MixedStream(sources, HALF, 8)
    with pytest.raises(ValueError):
        stream.set_epoch(1, {"mnist": -1, "cifar10": 1})


def test_shuffle_buffer_never_reads_ahead_into_the_next_pass(data):
    """A buffer larger than the slot's data must not repeat samples before all were seen."""
    src = [resolve("mnist", data.dir, "train")]  # 230 samples
    for epoch_samples, times in ((220, 1), (460, 2)):
        s = MixedStream(src, {"mnist": 1}, 10, epoch_samples=epoch_samples, shuffle_buffer=1000)
        counts = collections.Counter(keys_of(run_epoch(s)))
        assert len(counts) == min(epoch_samples, 230) and set(counts.values()) == {times}


# ---------------------------------------------------------------- 12. the user's own stages


def _invert_cifar(sample):
    if sample["__source__"] == "cifar10":
        sample["image"] = 255 - sample["image"]
    return sample


def _drop_odd_mnist(sample):
    return None if sample["__source__"] == "mnist" and key_index(sample["__key__"]) % 2 else sample


@pytest.mark.parametrize("workers", [0, 2])
def test_sample_stages_see_every_decoded_sample(data, workers):
    """A stage inverts one source's images, another drops half of the other's samples:
    every batch is still full, and every image is what the stages made of its original."""
    stream = MixedStream(train_sources(data.dir), HALF, 8, epoch_samples=96, normalize=False,
                         sample_stages=[_invert_cifar, _drop_odd_mnist])
    batches = list(make_loader(stream, workers))
    assert len(batches) == 12 and all(len(b["key"]) == 8 for b in batches)
    for b in batches:
        for i, (key, src) in enumerate(zip(b["key"], b["source"].tolist())):
            name = ("mnist", "cifar10")[src]
            original = data.synth[name, "train"].image(key_index(key))
            if src == 1:
                assert (b["image"][i].numpy() == 255 - original).all()
            else:
                assert key_index(key) % 2 == 0
                assert (b["image"][i, :, 2:30, 2:30].numpy() == original[0]).all()


def test_a_stage_that_changes_the_shape_is_refused(data):
    stream = MixedStream(train_sources(data.dir), HALF, 8, epoch_samples=16,
                         sample_stages=[lambda s: dict(s, image=s["image"][:, :10])])
    with pytest.raises(ValueError, match="must stay uint8"):
        list(stream)
