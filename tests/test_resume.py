"""Resuming inside an epoch: the stream's state_dict / load_state_dict in one process (any
world size, any break point), then the trainer killed mid-epoch under torchrun and resumed
on the same and on another number of ranks.
"""
import collections
import itertools
import json
import os
import signal
import time

import numpy as np
import pytest
import torch

from helpers import HANG, finish, key_index, launch_train, mid_epoch_args, put_back
from pipeline.data.streams.stream import MixedStream, resolve
from pipeline.data.handover.loader import make_loader
from pipeline.ordering.topology import Topology
from pipeline.train import checkpoint
from pipeline.train.metrics import read_keys

WEIGHTS = {"mnist": 1.0, "cifar10": 1.0}


@pytest.fixture(scope="session")
def data(mid_epoch_shards):
    return mid_epoch_shards


def sources(data):
    return [resolve("mnist", str(data), "train"), resolve("cifar10", str(data), "train")]


def stream_for(data, rank=0, world=1, **kw):
    kw = dict(dict(seed=4, shuffle_buffer=30, epoch_samples=640), **kw)
    return MixedStream(sources(data), WEIGHTS, 8, Topology(rank, world), **kw)


def keys(loader, n=None):
    """The keys of the loader's next n batches (all of them by default), taking no more."""
    return [list(b["key"]) for b in itertools.islice(loader, n)]


# ---------------------------------------------------------------- in one process


@pytest.mark.parametrize("workers", [0, 1, 2, 3])
@pytest.mark.parametrize("stop", [1, 4, 7])
def test_read_n_save_rebuild_and_the_next_batches_are_the_same(data, workers, stop):
    """torchdata's test for a stateful loader: N batches, state_dict, a new stream and loader
    from that state, and the rest must equal an uninterrupted pass (keys in order)."""
    for rank in range(2):
        whole = keys(make_loader(stream_for(data, rank, 2), workers))
        first = stream_for(data, rank, 2)
        head = keys(make_loader(first, workers), stop)
        state = json.loads(json.dumps(first.state_dict()))  # JSON all the way: it lives in checkpoints
        again = stream_for(data, rank, 2)
        loader = make_loader(again, workers)
        loader_state_first = again.remaining()
        again.load_state_dict(state)
        assert again.remaining() == len(whole) - stop and loader_state_first == len(whole)
        assert head + keys(loader) == whole, (rank, workers, stop)


def test_state_survives_set_epoch_and_applies_to_its_epoch_only(data):
    s = stream_for(data)
    s.set_epoch(3)
    head = keys(make_loader(s, 2), 5)
    state = s.state_dict()
    assert state["epoch"] == 3
    t = stream_for(data)
    t.load_state_dict(state)
    t.set_epoch(3)  # the trainer selects the epoch again: the resume point stays
    loader = make_loader(t, 2)
    rest = keys(loader)
    fresh = stream_for(data)
    fresh.set_epoch(3)
    assert head + rest == keys(make_loader(fresh, 2))
    t.set_epoch(4)  # the next epoch starts from its beginning
    fresh.set_epoch(4)
    assert keys(loader) == keys(make_loader(fresh, 2))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_state_loaded_while_the_workers_run_takes_effect_at_the_next_pass(data, workers):
    """Each pass sends the workers the stream's plan as it begins: read on past a saved state,
    load it again, and the next pass goes on from the state, as an uninterrupted pass would."""
    whole = keys(make_loader(stream_for(data), workers))
    s = stream_for(data)
    loader = make_loader(s, workers)
    head = keys(loader, 3)
    state = s.state_dict()
    assert keys(loader, 4) == whole[3:7]  # a second pass goes on where the first stopped
    s.load_state_dict(state)
    assert head + keys(loader) == whole


def test_a_state_for_other_sources_or_seed_is_refused(data):
    s = stream_for(data)
    keys(make_loader(s, 0), 2)
    state = s.state_dict()
    for other in (stream_for(data, seed=5), MixedStream(sources(data)[::-1], WEIGHTS, 8, seed=4)):
        with pytest.raises(ValueError, match="stream state is for"):
            other.load_state_dict(state)


