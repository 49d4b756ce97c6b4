"""pipeline.data.stages: shard lists split like webdataset splits them, the windows a
slot reads from its count, per-window shuffles, RandomMix."""
import pytest
import webdataset as wds

from pipeline.data import stages
from pipeline.data.partition import Partition
from pipeline.data.stages import RandomMix, SlotPlan, Window
from pipeline.data.topology import Topology, Worker


def plan_of(counts, slots, slot, start=0, *, seed=0, epoch=0, source=0, width=2, **kw):
    part = Partition(counts, slots, seed=seed, source=source)
    urls = [f"s{i}" for i in range(len(counts))]
    return SlotPlan(part, urls, epoch, [slot], {slot: start}, width=width, **kw)


def windows(plan, n):
    return [plan.next() for _ in range(n)]


def test_every_slots_first_pass_is_a_partition_seeded_by_seed_epoch_source():
    """The slots' first passes together read every shard once; the deal is the same each
    time it is made and changes with the epoch, the seed and the source."""
    def first_pass(**kw):
        out = []
        for slot in range(3):
            plan = plan_of([10] * 12, 3, slot, **kw)
            out.append([r for w in windows(plan, 2) for r in w.rows])  # 4 shards a slot, windows of 2
        return out

    base = first_pass()
    assert sorted(u for part in base for u, _, _ in part) == sorted(f"s{i}" for i in range(12))
    assert first_pass() == base
    assert first_pass(epoch=1) != base and first_pass(seed=1) != base and first_pass(source=1) != base


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
    plan = plan_of([10] * 6, 2, 1)  # 3 shards in the slot: windows of 2, then 1
    first = windows(plan, 2)
    assert [len(w.rows) for w in first] == [2, 1] and [w.start for w in first] == [0, 20]
    nxt = windows(plan, 2)
    assert [w.start for w in nxt] == [30, 50]  # the second pass
    assert sorted(r for w in first for r in w.rows) == sorted(r for w in nxt for r in w.rows)
    assert [r for w in first for r in w.rows] != [r for w in nxt for r in w.rows]
    assert len({w.key for w in first + nxt}) == 4  # every window shuffles with its own seed


def test_a_plan_made_from_a_count_goes_on_where_the_old_one_stood():
    """The slot's count is its whole state: a plan started from it opens the window that
    holds that position, with the positions before it skipped."""
    plan = plan_of([7, 9, 11, 5, 8], 1, 0)
    walk = windows(plan, 5)
    for w in walk:
        for pos in (0, 3):
            count = w.start + pos
            again = plan_of([7, 9, 11, 5, 8], 1, 0, count).next()
            assert (again.rows, again.key, again.start, again.size, again.skip) == (w.rows, w.key, w.start, w.size,
                                                                                     pos)
    half = plan_of([7, 9, 11, 5, 8], 1, 0)
    w = half.next()
    assert half.state(4) == {0: w.start + 4} and half.state(10 ** 6) == {0: w.start + w.size}


def test_resampled_windows_draw_a_slots_own_pieces_with_replacement():
    plan = plan_of([10] * 8, 2, 0, resample=True, width=3)
    drawn = windows(plan, 30)
    mine = {r for w in windows(plan_of([10] * 8, 2, 0), 2) for r in w.rows}
    assert {r for w in drawn for r in w.rows} == mine  # its own 4 shards, and each of them
    assert any(len(set(w.rows)) < 3 for w in drawn)  # with replacement: a window may hold one twice
    assert all(b.start == a.start + a.size for a, b in zip(drawn, drawn[1:]))
    again = plan_of([10] * 8, 2, 0, drawn[7].start + 2, resample=True, width=3).next()
    assert (again.rows, again.key, again.skip) == (drawn[7].rows, drawn[7].key, 2)


def test_a_slot_of_several_pieces_of_one_shard_reads_each_range():
    plan = plan_of([12], 3, 2, width=1)  # one shard cut in 3 pieces (the most parts it allows here)
    (url, lo, hi), = plan.next().rows
    assert url == "s0" and hi - lo == 4


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
    at = RandomMix([a, b], [0.7, 0.3], seed=[0, 1, 2, 3]).draw(64, at=9)  # batch 9's draws, from its position alone
    assert (at == RandomMix([a, b], [0.7, 0.3], seed=[0, 1, 2, 3]).draw(64, at=9)).all()
    assert (at != RandomMix([a, b], [0.7, 0.3], seed=[0, 1, 2, 3]).draw(64, at=10)).any()
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
        reader = stages.Reader(src)
        if sparse:  # the source's labels are 0, 2, 4, ...: class index = label / 2
            reader.target = dataclasses.replace(reader.target, label_values=tuple(range(0, 20, 2)))
            reader.lookup = reader.target.lookup()
        if not fast:
            reader.regular = None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            data = reader(Window(((src.urls[0], 0, None),)))
        images = ([bytes(x) for x in data.images] if encoding == "png" else
                  data.images.take(slice(None)).tolist() if fast else None)
        seen.append((data.keys, data.labels.tolist(), images, [str(w.message) for w in caught], reader.errors.skipped))
    (keys, labels, _, said, stats), (keys2, labels2, _, said2, stats2) = seen
    assert keys == keys2 and labels == labels2 and said == said2 and stats == stats2
    assert stats == 12 - len(keys) == len(said) and (len(keys) == 10 or sparse and len(keys) >= 1)
    assert ("is not one of the source's 10 label values" if sparse else "outside 0..9") in said[0]


def _keep_all(sample):
    return sample


def test_a_sources_chain_is_stages_with_state_nested_by_name(tmp_path):
    """The chain is named stages (each a Node: next, state, reset); its state nests theirs,
    only the slots' holds a position, and a chain rebuilt from that goes on identically."""
    from helpers import build_shards
    from pipeline.data.manifest import resolve
    from pipeline.data.node import Node

    build_shards(tmp_path, "toy", "train", 60, maxcount=10)
    src = resolve("toy", str(tmp_path), "train")
    part = Partition(src.counts, 2, seed=0, source=0)

    def chain(counts=None):
        plan = SlotPlan(part, src.urls, 0, [1], counts or {}, width=2)
        return stages.SourceStream(plan, stages.Reader(src), sample_stages=[_keep_all])

    first = chain()
    head = first.take(7)[0]
    state = first.state()
    assert [name for name, _ in first.stages] == ["slots", "read", "shuffle", "decode",
                                                  f"stage:{__name__}:_keep_all"]
    assert all(isinstance(node, Node) for _, node in first.stages) and isinstance(first, Node)
    assert state["slots"] == {1: 7} and all(state[k] == {} for k in state if k != "slots")
    rest = first.take(20)[0]
    first.reset(json_roundtrip(state))  # reset goes back there in place
    assert first.take(20)[0] == rest
    again = chain(json_roundtrip(state)["slots"])
    assert again.take(20)[0] == rest and head + rest == chain().take(27)[0]
    mix = stages.Mix([chain(), chain()], [1, 1], [0, 1], 4)
    mix.next()
    assert mix.state()["at"] == 1 and len(mix.state()["sources"]) == 2


def json_roundtrip(state):
    import json

    return {k: ({int(s): c for s, c in v.items()} if k == "slots" else v)
            for k, v in json.loads(json.dumps({k: {str(s): c for s, c in v.items()} for k, v in state.items()})).items()}
