"""The stream's place through every door of the streaming API, in any order: random sequences of
set_epoch, set_workers, state_dict / load_state_dict (states from any earlier point, JSON round
tripped, into the same stream or a new one, as a new process would) and partial and full passes.
Each epoch must read the keys an uninterrupted epoch reads: exactly, where its passes all ran on
one worker count; with no sample twice and less than one batch unread where a change of workers
re-dealt the rest. Then the issue's three reported cases, through make_loader as a user's loop
runs them."""
import collections
import copy
import itertools
import json

import numpy as np
import pytest

from helpers import build_shards, fields_corpus, read_pass as read
from pipeline.data.manifests.manifest import resolve
from pipeline.data.streams.stream import MixedStream
from pipeline.data.handover.loader import make_loader

BATCH = 10
WEIGHTS = {"a": 2.0, "b": 1.0}


@pytest.fixture(scope="module", params=["image+label", "fields"])
def sources(tmp_path_factory, request):
    """Tiny raw images and labels, or (fields) PNGs with a caption, read through a schema with a
    text field and a random resized crop stage (the corpus of tests/test_coverage.py)."""
    out = tmp_path_factory.mktemp("lifecycle")
    sizes = (("a", 330, 40), ("b", 200, 30))
    if request.param == "fields":
        return fields_corpus(out, sizes)
    for name, n, per in sizes:
        build_shards(out, name, "train", n, shape=(1, 2, 2), maxcount=per)
    return [resolve(n, str(out), "train") for n in "ab"]


def new_stream(sources):
    return MixedStream(sources, WEIGHTS, BATCH, seed=7, shuffle_buffer=50, epoch_samples=300)


class Expected:
    """What the user has read of the epoch the stream stands in, by the API's documented rules."""

    def __init__(self):
        self.epoch, self.keys, self.finished, self.workers = 0, collections.Counter(), False, set()
        self.pinned, self.given = None, False

    def restart(self, epoch):
        self.epoch, self.keys, self.finished, self.workers = epoch, collections.Counter(), False, set()


def reference(sources, epoch, cache={}):
    key = (tuple(s.manifest for s in sources), epoch)
    if key not in cache:
        s = new_stream(sources)
        s.set_epoch(epoch)
        cache[key] = collections.Counter(read(s)[0])
    return cache[key]


def check_epoch(sources, want, what):
    ref = reference(sources, want.epoch)
    if len(want.workers) <= 1:
        assert want.keys == ref, f"{what}: epoch {want.epoch} read other keys than an uninterrupted one"
    else:
        assert not want.keys - ref, f"{what}: a sample of epoch {want.epoch} read twice"
        assert sum(ref.values()) - sum(want.keys.values()) < BATCH, f"{what}: a batch or more of epoch {want.epoch} unread"


def run_case(sources, rng, steps=14):
    stream, want, saved, log = new_stream(sources), Expected(), [], []
    for _ in range(steps):
        op = rng.choice(["pass", "pass", "part", "part", "epoch", "workers", "save", "save", "load", "new"])
        log.append(op)
        what = " -> ".join(log)
        if op in ("pass", "part"):
            if want.finished:  # a pass after a finished epoch reads the next
                want.restart(want.epoch + 1)
            left = stream.remaining()
            most = None if op == "pass" else int(rng.integers(1, max(2, left)))
            keys, got, _ = read(stream, most)
            assert got == (left if op == "pass" else min(most, left)), f"{what}: remaining() said {left}"
            want.keys.update(keys)
            want.workers.add(stream.workers)
            want.pinned = None
            if got == left:
                check_epoch(sources, want, what)
                want.finished = True
                assert stream.remaining() == len(stream) == 30, f"{what}: the next pass reads the next epoch"
            else:
                assert stream.remaining() == left - got, what
        elif op == "epoch":
            epoch = int(rng.choice([want.epoch, want.epoch + 1, int(rng.integers(0, 4))]))
            log[-1] = f"set_epoch({epoch})"
            if want.pinned is not None:
                saved_epoch, ended = want.pinned
                if epoch not in ((saved_epoch, saved_epoch + 1) if ended else (saved_epoch,)):
                    with pytest.raises(ValueError, match="set_epoch"):
                        stream.set_epoch(epoch)
                    continue
            elif epoch != want.epoch or want.finished:
                want.restart(epoch)
            stream.set_epoch(epoch)
            want.given = True
        elif op == "workers":
            n = int(rng.integers(1, 4))
            log[-1] = f"set_workers({n})"
            stream.set_workers(n)
        elif op == "save":
            saved.append((json.loads(json.dumps(stream.state_dict())), copy.deepcopy(want), stream.workers))
        elif op in ("load", "new") and saved:
            state, then, workers = saved[int(rng.integers(0, len(saved)))]
            if op == "new":  # another process: a new stream, its epoch maybe set first, as a resuming loop does
                stream, want = new_stream(sources), Expected()
                stream.set_workers(int(rng.integers(1, 4)))
                if rng.random() < 0.5:
                    stream.set_epoch(then.epoch)
                    want.epoch, want.given = then.epoch, True
            ended = then.finished
            if want.given and want.pinned is None and want.epoch not in ((then.epoch, then.epoch + 1) if ended
                                                                           else (then.epoch,)):
                with pytest.raises(ValueError, match="load_state_dict after set_epoch"):
                    stream.load_state_dict(state)
                continue
            said = stream.load_state_dict(state)
            assert said["deal"] == ("next epoch" if ended else said["deal"]), what
            if ended:
                want.restart(then.epoch + 1)
            else:
                want.epoch, want.keys, want.finished = then.epoch, collections.Counter(then.keys), False
                want.workers = {workers}
            want.pinned = (then.epoch, ended)


