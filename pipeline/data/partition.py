"""The canonical partition: K logical slots per source, fixed when a run first starts.

A source's shards (split into up to `MAX_PARTS` sample ranges when there are fewer
shards than slots) are dealt to K slots; physical (rank, worker) pairs own whole
slots, dealt with the islice rule of `wds.split_by_node` then `wds.split_by_worker`
applied to the slot list. Where a slot stands is one integer, the samples it has
consumed this epoch, so a stream's state is O(K) small integers whatever the number
of shards, and a resume on another world re-deals the same K slots, each going on
from its count: same-world and other-world resume are one code path.

Every order is a pure function of integers (seed, epoch, source, slot, position),
drawn from a counter-based generator (numpy's Philox keyed by them), so any position
is reached directly, without replaying what came before. Keys start with a tag naming
what they draw (numpy's SeedSequence gives [1, 2] and [1, 2, 0] one stream).
"""
import itertools
import math

import numpy as np

MAX_PARTS = 4  # a shard is cut into at most this many sample ranges for small sources
MAX_COUNT = 1 << 53  # a consumed count beyond this is no count a run can reach
MAX_SLOTS = 1 << 22  # K per source: 4M slots is 4,000 ranks x 8 workers x 128 each
DEAL, ORDER, SHUFFLE, RESAMPLE, RESHUFFLE, MIX = range(6)  # the first word of every generator key


def default_slots(world, workers, shards):
    """K for a run that first starts on `world` ranks x `workers` workers over a source of
    `shards` shards: at least one slot per (rank, worker) pair, and up to 12 per pair
    while there are shards for them, so the run can later grow to 12x the pairs. No more
    slots than shards unless the pairs need them: a slot holding part of a shard reads the
    whole shard for it."""
    pairs = world * max(workers, 1)
    return max(pairs, min(12 * pairs, shards))


def stride(rank, world, worker=0, workers=0):
    """(first, step) of what `wds.split_by_node` then `wds.split_by_worker` give a (rank,
    worker) pair of a list: rank r takes every world-th item from r, its worker w every
    workers-th of those, i.e. items r + w * world, stepping world * workers. Written out
    (webdataset reads the rank from the environment; here it is handed in);
    tests/test_partition.py checks the two agree."""
    if not (world >= 1 and 0 <= rank < world and workers >= 0 and 0 <= worker < max(workers, 1)):
        raise ValueError(f"rank {rank} of {world}, worker {worker} of {workers}: out of range")
    return rank + worker * world, world * max(workers, 1)


def owned(slots, rank, world, worker=0, workers=0):
    """The slots a (rank, worker) pair reads (see `stride`)."""
    first, step = stride(rank, world, worker, workers)
    return list(range(first, slots, step))


def generator(*key):
    """A Philox generator keyed by non-negative integers: the same key, the same stream
    (the two key words come from numpy's SeedSequence of them)."""
    # Philox keyed by a SeedSequence takes its key as generate_state(2, np.uint64), the same
    # two words; Philox(key=...) would first seed itself from OS entropy only to drop it
    return np.random.Generator(np.random.Philox(np.random.SeedSequence(_words(key))))


def seed_of(key):
    """A 63-bit integer drawn from a key, as `generator` would key its stream (the key checked
    as `generator` checks it)."""
    return int(np.random.SeedSequence(_words(key)).generate_state(1, np.uint64)[0] >> np.uint64(1))


def _words(key):
    """The key as the uint32 words SeedSequence makes of a list of ints (each int's words,
    low first; 0 is one word), which it takes as they are: 1.9 us against 7.3 for the list,
    the same state (tests/test_partition.py)."""
    words = []
    for k in key:
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
            raise ValueError(f"generator key must be non-negative integers, got {key}")
        k = int(k)
        words.append(k & 0xFFFF_FFFF)
        while k > 0xFFFF_FFFF:
            k >>= 32
            words.append(k & 0xFFFF_FFFF)
    return np.array(words, np.uint32)


