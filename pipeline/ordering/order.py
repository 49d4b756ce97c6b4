"""Where each sample of a source sits in an epoch: a pure function of (seed, epoch, source, position).

A source's epoch is a sequence of positions 0, 1, 2, ... Position g lies in pass
g // N (N: the source's samples): each pass deals the shards in a seeded order, cuts
that order into windows of consecutive shards (at least `window_samples` samples,
bounded by `window_bytes`), and permutes the samples of each window. So a run of
consecutive positions draws on every shard of its window, not one shard at a time:
data written in class order still gives batches of many classes, and a reader needs
only the window's shards in memory. Any position is reached directly, without reading
what comes before it, so a resume is exact whatever the world.

Every random draw comes from a counter-based generator (numpy's Philox) keyed by a
tag naming what it draws and the integers it depends on; `seed_of` gives an integer
seed from the same keys (for augmentation and the user's stages).
"""
import numpy as np

# the first word of every generator key: what the generator draws
ORDER, SHUFFLE, RESAMPLE, QUOTA, MIX, AUGMENT = range(10, 16)
MAX_COUNT = 1 << 53  # a position or count beyond this is none a run can reach


def generator(*key):
    """A Philox generator keyed by non-negative integers: the same key, the same stream."""
    return np.random.Generator(np.random.Philox(np.random.SeedSequence(_words(key))))


def seed_of(key):
    """A 63-bit integer seed drawn from a key, as `generator` keys its stream."""
    return int(np.random.SeedSequence(_words(key)).generate_state(1, np.uint64)[0] >> np.uint64(1))


def _words(key):
    """The key as the uint32 words SeedSequence makes of a list of ints (low word first;
    0 is one word), handed over as an array because building it from a list is slower."""
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


def apportion(total, weights):
    """`total` split in integers proportional to `weights` (largest remainders, ties to the
    earlier entry): the parts sum to `total` exactly and none exceeds its share rounded up."""
    w = np.asarray(weights, np.float64)
    if total == 0 or w.sum() <= 0:
        return np.zeros(len(w), np.int64)
    exact = total * w / w.sum()
    out = np.floor(exact).astype(np.int64)
    short = int(total - out.sum())
    if short:
        out[np.argsort(-(exact - out), kind="stable")[:short]] += 1
    return out


def split_exactly(rng, colours, sizes):
    """Deal a multiset (`colours[s]` items of colour s) into parts of the given `sizes`
    (which sum to the items), each part a uniform random draw without replacement of what
    the parts before it left: every part's mix is exact in total and random in detail."""
    left = np.asarray(colours, np.int64).copy()
    out = np.zeros((len(sizes), len(left)), np.int64)
    present = np.flatnonzero(left)
    if len(present) <= 1:  # one colour: nothing to draw
        out[:, present] = np.asarray(sizes, np.int64)[:, None]
        return out
    for i, n in enumerate(sizes):
        if n:
            out[i] = rng.multivariate_hypergeometric(left, int(n))
            left -= out[i]
    return out


class SourceOrder:
    """One source's positions in one epoch: which window and which place in it each holds.

    counts: samples per shard; nbytes: bytes per shard (None: unknown, estimated from
    `sample_bytes`); resample: each pass draws its shards with replacement (passes then
    differ in length) instead of permuting them.
    """

    def __init__(self, counts, nbytes=None, *, seed, epoch, source, window_samples, window_bytes,
                 sample_bytes=1024, resample=False):
        self.counts = np.asarray(counts, np.int64)
        self.total = int(self.counts.sum())
        if self.total <= 0:
            raise ValueError(f"source {source}: no samples to order")
        self.key = (seed, epoch, source)
        self.resample = resample
        per = (float(np.sum(nbytes)) / self.total) if nbytes is not None and len(nbytes) else float(sample_bytes)
        self.sample_bytes = per  # a sample's bytes on average, as the manifest's sizes (or the estimate) say
        self.window = int(max(1, min(window_samples, window_bytes // max(per, 1.0))))
        self._passes = {}
        self._starts = [0]  # where each pass begins (resampled passes differ in length)

    def _pass(self, q):
        """(shard order, each window's first shard and first position) of pass q, cached."""
        if q not in self._passes:
            if len(self._passes) > 4:
                self._passes.clear()
            n = len(self.counts)
            if self.resample:
                shards = generator(RESAMPLE, *self.key, q).integers(0, n, n)
            else:
                shards = generator(ORDER, *self.key, q).permutation(n)
            sizes = self.counts[shards]
            begin = np.concatenate([[0], np.cumsum(sizes)])
            win = begin[:-1] // self.window  # a shard joins the window its first sample falls in
            first = np.flatnonzero(np.concatenate([[True], win[1:] != win[:-1]]))
            self._passes[q] = (shards, np.append(first, n), begin)
        return self._passes[q]

    def pass_length(self, q):
        shards, _, begin = self._pass(q)
        return int(begin[-1])

    def locate(self, position):
        """(pass, window, offset in the window) of a position."""
        if not 0 <= position < MAX_COUNT:
            raise ValueError(f"position {position} outside 0..{MAX_COUNT}")
        if not self.resample:
            q, u = divmod(int(position), self.total)
        else:
            while self._starts[-1] <= position:
                self._starts.append(self._starts[-1] + self.pass_length(len(self._starts) - 1))
            q = int(np.searchsorted(self._starts, position, side="right")) - 1
            u = int(position) - self._starts[q]
        _, first, begin = self._pass(q)
        starts = begin[first]
        j = int(np.searchsorted(starts, u, side="right")) - 1
        return q, j, u - int(starts[j])

    def window_of(self, q, j):
        """(shard indices, samples, shuffle key) of window j of pass q."""
        shards, first, begin = self._pass(q)
        lo, hi = int(first[j]), int(first[j + 1])
        return shards[lo:hi], int(begin[hi] - begin[lo]), (SHUFFLE, *self.key, q, j)