@pytest.mark.parametrize("old, new", [((2, 2), (3, 1)), ((2, 2), (1, 0)), ((3, 1), (2, 2)), ((2, 0), (2, 3))])
def test_another_world_continues_the_epoch_without_reading_a_sample_twice(data, old, new):
    """k batches on each old rank, then the rest of the epoch on a new world: no key twice
    in the epoch, and nothing skipped but what the new world's last partial batch leaves."""
    (w0, k0), (w1, k1) = old, new
    stop = 9
    states, seen = [], []
    for r in range(w0):
        s = stream_for(data, r, w0)
        seen += [k for b in keys(make_loader(s, k0), stop) for k in b]
        states.append(s.state_dict())
    left = 640 - stop * w0 * 8  # every position of the epoch not read yet, the first world's leftover too
    after = []
    for r in range(w1):
        s = stream_for(data, r, w1)
        loader = make_loader(s, k1)
        s.load_state_dict(states)
        assert s.remaining() == left // (w1 * 8)
        after += [k for b in keys(loader) for k in b]
    everything = seen + after
    repeated = [k for k, c in collections.Counter(everything).items() if c > 1]
    assert not repeated, repeated[:5]
    assert len(after) == left // (w1 * 8) * w1 * 8 and left - len(after) < w1 * 8


@pytest.mark.slow
def test_four_worlds_in_a_row_read_no_key_twice(data):
    """(4 ranks, 2 workers) -> (3, 1) -> (6, 3) -> back to (4, 2), three batches a rank on
    each but the last, which finishes the epoch: what every pair left is dealt to the next
    world, so no key is read twice in the epoch, and only the last world's partial batch
    is lost."""
    epoch, batch = 480, 8
    states, seen, left = None, [], epoch
    hops = [(4, 2), (3, 1), (6, 3), (4, 2)]
    for hop, (world, workers) in enumerate(hops):
        new_states, batches = [], None
        for r in range(world):
            s = stream_for(data, r, world, epoch_samples=epoch)
            loader = make_loader(s, workers)
            if states:
                s.load_state_dict(states)
            batches = s.remaining()
            got = keys(loader, None if hop == len(hops) - 1 else 3)
            seen += [k for b in got for k in b]
            new_states.append(json.loads(json.dumps(s.state_dict())))
        assert new_states[0]["segment"]["world"] == world and new_states[0]["segment"]["generation"] == hop
        assert 0 <= left - batches * world * batch < world * batch  # the rest, in this world's batches
        left -= (3 if hop < len(hops) - 1 else batches) * world * batch
        states = new_states
    repeated = [k for k, c in collections.Counter(seen).items() if c > 1]
    assert not repeated, repeated[:5]
    assert 0 <= epoch - len(seen) < 4 * batch  # what the last world's partial global batch leaves


def _even_keys_only(sample):
    return sample if key_index(sample["__key__"]) % 2 == 0 else None


def test_a_users_filter_stage_interrupted_and_resumed_equals_an_uninterrupted_pass(data):
    """A stage of the user's that drops samples sits inside the chain: counts run over the
    positions it saw, so the resumed stream filters exactly what the whole pass would."""
    def stream(**kw):
        return stream_for(data, sample_stages=[_even_keys_only], **kw)

    whole = keys(make_loader(stream(), 2))
    assert whole and all(key_index(k) % 2 == 0 for b in whole for k in b)
    first = stream()
    head = keys(make_loader(first, 2), 5)
    again = stream()
    loader = make_loader(again, 2)
    again.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert head + keys(loader) == whole


def _random_flip(sample):
    """An augmentation of the user's, drawn from the sample's own seed."""
    if np.random.default_rng(sample["__seed__"]).random() < 0.5:
        sample["image"] = sample["image"][:, :, ::-1]
    return sample