class Partition:
    """One source's samples over K slots for every epoch.

    counts: samples per shard (the manifest's); pieces are (shard, part) with part a
    sample range [count * part // parts, count * (part + 1) // parts).
    """

    def __init__(self, counts, slots, *, seed, source):
        if slots < 1:
            raise ValueError(f"slots must be at least 1, got {slots}")
        self.counts = np.asarray(counts, np.int64)
        self.slots, self.seed, self.source = slots, seed, source
        n = len(self.counts)
        self.parts = 1 if n >= slots or n == 0 else min(MAX_PARTS, math.ceil(slots / n))
        shard = np.repeat(np.arange(n), self.parts)
        part = np.tile(np.arange(self.parts), n)
        lo = self.counts[shard] * part // self.parts
        hi = self.counts[shard] * (part + 1) // self.parts
        self.piece_shard, self.piece_lo, self.piece_hi = shard, lo, hi
        self._epoch, self._deal = None, None

    def deal(self, epoch):
        """Piece indices of every slot this epoch: one seeded permutation, piece i to slot i % K.
        The same on every rank; computed once per epoch in O(pieces)."""
        if self._epoch != epoch:
            order = generator(DEAL, self.seed, epoch, self.source).permutation(len(self.piece_shard))
            self._epoch, self._deal = epoch, order
        return self._deal

    def pieces(self, epoch, slot):
        """Slot's pieces this epoch, in reading order: (shard, lo, hi) rows."""
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} outside {self.slots} slots")
        mine = self.deal(epoch)[slot::self.slots]
        return np.stack([self.piece_shard[mine], self.piece_lo[mine], self.piece_hi[mine]], axis=1)

    def size(self, epoch, slot):
        """Samples in slot's share of one pass."""
        p = self.pieces(epoch, slot)
        return int((p[:, 2] - p[:, 1]).sum())

    def sizes(self, epoch):
        """Samples in every slot's share of one pass, as an array of K."""
        order = self.deal(epoch)
        out = np.zeros(self.slots, np.int64)
        np.add.at(out, np.arange(len(order)) % self.slots, (self.piece_hi - self.piece_lo)[order])
        return out

    def order(self, epoch, slot, turn, variant=0):
        """Slot's pieces in the order of its pass `turn`: the deal's order first, then an order
        drawn from (seed, epoch, source, slot, pass). A `variant` > 0 (a pair reading a slot
        it borrowed) has orders of its own from the first pass on."""
        rows = self.pieces(epoch, slot)
        if turn or variant:
            rows = rows[generator(ORDER, self.seed, epoch, self.source, slot, turn, variant).permutation(len(rows))]
        return rows

    def locate(self, epoch, slot, position):
        """Where position `position` of the slot's stream lies: (pass, piece row, offset in
        the piece), reached directly, not replayed; past the slot's share it goes on with
        passes of its own."""
        turn, rows, at = self._turn(epoch, slot, position)
        sizes = rows[:, 2] - rows[:, 1]
        ends = np.cumsum(sizes)
        k = int(np.searchsorted(ends, at, side="right"))
        here = self.pieces(epoch, slot)
        row = int(np.flatnonzero((here == rows[k]).all(axis=1))[0])
        return turn, row, int(at - (ends[k] - sizes[k]))

    def _turn(self, epoch, slot, position, variant=0):
        if not 0 <= position < MAX_COUNT:
            raise ValueError(f"position {position} outside 0..{MAX_COUNT}")
        total = self.size(epoch, slot)
        if total == 0:
            raise ValueError(f"slot {slot} of source {self.source} holds no samples")
        turn, at = divmod(position, total)
        return turn, self.order(epoch, slot, turn, variant), at

    def window(self, epoch, slot, position, width, variant=0):
        """The window of `width` pieces that holds the slot's position `position`, as
        (rows, start, size, key): its pieces, the slot position it starts at, how many
        positions it stands for, and the key of its shuffle. Windows never cross a pass."""
        turn, rows, at = self._turn(epoch, slot, position, variant)
        ends = np.cumsum(rows[:, 2] - rows[:, 1])
        cuts = ends[np.minimum(np.arange(width, len(rows) + width, width), len(rows)) - 1]
        j = int(np.searchsorted(cuts, at, side="right"))
        lo = int(cuts[j - 1]) if j else 0
        key = (SHUFFLE, self.seed, epoch, self.source, slot, turn, j, variant)
        return rows[j * width:(j + 1) * width], turn * int(ends[-1]) + lo, int(cuts[j]) - lo, key

    def resampled(self, epoch, slot, position, width, variant=0):
        """Like `window`, for a slot that draws `width` of its pieces with replacement per
        window, forever (--resample). Every window stands for the same span of positions,
        `width` times the slot's largest piece, so any position is reached directly (window
        position // span); the positions a window's drawn pieces leave empty are passed
        over as a short shard's are, and cost nothing but the count."""
        if not 0 <= position < MAX_COUNT:
            raise ValueError(f"position {position} outside 0..{MAX_COUNT}")
        pieces = self.pieces(epoch, slot)
        sizes = pieces[:, 2] - pieces[:, 1]
        if not sizes.sum():
            raise ValueError(f"slot {slot} of source {self.source} holds no samples")
        span = width * int(sizes.max())
        j = position // span
        rows = pieces[generator(RESAMPLE, self.seed, epoch, self.source, slot, j, variant).integers(
            0, len(pieces), width)]
        return rows, j * span, span, (RESHUFFLE, self.seed, epoch, self.source, slot, j, variant)


def check_counts(counts, slots):
    """A loaded {slot: consumed} map, range-checked (a checkpoint is input): raises ValueError."""
    if not isinstance(counts, dict):
        raise ValueError(f"slot counts must be a mapping, got {type(counts).__name__}")
    out = {}
    for k, v in counts.items():
        try:
            s = int(k)
        except (TypeError, ValueError):
            raise ValueError(f"slot {k!r} is not an integer") from None
        if not 0 <= s < slots or str(s) != str(k) or isinstance(v, bool) or not isinstance(v, int) \
                or not 0 <= v < MAX_COUNT:
            raise ValueError(f"slot {k!r}: count {v!r} outside slots 0..{slots - 1} or counts 0..{MAX_COUNT}")
        out[s] = v
    return out


def gather(states, slots, complete=True):
    """Several {slot: count} maps (ranks', workers') into one; each slot must appear once,
    and, when `complete`, every one of the K slots must."""
    merged = {}
    for state in states:
        for s, v in check_counts(state, slots).items():
            if s in merged:
                raise ValueError(f"slot {s} appears in more than one rank's state")
            merged[s] = v
    if complete and len(merged) != slots:
        missing = list(itertools.islice((s for s in range(slots) if s not in merged), 5))  # no K-sized set
        raise ValueError(f"the states hold {len(merged)} of the {slots} slots (missing {missing}...)")
    return merged
