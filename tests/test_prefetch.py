"""Remote shards fetched ahead of the reader (pipeline.data.streams.reading.Reader, `_Fetcher`): over a
local HTTP server that waits before every answer, an epoch reads the same keys in clearly less
time than one shard after another; damage and missing shards are said in the same line as
without fetching ahead; local sources start no thread; a reader's threads end with it, and a
forked copy starts its own."""
import functools
import gc
import http.server
import os
import threading
import time
import warnings

import pytest

from helpers import Quiet, build_shards, serving, shard_keys
from pipeline.data.store import remote
from pipeline.data.streams import reading
from pipeline.data.streams import plans
from pipeline.data.manifests.manifest import resolve
from pipeline.data.streams.stream import MixedStream
from pipeline.errors import FetchError

DELAY = 0.2  # seconds the server waits before each answer


class _Slow(Quiet, http.server.SimpleHTTPRequestHandler):
    def do_GET(self):
        time.sleep(self.server.delay)
        super().do_GET()


@pytest.fixture
def slow_server(tmp_path):
    """8 mnist shards of 20 raw samples, served on 127.0.0.1 DELAY seconds after each request:
    (their folder, the base URL)."""
    folder = tmp_path / "srv"
    build_shards(folder, "mnist", "train", 160, maxcount=20)
    with serving(functools.partial(_Slow, directory=str(folder)), delay=DELAY) as server:
        yield folder, server.url


def prefetching(threads):
    """reading.PREFETCH_THREADS set for a block (0: each shard read when its turn comes)."""
    import contextlib

    @contextlib.contextmanager
    def block():
        saved, reading.PREFETCH_THREADS = reading.PREFETCH_THREADS, threads
        try:
            yield
        finally:
            reading.PREFETCH_THREADS = saved
    return block()


def epoch(src, **kw):
    """An epoch's keys (workers=0: read in this process) and its wall time."""
    t0 = time.perf_counter()
    keys = [k for b in MixedStream([src], {"mnist": 1}, 8, seed=3, **kw) for k in b["key"]]
    return keys, time.perf_counter() - t0


@pytest.fixture(autouse=True)
def earlier_threads():
    """Fetch threads other tests in this process left running (their streams not yet
    collected): each test here looks only at the threads it started."""
    EARLIER.clear()
    EARLIER.update(t for t in threading.enumerate() if t.name == "pipeline-prefetch")


EARLIER = set()


def fetch_threads():
    return [t for t in threading.enumerate() if t.name == "pipeline-prefetch" and t.is_alive() and t not in EARLIER]


def wait_for_no_fetch_threads(timeout=15.0):
    deadline = time.time() + timeout
    while fetch_threads() and time.time() < deadline:
        gc.collect()
        time.sleep(0.02)
    return fetch_threads()


def test_an_epoch_over_a_slow_server_reads_the_same_keys_in_much_less_time(slow_server):
    folder, url = slow_server
    src = resolve("mnist", url, "train")
    assert len(src.urls) == 8 and remote.kind(src.urls[0]) == "http"
    with prefetching(0):
        one_by_one, slow = epoch(src)
    assert slow >= 8 * DELAY  # each shard waited for in turn
    with prefetching(4):
        ahead, fast = epoch(src)
    assert ahead == one_by_one == epoch(resolve("mnist", str(folder), "train"))[0]
    assert fast <= 0.7 * slow, f"fetched ahead {fast:.2f} s, one by one {slow:.2f} s"
    assert not wait_for_no_fetch_threads(), "the epoch's fetch threads outlived it"


def test_the_next_window_is_fetched_while_this_one_is_read(slow_server):
    """Windows of one shard each: reading window k starts window k+1's transfer, so a reader
    that takes DELAY per window itself waits for (almost) none of the later ones (without fetching
    ahead it waits DELAY for each; 0.8 of that leaves room for a loaded machine's reading time)."""
    _, url = slow_server
    src = resolve("mnist", url, "train")
    reader = reading.Reader(src)
    windows = [plans.Window(((u, 0, None),)) for u in src.urls]
    t0 = time.perf_counter()
    reader(windows[0], lambda: windows[1:2])
    waited = 0.0
    for k in range(1, len(windows)):
        time.sleep(DELAY)  # the consumer's work on the window before
        t = time.perf_counter()
        data = reader(windows[k], lambda k=k: windows[k + 1:k + 2])
        waited += time.perf_counter() - t
        assert len(data) == 20
    assert waited < 0.8 * (len(windows) - 1) * DELAY, f"waited {waited:.2f} s in {time.perf_counter() - t0:.2f} s"


def _damage(path):
    """One byte of the first image changed: the tar still parses, its sha256 differs."""
    import tarfile

    with tarfile.open(path) as tar:
        at = next(m.offset_data for m in tar.getmembers() if m.name.endswith(".raw"))
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))


