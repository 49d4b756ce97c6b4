"""Which samples an epoch reads, driven through the real stream in one process: every
world change and interruption step, single sources and mixtures, checked on the keys.

Each case builds its ranks' MixedStreams (a Topology each), pulls their workers'
batches in the order a DataLoader hands them over (round-robin), stops at a random
step, saves every rank's state, and resumes on another random world that reads the
rest of the epoch. The rule checked (README, "Guarantees"):
- a single source: no sample read twice, fewer unread than one global batch of the
  world that finishes the epoch;
- a mixture: within each source, no sample read a second time while another is unread
  (the counts differ by at most one), but for what the last partial global batch leaves:
  the reads missing for that rule are fewer than one global batch of the world that
  finishes the epoch; and the epoch's samples split by the weights.
"""
import collections
import json

import numpy as np
import pytest

from helpers import build_shards, fields_corpus
from pipeline.data.manifests.manifest import resolve
from pipeline.data.streams.stream import MixedStream
from pipeline.ordering.topology import Topology, Worker


SIZES = (("a", 530, 40), ("b", 260, 25), ("c", 97, 13))


@pytest.fixture(scope="module", params=["image+label", "fields"])
def corpus(tmp_path_factory, request):
    """Three sources in shards of uneven sizes (the last shard is short): tiny raw images and
    labels, or (fields) PNGs of 3x4 with a caption (the key) and a label, read through a schema
    with a text field and a random resized crop stage (pipeline.data.fields.schema)."""
    out = tmp_path_factory.mktemp("coverage")
    if request.param == "image+label":
        for name, n, per in SIZES:
            build_shards(out, name, "train", n, shape=(1, 2, 2), maxcount=per)
        return {name: resolve(name, str(out), "train") for name in "abc"}
    return {s.name: s for s in fields_corpus(out, SIZES)}


def streams_for(sources, weights, world, workers, batch_size, **kw):
    out = []
    for rank in range(world):
        s = MixedStream(sources, weights, batch_size, Topology(rank, world), seed=11, shuffle_buffer=60, **kw)
        s.set_workers(max(workers, 1))
        s.set_epoch(0)
        out.append(s)
    return out


def pull(streams, workers, steps=None):
    """Keys of `steps` batches per rank (all that are left: None), as DataLoaders hand
    them over: logical worker order, round-robin; records what each consumed."""
    n = max(workers, 1)
    made = [[s.batches(Worker(w, n)) for w in range(n)] for s in streams]
    left = {s.remaining() for s in streams}
    assert len(left) == 1, "every rank yields the same number of batches"
    keys = []
    for i in range(left.pop() if steps is None else steps):
        for r, s in enumerate(streams):
            batch = next(made[r][i % n])
            assert len(batch["key"]) == s.batch_size
            if "caption" in batch:  # a schema's fields: each row's fields are its sample's
                assert batch["caption"] == batch["key"] and batch["image"].shape == (s.batch_size, 1, 2, 2)
            s.record(batch["state"])
            keys += batch["key"]
    return keys


def epoch(sources, weights, before, after, stop, batch_size):
    """Keys of one epoch: `before` = (ranks, workers) until step `stop`, then `after`."""
    first = streams_for(sources, weights, *before, batch_size)
    keys = pull(first, before[1], stop)
    states = json.loads(json.dumps([s.state_dict() for s in first]))  # what a checkpoint holds
    second = streams_for(sources, weights, *after, batch_size)
    ended = stop >= first[0].current().batches
    for s in second:
        said = s.load_state_dict(states)
        same = (before[0], max(before[1], 1)) == (after[0], max(after[1], 1))
        assert said["deal"] == ("next epoch" if ended else "same" if same else "re-deal")
    if ended:  # a state saved at the epoch's end goes on at the next epoch's start (torchdata's rule)
        assert all(s.epoch == 1 and s.remaining() == len(s) for s in second)
        return keys, first[0]
    return keys + pull(second, after[1]), second[0]


def random_case(rng):
    worlds = [(int(rng.integers(1, 9)), int(rng.integers(0, 5))) for _ in range(2)]
    batch_size = int(rng.choice([1, 3, 8, 16]))
    return worlds, batch_size


