"""The stream's state carries its data and ties its numbers (pipeline.ordering.state_format): a state over
other shards is refused, an edited number is refused, a re-dealt segment's spans are made
from what its predecessors consumed and nothing else, and a state stays a few hundred bytes
a rank whatever the world and however many times it was re-dealt.

The cases are the hostile review's (issue 46): over source `a` (530 samples in 14 shards of
40), batches of 10. Before these checks a state re-sharded into 10 shards of 53 loaded as
"same" and read 114 samples twice and 114 never; positions moved 80 -> 240 read 80 twice
and 80 never; a re-dealt segment re-offering [0, 400] read 100 twice.
"""
import collections
import copy
import dataclasses
import json

import numpy as np
import pytest

from helpers import build_shards
from pipeline.ordering import deal, state_format
from pipeline.data.manifests.manifest import resolve
from pipeline.data.streams.stream import MixedStream
from pipeline.ordering.topology import Topology, Worker


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """`a` as 14 shards of 40 (twice, in two folders), re-sharded as 10 of 53, and another data
    set of the same names and counts (other pixels: another seed)."""
    out = {}
    for name, per, seed in (("a40", 40, 0), ("copy", 40, 0), ("a53", 53, 0), ("other", 40, 7)):
        folder = tmp_path_factory.mktemp(name)
        build_shards(folder, "a", "train", 530, shape=(1, 2, 2), maxcount=per, seed=seed)
        out[name] = resolve("a", str(folder), "train")
    return out


def streams(src, world=1, workers=1, batch=10):
    out = []
    for r in range(world):
        s = MixedStream([src], {"a": 1}, batch, Topology(r, world))
        s.set_workers(workers)
        out.append(s)
    return out


def pull(ss, steps=None):
    """Keys of `steps` batches a rank (all that are left: None), round-robin over the workers."""
    n = ss[0].current().workers
    made = [[s.batches(Worker(w, n)) for w in range(n)] for s in ss]
    keys = []
    for i in range(ss[0].remaining() if steps is None else steps):
        for r, s in enumerate(ss):
            b = next(made[r][i % n])
            s.record(b["state"])
            keys += b["key"]
    return keys


def twice_never(keys, total=530):
    c = collections.Counter(keys)
    return sum(1 for v in c.values() if v > 1), total - len(c)


def saved(ss):
    return json.loads(json.dumps([s.state_dict() for s in ss]))


# ---------------------------------------------------------------- the data's identity


def test_a_state_over_resharded_shards_is_refused(shards):
    """Same name, same 530 samples, other shards: which sample each position holds differs."""
    a = streams(shards["a40"])
    head = pull(a, 38)
    state = saved(a)
    assert state[0]["listings"] == [shards["a40"].listing]
    with pytest.raises(ValueError, match="other shards of source a") as e:
        streams(shards["a53"])[0].load_state_dict(state)
    assert "\n" not in str(e.value)
    same = streams(shards["copy"])  # the same shards in another folder: the same listing, and it goes on
    assert same[0].load_state_dict(state)["deal"] == "same"
    assert twice_never(head + pull(same)) == (0, 0)


def test_a_state_of_another_data_set_with_the_same_names_and_counts_is_refused(shards):
    a = streams(shards["a40"])
    pull(a, 5)
    assert [n for n in shards["other"].counts] == shards["a40"].counts
    with pytest.raises(ValueError, match="other shards of source a"):
        streams(shards["other"])[0].load_state_dict(saved(a))


def test_at_an_epochs_end_other_shards_start_the_next_epoch(shards):
    """A state saved at its epoch's end holds no position: the next epoch may read other data."""
    a = streams(shards["a40"])
    pull(a)
    b = streams(shards["a53"])
    assert b[0].load_state_dict(saved(a))["deal"] == "next epoch" and b[0].epoch == 1


def test_a_source_without_a_manifest_digest_is_known_by_its_shards(shards):
    src = shards["a40"]
    bare = dataclasses.replace(src, listing="")
    moved = dataclasses.replace(bare, urls=[u.replace("/a-", "/b-") for u in bare.urls])
    fewer = dataclasses.replace(bare, urls=bare.urls[:13], counts=bare.counts[:12] + [50], sizes=bare.sizes[:13])
    assert state_format.listing(bare) != state_format.listing(moved) and state_format.listing(bare) != state_format.listing(fewer)
    assert state_format.listing(bare) == state_format.listing(dataclasses.replace(bare, urls=[u.replace("/", "//", 1)
                                                                             for u in bare.urls]))