def _warned(src):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        keys, _ = epoch(src)
    return keys, [str(w.message) for w in caught]


def test_a_damaged_shard_fetched_ahead_is_named_in_the_same_line(slow_server):
    folder, url = slow_server
    src = resolve("mnist", url, "train")
    path = os.path.join(folder, os.path.basename(src.urls[3]))
    lost = shard_keys(path)
    _damage(path)
    with prefetching(0):
        keys0, said0 = _warned(src)
    with prefetching(4):
        keys1, said1 = _warned(src)
    assert keys1 == keys0 and len(lost) == 20 and not set(lost) & set(keys0)  # skipped (others read again instead)
    damaged = [line for line in said1 if "sha256 differs from the manifest" in line]
    assert len(damaged) == 1 and src.urls[3] in damaged[0] and "\n" not in damaged[0]
    assert said1 == said0


def test_a_missing_shard_fetched_ahead_fails_with_the_same_line(slow_server):
    folder, url = slow_server
    src = resolve("mnist", url, "train")
    os.remove(os.path.join(folder, os.path.basename(src.urls[5])))
    said = []
    for threads in (0, 4):
        with prefetching(threads), pytest.raises(FetchError) as e:
            epoch(src)
        said.append(str(e.value))
        del e  # its frames hold the stream and its reader
    assert said[0] == said[1] and "HTTP Error 404" in said[0] and src.urls[5] in said[0] and "\n" not in said[0]
    assert not wait_for_no_fetch_threads()


def test_a_local_source_starts_no_thread(tmp_path):
    build_shards(tmp_path, "mnist", "train", 60, maxcount=20)
    src = resolve("mnist", str(tmp_path), "train")
    seen = []
    stream = MixedStream([src], {"mnist": 1}, 8, seed=3, sample_stages=[lambda s: seen.append(len(fetch_threads()))
                                                                        or s])
    assert sum(len(b["key"]) for b in stream) >= 56
    assert seen and max(seen) == 0
    assert reading.Reader(src).fetchable == set()


def test_a_stream_dropped_mid_epoch_stops_its_threads(slow_server):
    _, url = slow_server
    src = resolve("mnist", url, "train")
    it = iter(MixedStream([src], {"mnist": 1}, 8, seed=3, shuffle_buffer=20))  # windows of a shard or two
    next(it)
    assert fetch_threads()
    del it
    assert not wait_for_no_fetch_threads(), "a dropped stream's fetch threads went on"


def test_passes_of_one_stream_leave_no_threads_behind_them(slow_server):
    """Each pass (an epoch, a loop left early) makes readers of its own: their threads stayed
    until the collector found them, 10 more each pass. With the collector off, a pass ended
    or left stops its threads before the next."""
    _, url = slow_server
    src = resolve("mnist", url, "train")
    ms = MixedStream([src], {"mnist": 1}, 8, seed=3, shuffle_buffer=20)
    gc.disable()
    try:
        most = 0
        for n in range(6):
            for i, _ in enumerate(ms):
                if n % 2 and i == 2:  # every other pass is left early
                    break
            deadline = time.time() + 5
            while len(fetch_threads()) > 0 and time.time() < deadline:  # they end after their transfer
                time.sleep(0.02)
            most = max(most, len(fetch_threads()))
    finally:
        gc.enable()
    assert most == 0, f"{most} fetch threads outlived their pass"


def test_a_forked_reader_starts_its_own_threads(slow_server):
    """A reader whose threads were started before a fork reads on in the child (a
    DataLoader worker forked from a process that read with workers=0) instead of waiting
    for transfers that no thread there will finish."""
    _, url = slow_server
    src = resolve("mnist", url, "train")
    reader = reading.Reader(src)
    windows = [plans.Window(((u, 0, None),)) for u in src.urls]
    reader(windows[0], lambda: windows[1:2])  # windows[1] is now in flight in this process
    pid = os.fork()
    if pid == 0:  # the child: read the window the parent's threads were fetching
        code = 1
        try:
            code = 0 if len(reader(windows[1])) == 20 and reader.fetcher.pid == os.getpid() else 3
        finally:
            os._exit(code)
    deadline = time.time() + 30
    while time.time() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked reader waited for its parent's transfer")
    assert len(reader(windows[1])) == 20


