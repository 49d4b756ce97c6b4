"""pipeline.data.shards.readbuffer: a window's raw shards read into one buffer, rows gathered from it;
and the Reader that reads raw windows through it."""
import io

import numpy as np
import pytest

from helpers import build_shards, read_members, write_tar
from pipeline.data.store import remote
from pipeline.data.streams import stages
from pipeline.data.streams import reading
from pipeline.data.streams import plans
from pipeline.data.shards.readbuffer import CHUNK, Arena, Rows
from pipeline.data.manifests.manifest import resolve
from pipeline.data.shards.read import iter_samples
from pipeline.data.shards.regular import regular_members
from pipeline.errors import ShardError


class Dribble:
    """A stream without readinto that hands out at most `step` bytes a read, as a socket may."""

    def __init__(self, data, step):
        self.data, self.step = data, step

    def read(self, n=-1):
        out, self.data = self.data[:min(n, self.step)], self.data[min(n, self.step):]
        return out


def test_shards_read_one_after_another_keep_their_bytes_as_the_buffer_grows():
    arena = Arena()
    arena.clear(10)  # a manifest that claims far less than the shards hold: the buffer grows, copying
    first, second = bytes(range(256)) * 300, bytes(range(255, -1, -1)) * (CHUNK // 100)
    a = arena.read(io.BytesIO(first), len(first))  # a file object: readinto
    b = arena.read(Dribble(second, 7777), len(second))  # read() only, in short pieces
    assert a == (0, len(first)) and b == (len(first), len(first) + len(second))
    assert arena.view(*a).tobytes() == first and arena.view(*b).tobytes() == second
    assert len(arena.buf) > len(first) + len(second)


@pytest.mark.parametrize("stream", [lambda d: io.BytesIO(d), lambda d: Dribble(d, 1000)])
def test_a_shard_longer_than_its_limit_is_refused_after_one_byte_more(stream):
    arena = Arena()
    arena.clear(0)
    with pytest.raises(ShardError, match="more than 5000 bytes"):
        arena.read(stream(bytes(9000)), 5000)
    assert arena.used == 5001  # what was read: the limit and the byte that says it is passed
    arena.rewind(0)  # a retry starts the shard over
    assert arena.read(stream(bytes(5000)), 5000) == (0, 5000)


def test_rows_gather_images_at_any_offsets_and_refuse_a_window_read_over():
    arena = Arena()
    arena.clear(0)
    data = np.arange(1000, dtype=np.uint8).tobytes()
    arena.read(io.BytesIO(data), len(data))
    rows = Rows(arena, [0, 3, 500, 990], 10)
    assert rows.take([2, 0]).tolist() == [list(data[500:510]), list(data[0:10])]
    assert rows[1:].take([0]).tolist() == [list(data[3:13])] and len(rows[1:]) == 3
    joined = Rows.join([rows[:0], Rows(arena, [7], 10), rows[3:]])  # an empty part takes no part
    assert joined.size == 10 and joined.take(slice(None)).tolist() == [list(data[7:17]), list(data[990:1000])]
    assert rows[:2].tobytes() == [data[0:10], data[3:13]]
    arena.clear(0)
    with pytest.raises(RuntimeError, match="read over"):
        rows.take([0])


def window_of(src, shards=None):
    return plans.Window(tuple((u, 0, None) for u in (shards or src.urls)))


@pytest.fixture
def raw_source(tmp_path):
    build_shards(tmp_path, "toy", "train", 30, shape=(1, 5, 7), encoding="raw", maxcount=10)
    return resolve("toy", str(tmp_path), "train")


def sequential(urls):
    """(keys, images, labels) of raw shards as the sequential reader reads them."""
    keys, images, labels = [], [], []
    for url in urls:
        with open(url, "rb") as f:
            for s in iter_samples(f, {"raw", "cls"}):
                keys.append(s["__key__"])
                images.append(s["raw"])
                labels.append(int(s["cls"]))
    return keys, images, labels


def test_a_raw_window_reads_through_one_arena_exactly_as_the_sequential_reader(raw_source):
    reader = reading.Reader(raw_source)
    data = reader(window_of(raw_source))
    assert isinstance(data.images, Rows) and data.images.arena is reader.arena
    keys, images, labels = sequential(raw_source.urls)
    assert data.keys == keys and data.labels.tolist() == labels
    assert [bytes(r) for r in data.images.take(slice(None))] == images
    again = reader(window_of(raw_source, raw_source.urls[:1]))  # the next window, in the same buffer
    assert again.keys == keys[:10] and [bytes(r) for r in again.images.take(slice(None))] == images[:10]
    with pytest.raises(RuntimeError, match="read over"):
        data.images.take([0])


def test_manifest_sizes_that_understate_or_claim_the_most_change_nothing_read(raw_source):
    want = sequential(raw_source.urls)
    for claim in (1, reading.WHOLE_SHARD):  # the arena grows past a small claim; a large one sizes no more
        reader = reading.Reader(raw_source)
        reader.expected = {u: (c, claim, d) for u, (c, _, d) in reader.expected.items()}
        data = reader(window_of(raw_source))
        assert (data.keys, [bytes(r) for r in data.images.take(slice(None))], data.labels.tolist()) == want
        assert len(reader.arena.buf) <= reading.WHOLE_SHARD + (1 << 20)


def test_a_read_retried_from_the_start_of_its_shard_overwrites_the_failed_attempt(raw_source, monkeypatch):
    """read_url calls consume again after a transient error: the second shard's first attempt
    broke off half way, and the retry must land where that attempt began, not after it."""
    real = remote.read_url
    failed = []

    def flaky(url, consume, **kw):
        if url == raw_source.urls[1] and not failed:
            failed.append(url)
            data = open(url, "rb").read()
            with pytest.raises(OSError):
                consume(BrokenHalfWay(data))
        return real(url, consume, **kw)

    monkeypatch.setattr(remote, "read_url", flaky)
    reader = reading.Reader(raw_source)
    data = reader(window_of(raw_source))
    keys, images, labels = sequential(raw_source.urls)
    assert failed and data.keys == keys and [bytes(r) for r in data.images.take(slice(None))] == images
    ends = [regular_members(open(u, "rb").read())[2:] for u in raw_source.urls]  # each shard up to its last image
    assert reader.arena.used == sum(int(starts[-1] + sizes[-1]) for starts, sizes in ends)  # no half shard between


class BrokenHalfWay:
    def __init__(self, data):
        self.data, self.sent = data, False

    def read(self, n=-1):
        if self.sent:
            raise OSError("connection reset")
        self.sent = True
        return self.data[:len(self.data) // 2]


def test_the_arena_keeps_no_more_than_the_images_need_and_gives_back_a_large_window(raw_source, tmp_path):
    """A shard padded far past its end-of-archive block keeps nothing past its last image; a
    shard left to the sequential reader (three members a sample) leaves the arena; and a
    window much larger than the next two gives its buffer back."""
    padded = tmp_path / "padded.tar"
    padded.write_bytes(open(raw_source.urls[0], "rb").read() + bytes(8 << 20))  # zeros after the end: still read
    reader = reading.Reader(raw_source)
    reader.expected[str(padded)] = (10, padded.stat().st_size, None)
    data = reader(plans.Window(((str(padded), 0, None),)))
    assert len(data) == 10 and reader.arena.used < 64 << 10
    assert len(reader.arena.buf) > 8 << 20  # the claim made room for the padding once

    extra = tmp_path / "extra.tar"
    members = read_members(raw_source.urls[0])
    write_tar(extra, [m for name, body in members
                      for m in [(name, body)] + ([(name[:-3] + "bin", b"x" * 1000)] if name.endswith(".cls") else [])])
    reader.expected[str(extra)] = (10, extra.stat().st_size, None)
    data = reader(plans.Window(((str(extra), 0, None),)))
    assert len(data) == 10 and not isinstance(data.images, Rows) and reader.arena.used == 0
    reader(window_of(raw_source, raw_source.urls[:1]))
    assert len(reader.arena.buf) < 1 << 20  # two small windows after the large one: its memory is given back


def test_a_local_shard_is_read_at_most_chunk_bytes_at_a_time(tmp_path):
    """A local file's read deadline is checked between reads (remote._Local): the arena asks
    for at most CHUNK bytes a read, as remote.read_all did."""
    path = tmp_path / "big"
    path.write_bytes(bytes(3 * CHUNK + 5))
    asked = []
    with remote.open_local(str(path)) as f:
        real = f.f.readinto
        f.f.readinto = lambda b: asked.append(len(b)) or real(b)
        arena = Arena()
        arena.clear(path.stat().st_size)
        assert arena.read(f, 4 * CHUNK) == (0, 3 * CHUNK + 5)
    assert max(asked) <= CHUNK and len(asked) >= 4


def test_images_of_differing_sizes_are_copied_out_of_the_arena_before_it_is_read_over(raw_source, tmp_path):
    """Raw images of several sizes in one shard leave the arena as bytes of their own: the next
    window reads over the buffer, and images still to be decoded must not change with it."""
    uneven = tmp_path / "uneven.tar"
    bodies = [bytes([i]) * (30 + i) for i in range(6)]
    write_tar(uneven, [m for i, body in enumerate(bodies) for m in [(f"k{i}.raw", body), (f"k{i}.cls", b"1")]])
    reader = reading.Reader(raw_source)
    reader.expected[str(uneven)] = (6, uneven.stat().st_size, None)
    data = reader(plans.Window(((str(uneven), 0, None),)))
    assert data.images == bodies and all(type(image) is bytes for image in data.images)
    reader(window_of(raw_source))  # the next window, read over the same buffer
    assert data.images == bodies
