"""pipeline.data.streams.mix.RandomMix: wds.RandomMix's constructor and place in a webdataset pipeline,
with exact, seeded draws; and the training stream mixes through it."""
import collections
import itertools

import numpy as np
import pytest
import webdataset as wds

from helpers import build_shards, train_sources
from pipeline.ordering import deal
from pipeline.data.streams import mix
from pipeline.data.streams.mix import RandomMix
from pipeline.data.streams.stream import MixedStream


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    out = tmp_path_factory.mktemp("mix")
    build_shards(out, "a", "train", 60, shape=(1, 2, 2), maxcount=20)
    build_shards(out, "b", "train", 40, shape=(1, 2, 2), maxcount=20)
    return out


def pipeline(shards, name, repeat=True):
    urls = sorted(str(p) for p in shards.glob(f"{name}-train-*.tar"))
    ds = wds.WebDataset(urls, shardshuffle=False, empty_check=False).to_tuple("__key__")
    return ds.repeat() if repeat else ds


def test_it_takes_wds_random_mixs_place_in_a_webdataset_pipeline(shards):
    """The same pipeline with RandomMix instead of wds.RandomMix: every block of BLOCK samples
    holds the sources exactly by their weights, the same seed gives the same order, another seed
    another, where wds.RandomMix's counts drift."""
    def keys(cls=RandomMix, **kw):
        mixed = cls([pipeline(shards, "a"), pipeline(shards, "b")], [3, 1], **kw)
        batched = wds.DataPipeline(mixed, wds.batched(64, collation_fn=lambda xs: [x[0] for x in xs]))
        return [k for batch in itertools.islice(batched, deal.BLOCK // 64) for k in batch]

    got = keys(seed=1)
    counts = collections.Counter(k.split("-")[0] for k in got)
    assert len(got) == deal.BLOCK and counts == {"a": 3 * deal.BLOCK // 4, "b": deal.BLOCK // 4}
    assert got == keys(seed=1) and got != keys(seed=2)
    stock = collections.Counter(k.split("-")[0] for k in keys(cls=wds.RandomMix))
    assert sum(stock.values()) == deal.BLOCK  # a drop-in: the same constructor, the same samples out


@pytest.mark.parametrize("longest", [False, True])
def test_longest_as_wds_random_mix_has_it(shards, longest):
    """longest=False ends at the first dataset that runs out (b: 40 samples); True reads all of both."""
    got = list(RandomMix([pipeline(shards, "a", False), pipeline(shards, "b", False)], [1, 1], longest=longest))
    counts = collections.Counter(k[0].split("-")[0] for k in got)
    if longest:
        assert counts == {"a": 60, "b": 40}
    else:
        assert counts["b"] == 40 and counts["a"] < 60


def test_bad_probabilities_are_one_line():
    with pytest.raises(ValueError, match="2 datasets need as many probabilities"):
        RandomMix([[1], [2]], [1])
    with pytest.raises(ValueError, match="not all 0"):
        RandomMix([[1], [2]], [0, 0])


def test_the_training_stream_mixes_through_it(monkeypatch, tmp_path):
    build_shards(tmp_path, "mnist", "train", 40, maxcount=20)
    build_shards(tmp_path, "cifar10", "train", 40, shape=(3, 32, 32), maxcount=20)
    used = []
    real = RandomMix.next

    def next_(self, n=None):
        used.append(self)
        return real(self, n)

    monkeypatch.setattr(mix.RandomMix, "next", next_)
    s = MixedStream(train_sources(str(tmp_path)), {"mnist": 1, "cifar10": 1}, 8, epoch_samples=64)
    assert len(list(s)) == 8 and len(used) == 8 and all(isinstance(m.choices, deal.Choices) for m in used)


@pytest.mark.parametrize("probs, match", [([float("nan"), 1], "probability nan is not a finite"),
                                          ([float("inf"), 1], "probability inf is not a finite"),
                                          ([-1, 1], "probability -1.0 is not a finite"),
                                          ([0, 0], "not all 0"),
                                          (["a", 1], "RandomMix: probabilities must be numbers"),
                                          ([None, 1], "RandomMix: probabilities must be numbers")])
def test_weights_that_are_no_weights_are_one_line_each(probs, match):
    with pytest.raises(ValueError, match=match):
        RandomMix([[1], [2]], probs)


def test_no_datasets_is_one_line():
    with pytest.raises(ValueError, match="no datasets"):
        RandomMix([])


def test_huge_weights_are_relative():
    """1e308 is a finite weight: it counts against the others (BLOCK * 1e308 overflowed to inf)."""
    got = list(RandomMix([range(5000), range(10000, 10005)], [1e308, 1e308]))
    assert set(x // 10000 for x in got[:deal.BLOCK // 2]) == {0, 1}
    assert list(RandomMix([[1, 2], [3]], [1e308, 0], longest=True)) == [1, 2]


@pytest.mark.timeout(60)  # the spin yielded nothing, for ever
@pytest.mark.parametrize("tiny", [0, 1e-300])
def test_longest_ends_when_nothing_left_can_be_drawn(tiny):
    """A dataset never drawn (weight 0, or a share of a block that rounds to 0) ends the mix once
    the others have: it spun at 100% CPU, yielding nothing."""
    assert list(RandomMix([[1, 2, 3], [4, 5]], [1, tiny], longest=True)) == [1, 2, 3]


@pytest.mark.timeout(60)
def test_longest_yields_what_can_be_drawn_and_ends_over_random_weights():
    """Property: over random weights (zeros among them) and lengths, longest=True yields every
    sample of each dataset that can be drawn, in its order, and ends; longest=False stops at the
    first that runs out."""
    import numpy as np

    rng = np.random.default_rng(0)
    for trial in range(60):
        n = int(rng.integers(1, 5))
        lengths = rng.integers(0, 40, n).tolist()
        probs = [float(rng.choice([0, 1e-300, rng.random(), 1e308 * rng.random()])) for _ in range(n)]
        if max(probs) == 0:
            probs[0] = 1.0
        data = [[(i, j) for j in range(k)] for i, k in enumerate(lengths)]
        mixed = RandomMix(data, probs, longest=True, seed=trial)
        drawn = [k > 0 for k in mixed.choices.every]
        got = list(mixed)
        for i in range(n):
            assert [x for x in got if x[0] == i] == (data[i] if drawn[i] else []), (lengths, probs)
        short = list(RandomMix(data, probs, seed=trial))
        assert len(short) <= len(got)


@pytest.mark.parametrize("seed", ["x", -1, 1.5, True, 2 ** 63])
def test_a_seed_that_is_no_generator_key_is_refused_when_the_mix_is_made(seed):
    """It failed only when iterated, in numpy's words (the final hostile pass)."""
    with pytest.raises(ValueError, match="RandomMix seed"):
        RandomMix([[1], [2]], [1, 1], seed=seed)
    assert list(RandomMix([[1], [2]], [1, 1], seed=np.int64(3))) != []