@pytest.mark.parametrize("ahead_shards", [0, 1, 3, 20])
def test_shards_are_fetched_ahead_across_windows_up_to_the_bytes_ahead(slow_server, ahead_shards):
    """Windows of one shard each: reading the first starts the transfers of the next shards
    whose bytes add up to `ahead` (at least one, however small `ahead` is), not more."""
    _, url = slow_server
    src = resolve("mnist", url, "train")
    size = max(src.sizes)
    reader = reading.Reader(src, ahead=ahead_shards * size)
    windows = [plans.Window(((u, 0, None),)) for u in src.urls]
    for k in range(len(windows)):
        reader(windows[k], lambda k=k: iter(windows[k + 1:]))
        expected = src.urls[k + 1:k + 1 + max(1, ahead_shards)]
        assert list(reader.fetched) == expected
        assert sum(src.sizes[src.urls.index(u)] for u in reader.fetched) <= max(ahead_shards * size, size)


def test_a_plan_looks_ahead_to_its_run_s_end_and_no_further():
    """Over random orders and runs, the windows `upcoming` gives after each window are the
    ones `next` goes on to give, up to the run's end: none of the run's start again (that is
    read only after damage), none left out."""
    import random

    import numpy as np

    from pipeline.ordering import order

    rng = random.Random(7)
    for case in range(200):
        counts = [rng.randint(1, 40) for _ in range(rng.randint(1, 12))]
        o = order.SourceOrder(counts, None, seed=case, epoch=rng.randint(0, 3), source=0,
                              window_samples=rng.randint(1, 120), window_bytes=1 << 30, sample_bytes=10)
        cuts = sorted(rng.sample(range(3 * o.total + 8), 2 * rng.randint(1, 4)))
        run = [(a, b - a) for a, b in zip(cuts[::2], cuts[1::2])]
        plan = plans.RunPlan(o, [f"s{i}" for i in range(len(counts))], run)
        length = sum(n for _, n in run)
        seen = []
        while True:
            ahead = list(plan.upcoming())
            w = plan.next()
            seen.append(w)
            if w.start + w.size - w.skip >= length:
                break
            assert ahead and ahead[0] == w
        rest = [(w.rows, w.start) for w in seen[1:]]
        first = plans.RunPlan(o, plan.urls, run)
        first.next()
        assert [(w.rows, w.start) for w in first.upcoming()] == rest, case
        assert sum(w.size - w.skip for w in seen) == length and np.all(np.diff([w.start for w in seen]) > 0)


def test_the_bytes_fetched_ahead_count_in_the_memory_budget(slow_server):
    """What a remote source's reader may hold ahead (`fetch_ahead`, at least a shard) is part of
    what the trainer checks against --max-batch-memory (MixedStream.window_held)."""
    folder, url = slow_server
    local, far = resolve("mnist", str(folder), "train"), resolve("mnist", url, "train")
    base = MixedStream([local], {"mnist": 1}, 8).window_held()
    for ahead in (0, 1, 5 << 20):
        assert MixedStream([far], {"mnist": 1}, 8, fetch_ahead=ahead).window_held() == base + max(ahead, max(far.sizes))
    assert MixedStream([local], {"mnist": 1}, 8, fetch_ahead=5 << 20).window_held() == base
    with pytest.raises(ValueError, match="fetch_ahead"):
        MixedStream([far], {"mnist": 1}, 8, fetch_ahead=-1)


def _plan(rng, case):
    from pipeline.ordering import order

    counts = [rng.randint(1, 40) for _ in range(rng.randint(1, 14))]
    o = order.SourceOrder(counts, None, seed=case, epoch=rng.randint(0, 3), source=0,
                          window_samples=rng.randint(1, 120), window_bytes=1 << 30, sample_bytes=10)
    cuts = sorted(rng.sample(range(3 * o.total + 8), 2 * rng.randint(1, 4)))
    return plans.RunPlan(o, [f"s{i}" for i in range(len(counts))], [(a, b - a) for a, b in zip(cuts[::2], cuts[1::2])])


def _from_scratch(windows, ahead, size):
    """What the look-ahead holds by its definition: the distinct shards of `windows`, in reading
    order, until the next would pass `ahead` bytes (at least one). (The walk fetches them in
    the order they joined it, so a shard read twice keeps its earlier place.)"""
    held, total = [], 0
    for w in windows:
        for url in dict.fromkeys(u for u, _, _ in w.rows):
            if url not in held:
                if held and total + size(url) > ahead:
                    return held
                held.append(url)
                total += size(url)
    return held