@pytest.mark.parametrize("case", range(40))
def test_any_order_of_the_apis_calls_reads_each_epoch_as_an_uninterrupted_one(sources, case):
    run_case(sources, np.random.default_rng(case))


# ---------------------------------------------------------------- the cases, through make_loader


def keys(loader, n=None):
    return [k for b in itertools.islice(loader, n) for k in b["key"]]


@pytest.mark.slow
def test_a_state_saved_after_an_epoch_goes_on_at_the_next_epochs_start(sources):
    """Case 1: saved after epoch 0's loop (README), loaded after set_epoch(1): epoch 1 in full (it read 0 batches)."""
    s = new_stream(sources)
    loader = make_loader(s, 2)
    s.set_epoch(0)
    keys(loader)
    state = json.loads(json.dumps(s.state_dict()))
    t = new_stream(sources)
    t.set_epoch(1)
    t.load_state_dict(state)
    assert keys(make_loader(t, 2)) == keys(make_loader(_at(sources, 1), 2))


@pytest.mark.slow
def test_batches_read_after_a_load_are_not_read_again_by_a_loader_of_other_workers(sources):
    """Case 2: a state after 20 batches loaded, 5 more from a 0-worker loader, then a 2-worker loader:
    no sample twice, less than a batch unread (it read 50 twice and left 10)."""
    s = new_stream(sources)
    head = keys(make_loader(s, 0), 20)
    t = new_stream(sources)
    t.load_state_dict(json.loads(json.dumps(s.state_dict())))
    more = keys(make_loader(t, 0), 5)
    assert t.remaining() == 30 - 25
    rest = keys(make_loader(t, 2))
    got, ref = collections.Counter(head + more + rest), collections.Counter(keys(make_loader(_at(sources, 0), 0)))
    assert not got - ref and sum((ref - got).values()) < BATCH


@pytest.mark.slow
def test_a_state_loaded_before_its_loader_goes_on_exactly(sources):
    """Case 3: loaded before make_loader(stream, 2) on the same world: the rest exactly (one batch was lost)."""
    whole = keys(make_loader(_at(sources, 0), 2))
    s = new_stream(sources)
    head = keys(make_loader(s, 2), 12)
    t = new_stream(sources)
    t.load_state_dict(json.loads(json.dumps(s.state_dict())))
    assert head + keys(make_loader(t, 2)) == whole


@pytest.mark.slow
def test_a_state_loaded_before_its_loader_says_so_and_its_lengths_are_the_next_pass(sources):
    """load_state_dict before make_loader(stream, 2), on the same 2 workers, answered
    {'deal': 're-deal', ..., 'to': [1, 1, 10]} (the stream assumes 1 worker until its loader
    says), and len(stream) then said the whole segment's batches (30) where the pass yielded 18."""
    s = new_stream(sources)
    keys(make_loader(s, 2), 12)
    t = new_stream(sources)
    said = t.load_state_dict(json.loads(json.dumps(s.state_dict())))
    assert said["deal"] == "same on as many workers" and said["to"] == [1, None, BATCH], said
    assert len(t) == t.remaining() == 18
    loader = make_loader(t, 2)
    assert len(t) == t.remaining() == len(loader) == 18
    assert len(keys(loader)) == 18 * BATCH
    u = new_stream(sources)
    make_loader(u, 2)  # the workers given first: the same state is "same"
    assert u.load_state_dict(json.loads(json.dumps(s.state_dict())))["deal"] == "same"