def test_a_random_stage_drawn_from_the_samples_seed_resumes_exactly(data):
    """`__seed__` is a pure function of where the sample stands in its slot: the same
    sample gets the same flip after a resume, here and on another world."""
    def batches(loader, n=None):
        out = []
        for b in itertools.islice(loader, n):  # a checksum that a flip changes: columns weighted by position
            image = b["image"].double()
            out.append((list(b["key"]), (image * torch.arange(image.shape[-1])).flatten(1).sum(1).tolist()))
        return out

    def stream(rank=0, world=1):
        return stream_for(data, rank, world, sample_stages=[_random_flip])

    whole = batches(make_loader(stream(), 2))
    first = stream()
    head = batches(make_loader(first, 2), 5)
    state = json.loads(json.dumps(first.state_dict()))
    again = stream()
    loader = make_loader(again, 2)
    again.load_state_dict(state)
    assert head + batches(loader) == whole
    flipped = dict((k, v) for ks, vs in whole for k, v in zip(ks, vs))
    plain = dict((k, v) for ks, vs in batches(make_loader(stream_for(data), 2)) for k, v in zip(ks, vs))
    assert 0 < sum(flipped[k] != plain[k] for k in flipped) < len(flipped)  # some flipped, not all
    moved = {}
    for r in range(2):  # the rest of the epoch on 2 ranks: each sample as the whole pass drew it
        s = stream(r, 2)
        loader = make_loader(s, 1)
        s.load_state_dict([state])
        moved.update((k, v) for ks, vs in batches(loader) for k, v in zip(ks, vs))
    common = [k for k in moved if k in flipped]
    assert len(common) > len(moved) // 2 and all(moved[k] == flipped[k] for k in common)


@pytest.mark.slow
def test_after_another_world_a_same_world_resume_continues_exactly(data):
    """2 ranks x 2 workers, then the rest on 3 ranks, stopped after 3 batches and resumed
    on the same 3 ranks: the re-dealt segment is kept in the state, and goes on exactly."""
    states = []
    for r in range(2):
        s = stream_for(data, r, 2)
        keys(make_loader(s, 2), 5)
        states.append(json.loads(json.dumps(s.state_dict())))
    for r in range(3):
        s = stream_for(data, r, 3)
        loader = make_loader(s, 2)
        s.load_state_dict(states)
        whole = keys(loader)
        s = stream_for(data, r, 3)
        loader = make_loader(s, 2)
        s.load_state_dict(states)
        head = keys(loader, 3)
        state = json.loads(json.dumps(s.state_dict()))
        s = stream_for(data, r, 3)
        loader = make_loader(s, 2)
        s.load_state_dict(state)
        assert head + keys(loader) == whole, r


@pytest.fixture(scope="module")
def two_rank_states(data):
    """Both ranks' states of a 2-rank, 2-worker stream after 5 batches, through JSON."""
    states = []
    for r in range(2):
        s = stream_for(data, r, 2)
        keys(make_loader(s, 2), 5)
        states.append(json.loads(json.dumps(s.state_dict())))
    return states


def _set(rank, field, value):
    def edit(states):
        for r in range(len(states)) if rank is None else [rank]:
            states[r][field] = value
    return edit


def _segment(rank, field, value):
    def edit(states):
        for r in range(len(states)) if rank is None else [rank]:
            states[r]["segment"][field] = value
    return edit


def _entry(field, value):
    def edit(states):
        states[0]["ranks"][0][field] = value
    return edit


def _before(records):
    return _segment(None, "before", records)