# ---------------------------------------------------------------- every number tied to the others


def test_a_position_moved_inside_its_run_is_refused(shards):
    """1 rank x 2 workers, 16 batches: worker 0 read positions 0..80 of its run of 270; a state
    saying 240 passes every range (a pair may pass over damaged samples) but is not what
    state_dict wrote."""
    a = streams(shards["a40"], workers=2)
    head = pull(a, 16)
    state = saved(a)
    assert state[0]["ranks"][0]["passed"] == []
    edited = copy.deepcopy(state)
    edited[0]["ranks"][0]["passed"] = [[0, [160]]]
    with pytest.raises(ValueError, match="rank 0: its check .* does not match its numbers") as e:
        streams(shards["a40"], workers=2)[0].load_state_dict(edited)
    assert "\n" not in str(e.value)
    b = streams(shards["a40"], workers=2)
    assert b[0].load_state_dict(state)["passed"] == {0: 0}
    assert twice_never(head + pull(b)) == (0, 0)


def generation_one(src):
    """Keys read and the state after 5 batches on 2 ranks, then 5 more on 1 rank."""
    first = streams(src, world=2)
    head = pull(first, 5)
    second = streams(src)
    assert second[0].load_state_dict(saved(first))["deal"] == "re-deal"
    head += pull(second, 5)
    return head, saved(second)


@pytest.mark.parametrize("record", [dict(done=0), dict(done=20), dict(world=1), dict(passed=[[1, [40]]])])
def test_a_re_dealt_segment_is_made_from_what_was_consumed_and_edits_are_refused(shards, record):
    """A generation-1 segment lists no spans: it names the world before it and what that
    consumed, and its spans are made from them. Editing that record (done 0 offers again what
    the first world read; done 20 hides what it did not) is refused."""
    head, state = generation_one(shards["a40"])
    seg = state[0]["segment"]
    assert seg["generation"] == 1 and "spans" not in seg
    assert seg["before"] == [{"world": 2, "workers": 1, "batch_size": 10, "done": 5, "passed": []}]
    edited = copy.deepcopy(state)
    rec = edited[0]["segment"]["before"][0]
    rec.update(record)
    made = deal.replay(0, [530], [(rec["world"], 1, 10, rec["done"], tuple((p, tuple(v)) for p, v in rec["passed"]))],
                       world=1, workers=1, batch_size=10, seed=0, passes=(530,))
    edited[0]["segment"]["batches"] = made.batches  # consistent in itself: only the check can tell
    with pytest.raises(ValueError, match="does not match its numbers") as e:
        streams(shards["a40"])[0].load_state_dict(edited)
    assert "\n" not in str(e.value)
    again = streams(shards["a40"])
    again[0].load_state_dict(state)
    assert twice_never(head + pull(again)) == (0, 0)


@pytest.mark.parametrize("case", range(30))
def test_replayed_segments_hold_exactly_what_their_predecessors_left(case):
    """Random epochs re-dealt 1-4 times, each world reading a random part of its segment and its
    pairs passing over a random few positions: the segment `deal.replay` makes from the
    records equals the one the re-deals made, and its spans are exactly the positions no
    earlier segment read, each once."""
    rng = np.random.default_rng(case)
    S = int(rng.integers(1, 4))
    targets = [int(t) for t in rng.integers(100, 3000, S)]
    world = lambda: (int(rng.integers(1, 7)), int(rng.integers(1, 4)), int(rng.integers(1, 9)))  # noqa: E731
    w, k, b = world()
    seg = deal.first(0, targets, world=w, workers=k, batch_size=b, batches=sum(targets) // (w * b), seed=case,
                     passes=tuple(targets))
    read = [set() for _ in range(S)]
    for _ in range(int(rng.integers(1, 5))):
        done = int(rng.integers(0, seg.batches + 1))
        passed = {}
        for p in range(seg.pairs):
            if rng.random() < 0.3:
                left = seg.quotas()[p] - seg.taken(p, done)
                passed[p] = tuple(int(rng.integers(0, n + 1)) for n in left)
        for p in range(seg.pairs):
            took = seg.taken(p, done) + np.asarray(passed.get(p, 0))
            for s, run in enumerate(seg.runs(p)):
                read[s] |= {a + i for a, n in deal.cut(run, 0, int(took[s])) for i in range(n)}
        w, k, b = world()
        seg = seg.after(done, passed, world=w, workers=k, batch_size=b)
    again = deal.replay(0, targets, seg.history, world=w, workers=k, batch_size=b, seed=case, passes=tuple(targets))
    assert again == seg
    for s in range(S):
        left = [a + i for a, n in seg.spans[s] for i in range(n)]
        assert len(left) == len(set(left)) and not read[s] & set(left)
        assert read[s] | set(left) == set(range(targets[s]))


