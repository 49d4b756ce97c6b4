"""pipeline.data.streams.stages: shard lists split like webdataset splits them, the windows a
pair's run reads from its position, per-window shuffles, a chain rebuilt at its position."""
import pytest
import webdataset as wds

from pipeline.data.streams import stages
from pipeline.data.streams import reading
from pipeline.data.streams import plans
from pipeline.data.streams.mix import RandomMix
from pipeline.ordering.order import SourceOrder
from pipeline.data.streams.plans import RunPlan, Window
from pipeline.ordering.topology import Topology, Worker


def plan_of(counts, run, at=0, *, window=20, **kw):
    o = SourceOrder(counts, seed=0, epoch=0, source=0, window_samples=window, window_bytes=1 << 30, **kw)
    return RunPlan(o, [f"s{i}" for i in range(len(counts))], run, at)


def places(plan, n):
    """(window rows, key, place) of the run's next n positions, window by window."""
    out = []
    while len(out) < n:
        w = plan.next()
        out += [(w.rows, w.key, k) for k in range(w.skip, w.size)]
    return out[:n]


@pytest.mark.parametrize("world, workers", [(1, 1), (2, 1), (2, 3), (3, 2), (4, 4)])
def test_the_split_is_webdatasets_and_a_partition(world, workers, monkeypatch):
    urls = [f"s{i:02d}" for i in range(24)]
    parts = []
    for r in range(world):
        for w in range(workers):
            topo, worker = Topology(r, world), Worker(w, workers)
            mine = plans.split(urls, topo, worker)
            # what webdataset itself gives a process with this rank and worker in its environment
            for k, v in dict(RANK=r, WORLD_SIZE=world, WORKER=w, NUM_WORKERS=workers).items():
                monkeypatch.setenv(k, str(v))
            assert mine == list(wds.split_by_worker(wds.split_by_node(urls)))
            parts.append(mine)
    assert sorted(u for p in parts for u in p) == urls


def test_a_run_reads_its_positions_window_by_window_across_spans():
    counts = [7, 9, 11, 5, 8]
    whole = places(plan_of(counts, [(0, 40)]), 40)
    split = places(plan_of(counts, [(3, 10), (25, 5)]), 15)
    assert split == whole[3:13] + whole[25:30]
    assert len(set(whole)) == 40


def test_a_plan_made_from_a_position_goes_on_where_the_old_one_stood():
    """The position is the run's whole state: a plan started from it opens the window that
    holds that position, with the places before it skipped."""
    counts = [7, 9, 11, 5, 8]
    run = [(5, 12), (30, 40)]
    whole = places(plan_of(counts, run), 52)
    for at in (0, 1, 11, 12, 13, 30, 51):
        assert places(plan_of(counts, run, at), 52 - at) == whole[at:]
    half = plan_of(counts, run)
    w = half.next()
    assert half.state(3) == 3 and half.state(10 ** 6) == w.size - w.skip


def test_a_run_past_its_end_reads_itself_again():
    """Only after damage: a pair that still owes samples re-reads its own run, not another's."""
    plan = plan_of([10, 10], [(4, 6)])
    first = places(plan, 6)
    assert places(plan, 6) == first


def test_windows_of_a_resampled_source_hold_shards_drawn_with_replacement():
    plan = plan_of([10] * 8, [(0, 2000)], window=30, resample=True)
    rows = [places(plan, 1)[0][0]]
    for _ in range(60):
        rows.append(plan.next().rows)
    assert any(len(set(r)) < len(r) for r in rows)


@pytest.mark.parametrize("encoding", ["raw", "png"])
@pytest.mark.parametrize("sparse", [False, True])
def test_the_fast_and_the_sequential_reader_agree_on_bad_labels(tmp_path, encoding, sparse):
    """read.regular's labels are checked as decode.label_of checks them: the same samples
    kept, in order, and the same warnings."""
    import dataclasses
    import warnings

    from helpers import build_shards, read_members, write_tar
    from pipeline.data.manifests.manifest import resolve

    build_shards(tmp_path, "toy", "train", 12, encoding=encoding, maxcount=12)
    shard = tmp_path / "toy-train-000000.tar"
    write_tar(shard, [(n, b"20" if n.endswith(".cls") and i in (3, 9) else body)
                      for i, (n, body) in enumerate(read_members(shard))])
    src = resolve("toy", str(tmp_path), "train")
    seen = []
    for fast in (True, False):
        reader = reading.Reader(src)
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


def test_a_sources_chain_is_named_stages_and_goes_on_from_its_position_alone(tmp_path):
    """The chain is named stages (each pulling from the one before, its `upstream`); its position is all
    it keeps: a chain rebuilt at that position (what a resume builds) goes on identically."""
    from helpers import build_shards
    from pipeline.ordering import deal
    from pipeline.data.manifests.manifest import resolve

    build_shards(tmp_path, "toy", "train", 60, maxcount=10)
    src = resolve("toy", str(tmp_path), "train")
    o = SourceOrder(src.counts, seed=0, epoch=0, source=0, window_samples=20, window_bytes=1 << 30)

    def chain(at=0):
        plan = RunPlan(o, src.urls, [(10, 40)], at)
        return stages.SourceStream(plan, reading.Reader(src), sample_stages=[_keep_all])

    first = chain()
    head = first.take(7)[0]
    assert [name for name, _ in first.stages] == ["positions", "read", "shuffle", "decode",
                                                  f"stage:{__name__}:_keep_all"]
    nodes = [node for _, node in first.stages]
    assert nodes[0].upstream is None and all(b.upstream is a for a, b in zip(nodes, nodes[1:]))
    assert all(callable(node.next) for node in nodes) and callable(first.next)
    assert first.position() == 7
    rest = first.take(20)[0]
    again = chain(7)
    assert again.take(20)[0] == rest and head + rest == chain().take(27)[0]
    mix = RandomMix([chain(), chain()], choices=deal.Choices([4, 4], (0, 1)), batch_size=4)
    choice, parts = mix.next()
    second, _ = mix.next()
    assert mix.at == 2 and sorted(choice.tolist() + second.tolist()) == [0, 0, 0, 0, 1, 1, 1, 1]  # exact over 8
    assert [len(p[0]) if p else 0 for p in parts] == [choice.tolist().count(s) for s in (0, 1)]
    assert sum(len(p[0]) for p in parts if p is not None) == 4 and len(choice) == 4