HOSTILE_STATES = {  # a checkpoint's stream state is input: each edit must be refused in one line
    "sources missing": (lambda st: st[0].__delitem__("sources"), "field sources missing"),
    "listings missing": (lambda st: st[0].__delitem__("listings"), "field listings missing"),
    "a field missing": (lambda st: st[0].__delitem__("segment"), "field segment missing"),
    "version of another release": (_set(None, "version", 3), "version 3, expected 4"),
    "world a string": (_segment(None, "world", "2"), "segment world"),
    "workers a string": (_segment(None, "workers", "2"), "segment workers"),
    "workers enormous": (_segment(None, "workers", 10 ** 9), "segment workers"),
    "rank twice": (lambda st: st[1]["ranks"][0].update(rank=0), "rank 0 appears twice"),
    "rank outside the world": (lambda st: st[1]["ranks"][0].update(rank=7), "stream state rank"),
    "segments differ across ranks": (_segment(1, "batches", 41), "disagree on segment"),
    "batches beyond the spans": (_segment(None, "batches", 10 ** 6), "batches: 1000000, where its worlds and what "
                                                                      "they consumed make 40"),
    "batches negative": (_segment(None, "batches", -5), "segment batches"),
    "generation of a re-dealt segment": (_segment(None, "generation", 1), "generation: 1, where"),
    "done differs across ranks": (_set(0, "done", 2), "disagree on how many batches"),
    "done beyond the segment": (_set(None, "done", 1000), "stream state done: 1000"),
    "done a string": (_set(None, "done", "5"), "stream state done"),
    "passed past the run": (_entry("passed", [[0, [10 ** 6, 0]]]), "does not match its numbers"),
    "passed a string": (_entry("passed", [[0, ["1", 0]]]), "rank 0 passed of 0"),
    "passed for three sources": (_entry("passed", [[0, [1, 0, 0]]]), "rank 0 passed of 0"),
    "passed of a worker outside the segment": (_entry("passed", [[2, [1, 0]]]), "rank 0 passed"),
    "passed listed twice": (_entry("passed", [[0, [1, 0]], [0, [1, 0]]]), "listed twice"),
    "passed not a list": (_entry("passed", {"0": [1, 0]}), "rank 0 passed"),
    # consistent in themselves, but not what state_dict wrote: the check refuses them
    "passed inside the run": (_entry("passed", [[0, [20, 0]]]), "does not match its numbers"),
    "done moved back on every rank": (_set(None, "done", 3), "does not match its numbers"),
    "check missing": (lambda st: [st[0]["ranks"][0].pop("check"), None][1], "does not match its numbers"),
    "epoch a string": (_set(None, "epoch", "0"), "stream state epoch"),
    "targets of other weights": (_set(None, "targets", [600, 40]), "weights or the epoch's samples changed"),
    "listings of other shards": (_set(None, "listings", ["0" * 64, "1" * 64]), "other shards of source mnist"),
    "listings for one source": (_set(None, "listings", ["0" * 64]), "one shard-list digest per source"),
    "before not a list": (_before(5), "segment before"),
    "before too long": (_before([{}] * (1 + (1 << 12))), "at most 4096 earlier segments"),
    "before of a world of text": (_before([{"world": "2", "workers": 2, "batch_size": 8, "done": 1, "passed": []}]),
                                  r"segment before\[0\] world"),
    "before done past its segment": (_before([{"world": 2, "workers": 2, "batch_size": 8, "done": 41,
                                               "passed": []}]), r"segment before\[0\] done: 41"),
    "before a record the segment does not count": (_before([{"world": 2, "workers": 2, "batch_size": 8, "done": 1,
                                                  "passed": [[3, [10 ** 6, 0]]]}]), "generation: 0, where"),
    "before passed of a pair outside": (_before([{"world": 2, "workers": 2, "batch_size": 8, "done": 1,
                                                  "passed": [[4, [1, 0]]]}]), r"before\[0\] passed"),
    "seed differs across ranks": (_set(1, "seed", 5), "disagree on seed"),
    "ranks not a list": (lambda st: [{**st[0], "ranks": 5}], "ranks: a list"),
    "no states": (lambda st: [], "non-empty list"),
    "not a mapping": (lambda st: [1, 2], "a mapping"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE_STATES))
def test_a_hostile_stream_state_is_refused_in_one_line(data, two_rank_states, name):
    edit, match = HOSTILE_STATES[name]
    states = json.loads(json.dumps(two_rank_states))
    got = edit(states)
    state = states if got is None else got
    s = stream_for(data, 0, 2)
    make_loader(s, 2)
    s.load_state_dict(json.loads(json.dumps(two_rank_states)))  # the unedited states are taken
    with pytest.raises(ValueError, match=match) as e:
        s.load_state_dict(state)
    assert "\n" not in str(e.value)


