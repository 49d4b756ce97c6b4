"""pipeline.ordering.order: each position's place a pure function of (seed, epoch, source,
position), windows of whole shards that mix many shards, keyed generators."""
import numpy as np
import pytest

from pipeline.ordering import order
from pipeline.ordering.order import SourceOrder


def walk(o, n):
    """(shard, place in the window) of positions 0..n, by locating each one."""
    out = []
    for g in range(n):
        q, j, off = o.locate(g)
        shards, size, key = o.window_of(q, j)
        assert 0 <= off < size
        out.append((q, j, off))
    return out


def test_a_pass_covers_every_window_place_once_and_windows_are_whole_shards():
    counts = [7, 9, 11, 5, 8, 13, 6]
    o = SourceOrder(counts, seed=1, epoch=0, source=0, window_samples=20, window_bytes=1 << 30)
    places = walk(o, sum(counts))
    assert len(set(places)) == sum(counts)
    windows = {(q, j) for q, j, _ in places}
    shards = [int(s) for q, j in sorted(windows) for s in o.window_of(q, j)[0]]
    assert sorted(shards) == list(range(len(counts)))  # every shard in one window of the pass
    assert all(o.window_of(q, j)[1] == sum(counts[s] for s in o.window_of(q, j)[0]) for q, j in windows)
    assert len(windows) < len(counts)  # windows hold several shards


def test_orders_are_pure_functions_of_seed_epoch_source_and_passes_differ():
    def shards(**kw):
        args = dict(seed=1, epoch=0, source=0, window_samples=10, window_bytes=1 << 30)
        o = SourceOrder([10] * 12, **dict(args, **kw))
        return [tuple(o.window_of(0, j)[0]) for j in range(3)], [tuple(o.window_of(1, j)[0]) for j in range(3)]

    base = shards()
    assert shards() == base and base[0] != base[1]
    assert shards(epoch=1) != base and shards(seed=2) != base and shards(source=1) != base


def test_the_window_grows_to_the_samples_asked_within_the_bytes_allowed():
    counts = [100] * 50
    big = SourceOrder(counts, [100 * 1000] * 50, seed=0, epoch=0, source=0, window_samples=1000,
                      window_bytes=1 << 30)
    capped = SourceOrder(counts, [100 * 1000] * 50, seed=0, epoch=0, source=0, window_samples=1000,
                         window_bytes=300 * 1000)
    assert big.window_of(0, 0)[1] == 1000 and capped.window_of(0, 0)[1] == 300
    unknown = SourceOrder(counts, None, seed=0, epoch=0, source=0, window_samples=1000, window_bytes=300 * 1000,
                          sample_bytes=1000)  # no sizes in the manifest: estimated from the shape
    assert unknown.window_of(0, 0)[1] == 300


def test_any_position_is_reached_directly():
    o = SourceOrder([10] * 100, seed=3, epoch=2, source=1, window_samples=40, window_bytes=1 << 30)
    far = 10 ** 12 + 17
    q, j, off = o.locate(far)
    assert q == far // 1000 and o.window_of(q, j)[1] == 40 and off == (far % 1000) % 40
    with pytest.raises(ValueError):
        o.locate(-1)
    with pytest.raises(ValueError):
        o.locate(order.MAX_COUNT)


def test_resampled_passes_draw_shards_with_replacement():
    o = SourceOrder([5, 6, 7, 8, 9, 10], seed=0, epoch=0, source=0, window_samples=1, window_bytes=1 << 30,
                    resample=True)
    seen = [tuple(o._pass(q)[0]) for q in range(20)]
    assert any(len(set(s)) < len(s) for s in seen)  # a shard drawn twice in a pass
    start = 0
    for q in range(5):  # passes follow each other, each as long as what it drew
        assert o.locate(start)[:2] == (q, 0)
        start += o.pass_length(q)


def test_apportion_is_exact_and_proportional():
    rng = np.random.default_rng(0)
    for _ in range(500):
        w = rng.uniform(0, 1, rng.integers(1, 6))
        total = int(rng.integers(0, 10 ** 6))
        got = order.apportion(total, w)
        assert got.sum() == total and (got >= 0).all()
        assert (np.abs(got - total * w / w.sum()) < 1).all()


def test_split_exactly_gives_every_part_its_size_and_every_colour_its_count():
    rng = np.random.default_rng(1)
    for _ in range(200):
        colours = rng.integers(0, 500, rng.integers(1, 4))
        cuts = np.sort(rng.integers(0, colours.sum() + 1, rng.integers(1, 9)))
        sizes = np.diff(np.concatenate([[0], cuts, [colours.sum()]]))
        parts = order.split_exactly(order.generator(5), colours, sizes)
        assert (parts.sum(axis=1) == sizes).all() and (parts.sum(axis=0) == colours).all() and (parts >= 0).all()


def test_generator_keys_must_be_integers():
    assert order.generator(1, 2).integers(1 << 30) == order.generator(1, 2).integers(1 << 30)
    for key in [(-1,), (1.5,), ("1",), (True,)]:
        with pytest.raises(ValueError):
            order.generator(*key)


def test_generator_draws_what_its_keyed_philox_always_drew():
    """Checkpoints hold positions, not draws: every order a stream ever took must come back
    from its key, so the generator stays Philox keyed by SeedSequence(key).generate_state(2)."""
    for key in [(0,), (0, 0), (3, 0, 1, 7), (5, 1 << 40, 2, 0, 9), ((1 << 32) - 1, 1 << 32, 1 << 64, (1 << 63) + 5),
                (np.int64(7), 1 << 100)]:
        words = np.random.SeedSequence(list(map(int, key))).generate_state(2, np.uint64)
        want = np.random.Generator(np.random.Philox(key=words))
        got = order.generator(*key)
        assert np.array_equal(got.permutation(1000), want.permutation(1000))
        assert np.array_equal(got.random(257), want.random(257))
        seed = np.random.SeedSequence(list(map(int, key))).generate_state(1, np.uint64)[0]
        assert order.seed_of(key) == int(seed) >> 1
