"""pipeline.stages: shard lists split like webdataset splits them, windows and what an
interrupted epoch leaves, per-window shuffles, RandomMix."""
import collections
import itertools

import numpy as np
import pytest
import webdataset as wds

from pipeline.data import stages
from pipeline.data.stages import RandomMix, Window, leftovers, windows
from pipeline.data.topology import Topology, Worker


def test_shard_order_depends_on_seed_and_epoch():
    """Every rank sees the same epoch shard order (so slots stay disjoint), and that
    order changes with the epoch and the seed."""
    urls = [f"s-{i}" for i in range(12)]

    def first_pass(rank, world=3, **kw):
        plan = windows(urls, **dict(dict(seed=0, epoch=0, source=0), **kw), topo=Topology(rank, world),
                       worker=Worker())
        return [u for _, w in zip(range(4), plan) for u in w.urls]

    def epoch_order(**kw):
        return [first_pass(rank, **kw) for rank in range(3)]

    base = epoch_order()
    assert sorted(u for part in base for u in part) == sorted(urls)  # a partition of the shards
    assert epoch_order() == base
    assert epoch_order(epoch=1) != base and epoch_order(seed=1) != base and epoch_order(source=1) != base




@pytest.mark.parametrize("world, workers", [(1, 1), (2, 1), (2, 3), (3, 2), (4, 4)])
def test_the_split_is_webdatasets_and_a_partition(world, workers, monkeypatch):
    urls = [f"s{i:02d}" for i in range(24)]
    parts = []
    for r in range(world):
        for w in range(workers):
            topo, worker = Topology(r, world), Worker(w, workers)
            mine = stages.split(urls, topo, worker)
            # what webdataset itself gives a process with this rank and worker in its environment
            for k, v in dict(RANK=r, WORLD_SIZE=world, WORKER=w, NUM_WORKERS=workers).items():
                monkeypatch.setenv(k, str(v))
            assert mine == list(wds.split_by_worker(wds.split_by_node(urls)))
            parts.append(mine)
    assert sorted(u for p in parts for u in p) == urls


def test_windows_repeat_a_slots_own_shards_in_a_new_order():
    urls = [f"s{i}" for i in range(12)]
    plan = windows(urls, seed=0, epoch=0, source=0, topo=Topology(1, 2), worker=Worker(0, 2), window_shards=2)
    first = [next(plan) for _ in range(2)]  # the slot has 3 shards: windows of 2, then 1
    assert [len(w.urls) for w in first] == [2, 1] and {w.pass_id for w in first} == {0}
    nxt = [next(plan) for _ in range(2)]
    assert {w.pass_id for w in nxt} == {1}
    assert sorted(u for w in first for u in w.urls) == sorted(u for w in nxt for u in w.urls)
    assert len({w.tag for w in first + nxt}) == 4  # every window shuffles with its own seed


def test_too_few_shards_draw_with_replacement():
    plan = windows(["a", "b"], seed=0, epoch=0, source=0, topo=Topology(0, 2), worker=Worker(1, 2))
    drawn = [next(plan) for _ in range(20)]
    assert {w.pass_id for w in drawn} == {"resample"} and {u for w in drawn for u in w.urls} == {"a", "b"}
    assert leftovers(iter(drawn), [3, 1]) == []  # nothing to finish: fresh draws go on


def test_leftovers_are_the_rest_of_the_current_pass():
    urls = [f"s{i}" for i in range(8)]

    def plan():
        return windows(urls, seed=1, epoch=0, source=0, topo=Topology(), worker=Worker(), window_shards=2)

    all_windows = list(itertools.islice(plan(), 8))
    left = leftovers(plan(), [1, 5])  # in the second window, 5 samples into it
    assert [w.urls for w in left] == [w.urls for w in all_windows[1:4]]
    assert left[0].start == 5 and all(w.start == 0 for w in left[1:])
    assert leftovers(plan(), None) == all_windows[:4]  # a worker that never started: its whole pass