def test_a_state_of_another_batch_size_is_re_dealt_not_run_as_it_was(data):
    """The same world with another batch size: what is left is cut into this stream's
    batches (as on another world), not run for the old batch count, and no key repeats."""
    states, seen = [], []
    for r in range(2):
        s = MixedStream(sources(data), WEIGHTS, 4, Topology(r, 2), seed=4, shuffle_buffer=30, epoch_samples=640)
        seen += [k for b in keys(make_loader(s, 2), 5) for k in b]  # 5 of 80 batches of 4: 600 samples left
        states.append(json.loads(json.dumps(s.state_dict())))
    after = []
    for r in range(2):
        s = stream_for(data, r, 2)
        loader = make_loader(s, 2)
        said = s.load_state_dict(states)
        assert said == {"deal": "re-deal", "generation": 1, "from": [2, 2, 4], "to": [2, 2, 8], "passed": {0: 0, 1: 0}}
        assert s.remaining() == 600 // 16
        after += [k for b in keys(loader) for k in b]
    assert len(after) == 592 and len(set(seen + after)) == 632


def test_a_source_whose_manifest_lists_no_samples_is_one_line(data):
    """Every slot of it would be empty, with none to borrow (a ZeroDivisionError before)."""
    import dataclasses

    mnist, cifar = sources(data)
    empty = dataclasses.replace(cifar, counts=[0] * len(cifar.counts))
    with pytest.raises(ValueError, match="cifar10: its manifest lists no samples"):
        keys(make_loader(MixedStream([mnist, empty], WEIGHTS, 8, seed=4, epoch_samples=64), 0))


def test_another_world_needs_every_ranks_state(data):
    s = stream_for(data, 0, 2)
    keys(make_loader(s, 0), 2)
    with pytest.raises(ValueError, match="needs every rank's stream state"):
        stream_for(data, 0, 3).load_state_dict([s.state_dict()])


# ---------------------------------------------------------------- the trainer under torchrun


def run_ok(proc, timeout=HANG):
    code, err = finish(proc, timeout)
    assert code == 0, err[-3000:]


def common(data, out):
    return mid_epoch_args(data, out, "--checkpoint-every", "3")


def metrics(out):
    """The run's figures, without the line a resume adds to say where it began."""
    lines = [json.loads(ln) for ln in open(os.path.join(out, "metrics.jsonl"))]
    for ln in lines:
        ln.pop("samples_per_s", None)
    return [ln for ln in lines if ln["kind"] != "resumed"]


def key_log(out, world):
    return {r: read_keys(os.path.join(out, f"keys-rank{r}.txt")) for r in range(world)}


def position(out):
    import torch

    try:
        state = torch.load(os.path.join(out, "checkpoint.pt"), weights_only=True)
    except (OSError, RuntimeError, EOFError):
        return None
    return json.loads(state["position"])


@pytest.mark.slow
@pytest.mark.xdist_group("mid-epoch-runs")  # shares the session's uninterrupted run with test_preempt
def test_killed_inside_an_epoch_and_resumed_matches_the_uninterrupted_run(data, uninterrupted_run, tmp_path):
    whole = uninterrupted_run
    out = tmp_path / "run"
    proc = launch_train(common(data, out), 2)
    t0 = time.time()
    while not ((position(out) or {}).get("step", 0) >= 9):  # a checkpoint inside epoch 1 (40 steps)
        assert proc.poll() is None and time.time() - t0 < HANG, "no mid-epoch checkpoint"  # a hang guard
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    assert position(out)["mid"] and position(out)["epoch"] == 0
    run_ok(launch_train([*common(data, out), "--resume"], 2))
    assert metrics(out) == metrics(whole)
    assert key_log(out, 2) == key_log(whole, 2)
    s, w = (json.loads((d / "summary.json").read_text()) for d in (out, whole))
    assert s["eval"] == w["eval"] and s["resumed_from"]["step"] >= 9
    resumed = [json.loads(ln) for ln in open(out / "metrics.jsonl") if '"resumed"' in ln]
    assert [(r["step"], r["world"]) for r in resumed] == [(s["resumed_from"]["step"], 2)]  # the report marks it


