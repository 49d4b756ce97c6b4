"""A pair's run of a source's positions as the windows that hold them: `RunPlan` for training
(its reserve and, past that, later passes), `OncePlan` for evaluation (each shard once), and
`split`, a rank's and worker's share of a list."""
from dataclasses import dataclass

import numpy as np

from pipeline.ordering import order
from pipeline.ordering.topology import stride


def split(urls, topo, worker):
    """This (rank, worker)'s shards for evaluation: the islice rule of `wds.split_by_node`,
    then `wds.split_by_worker`, with the rank and worker handed in (topology.stride)."""
    first, step = stride(topo.rank, topo.world, worker.id, worker.count)
    return list(urls)[first::step]


@dataclass(frozen=True)
class Window:
    """Shards read and shuffled together, and which of its places a chain takes.

    rows: (url, lo, hi) sample ranges of shards in their own order (hi None: to the end);
    key: the shuffle's generator key (None: read in order); places skip..size of the
    window's shuffled order are taken, the first of them being the run's position
    `start`. Two windows with the same rows and key hold the same samples in the same
    order (`same`), so a chain reads and shuffles them once. `spare`: its places lie past the
    pair's run (its reserve, later passes), read only to replace samples passed over there;
    a damaged sample met here is not counted again (`skipped` counts the damaged samples at
    the epoch's own positions, whatever the workers)."""

    rows: tuple
    key: tuple = None
    start: int = 0
    size: int = None
    skip: int = 0
    spare: bool = False

    def same(self, other):
        return other is not None and (other is self or (other.rows == self.rows and other.key == self.key))


class RunPlan:
    """The windows one (rank, worker) reads of one source: its run of the epoch's positions
    (pipeline.ordering.deal), window by window (pipeline.ordering.order), from `at` positions in.

    Each window is read whole and its positions taken where the run holds them. A pair that
    passed over damaged samples and still owes samples goes on into its `reserve`
    (deal.Segment.reserves: positions no other pair reads); past that too, it reads the same
    places of its run and reserve `beyond` positions further on, then twice that, ... (later
    passes, shuffled anew: samples that repeat, where a pair whose places all held damaged
    samples finds good ones, while any is readable). `beyond` is past every position a pair
    of the epoch reads, the same for all, so no two pairs read one position: twice the epoch's
    target and a pass (MixedStream) (None: the run again).
    """

    def __init__(self, order, urls, run, at=0, reserve=(), beyond=None):
        self.order, self.urls, self.run = order, list(urls), list(run) + list(reserve)
        self.beyond = beyond or 0
        self.own = sum(n for _, n in run)  # the run proper: what is fetched ahead
        self.ends = np.cumsum([n for _, n in self.run]) if self.run else np.zeros(0, np.int64)
        self.length = int(self.ends[-1]) if self.run else 0
        self.reset(at)

    def reset(self, at=None):
        self.at, self.current = int(at or 0), None

    def next(self):
        """The window holding the run's next position (the current one counts as read)."""
        if self.current is not None:
            w = self.current
            self.at = w.start + w.size - w.skip
        if not self.length:
            raise StopIteration
        self.current = self._window_at(self.at)
        return self.current

    def _window_at(self, at):
        rounds, place = divmod(at, self.length)  # past the run's end only after damage
        k = int(np.searchsorted(self.ends, place, side="right"))
        start, n = self.run[k]
        position = start + place - (int(self.ends[k]) - n) + rounds * self.beyond
        q, j, offset = self.order.locate(position)
        shards, size, key = self.order.window_of(q, j)
        take = min(size - offset, int(self.ends[k]) - place)
        rows = tuple((self.urls[i], 0, None) for i in shards.tolist())
        return Window(rows, key, start=at, size=offset + take, skip=offset, spare=at >= self.own)

    def upcoming(self):
        """The windows after the current one, to the run's end: what a reader fetches ahead.
        It stops at the run's end, where only damage makes a pair read its reserve."""
        w = self.current
        at = self.at if w is None else w.start + w.size - w.skip
        while at < self.own:
            w = self._window_at(at)
            yield w
            at = w.start + w.size - w.skip

    def state(self, pos=0):
        """Positions of the run read: the current window counted `pos` positions past its start."""
        w = self.current
        return self.at if w is None else w.start + min(pos, w.size - w.skip)


class OncePlan:
    """Evaluation: each of the pair's shards once, whole and in order."""

    def __init__(self, urls):
        self.urls = list(urls)
        self.reset()

    def next(self):
        self.at += 1
        return self.windows[self.at - 1] if self.at <= len(self.windows) else None

    def upcoming(self):
        return iter(self.windows[self.at:])

    def state(self, pos=0):
        return {}

    def reset(self, state=None):
        self.windows, self.at = [Window(((u, 0, None),)) for u in self.urls], 0
