"""Who reads which positions: an epoch's samples dealt to (rank, worker) pairs, exactly.

An epoch asks each source for `targets[s]` positions (pipeline.ordering.order): the
epoch's samples split by the mixture weights. A `Segment` is the part of an epoch one
world runs: per source a list of spans of those positions still to read, and the
world (ranks, workers, batch size) that reads them. It reads `batches` batches per
rank; their samples are split between the sources in proportion to what each has left
(`quotas`), and between the pairs so that each pair's mix is exact (a seeded draw
without replacement), and every pair reads one contiguous run of each source's spans.
No position is given to two pairs, and what a segment leaves is less than one global
batch.

The pairs are listed in the order `wds.split_by_node` then `wds.split_by_worker`
deal a list: item i belongs to rank i % world, worker i // world, so a (rank, worker)
finds its own item by calling them (pipeline.ordering.topology).

When a run stops, each pair has read a prefix of its runs. Resuming on the same world
goes on from there with the same segment; on another world, what each pair left, and
what no pair was given, become the spans of the next segment (`Segment.after`). The
state is small: the worlds the epoch ran on, the batches each made and the positions
its pairs passed over (damaged samples, samples a stage dropped), kept in the segment's
`history`; its spans, the pairs' runs and positions are recomputed from them
(`replay`), so no span is ever offered on its own.
"""
import functools
from dataclasses import dataclass, replace

import numpy as np

from pipeline.ordering import order

BLOCK = 1 << 12  # a pair's source choices are drawn in blocks of this many samples (a resume draws one)