@pytest.mark.slow
@pytest.mark.parametrize("world", [3, 1])
@pytest.mark.xdist_group("mid-epoch-runs")  # resumes test_preempt's run, stopped by SIGTERM
def test_resumed_on_another_world_size_no_sample_twice_in_the_epoch(data, sigterm_stopped, world):
    out, as_stopped, _ = sigterm_stopped
    put_back(out, as_stopped)
    done = position(out)["step"]
    assert position(out) == {"epoch": 0, "mid": True, "step": done, "seen": done * 16} and 4 <= done < 40
    # --checkpoint-every: checkpoints written on the new world too (the stopped run wrote only the signal's)
    run_ok(launch_train([*mid_epoch_args(data, out, "--checkpoint-every", "3"), "--resume"], world))
    s = json.loads((out / "summary.json").read_text())
    assert s["world_size"] == world and s["epochs_done"] == 2
    lines = [ln for r in range(max(2, world)) for ln in key_log(out, max(2, world)).get(r, [])]
    first = [k for e, k in lines if e == 1]
    assert len(first) == len(set(first)), "a sample read twice in the interrupted epoch"
    left = 640 - done * 16
    assert len(first) == done * 16 + left // (world * 8) * world * 8
    assert s["epochs"][0]["batches"] == {f"rank{r}": left // (world * 8) for r in range(world)}
    assert set(s["epochs"][0]["before_resume"]) == {"before_resume_rank0", "before_resume_rank1"}


@pytest.mark.slow
@pytest.mark.parametrize("before, after, stop", [((2, 1), (3, 1), 13), ((3, 1), (2, 1), 9), ((1, 1), (1, 2), 5),
                                                 ((1, 1), (2, 1), 5)])
def test_the_trainer_resumed_on_another_world_reads_no_sample_twice(one_source, tmp_path, before, after, stop):
    """torchrun, --record-keys: stopped after `stop` steps on `before` (ranks, workers),
    resumed on `after`: over the epoch no key twice, fewer unread than one global batch."""
    out = tmp_path / "run"
    args = ["--train", f"mnist={one_source}/", "--batch-size", "16", "--epochs", "1", "--width", "4",
            "--record-keys", "--out", str(out)]
    run_ok(launch_train([*args, "--workers", str(before[1]), "--checkpoint-every", str(stop),
                         "--stop-after-steps", str(stop)], before[0]))
    assert position(out)["step"] == stop
    run_ok(launch_train([*args, "--workers", str(after[1]), "--resume"], after[0]))
    world = max(before[0], after[0])
    keys = [k for r in range(world) for _, k in key_log(out, world).get(r, [])]
    assert len(keys) == len(set(keys)), "a sample read twice in the epoch"
    assert 0 <= 1200 - len(keys) < after[0] * 16


@pytest.mark.slow
def test_a_rank_left_out_by_a_smaller_world_keeps_its_key_log_when_the_world_grows_again(one_source, tmp_path):
    """2 ranks, then 1, then 2 again inside one epoch (the hostile review: the 1-rank checkpoint
    counted rank 0's key lines only, so rank 1's log was emptied when rank 1 came back, and 40 of
    its keys were lost): every key of the epoch once, fewer unread than one global batch."""
    out = tmp_path / "run"
    args = ["--train", f"mnist={one_source}/", "--batch-size", "16", "--epochs", "1", "--width", "4",
            "--record-keys", "--out", str(out), "--workers", "1"]
    run_ok(launch_train([*args, "--stop-after-steps", "5", "--checkpoint-every", "5"], 2))
    run_ok(launch_train([*args, "--stop-after-steps", "5", "--checkpoint-every", "5", "--resume"], 1))
    state = torch.load(out / "checkpoint.pt", weights_only=True)
    limits = checkpoint.Limits(epochs=1, epoch_samples=1200, batch_size=16, sources=1)
    counts = checkpoint.trainer_state(state, "ckpt.pt", limits)["key_counts"]
    assert counts == [80 + 80, 80], counts  # rank 0: 5 steps on 2 ranks, then 5 alone; rank 1 carried
    for edited in ([counts[0], counts[1] - 30], [counts[0] - 50, counts[1]]):  # the hostile re-attack's
        with pytest.raises(ValueError, match="key_counts"):
            checkpoint.trainer_state(dict(state, key_counts=json.dumps(edited)), "ckpt.pt", limits)
    # a checkpoint written before the left-out ranks' counts were kept: taken from the run's tallies
    assert checkpoint.trainer_state(dict(state, key_counts=json.dumps(counts[:1])), "ckpt.pt", limits)[
        "key_counts"] == counts
    run_ok(launch_train([*args, "--resume"], 2))
    keys = [k for _, k in key_log(out, 2).get(0, []) + key_log(out, 2).get(1, [])]
    assert len(keys) == len(set(keys)), "a sample read twice in the epoch"
    assert 0 <= 1200 - len(keys) < 2 * 16, f"{1200 - len(keys)} keys unread or lost"


@pytest.mark.parametrize("change", [dict(shuffle_buffer=60), dict(window_bytes=1 << 12), dict(resample=True)])
def test_another_shuffle_window_or_resampling_inside_an_epoch_is_refused(data, change):
    """They decide which sample each position holds: a resume that changed them read 122 of 800
    samples twice (the hostile review). Refused in one line; at an epoch boundary they may change."""
    s = stream_for(data)
    keys(make_loader(s, 0), 3)
    state = json.loads(json.dumps(s.state_dict()))
    with pytest.raises(ValueError, match="which sample each position holds would change") as e:
        stream_for(data, **change).load_state_dict(state)
    assert "\n" not in str(e.value)
    stream_for(data).load_state_dict(state)  # the same settings go on


@pytest.mark.slow
@pytest.mark.parametrize("before, after, stop", [(2, 1, 2), (1, 2, 4)])
def test_skipped_over_a_resume_on_another_world_counts_each_damaged_position_once(tmp_path, before, after, stop):
    """torchrun, 40 samples of which 10 lack their image, batches of 4, 2 workers: stopped after
    `stop` steps on `before` ranks (16 samples read), resumed on `after`: the epoch's
    skipped_samples is 10, each damaged position once over both worlds, and its 40 keys hold
    no damaged one."""
    from helpers import png_set_then_damage

    manifest, _ = png_set_then_damage(tmp_path)
    out = tmp_path / "run"
    args = ["--train", f"web={manifest}", "--epochs", "1", "--batch-size", "4", "--epoch-samples",
            "40", "--workers", "2", "--width", "4", "--on-error", "skip", "--record-keys", "--out", str(out)]
    run_ok(launch_train([*args, "--checkpoint-every", str(stop), "--stop-after-steps", str(stop)], before))
    assert position(out)["step"] == stop
    run_ok(launch_train([*args, "--resume"], after))
    keys = [k for r in range(2) for _, k in key_log(out, 2).get(r, [])]
    assert len(keys) == 40 and not {f"s{i:02d}" for i in range(0, 40, 4)} & set(keys), sorted(keys)
    assert json.loads((out / "summary.json").read_text())["skipped_samples"] == 10


@pytest.mark.parametrize("lines, missing", [
    (['{"kind": "eval", "epoch": 1, "accuracy": 0.5}'], False),
    (['{"kind":"eval","epoch":1}'], False),  # compact JSON is the same record (hostileP 3)
    (['{"kind": "eval", "epoch": 2}'], True),
    (['[{"kind": "eval", "epoch": 1}]'], True),  # not a record: damaged, evaluated again (hostileP 2)
    (['{"kind": "eval", "ep'], True),  # cut in half
    (['{"kind": "train", "epoch": 1}', "garbage", '{"kind": "eval", "epoch": 1}'], False),
    ([], True),
])
def test_a_resume_evaluates_the_saved_epoch_only_where_its_eval_line_is_missing(tmp_path, lines, missing):
    from types import SimpleNamespace

    from pipeline.train.loop import missing_eval

    (tmp_path / "metrics.jsonl").write_text("".join(ln + "\n" for ln in lines))
    args, topo = SimpleNamespace(out=str(tmp_path)), SimpleNamespace(is_main=True)
    run = SimpleNamespace(in_epoch=False, epoch=1)
    assert missing_eval(args, topo, run, ckpt="ckpt") is missing
