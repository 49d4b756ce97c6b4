"""The stream's place is one immutable cursor (pipeline/data/streams/cursor.py) that set_epoch,
load_state_dict and set_workers each replace whole. For random sequences of those calls and of
partial and full passes, at every step: a new stream given only the cursor (and the batches that
arrived under its plan) yields exactly what the stream yields, and both yield exactly what a
fresh stream yields that reached the same place by the shortest calls (its workers, then the
epoch set or the state loaded, then the batches read since), so nothing outside the cursor
steers the stream and each call builds the cursor it should. A refused call (bad arguments
interleaved at random too) leaves the cursor it found and the batches arrived under it."""
import dataclasses
import json

import numpy as np
import pytest

from helpers import read_pass, two_small_sources
from pipeline.data.streams.cursor import Cursor
from pipeline.data.streams.stream import MixedStream

BATCH = 10
EPOCH = 30  # batches an epoch (300 samples)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    return two_small_sources(tmp_path_factory.mktemp("cursor"))


def new_stream(sources):
    return MixedStream(sources, {"a": 2.0, "b": 1.0}, BATCH, seed=7, shuffle_buffer=50, epoch_samples=EPOCH * BATCH)


def at_cursor(sources, stream):
    """A new stream given only `stream`'s cursor and the batches that arrived under its plan."""
    twin = new_stream(sources)
    twin.cursor, twin.arrived = stream.cursor, dict(stream.arrived)
    return twin


@dataclasses.dataclass
class Route:
    """Where the stream should stand, as the shortest calls on a fresh stream: set_workers(workers),
    then set_epoch or load_state_dict (`base`), then `reads` batches in one pass. epoch, finished,
    pinned, given: the documented rules' view, to know which calls are refused."""

    workers: int = 1
    base: tuple = ("epoch", 0)
    reads: int = 0
    epoch: int = 0
    finished: bool = False
    pinned: tuple = None
    given: bool = False
    deep: dict = None

    def fresh(self, sources):
        s = new_stream(sources)
        s.set_workers(self.workers)
        kind, arg = self.base
        s.set_epoch(arg) if kind == "epoch" else s.load_state_dict(arg)
        if self.reads:
            assert read_pass(s, self.reads)[1] == self.reads
        return s

    def restart(self, base, epoch):
        self.base, self.reads, self.epoch, self.finished = base, 0, epoch, False


def check_same_place(sources, stream, route, what):
    twin, fresh = at_cursor(sources, stream), route.fresh(sources)
    assert twin.remaining() == fresh.remaining(), what
    assert twin.state_dict() == fresh.state_dict(), what
    assert read_pass(twin)[0] == read_pass(fresh)[0], f"{what}: the next pass differs"


def refused(stream, call, match):
    before, arrived = stream.cursor, dict(stream.arrived)
    with pytest.raises(ValueError, match=match):
        call()
    assert stream.cursor is before and stream.arrived == arrived, "a refused call changed the cursor"


def nested(depth):
    out = {}
    for _ in range(depth):
        out = {"x": out}
    return out


BAD_CALLS = [  # (what, call(stream, route), the refusal's words)
    ("set_epoch(-1)", lambda s, r: s.set_epoch(-1), r"set_epoch\(-1\): the epoch is an integer"),
    ("set_epoch(1.5)", lambda s, r: s.set_epoch(1.5), r"set_epoch\(1.5\): the epoch is an integer"),
    ("set_epoch(None)", lambda s, r: s.set_epoch(None), r"set_epoch\(None\): the epoch is an integer"),
    ("set_epoch(True)", lambda s, r: s.set_epoch(True), r"set_epoch\(True\): the epoch is an integer"),
    ("set_epoch(nan)", lambda s, r: s.set_epoch(float("nan")), r"set_epoch\(nan\): the epoch is an integer"),
    ("set_epoch(2**53+1)", lambda s, r: s.set_epoch(2 ** 53 + 1), r"the epoch is an integer in 0\.\."),
    ("set_epoch(e, [1, 1])", lambda s, r: s.set_epoch(r.epoch, [1, 1]), r"weights are a dict"),
    ("set_workers(-1)", lambda s, r: s.set_workers(-1), r"set_workers\(-1\): loader workers per rank"),
    ("set_workers(2.0)", lambda s, r: s.set_workers(2.0), r"set_workers\(2.0\): loader workers per rank"),
    ("set_workers('2')", lambda s, r: s.set_workers("2"), r"set_workers\('2'\): loader workers per rank"),
    ("set_workers(2000)", lambda s, r: s.set_workers(2000), r"set_workers\(2000\): loader workers per rank"),
    ("load(deep)", lambda s, r: s.load_state_dict(r.deep), "nested too deep"),
]