def test_share_out_cuts_equal_runs_without_overlap():
    from types import SimpleNamespace

    from pipeline.data.stream import share_out

    src = SimpleNamespace(urls=["a", "b", "c"], counts=[10, 10, 10])
    pieces = [Window(("a",), "ta", 0, 4), Window(("b", "c"), "tbc", 0)]  # 6 + 20 samples left
    parts = share_out(pieces, src, 3)
    total = {"ta": 10, "tbc": 20}

    def span(w):
        return range(w.start, w.stop if w.stop is not None else total[w.tag])

    assert [sum(len(span(w)) for w in p) for p in parts] == [8, 9, 9]
    covered = collections.Counter((w.tag, i) for p in parts for w in p for i in span(w))
    assert set(covered.values()) == {1} and len(covered) == 26


def test_random_mix_has_webdatasets_signature_and_a_seed():
    a, b = [("a", i) for i in range(1000)], [("b", i) for i in range(50)]
    mixed = list(RandomMix([a, b], [0.5, 0.5], seed=3))  # longest=False: stops at the first source to end
    assert sum(s == "b" for s, _ in mixed) == 50 and len(mixed) < 200
    longest = list(RandomMix([a, b], [0.5, 0.5], longest=True, seed=3))
    assert sorted(longest) == sorted(a + b)
    assert list(RandomMix([a, b], seed=3)) == list(RandomMix([a, b], seed=3))  # probs=None: equal
    assert list(RandomMix([a, b], seed=3)) != list(RandomMix([a, b], seed=4))
    draws = RandomMix([a, b], [0.7, 0.3], seed=[0, 1, 2, 3]).draw(100_000)
    assert abs((draws == 0).mean() - 0.7) < 0.01
    for bad in ([1.0], [-1.0, 2.0], [0.0, 0.0], [float("nan"), 1.0]):
        with pytest.raises(ValueError):
            RandomMix([a, b], bad)


def test_random_mix_state_restores_the_draws():
    mix = RandomMix([[], []], seed=7)
    mix.draw(37)
    state = mix.state()
    after = mix.draw(50)
    again = RandomMix([[], []], seed=0)
    again.restore(state)
    assert (again.draw(50) == after).all()


@pytest.mark.parametrize("encoding", ["raw", "png"])
@pytest.mark.parametrize("sparse", [False, True])
def test_the_fast_and_the_sequential_reader_agree_on_bad_labels(tmp_path, encoding, sparse):
    """read.regular's labels are checked as decode.label_of checks them: the same samples
    kept, in order, and the same warnings."""
    import dataclasses
    import warnings

    from helpers import build_shards, read_members, write_tar
    from pipeline.data.manifest import resolve

    build_shards(tmp_path, "toy", "train", 12, encoding=encoding, maxcount=12)
    shard = tmp_path / "toy-train-000000.tar"
    write_tar(shard, [(n, b"20" if n.endswith(".cls") and i in (3, 9) else body)
                      for i, (n, body) in enumerate(read_members(shard))])
    src = resolve("toy", str(tmp_path), "train")
    seen = []
    for fast in (True, False):
        reader = stages.Reader(src, {"skipped": 0})
        if sparse:  # the source's labels are 0, 2, 4, ...: class index = label / 2
            reader.target = dataclasses.replace(reader.target, label_values=tuple(range(0, 20, 2)))
            reader.lookup = reader.target.lookup()
        if not fast:
            reader.regular = None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            data = reader(Window((src.urls[0],), "t", 0))
        seen.append((data.keys, data.labels.tolist(), [bytes(x) for x in data.images] if encoding == "png" else
                     data.images.tolist() if fast else None, [str(w.message) for w in caught], reader.stats))
    (keys, labels, _, said, stats), (keys2, labels2, _, said2, stats2) = seen
    assert keys == keys2 and labels == labels2 and said == said2 and stats == stats2
    assert stats["skipped"] == 12 - len(keys) == len(said) and (len(keys) == 10 or sparse and len(keys) >= 1)
    assert ("is not one of the source's 10 label values" if sparse else "outside 0..9") in said[0]