def test_the_walk_carried_on_window_by_window_holds_what_a_walk_from_scratch_finds():
    """Over random orders, runs, shard sizes and budgets, driven as `Read` drives a reader (a
    window the same as the last one is not handed over), the look-ahead carried on from one
    window to the next holds, after each window, what walking its windows ahead from scratch
    finds, and is never started over within the run. Sizes unknown to the manifest count as
    the whole budget."""
    import random

    rng = random.Random(11)
    for case in range(300):
        plan = _plan(rng, case)
        sizes = {u: rng.choice([None, 1, 5, 20, 50]) for u in plan.urls}
        ahead = rng.choice([0, 1, 10, 40, 200, 10**6])
        size = lambda u: ahead if sizes[u] is None else sizes[u]  # noqa: E731
        walk, last, walks = None, None, 0
        while True:
            try:
                w = plan.next()
            except StopIteration:
                break
            if not w.same(last):
                last = w
                if walk is None or not walk.reached(w):
                    walk, walks = reading._Walk(iter(plan.upcoming()), ahead, sizes.get, w), walks + 1
                walk.extend()
                assert set(walk.held) == set(_from_scratch(plan.upcoming(), ahead, size)), case
            if w.start + w.size - w.skip >= plan.length:
                break
        assert walks == 1, f"case {case}: the look-ahead was walked from scratch {walks} times in one run"


def test_a_reader_walks_each_window_ahead_once(slow_server):
    """An epoch of one-sample windows makes each window about twice (once looking ahead, once to
    read it), not once per window before it: a walk from scratch for every window made 3000
    one-sample windows cost 57 s of looking ahead."""
    folder, url = slow_server
    src = resolve("mnist", url, "train")
    made = []
    original = plans.RunPlan._window_at

    def counted(self, at):
        made.append(at)
        return original(self, at)

    plans.RunPlan._window_at = counted
    try:
        with prefetching(4):
            keys, _ = epoch(src, shuffle_buffer=1, fetch_ahead=1 << 30)
    finally:
        plans.RunPlan._window_at = original
    windows = len(set(made))
    assert len(keys) == 160 and windows >= 8
    assert len(made) <= 2 * windows + 2, f"{len(made)} windows made for {windows}"


def test_a_fetch_thread_waiting_for_work_holds_no_shard(slow_server):
    """Once the reader has taken a shard fetched ahead, no idle thread keeps its bytes (each of
    the 16 threads held its last shard, outside the memory budget)."""
    from concurrent.futures import Future

    _, url = slow_server
    src = resolve("mnist", url, "train")
    reader = reading.Reader(src)
    windows = [plans.Window(((u, 0, None),)) for u in src.urls]
    for k in range(len(windows)):
        assert len(reader(windows[k], lambda k=k: windows[k + 1:])) == 20
    assert not reader.fetched and fetch_threads()

    def holding():
        gc.collect()
        return [f for f in gc.get_objects() if type(f) is Future and f.done() and not f.cancelled()
                and f.result()[0] is not None]

    deadline = time.time() + 5
    while holding() and time.time() < deadline:
        time.sleep(0.05)
    assert not holding(), "idle fetch threads hold the shards they fetched"


def test_a_budget_passed_by_fetching_ahead_names_the_flag(slow_server):
    """A job over the memory cap because of the shards a remote source fetches ahead is told
    to lower --fetch-ahead among the rest; a local source's refusal does not name it."""
    from types import SimpleNamespace

    from pipeline.train import guard

    folder, url = slow_server
    args = SimpleNamespace(batch_size=8, workers=2, max_batch_memory=1 << 30)
    far = MixedStream([resolve("mnist", url, "train")], {"mnist": 1}, 8, fetch_ahead=4 << 30)
    with pytest.raises(ValueError) as e:
        guard.check_memory(args, far)
    assert "fetched ahead (" in str(e.value) and "lower --shuffle-window, --fetch-ahead, --batch-size or --workers" \
        in str(e.value), str(e.value)  # the largest share first
    local = MixedStream([resolve("mnist", str(folder), "train")], {"mnist": 1}, 8, window_bytes=1 << 40,
                        shuffle_buffer=10**9)
    with pytest.raises(ValueError) as e:
        guard.check_memory(SimpleNamespace(batch_size=8, workers=2, max_batch_memory=1 << 10), local)
    assert "--fetch-ahead" not in str(e.value) and "--shuffle-window" in str(e.value), str(e.value)


def test_the_fetch_threads_leave_stop_signals_to_the_trainers_thread(monkeypatch):
    """A stop signal taken by a fetch thread would leave the trainer's thread waiting out a stalled read
    (stop.StopRequest.interruptible raises only where the signal interrupts the wait): the threads
    block every stop signal, so that the kernel hands it to a thread that does not."""
    import signal

    monkeypatch.setattr(reading, "_fetch", lambda *args: signal.pthread_sigmask(signal.SIG_BLOCK, []))
    fetcher = reading._Fetcher(1)
    try:
        blocked = fetcher.submit("u", None, None, None, None).result(timeout=30)
    finally:
        fetcher.stop()
    assert reading.STOP_SIGNALS <= blocked
    from pipeline.train.stop import ALLOWED

    assert reading.STOP_SIGNALS == {getattr(signal, "SIG" + name) for name in ALLOWED}  # any --stop-signals
    assert signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, [])  # this thread's own mask untouched