def step(sources, stream, route, saved, rng, log):
    op = rng.choice(["read", "read", "epoch", "workers", "workers", "save", "load", "len", "len", "bad"])
    if op == "bad":
        what, call, match = BAD_CALLS[int(rng.integers(0, len(BAD_CALLS)))]
        log.append(what)
        if what == "load(deep)":  # its own state with a key nested deep (the plan made now, as len() makes it)
            route.deep = dict(stream.state_dict(), extra=nested(5000))
        return refused(stream, lambda: call(stream, route), match)
    if op == "len":  # as a loop sized by len() asks: the plan is made now, before the next call
        log.append("len")
        assert len(stream) == route.fresh(sources).remaining(), " -> ".join(log)
    elif op == "read":
        if route.finished:  # a pass after a finished epoch reads the next
            route.restart(("epoch", route.epoch + 1), route.epoch + 1)
        left = stream.remaining()
        most = left if rng.random() < 0.3 else int(rng.integers(1, left + 1))
        log.append(f"read {most}")
        ahead = read_pass(at_cursor(sources, stream), most)[0]
        assert read_pass(stream, most)[0] == ahead, f"{' -> '.join(log)}: the stream read other batches than its twin"
        route.reads += most
        route.finished, route.pinned = most == left, None
    elif op == "epoch":
        epoch = int(rng.choice([route.epoch, route.epoch + 1, int(rng.integers(0, 4))]))
        log.append(f"set_epoch({epoch})")
        if route.pinned is not None:
            saved_epoch, ended = route.pinned
            if epoch not in ((saved_epoch, saved_epoch + 1) if ended else (saved_epoch,)):
                return refused(stream, lambda: stream.set_epoch(epoch), "set_epoch after load_state_dict")
        elif epoch != route.epoch or route.finished:
            route.restart(("epoch", epoch), epoch)
        stream.set_epoch(epoch)
        route.given = True
    elif op == "workers":
        n = int(rng.integers(1, 4))
        log.append(f"set_workers({n})")
        if n != route.workers and route.reads:  # the epoch's rest dealt again: as its state loaded on n workers
            state = stream.state_dict()
            route.restart(("load", state), route.epoch + route.finished)
        stream.set_workers(n)
        route.workers = n
    elif op == "save":
        log.append("save")
        saved.append((json.loads(json.dumps(stream.state_dict())), route.epoch, route.finished))
    elif op == "load" and saved:
        state, epoch, ended = saved[int(rng.integers(0, len(saved)))]
        log.append(f"load (epoch {epoch}{', ended' if ended else ''})")
        if route.given and route.pinned is None and route.epoch not in ((epoch, epoch + 1) if ended else (epoch,)):
            return refused(stream, lambda: stream.load_state_dict(state), "load_state_dict after set_epoch")
        stream.load_state_dict(state)
        route.restart(("load", state), epoch + ended)
        route.pinned = (epoch, ended)


@pytest.mark.parametrize("case", range(16))
def test_any_calls_leave_the_stream_where_a_fresh_stream_at_its_cursor_and_by_the_shortest_route_is(sources, case):
    rng = np.random.default_rng(case)
    stream, route, saved, log = new_stream(sources), Route(), [], []
    for _ in range(16):
        step(sources, stream, route, saved, rng, log)
        check_same_place(sources, stream, route, " -> ".join(log))


def test_the_cursor_is_one_value_no_call_changes_in_place(sources):
    stream = new_stream(sources)
    first = stream.cursor
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.epoch = 3
    read_pass(stream, 4)
    stream.set_epoch(2)
    stream.set_workers(2)
    assert (first.epoch, first.workers, first.plan) == (0, 1, None) and isinstance(stream.cursor, Cursor)
    assert (stream.epoch, stream.workers) == (2, 2)


def test_new_weights_refused_inside_an_epoch_leave_the_cursor_and_weights_as_they_were(sources):
    stream = new_stream(sources)
    read_pass(stream, 3)
    refused(stream, lambda: stream.set_epoch(0, {"a": 1.0, "b": 1.0}), r"set_epoch\(0, weights\) inside epoch 0")
    assert stream.weights == {"a": 2 / 3, "b": 1 / 3}