@pytest.mark.parametrize("case", range(20))
def test_every_state_loads_back_as_written_and_any_one_number_changed_is_refused(shards, case):
    """States from random worlds and stops, through JSON, load back; one number of a rank's entry
    or of the segment's records changed by one (any field, any rank) is refused in one line."""
    rng = np.random.default_rng(500 + case)
    src = shards["a40"]
    hops = [(int(rng.integers(1, 4)), int(rng.integers(1, 4))) for _ in range(int(rng.integers(1, 4)))]
    states = None
    for world, workers in hops:
        ss = streams(src, world, workers)
        if states:
            for s in ss:
                s.load_state_dict(states)
        pull(ss, int(rng.integers(0, ss[0].remaining())))
        states = saved(ss)
    for s in streams(src, *hops[-1]):
        assert s.load_state_dict(states)["deal"] == "same"
    numbers = list(_numbers(states))
    for path in [numbers[i] for i in rng.choice(len(numbers), min(6, len(numbers)), replace=False)]:
        edited = copy.deepcopy(states)
        node = edited
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] += 1
        with pytest.raises(ValueError) as e:
            streams(src, *hops[-1])[0].load_state_dict(edited)
        assert "\n" not in str(e.value), path


def _numbers(doc, path=()):
    """Paths to every integer of the states' segments, dones and rank entries."""
    if isinstance(doc, dict):
        for k, v in doc.items():
            if k not in ("version", "seed", "epoch", "targets", "order", "listings", "sources", "check"):
                yield from _numbers(v, path + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _numbers(v, path + (i,))
    elif type(doc) is int:
        yield path


@pytest.mark.parametrize("case", range(16))
def test_a_resume_on_another_batch_size_reads_no_sample_twice(shards, case):
    """Random worlds and batch sizes before and after a stop (the trainer's --batch-size and
    --global-batch change both), one to three re-deals: over the epoch no key twice, and fewer
    unread than one global batch of the world that finishes it."""
    rng = np.random.default_rng(900 + case)
    src, states, read = shards["a40"], None, []
    hops = [(int(rng.integers(1, 5)), int(rng.integers(1, 4)), int(rng.choice([3, 8, 10, 16, 32])))
            for _ in range(int(rng.integers(2, 5)))]
    for i, (world, workers, batch) in enumerate(hops):
        ss = streams(src, world, workers, batch)
        if states:
            for s in ss:
                assert s.load_state_dict(states)["deal"] in ("same", "re-deal")
        left = ss[0].current().batches  # (this world has read none of it yet)
        if not left:  # what the world before left is less than one batch on every rank here
            break
        last = i == len(hops) - 1  # the world that finishes the epoch
        read += pull(ss, None if last else int(rng.integers(0, left)))
        states = saved(ss)
        if last:
            break
    twice, never = twice_never(read)
    assert twice == 0, hops
    assert never < world * batch, hops


@pytest.mark.parametrize("bad", ["1", 1.5, True, -1, 2 ** 60, None])
def test_a_loader_state_whose_next_epoch_is_no_epoch_is_one_line_naming_the_field(shards, bad):
    """`next_epoch` "1" ended in int()'s own words ("invalid literal for int() with base 10"),
    1.5 and True loaded as epoch 1, -1 as an epoch before the first: each is refused in one line
    that names the field and the value, before the stream takes the state."""
    from pipeline.data.handover.dataloader import StatefulLoader

    state = json.loads(json.dumps(StatefulLoader(streams(shards["a40"])[0]).state_dict()))
    state["next_epoch"] = bad
    loader = StatefulLoader(streams(shards["a40"])[0])
    with pytest.raises(ValueError) as e:
        loader.load_state_dict(state)
    said = str(e.value)
    assert said.startswith(f"loader state next_epoch: {bad!r}"[:40]) and "an integer in 0.." in said, said
    assert "\n" not in said and loader.next_epoch == 0 and not loader._resumed