@pytest.mark.parametrize("case", range(24))
def test_a_single_source_reads_no_sample_twice_on_any_world_change(corpus, case):
    rng = np.random.default_rng(case)
    (before, after), batch_size = random_case(rng)
    src = corpus["a"]
    total = src.total
    if total < max(before[0], after[0]) * batch_size:
        pytest.skip("less than one batch per rank")
    batches = total // (before[0] * batch_size)
    stop = int(rng.integers(0, batches + 1))
    keys, last = epoch([src], {"a": 1}, before, after, stop, batch_size)
    counts = collections.Counter(keys)
    assert max(counts.values()) == 1, f"{before} -> {after} at step {stop}: a sample read twice"
    assert total - len(counts) < last.topo.world * batch_size, f"{before} -> {after} at step {stop}: too many unread"


@pytest.mark.parametrize("case", range(16))
def test_a_mixture_reads_a_sample_twice_only_after_all_of_its_source_once(corpus, case):
    rng = np.random.default_rng(1000 + case)
    (before, after), batch_size = random_case(rng)
    sources = [corpus["a"], corpus["c"]] if case % 2 else [corpus["b"], corpus["c"], corpus["a"]]
    weights = {s.name: float(w) for s, w in zip(sources, rng.uniform(0.2, 1.0, len(sources)))}
    per_rank = sum(s.total for s in sources) // (before[0] * batch_size)
    if per_rank < 1 or sum(s.total for s in sources) < after[0] * batch_size:
        pytest.skip("less than one batch per rank")
    stop = int(rng.integers(0, per_rank + 1))
    keys, last = epoch(sources, weights, before, after, stop, batch_size)
    counts = collections.Counter(keys)
    targets = last.targets()
    for i, s in enumerate(sources):
        mine = [counts.get(f"{s.name}-train-{k:07d}", 0) for k in range(s.total)]
        missing = sum(max(0, max(mine) - 1 - c) for c in mine)  # reads the rule wants before any sample's last
        assert missing < last.topo.world * batch_size, f"{s.name}: read {max(mine)} times while another was read " \
                                                f"{min(mine)} ({missing} reads short)"
        assert 0 <= targets[i] - sum(mine) < last.topo.world * batch_size  # the source's share, to the last batch
    assert sum(targets) - len(keys) < last.topo.world * batch_size


@pytest.mark.parametrize("workers", [0, 1, 2, 3])
def test_an_uninterrupted_epoch_reads_every_sample_once_whatever_the_workers(corpus, workers):
    """The reported bug: 6,000 samples, 2 workers, batches of 64: one worker owned 3,000
    and yielded 3,008. Here every pair reads a run of exactly its batches' samples."""
    src = corpus["a"]
    streams = streams_for([src], {"a": 1}, 1, workers, 64)
    keys = pull(streams, workers)
    assert len(keys) == len(set(keys)) == (src.total // 64) * 64


def test_the_same_world_goes_on_bit_for_bit(corpus):
    """Stopped and resumed on the same world, the batches are the uninterrupted run's."""
    sources, weights = [corpus["a"], corpus["b"]], {"a": 2, "b": 1}
    whole = pull(streams_for(sources, weights, 2, 3, 8), 3)
    for stop in (0, 5, 13, 20):
        keys, _ = epoch(sources, weights, (2, 3), (2, 3), stop, 8)
        assert keys == whole


def test_the_epochs_mix_matches_the_weights_exactly(corpus):
    sources = [corpus["a"], corpus["b"]]
    streams = streams_for(sources, {"a": 3, "b": 1}, 2, 2, 10, epoch_samples=400)
    keys = pull(streams, 2)
    got = collections.Counter(k.split("-")[0] for k in keys)
    assert got == {"a": 300, "b": 100}


def test_each_batch_draws_its_sources_at_random(corpus):
    """Exact in total, random in detail: the batches' compositions vary, with a seed."""
    streams = streams_for([corpus["a"], corpus["b"]], {"a": 1, "b": 1}, 1, 0, 16)
    made = streams[0].batches(Worker(0, 1))
    shares = [int((b["source"] == 0).sum()) for b in made]
    assert len(set(shares)) > 3 and abs(np.mean(shares) - 8) < 1