@dataclass(frozen=True)
class Segment:
    epoch: int
    generation: int
    world: int
    workers: int
    batch_size: int
    batches: int  # per rank
    spans: tuple  # per source: ((start, length), ...) of the epoch's positions, in order
    seed: int = 0
    passes: tuple = ()  # per source, positions in a pass (its samples); 0: passes of other lengths (resampled)
    history: tuple = ()  # per earlier segment of the epoch: (world, workers, batch_size, done, passed), see `after`
    owed: tuple = ()  # per source, the samples the epoch still owes (a re-dealt segment); () : what its spans hold

    @property
    def pairs(self):
        return self.world * self.workers

    def left(self):
        """Positions of each source the segment's spans hold."""
        return np.array([sum(n for _, n in s) for s in self.spans], np.int64)

    def worker_batches(self, worker):
        """Batches one worker of each rank makes: a rank's batches dealt round-robin."""
        return self.batches // self.workers + (worker < self.batches % self.workers)

    @functools.cached_property
    def _quotas(self):
        sizes = [self.worker_batches(i // self.world) * self.batch_size for i in range(self.pairs)]
        rng = order.generator(order.QUOTA, self.seed, self.epoch, self.generation)
        return order.split_exactly(rng, self.shares(), sizes)

    def quotas(self):
        """(P x S) samples each pair takes of each source, rows in split order."""
        return self._quotas

    def shares(self):
        """Samples of each source the segment reads: its spans split by what each holds,
        leaving unread only positions of a source's last pass where it can (so that no
        sample is read again while one of its pass is not), the highest first."""
        if self.owed:  # a re-deal: what the earlier worlds still owed of each source (their passed-over
            # positions no longer count), read from the spans and, where they fall short, the reserves
            return order.apportion(self.batches * self.world * self.batch_size, self.owed)
        left = self.left()
        wanted = order.apportion(self.batches * self.world * self.batch_size, left)
        unread = left - wanted
        room = np.array([_last_pass(spans, n) if n else r for spans, n, r in
                         zip(self.spans, self.passes or [0] * len(left), left)], np.int64)
        over = int(np.maximum(unread - room, 0).sum())
        if over and int(np.minimum(unread, room).sum()) + over <= int(room.sum()):
            unread = np.minimum(unread, room)
            for s in np.argsort(unread - room):  # the sources with the most room take the rest
                more = min(over, int(room[s] - unread[s]))
                unread[s] += more
                over -= more
        return left - unread

    def runs(self, pair):
        """Per source, the spans of epoch positions pair `pair` reads, in order: its run."""
        q = self.quotas()
        before = q[:pair].sum(axis=0)
        return [cut(spans, int(a), int(a + n)) for spans, a, n in zip(self.spans, before, q[pair])]

    def reserves(self, pair, targets):
        """Per source, the positions pair `pair` reads after its run, in place of the samples it
        passed over (damaged, or dropped by a stage), so that they come from samples no pair reads
        this epoch: its share of what the segment's runs leave of its spans, then of the positions
        after the epoch's target to the end of that pass; each part is cut between the pairs in
        proportion to their quotas. A pair that needs more (a damaged shard in its run) goes on
        into the next SPILL pairs' shares of those: into the k-th of a share's len(others) pieces
        counted from its end when it is the owner's k-th pair before, each piece read from its
        end while the owner reads the share from its start, so the two meet only once the share
        is used up (to a piece of it), and no third pair reads a position of it (when every pair
        passed over most of its run, all of them spilling, a position is read twice at most);
        then into its share of the next pass (a repeat, once the pass was read). `targets`: the
        epoch's positions of each source."""
        q = self.quotas()
        others = [(pair + k) % self.pairs for k in range(1, min(self.pairs, SPILL + 1))]
        out = []
        for s, (spans, t) in enumerate(zip(self.spans, targets)):
            unread, this_pass, next_pass = self._pools(s, int(t), q[:, s], [pair, *others])
            spill = [span for k, o in enumerate(others, 1) for part in (unread, this_pass)
                     for span in _from_the_back(_piece(part[o], k, len(others)))]
            out.append(unread[pair] + this_pass[pair] + spill + next_pass[pair])
        return out

    def _pools(self, s, target, quota, pairs):
        """Source s's unread parts, each cut between all the pairs: {pair: spans} of `pairs`' shares."""
        used, held = int(quota.sum()), int(sum(n for _, n in self.spans[s]))
        length = int(self.passes[s]) if self.passes else 0
        after = (-target) % length if length else target  # to the end of the target's pass (resampled: as much again)
        parts = [(self.spans[s], used, held), (((target, after),) if after else (), 0, after),
                 (((target + after, length),) if length else (), 0, length)]
        pools = []
        for spans, lo, hi in parts:
            shares = order.apportion(hi - lo, quota) if hi > lo else np.zeros(len(quota), np.int64)
            ends = lo + np.cumsum(shares)
            pools.append({p: cut(spans, int(ends[p] - shares[p]), int(ends[p])) for p in pairs})
        return pools

    def choices(self, pair):
        """The pair's `Choices`: which source each of its samples comes from."""
        return Choices(self.quotas()[pair], (order.MIX, self.seed, self.epoch, self.generation, pair))

    def worker_done(self, worker, done):
        """Batches logical worker `worker` of each rank made when each rank made `done`: the
        workers make their rank's batches in turn, from logical worker 0."""
        return done // self.workers + (worker < done % self.workers)

    def taken(self, pair, done):
        """Samples of each source pair `pair` took when each rank made `done` batches."""
        n = self.worker_done(pair // self.world, done) * self.batch_size
        q = self.quotas()[pair]
        if (q > 0).sum() <= 1:  # one source: no draw needed to know the split
            return np.where(q > 0, min(n, int(q.sum())), 0)
        return self.choices(pair).taken(n)

    def after(self, done, passed, *, world, workers, batch_size):
        """The next segment, on another world, once each rank made `done` batches of this one and
        pair p passed over passed[p] positions of each source without a sample (damage, a stage's
        drops; pairs not listed passed over none). Its spans follow from these counts alone,
        and it keeps them in its `history`, so a state names how it was made, never its spans."""
        taken = [self.taken(p, done) for p in range(self.pairs)]
        read = [t + np.asarray(passed.get(p, 0), np.int64) for p, t in enumerate(taken)]
        record = (self.world, self.workers, self.batch_size, int(done),
                  tuple(sorted((int(p), tuple(int(x) for x in v)) for p, v in passed.items())))
        nxt = self.rest(read, generation=self.generation + 1, world=world, workers=workers, batch_size=batch_size)
        # the samples still owed, not the positions left: positions passed over (damage, a stage's drops)
        # were read without a sample, and the new world makes up for them from its reserves
        owed = (np.asarray(self.owed, np.int64) if self.owed else self.left()) - np.sum(taken, axis=0)
        return replace(nxt, history=self.history + (record,), owed=tuple(int(x) for x in owed),
                       batches=int(owed.sum()) // (world * batch_size))

    def rest(self, read, *, generation, world, workers, batch_size):
        """The next segment, on another world: what every pair left of its runs, then what
        no pair was given, but the places of it that pairs read as their reserve. read: per
        pair (in split order), the positions of each source it read."""
        q = self.quotas()
        spans = []
        for s, mine in enumerate(self.spans):
            ends = np.cumsum(q[:, s])
            done = np.minimum([int(r[s]) for r in read], q[:, s])
            left = [(int(e - n + d), int(e)) for e, n, d in zip(ends, q[:, s], done)]  # each pair's unread places
            used, held = int(ends[-1]) if len(ends) else 0, sum(n for _, n in mine)
            shares = order.apportion(held - used, q[:, s]) if held > used else np.zeros(len(q), np.int64)
            over = [max(0, int(r[s]) - int(n)) for r, n in zip(read, q[:, s])]  # read into the reserve
            for e, n, o in zip(used + np.cumsum(shares), shares, over):  # what no pair was given, less those
                left.append((int(e - n + min(o, n)), int(e)))
            spans.append(merge(sorted(cut_all(mine, sorted(left)))))  # the lowest positions first: the highest go unread
        left = sum(n for s in spans for _, n in s)
        return Segment(self.epoch, generation, world, workers, batch_size, left // (world * batch_size),
                       tuple(spans), self.seed, self.passes)


SPILL = 16  # other pairs' reserves a pair may go on into: its reserve's spans stay few at any world size
PIECES = 16  # a reserve read from its end, in at most this many pieces, each read forward (of 1 where it is short)


def _piece(spans, k, m):
    """The k-th of m near-equal pieces of a share's places, counted from its end (k from 1)."""
    n = sum(size for _, size in spans)
    return cut(spans, n * (m - k) // m, n * (m - k + 1) // m)


def _from_the_back(spans):
    """A share's spans as pieces from its end to its start (each piece in order): what another
    pair takes of it meets what its owner takes from the start only once it is used up."""
    n = sum(k for _, k in spans)
    size = -(-n // PIECES) if n else 0
    return [span for hi in range(n, 0, -size) for span in cut(spans, max(0, hi - size), hi)] if n else []


def first(epoch, targets, *, world, workers, batch_size, batches, seed, passes=()):
    """The segment of an epoch that starts afresh: every source's positions 0..target."""
    spans = tuple(((0, int(t)),) if t else () for t in targets)
    return Segment(epoch, 0, world, workers, batch_size, batches, spans, seed, tuple(passes))


def replay(epoch, targets, history, *, world, workers, batch_size, seed, passes=()):
    """The segment that `history` (Segment.history: each earlier segment's world, the batches a
    rank made of it and the positions its pairs passed over) leads to, on this world: the
    epoch's first segment, re-dealt once per record."""
    worlds = [h[:3] for h in history] + [(world, workers, batch_size)]
    w, k, b = worlds[0]
    seg = first(epoch, targets, world=w, workers=k, batch_size=b, batches=int(sum(targets)) // (w * b), seed=seed,
                passes=passes)
    for (_, _, _, done, passed), (w, k, b) in zip(history, worlds[1:]):
        seg = seg.after(done, dict(passed), world=w, workers=k, batch_size=b)
    return seg


def _last_pass(spans, n):
    """Positions of the spans in the last pass they reach (passes of n positions)."""
    if not spans:
        return 0
    start, length = spans[-1]
    top = (start + length - 1) // n * n
    return sum(max(0, a + k - max(a, top)) for a, k in spans)


def cut_all(spans, ranges):
    """The spans covering each (lo, hi) range of places in the sequence `spans` lists, the
    ranges in order and apart: one walk over the spans for all of them, where a `cut` each
    would walk them once a range (a re-deal of many pairs over many spans)."""
    out, ranges = [], [(lo, hi) for lo, hi in ranges if lo < hi]
    k, at = 0, 0
    for start, n in spans:
        while k < len(ranges) and ranges[k][0] < at + n:
            lo, hi = ranges[k]
            a, b = max(lo, at), min(hi, at + n)
            if a < b:
                out.append((start + a - at, b - a))
            if hi > at + n:
                break  # the range goes on in the next span
            k += 1
        at += n
    return out


def cut(spans, lo, hi):
    """The spans covering places lo..hi of the sequence `spans` lists, in order."""
    out, at = [], 0
    for start, n in spans:
        a, b = max(lo, at), min(hi, at + n)
        if a < b:
            out.append((start + a - at, b - a))
        at += n
        if at >= hi:
            break
    return out


def merge(spans):
    """Adjacent spans joined (a span that goes on where the last ended)."""
    out = []
    for start, n in spans:
        if out and out[-1][0] + out[-1][1] == start:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((start, n))
    return tuple(out)


class Choices:
    """Which source each of a pair's samples comes from: exactly `quota[s]` of source s in
    all, in a seeded random order, drawn block by block so that any sample's choice is
    found without drawing the ones before its block."""

    def __init__(self, quota, key):
        self.quota, self.key = np.asarray(quota, np.int64), key
        total = int(self.quota.sum())
        sizes = [min(BLOCK, total - b) for b in range(0, total, BLOCK)]
        self.blocks = order.split_exactly(order.generator(*key), self.quota, sizes)
        self.every = None
        self._block = (None, None)

    @classmethod
    def unending(cls, probs, key):
        """Draws without a total: every block holds each source's share of BLOCK exactly (largest
        remainders), for a mix of streams that may not end (mix.RandomMix)."""
        self = cls.__new__(cls)
        self.every, self.key, self.quota, self.blocks = order.apportion(BLOCK, probs), key, None, None
        self._block = (None, None)
        return self

    def block(self, b):
        if self._block[0] != b:
            counts = self.blocks[b] if self.every is None else self.every
            labels = np.repeat(np.arange(len(counts), dtype=np.int8), counts)
            self._block = (b, labels[order.generator(*self.key, b).permutation(len(labels))])
        return self._block[1]

    def take(self, lo, hi):
        """The sources of samples lo..hi."""
        parts = []
        while lo < hi:
            b, at = divmod(lo, BLOCK)
            n = min(hi - lo, BLOCK - at)
            parts.append(self.block(b)[at:at + n])
            lo += n
        return np.concatenate(parts) if parts else np.zeros(0, np.int8)

    def taken(self, n):
        """How many of the first n samples come from each source."""
        if (self.quota > 0).sum() <= 1:  # one source: no order to draw
            return np.where(self.quota > 0, min(n, int(self.quota.sum())), 0)
        b, at = divmod(n, BLOCK)
        out = self.blocks[:b].sum(axis=0)
        if at:
            out = out + np.bincount(self.block(b)[:at], minlength=len(self.quota))
        return out
