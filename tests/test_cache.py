"""pipeline.cache: copies checked against the current manifest, a full disk, LRU eviction
under --cache-size, and several processes sharing one folder. Servers on 127.0.0.1 only."""
import errno
import hashlib
import http.server
import json
import os
import random
import subprocess
import sys
import time
import warnings

import pytest

from helpers import HANG, Quiet, build_shards, run_capture, serving
from pipeline.data.store import cache as caching
from pipeline.data.store.cache import Cache, path as cache_path
from pipeline.errors import ShardError
from pipeline.data.store.remote import Policy, read_all, read_url

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST = Policy(retries=1, delay=0.05, timeout=2.0, min_rate=1e6)
KB = 1024


def blob(tag, n=16 * KB):
    """n bytes that differ for each tag."""
    seed = hashlib.sha256(tag.encode()).digest()
    return (seed * (n // len(seed) + 1))[:n]


def sha(data):
    return hashlib.sha256(data).hexdigest()


class Files(Quiet, http.server.BaseHTTPRequestHandler):
    """Serves server.files (path -> bytes, changeable while it runs) and counts GETs per path."""

    def do_GET(self):
        body = self.server.files.get(self.path)
        self.server.hits[self.path] = self.server.hits.get(self.path, 0) + 1
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def files_server(files):
    return serving(Files, files=files, hits={})


def read(url, data, cache, **kw):
    """read_url as the shard reader calls it: size and sha256 from the (current) manifest."""
    return read_url(url, read_all, policy=FAST, nbytes=len(data), digest=sha(data), cache_dir=cache, **kw)


def entries(folder):
    return sorted(f for f in os.listdir(folder) if not f.startswith(".")) if os.path.isdir(folder) else []


def messages(w):
    return [str(x.message) for x in w]


# ---------------------------------------------------------------- copies match the current manifest


@pytest.mark.parametrize("rebuilt", ["same size", "other size"])
def test_a_shard_rebuilt_on_the_server_is_fetched_again_not_used_stale(tmp_path, rebuilt):
    old = blob("v1")
    new = blob("v2") if rebuilt == "same size" else blob("v2", 20 * KB)
    cache = str(tmp_path / "cache")
    with files_server({"/a.tar": old}) as srv:
        url = srv.url + "a.tar"
        assert read(url, old, cache) == old
        assert read(url, old, cache) == old and srv.hits["/a.tar"] == 1  # the copy, while it matches
        srv.files["/a.tar"] = new  # rebuilt: a new manifest lists its new sha256 (and size)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            assert read(url, new, cache) == new
        assert srv.hits["/a.tar"] == 2
        assert len(w) == 1 and "no longer matches the manifest" in str(w[0].message) and url in str(w[0].message)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert read(url, new, cache) == new  # the new copy, silently
        assert srv.hits["/a.tar"] == 2
    with open(cache_path(cache, url), "rb") as f:
        assert f.read() == new


def test_a_copy_damaged_on_disk_is_fetched_again(tmp_path):
    data, cache = blob("a"), str(tmp_path / "cache")
    with files_server({"/a.tar": data}) as srv:
        url = srv.url + "a.tar"
        read(url, data, cache)
        path = cache_path(cache, url)
        damaged = bytearray(data)
        damaged[5000] ^= 1
        with open(path, "wb") as f:
            f.write(damaged)  # same size: only the hash can tell
        with pytest.warns(UserWarning, match="sha256 differs"):
            assert read(url, data, cache) == data
        assert srv.hits["/a.tar"] == 2


def test_a_consumer_error_on_a_damaged_copy_refetches_but_on_a_good_copy_raises(tmp_path):
    """A copy whose parse fails: damaged on disk -> fetch again; what the manifest lists -> the
    shard itself is bad, and the error stands."""
    data, cache = blob("a"), str(tmp_path / "cache")

    def picky(stream):
        got = read_all(stream)
        if got != data:
            raise ShardError("truncated member")
        return got

    with files_server({"/a.tar": data}) as srv:
        url = srv.url + "a.tar"
        read(url, data, cache)
        with open(cache_path(cache, url), "r+b") as f:
            f.write(b"X")
        with pytest.warns(UserWarning, match="no longer matches"):
            assert read_url(url, picky, policy=FAST, nbytes=len(data), digest=sha(data), cache_dir=cache) == data

        def broken(stream):
            stream.read(10)
            raise ShardError("bad member")
        with pytest.raises(ShardError, match="bad member"):
            read_url(url, broken, policy=FAST, nbytes=len(data), digest=sha(data), cache_dir=cache)
        assert srv.hits["/a.tar"] == 2
    assert os.path.exists(cache_path(cache, url))  # the good copy stays


def test_a_rebuilt_set_behind_the_cache_streams_its_new_samples(tmp_path):
    """End to end through the shard reader: rebuild the shard set on the server (other seed,
    new sha256 in the new manifest), resolve it again: the new keys, not the cached ones."""
    from helpers import serve
    from pipeline.data.manifests.manifest import resolve

    folder, cache = tmp_path / "srv", str(tmp_path / "cache")

    build_shards(folder, "mnist", "train", 40, maxcount=20, seed=0)
    with serve(folder) as base:
        first = resolve("mnist", base, "train", policy=FAST)
        before = _keys_of(first, cache)
        build_shards(folder, "mnist", "train", 40, maxcount=20, seed=1)  # same names and sizes, new order
        second = resolve("mnist", base, "train", policy=FAST)
        assert second.digests != first.digests and second.sizes == first.sizes
        with pytest.warns(UserWarning, match="no longer matches"):
            after = _keys_of(second, cache)
    assert sorted(before) == sorted(after) and before != after


def _keys_of(src, cache):
    """Every key of a source, shard by shard in manifest order, through stages.Reader."""
    from pipeline.data.streams import stages
    from pipeline.data.streams import reading
    from pipeline.data.streams import plans

    reader = reading.Reader(src, policy=FAST, cache_dir=cache)
    keys = reader(plans.Window(tuple((u, 0, None) for u in src.urls))).keys
    assert reader.errors.skipped == 0
    return keys


# ---------------------------------------------------------------- a full disk


@pytest.mark.parametrize("error", [errno.ENOSPC, errno.EDQUOT])
def test_a_full_disk_turns_the_cache_off_with_one_warning(tmp_path, monkeypatch, error):
    cache = str(tmp_path / "cache")
    monkeypatch.setattr(caching, "_OFF", set())
    real_open = open
    opened = []

    class Full:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            raise OSError(error, os.strerror(error))

        def close(self):
            self.f.close()

    def fake_open(path, mode="r", *a, **kw):
        f = real_open(path, mode, *a, **kw)
        if (isinstance(path, int) or str(path).startswith(cache)) and "w" in mode:  # a copy, opened from mkstemp
            opened.append(path)
            return Full(f)
        return f

    monkeypatch.setattr(caching, "open", fake_open, raising=False)
    datas = {f"/{i}.tar": blob(str(i)) for i in range(3)}
    with files_server(datas) as srv:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            for path, data in datas.items():
                assert read(srv.url + path[1:], data, cache) == data
    assert len(w) == 1 and "reading remote shards without the cache" in str(w[0].message)
    assert os.strerror(error) in str(w[0].message)
    assert len(opened) == 1  # off after the first failure: no further copies tried
    assert os.listdir(cache) == []  # the partial copy is gone


CHILD = r"""
import resource, sys, warnings
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))  # any file over 4 KiB: EFBIG (Python ignores SIGXFSZ)
from pipeline.data.store.remote import Policy, read_all, read_url
url, cache, n, digest = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
for _ in range(3):
    data = read_url(url, read_all, policy=Policy(retries=0, timeout=5), nbytes=n, digest=digest, cache_dir=cache)
    assert len(data) == n
print("read 3 times")
"""


def test_a_file_size_limit_in_a_real_process_degrades_to_no_cache(tmp_path):
    data, cache = blob("big", 64 * KB), str(tmp_path / "cache")
    with files_server({"/a.tar": data}) as srv:
        p = run_capture([sys.executable, "-c", CHILD, srv.url + "a.tar", cache, str(len(data)), sha(data)],
                        env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=HANG)
        assert p.returncode == 0 and "read 3 times" in p.stdout, p.stderr[-2000:]
        assert srv.hits["/a.tar"] == 3
    assert p.stderr.count("reading remote shards without the cache") == 1, p.stderr
    assert "File too large" in p.stderr and "Traceback" not in p.stderr
    assert entries(cache) == []


# ---------------------------------------------------------------- --cache-size


def test_least_recently_used_copies_are_evicted_under_the_size(tmp_path):
    cache = Cache(str(tmp_path / "cache"), 3 * 16 * KB)
    datas = {name: blob(name) for name in "abcde"}
    with files_server({f"/{k}.tar": v for k, v in datas.items()}) as srv:
        def get(name):
            return read(srv.url + f"{name}.tar", datas[name], cache)

        def held():
            return {n for n in datas if os.path.exists(cache_path(cache.folder, srv.url + f"{n}.tar"))}

        for name in "abc":
            get(name)
        assert held() == set("abc")
        get("a")  # a is now the most recently used; b the least
        get("d")
        assert held() == set("acd")
        get("e")
        assert held() == set("ade")
        assert srv.hits == {"/a.tar": 1, "/b.tar": 1, "/c.tar": 1, "/d.tar": 1, "/e.tar": 1}
        get("b")  # evicted earlier: fetched again
        assert srv.hits["/b.tar"] == 2 and held() == set("deb")
    total = sum(os.path.getsize(os.path.join(cache.folder, f)) for f in entries(cache.folder))
    assert total <= cache.size and not os.path.exists(os.path.join(cache.folder, caching.LOCK))


def test_a_shard_larger_than_the_cache_is_read_through(tmp_path):
    cache = Cache(str(tmp_path / "cache"), 8 * KB)
    data = blob("a")
    with files_server({"/a.tar": data}) as srv:
        assert read(srv.url + "a.tar", data, cache) == data
        assert read(srv.url + "a.tar", data, cache) == data
        assert read_url(srv.url + "a.tar", read_all, policy=FAST, cache_dir=cache) == data  # a size nobody announced
        assert srv.hits["/a.tar"] == 3
    assert entries(cache.folder) == []


def test_eviction_removes_copies_whose_writer_died_but_not_live_ones(tmp_path):
    folder = tmp_path / "cache"
    folder.mkdir()
    dead = run_capture([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan = folder / f"x-a.tar.{int(dead.stdout)}.1.tmp"
    live = folder / f"x-b.tar.{os.getpid()}.1.tmp"
    orphan.write_bytes(b"o" * 1000)
    live.write_bytes(b"l" * 1000)
    assert caching.evict(Cache(str(folder), 10), 10) == 1000
    assert not orphan.exists() and live.exists()


SHARER = r"""
import json, random, sys, warnings
from pipeline.data.store.cache import Cache
from pipeline.data.store.remote import Policy, read_all, read_url
base, folder, size, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
want = json.loads(sys.argv[5])  # name -> [bytes, sha256]
rng = random.Random(seed)
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    for _ in range(150):
        name = rng.choice(sorted(want))
        n, digest = want[name]
        got = read_url(base + name, lambda s: __import__("hashlib").sha256(read_all(s)).hexdigest(),
                       policy=Policy(retries=2, delay=0.05, timeout=5), nbytes=n, digest=digest,
                       cache_dir=Cache(folder, size))
        assert got == digest, (name, got)
print(json.dumps([str(x.message) for x in w]))
"""


SHARED = {f"s{i}.tar": blob(f"s{i}", (16 + i) * KB) for i in range(8)}  # what the SHARER processes read
SHARED_SIZE = 3 * 20 * KB  # holds two or three of them (16 to 23 KB each)


def sharer_draws(seed):
    """The names one SHARER process reads, in its order."""
    rng = random.Random(seed)
    return [rng.choice(sorted(SHARED)) for _ in range(150)]


def lru_fetches(draws):
    """The GETs of one reader of `draws` through a cache of SHARED_SIZE that, before it writes a
    new copy, evicts the least recently used ones until the copy fits (cache.make_room)."""
    held, fetches = [], 0  # least recently used first
    for name in draws:
        if name in held:
            held.remove(name)
        else:
            fetches += 1
            while sum(len(SHARED[k]) for k in held) > SHARED_SIZE - len(SHARED[name]):
                held.pop(0)
        held.append(name)
    return fetches


def run_sharers(folder, seeds):
    """SHARER processes, one a seed, reading SHARED through one cache folder at once: [(process,
    stdout, stderr)] and the GETs the server saw."""
    want = json.dumps({k: [len(v), sha(v)] for k, v in SHARED.items()})
    with files_server({"/" + k: v for k, v in SHARED.items()}) as srv:
        procs = [subprocess.Popen([sys.executable, "-c", SHARER, srv.url, str(folder), str(SHARED_SIZE), str(seed),
                                   want], env=dict(os.environ, PYTHONPATH=ROOT), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for seed in seeds]
        outs = [(p, *p.communicate(timeout=HANG)) for p in procs]
        return outs, sum(srv.hits.values())


def test_one_reader_fetches_exactly_what_lru_eviction_must(tmp_path):
    """One SHARER alone: 150 reads of 8 shards through a cache that holds 2 or 3 of them fetch
    107 (lru_fetches); a cache that served nothing would fetch 150, one that evicted in
    order of writing (uses not counted) 102, one that evicted the newest copy 96."""
    outs, hits = run_sharers(tmp_path / "cache", [0])
    (p, out, err), = outs
    assert p.returncode == 0, err[-2000:]
    assert json.loads(out.strip().splitlines()[-1]) == [], out
    assert hits == lru_fetches(sharer_draws(0)) == 107


@pytest.mark.slow
def test_processes_sharing_one_bounded_cache_never_see_a_partial_or_evicted_copy(tmp_path):
    """Three processes read eight shards at random through one folder that holds three: they
    write, evict and read each other's copies all the time. Every read must be the manifest's
    bytes from the first look (no 'no longer matches' warning: nobody saw half a file), the
    folder stays within its size, and nothing partial is left."""
    folder = str(tmp_path / "cache")
    outs, hits = run_sharers(folder, range(3))
    for p, out, err in outs:
        assert p.returncode == 0, err[-2000:]
        assert json.loads(out.strip().splitlines()[-1]) == [], out
    # The three processes' reads, merged in whatever order they run, are one uniform random
    # stream of 450 reads over the 8 shards, which the shared LRU copies miss about as often as
    # each process's own stream alone: 107 + 99 + 93 = 299 fetches apart; 293-337 were measured
    # together (two processes may fetch the same shard at once). A cache that served nothing
    # would fetch 450, one that held a single copy ~387.
    apart = sum(lru_fetches(sharer_draws(seed)) for seed in range(3))
    assert apart == 299 and 0.8 * apart <= hits <= 1.2 * apart, hits
    left = entries(folder)
    assert not [f for f in left if f.endswith(".tmp")]
    assert sum(os.path.getsize(os.path.join(folder, f)) for f in left) <= SHARED_SIZE
    for f in left:
        data = open(os.path.join(folder, f), "rb").read()
        assert data in SHARED.values()


def test_an_unbounded_cache_leaves_no_lock_file(tmp_path):
    data, cache = blob("a"), str(tmp_path / "cache")
    with files_server({"/a.tar": data}) as srv:
        read(srv.url + "a.tar", data, cache)
    assert os.listdir(cache) == [os.path.basename(cache_path(cache, srv.url + "a.tar"))]
    t = time.time()
    assert caching.of(cache) == Cache(cache) and caching.of(None) is None and caching.of("") is None
    assert time.time() - t < 1


@pytest.mark.parametrize("planted", ["fifo", "link", "folder"])
def test_a_fifo_link_or_folder_under_a_copys_name_is_never_read_through(tmp_path, planted):
    """A shared folder may hold anything under a copy's name: a FIFO must not hang the read,
    a link must not be followed (nor its target removed), a folder must not fail it."""
    data, cache = blob("a"), str(tmp_path / "cache")
    os.mkdir(cache)
    target = tmp_path / "precious"
    target.write_bytes(data)  # even the right bytes: a link is not a copy this cache wrote
    with files_server({"/a.tar": data}) as srv:
        url = srv.url + "a.tar"
        where = cache_path(cache, url)
        {"fifo": lambda: os.mkfifo(where), "link": lambda: os.symlink(target, where),
         "folder": lambda: os.mkdir(where)}[planted]()
        t0 = time.time()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert read(url, data, cache) == data
        assert time.time() - t0 < 5 and srv.hits["/a.tar"] == 1
    assert target.read_bytes() == data
    if planted != "folder":  # a folder can't be renamed over: the copy is dropped, the read stands
        assert open(where, "rb").read() == data and not os.path.islink(where)


def test_a_planted_lock_link_is_refused_not_truncated(tmp_path):
    from pipeline.files import locked

    target = tmp_path / "precious"
    target.write_text("keep me")
    os.symlink(target, tmp_path / ".lock")
    with pytest.raises(OSError):
        with locked(str(tmp_path / ".lock")):
            pass
    assert target.read_text() == "keep me"


def test_the_shard_reader_through_a_bounded_cache_reads_every_sample_and_stays_within_it(tmp_path, monkeypatch):
    from helpers import serve
    from pipeline.data.streams import stages
    from pipeline.data.streams import reading
    from pipeline.data.manifests.manifest import resolve

    monkeypatch.setattr(reading, "PREFETCH_THREADS", 0)  # one shard after another: the LRU order is the reading order

    folder = tmp_path / "srv"
    build_shards(folder, "mnist", "train", 100, maxcount=20, seed=0)
    local = resolve("mnist", str(folder), "train")
    size = 2 * max(local.sizes) + 1
    cache = Cache(str(tmp_path / "cache"), size)
    want = _keys_of(local, None)
    with serve(folder) as base:
        remote_src = resolve("mnist", base, "train", policy=FAST)
        for _ in range(2):
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # no copy ever seen stale
                assert _keys_of(remote_src, cache) == want
            held = entries(cache.folder)  # 5 shards of equal size read in order: the last two stay
            assert held == sorted(os.path.basename(cache_path(cache.folder, u)) for u in remote_src.urls[-2:])
            assert sum(os.path.getsize(os.path.join(cache.folder, f)) for f in held) <= size