@pytest.mark.parametrize("counts", [(0, 2), (2, 0), (1, 2)])
def test_two_loaders_of_other_worker_counts_over_one_stream_each_read_for_their_own(sources, counts):
    """A loader made before another of another worker count over the same stream: its pass was
    refused ("1 loader workers, the stream was set for 2") in every epoch, while the docs say a
    loader of another worker count re-deals the rest. Each pass now deals the stream to its own
    loader's workers: whole epochs read as an uninterrupted one reads them; an epoch changed
    midway reads no sample twice and leaves less than a batch."""
    s = new_stream(sources)
    first, second = make_loader(s, counts[0]), make_loader(s, counts[1])
    s.set_epoch(0)
    assert collections.Counter(keys(first)) == reference(sources, 0)
    s.set_epoch(1)
    assert collections.Counter(keys(second)) == reference(sources, 1)
    s.set_epoch(2)
    head = keys(first, 7)
    rest = keys(second)
    got, ref = collections.Counter(head + rest), reference(sources, 2)
    assert not got - ref and sum((ref - got).values()) < BATCH
    first.close(), second.close()


def _at(sources, epoch):
    s = new_stream(sources)
    s.set_epoch(epoch)
    return s


# ---------------------------------------------------------------- the hostile review's findings


def test_new_weights_inside_an_epoch_are_refused_and_leave_the_stream_as_it_was(sources):
    """set_epoch(same epoch, new weights) after some batches: the epoch's split is fixed (its own
    state_dict was refused by itself, and a loader made then left the stream on 2 workers of a
    1-worker plan)."""
    s = new_stream(sources)
    read(s, 3)
    with pytest.raises(ValueError, match=r"set_epoch\(0, weights\) inside epoch 0, after 3 batches"):
        s.set_epoch(0, {"a": 1.0, "b": 1.0})
    state = s.state_dict()
    t = new_stream(sources)
    t.load_state_dict(state)
    s.set_epoch(1, {"a": 1.0, "b": 1.0})  # at the next epoch, new weights are taken
    assert s.weights == {"a": 0.5, "b": 0.5} and s.remaining() == len(s)


def test_set_workers_that_fails_leaves_the_workers_as_they_were(sources, monkeypatch):
    s = new_stream(sources)
    read(s, 3)
    monkeypatch.setattr(MixedStream, "_adopt", lambda self, state: (_ for _ in ()).throw(ValueError("refused")))
    with pytest.raises(ValueError, match="refused"):
        s.set_workers(2)
    assert s.workers == 1 and s.remaining() == 27


def test_a_state_of_another_rank_alone_is_refused_when_loaded(sources):
    from pipeline.ordering.topology import Topology

    ranks = [MixedStream(sources, WEIGHTS, BATCH, Topology(r, 2), seed=7, shuffle_buffer=50, epoch_samples=300)
             for r in range(2)]
    for s in ranks:
        read(s, 2)
    with pytest.raises(ValueError, match=r"holds rank\(s\) \[1\]'s place only; this stream is rank 0"):
        MixedStream(sources, WEIGHTS, BATCH, Topology(0, 2), seed=7, shuffle_buffer=50,
                    epoch_samples=300).load_state_dict(ranks[1].state_dict())


def test_a_loader_started_early_keeps_the_loaded_states_epoch_rule(sources):
    """make_loader(...).start() looks at the next plan; a state loaded before still refuses
    set_epoch of another epoch (start() had lifted it, and the state was thrown away)."""
    s = new_stream(sources)
    read(s, 4)
    t = new_stream(sources)
    t.load_state_dict(json.loads(json.dumps(s.state_dict())))
    loader = make_loader(t, 1).start()
    with pytest.raises(ValueError, match=r"saved inside epoch 0; set_epoch\(3\) disagrees"):
        t.set_epoch(3)
    assert t.remaining() == 26
    loader.close()


def test_a_re_deal_with_nothing_left_for_the_new_world_reads_the_next_epoch(sources):
    """30 samples left, 4 ranks of 10: no batch for the new world; len(), remaining() and the next
    pass agree (len 0 and remaining 13 while a pass read 0 batches, every time)."""
    from pipeline.ordering.topology import Topology

    s = MixedStream(sources, WEIGHTS, BATCH, seed=7, shuffle_buffer=50, epoch_samples=300)
    read(s, 27)
    state = json.loads(json.dumps(s.state_dict()))
    new = MixedStream(sources, WEIGHTS, BATCH, Topology(0, 4), seed=7, shuffle_buffer=50, epoch_samples=300)
    assert new.load_state_dict(state)["deal"] == "re-deal"
    assert len(new) == new.remaining() == 7 and read(new)[1] == 7 and new.epoch == 1


def test_a_stream_without_topo_takes_torchruns_environment(sources, monkeypatch):
    """The fields examples made their streams without topo=: under torchrun every rank read the same
    batches (the default was one process of one)."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    s = MixedStream(sources, WEIGHTS, BATCH, seed=7, epoch_samples=300)
    assert (s.topo.rank, s.topo.world) == (1, 2) and len(s) == 15
