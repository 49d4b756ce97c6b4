"""pipeline.ordering.deal: an epoch's positions dealt to (rank, worker) pairs, exactly, in the
order webdataset's splitters deal a list, and what a stopped world left dealt again."""
import numpy as np
import pytest
import webdataset as wds

from pipeline.ordering import deal
from pipeline.ordering.topology import stride


def segment(targets, world, workers, batch, seed=0):
    total = sum(targets)
    return deal.first(0, targets, world=world, workers=workers, batch_size=batch,
                      batches=total // (world * batch), seed=seed, passes=tuple(targets))


def positions(seg, pair, s):
    return [a + i for a, n in seg.runs(pair)[s] for i in range(n)]


@pytest.mark.parametrize("case", range(40))
def test_runs_tile_the_segment_and_mixes_are_exact(case):
    rng = np.random.default_rng(case)
    world, workers, batch = int(rng.integers(1, 9)), int(rng.integers(1, 5)), int(rng.integers(1, 20))
    targets = [int(t) for t in rng.integers(world * workers * batch, 3000, int(rng.integers(1, 4)))]
    seg = segment(targets, world, workers, batch, seed=case)
    q = seg.quotas()
    for i in range(seg.pairs):  # each pair: its batches' samples, split between the sources
        assert q[i].sum() == seg.worker_batches(i // world) * batch
        choices = seg.choices(i)
        picks = choices.take(0, int(q[i].sum()))
        assert np.bincount(picks, minlength=len(targets)).tolist() == q[i].tolist()
        assert (choices.taken(len(picks)) == q[i]).all()
    for s in range(len(targets)):
        got = [p for i in range(seg.pairs) for p in positions(seg, i, s)]
        assert len(got) == len(set(got)) == q[:, s].sum()
        assert sorted(got) == list(range(q[:, s].sum()))  # the lowest positions, each once
    assert q.sum() == seg.batches * world * batch > sum(targets) - world * batch


@pytest.mark.parametrize("case", range(40))
def test_the_rest_holds_exactly_what_the_pairs_left(case):
    rng = np.random.default_rng(100 + case)
    world, workers, batch = int(rng.integers(1, 9)), int(rng.integers(1, 5)), int(rng.integers(1, 9))
    targets = [int(t) for t in rng.integers(world * workers * batch, 2000, 2)]
    seg = segment(targets, world, workers, batch)
    q = seg.quotas()
    read = [[int(rng.integers(0, q[i, s] + 1)) for s in range(2)] for i in range(seg.pairs)]
    rest = seg.rest(read, generation=1, world=int(rng.integers(1, 9)), workers=2, batch_size=3)
    for s in range(2):
        done = {p for i in range(seg.pairs) for p in positions(seg, i, s)[:read[i][s]]}
        left = [a + k for a, n in rest.spans[s] for k in range(n)]
        assert len(left) == len(set(left)) and not done & set(left)
        assert sorted(done | set(left)) == list(range(targets[s]))  # nothing lost, nothing twice
        assert left == sorted(left)  # the lowest first: what goes unread is the highest
    assert rest.generation == 1 and rest.batches == int(rest.left().sum()) // (rest.world * 3)


def test_a_pair_finds_its_run_with_webdatasets_splitters(monkeypatch):
    for world, workers in [(1, 1), (3, 2), (8, 4)]:
        items = list(range(world * workers))
        for r in range(world):
            for w in range(workers):
                for k, v in dict(RANK=r, WORLD_SIZE=world, WORKER=w, NUM_WORKERS=workers).items():
                    monkeypatch.setenv(k, str(v))
                first, step = stride(r, world, w, workers)
                assert list(wds.split_by_worker(wds.split_by_node(items))) == items[first::step] == [r + w * world]


def test_a_mixture_leaves_unread_only_positions_of_a_last_pass():
    """Two sources of 100 samples; b's share is 101 positions, one into its second pass:
    what the last partial batch leaves unread must not be b's first pass."""
    seg = deal.first(0, [150, 101], world=2, workers=1, batch_size=8, batches=15, seed=0, passes=(100, 100))
    shares = seg.shares()
    assert shares.sum() == 240 and 101 - shares[1] <= 1  # b leaves at most its one second-pass position
