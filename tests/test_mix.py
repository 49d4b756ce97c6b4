"""pipeline.data.streams.mix.RandomMix: wds.RandomMix's constructor and place in a webdataset pipeline,
with exact, seeded draws; and the training stream mixes through it."""
import collections
import itertools

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
