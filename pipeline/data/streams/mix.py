"""The mixing stage: which source each sample comes from, and the samples taken from each.

`RandomMix` takes `wds.RandomMix`'s place, with its constructor (datasets, probs, longest),
but its draws are exact and seeded: every block of `deal.BLOCK` samples holds each source's
share of it exactly, in a seeded random order (`deal.Choices`), where wds.RandomMix draws each
sample with the global `random` module (a mixture that drifts, an order no state can reach).
Which source a sample comes from is then a function of its position, so a resume needs no
state but the position. In a webdataset pipeline it mixes iterables sample by sample; in the
training stream it is given each (rank, worker)'s exact `deal.Choices` and takes whole
batches from the sources' chains (`next`).
"""
import numbers
import numpy as np
import torch

from pipeline.ordering import order
from pipeline.ordering.deal import BLOCK, Choices


class RandomMix(torch.utils.data.IterableDataset):
    """Samples of several datasets mixed by `probs` (default: equal), as wds.RandomMix mixes them,
    with exact, seeded draws. longest=False ends at the first dataset that runs out (as
    wds.RandomMix does); longest=True goes on with the others, and ends when none left can be
    drawn: a dataset whose share of a block of `deal.BLOCK` draws rounds to 0 (weight 0, or 1e-300
    beside 1) is never drawn, so `RandomMix([[1, 2, 3], [4, 5]], [1, 0], longest=True)` yields
    1, 2, 3 and ends. Weights are relative: [1e308, 1] is [1, 1e-308]. `seed`: the draws' seed;
    `choices`: the draws themselves (the training stream's `deal.Choices` of one pair); in the
    training stream, `batch_size` and `at`, the batches already taken."""

    def __init__(self, datasets, probs=None, longest=False, *, seed=0, choices=None, batch_size=None, at=0):
        self.datasets, self.longest, self.batch_size, self.at = list(datasets), longest, batch_size, at
        if choices is None:
            if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed < 2 ** 63:
                raise ValueError(f"RandomMix seed {seed!r}: an int from 0 to 2**63 - 1 expected")  # numpy's key
            seed = int(seed)
            choices = Choices.unending(_checked(probs, len(self.datasets)), (order.MIX, seed))
        self.choices = choices

    def __iter__(self):
        """Sample by sample: the next of the dataset each draw names (a dataset that ran out is
        passed over with longest=True)."""
        sources = [iter(d) for d in self.datasets]
        # a dataset that is never drawn (no place in any block) counts as ended: without this,
        # longest=True drew block after block for it once the others ended, yielding nothing, forever
        every = self.choices.every
        live = [True] * len(sources) if every is None else [int(k) > 0 for k in every]
        for b in range(1 << 62):
            if not any(live):
                return
            for s in self.choices.take(b * BLOCK, (b + 1) * BLOCK).tolist():
                if not live[s]:
                    continue
                try:
                    yield next(sources[s])
                except StopIteration:
                    if not self.longest:
                        return
                    live[s] = False
                    if not any(live):
                        return

    def next(self, n=None):
        """The training stream's next batch (of n, else batch_size): which source each place comes
        from, and that many taken from each source's chain (`stages.SourceStream.take`)."""
        n = n or self.batch_size
        choice = self.choices.take(self.at * n, (self.at + 1) * n).astype(np.int64)
        self.at += 1
        wanted = np.bincount(choice, minlength=len(self.datasets))
        return choice, [source.take(int(k)) if k else None for source, k in zip(self.datasets, wanted)]



def _checked(probs, n):
    """The weights of n datasets as floats, or one ValueError line naming the bad value and the fix."""
    if n == 0:
        raise ValueError("RandomMix: no datasets; give it at least one iterable to mix")
    try:
        probs = [1.0] * n if probs is None else [float(p) for p in probs]
    except (TypeError, ValueError):
        raise ValueError(f"RandomMix: probabilities must be numbers, got {list(probs)!r:.200}") from None
    if len(probs) != n:
        raise ValueError(f"RandomMix: {n} datasets need as many probabilities, got {len(probs)}: {probs}")
    bad = [p for p in probs if not np.isfinite(p) or p < 0]
    if bad:
        raise ValueError(f"RandomMix: probability {bad[0]} is not a finite number >= 0; give each dataset a finite "
                         f"weight >= 0, got {probs}")
    if max(probs) <= 0:
        raise ValueError(f"RandomMix: probabilities >= 0, not all 0; got {probs}")
    top = max(probs)
    return [p / top for p in probs]  # relative: BLOCK * 1e308 (or a sum of two) is inf, and inf / inf nan
