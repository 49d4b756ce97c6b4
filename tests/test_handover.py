"""The hand-over of batches to the user (pipeline.data.handover.loader, ring, device, workers): batches
on the device, small fields that keep only themselves, bytes never overwritten whatever the
user keeps or copies, and the hand-over's failures (issue 53: two threads, a stuck worker, a
bad timeout, a huge batch without workers, the fork's copy, no busy wait). The CUDA cases
skip where no GPU is; device="cpu" runs the same path minus CUDA everywhere."""
import functools
import gc
import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch

from helpers import HALF, HANG, key_index, train_sources
from pipeline.data.streams.stream import MixedStream
from pipeline.data.handover.loader import make_loader

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _stream(data, n=20, batch=4, **kw):
    return MixedStream(train_sources(data.dir), HALF, batch, epoch_samples=batch * n, normalize=False, **kw)


_SAMPLES = {}


def _expected(data, name, index):
    """(3x32x32 uint8 image, label) of a sample as a uint8 batch holds it (MNIST padded, CIFAR10's
    labels after MNIST's)."""
    if (data.dir, name, index) not in _SAMPLES:
        _SAMPLES[data.dir, name, index] = _made(data, name, index)
    return _SAMPLES[data.dir, name, index]


def _made(data, name, index):
    synth = data.synth[name, "train"]
    original = synth.image(index)
    if name == "mnist":
        image = np.zeros((3, 32, 32), np.uint8)
        image[:, 2:30, 2:30] = original[0]
        return image, synth.label(index)
    return original, synth.label(index) + 10


def _wrong(data, keys, image, label, source):
    """The keys whose image or label in these (CPU) tensors are not the sample the key names."""
    bad = []
    for i, key in enumerate(keys):
        name = ("mnist", "cifar10")[int(source[i])]
        expect, expect_label = _expected(data, name, key_index(key))
        if not key.startswith(name) or not (image[i].numpy() == expect).all() or int(label[i]) != expect_label:
            bad.append(key)
    return bad


def _check(data, batch):
    cpu = {k: batch[k].cpu() for k in ("image", "label", "source")}
    assert _wrong(data, batch["key"], **cpu) == []


def _in_ring(loader, tensor):
    lo = loader.ring.memory.data_ptr()
    return lo <= tensor.data_ptr() < lo + loader.ring.memory.numel()


# ---------------------------------------------------------------- batches handed over on a device


@pytest.mark.parametrize("workers", [0, 2])
def test_a_cpu_device_hands_over_copies_and_gives_each_slot_back_at_once(data, workers):
    """device="cpu", the CUDA path minus CUDA: each batch is a copy of its slot (no tensor views
    the ring), the slot goes back right after the copy, and no batch is copied out twice."""
    loader = make_loader(_stream(data), workers, prefetch_factor=1, device="cpu")
    got = 0
    for b in loader:
        assert not any(_in_ring(loader, b[k]) for k in ("image", "label", "source"))
        assert loader.ring.held == [0] * max(workers, 1)
        _check(data, b)
        got += 1
    assert got == 20 and loader.ring.copied == 0
    loader.close()


@pytest.mark.parametrize("device", [None, "cpu"])
@pytest.mark.parametrize("workers", [0, 2])
def test_batches_held_over_three_epochs_keep_their_bytes(data, workers, device):
    """Every batch of 3 epochs held (10x a worker's slots): each keeps the bytes it arrived with."""
    s = _stream(data)
    loader = make_loader(s, workers, prefetch_factor=1, device=device)
    held = []
    for epoch in range(3):
        s.set_epoch(epoch)
        held += [(b, b["image"].clone(), b["label"].clone()) for b in loader]
    assert len(held) == 60
    for b, image, label in held:
        assert torch.equal(b["image"], image) and torch.equal(b["label"], label)
        _check(data, b)
    loader.close()


@pytest.mark.parametrize("device", [None, "cpu"])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_batch_dropped_right_after_its_copy_leaves_the_copy_whole(data, workers, device):
    """The CPU stand-in of a copy made on a side stream and the batch dropped before any wait:
    the copies, compared after the epoch, are the samples their keys name."""
    loader = make_loader(_stream(data), workers, prefetch_factor=1, device=device)
    copies = []
    for b in loader:
        copies.append((b["key"], b["image"].clone(), b["label"].clone(), b["source"].clone()))
        del b
    assert len(copies) == 20
    for keys, image, label, source in copies:
        assert _wrong(data, keys, image, label, source) == []
    loader.close()


def test_a_device_that_is_not_one_is_refused_in_one_line(data):
    with pytest.raises(ValueError, match=r"device must be 'cpu', 'cuda', 'cuda:N' or a torch.device, got 'gpu'"):
        make_loader(_stream(data), 0, device="gpu")
    with pytest.raises(ValueError, match=r"got 'cpu:1'"):  # the CPU has no second device
        make_loader(_stream(data), 0, device="cpu:1")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available here"):
            make_loader(_stream(data), 0, device="cuda")


# ---------------------------------------------------------------- a kept field keeps only itself


@pytest.mark.parametrize("workers", [0, 2])
def test_keeping_every_batchs_labels_keeps_only_their_bytes(data, workers):
    """A loop that keeps each batch's labels (to score the epoch at its end) holds at most twice
    the labels' own bytes, and the loader never copies a batch out (the labels viewed their slots:
    the ring's every slot held, and each batch after copied whole)."""
    loader = make_loader(_stream(data, n=30), workers, prefetch_factor=1)
    labels = [b["label"] for b in loader]
    own = sum(t.nelement() * t.element_size() for t in labels)
    retained = (sum(t.untyped_storage().nbytes() for t in labels)
                + sum(loader.ring.held) * loader.ring.spec.slot_bytes)
    assert len(labels) == 30 and loader.ring.copied == 0
    assert retained <= 2 * own, (retained, own)
    loader.close()


def test_a_loop_that_drops_each_batch_reuses_two_slots_without_workers(data):
    """At 0 workers the stream writes each batch into the slot given back last, whose bytes are
    still in the CPU's cache, not into each of the ring's slots in turn (which cost 8-12% of the
    samples per CPU-second of C and C8, docs/benchmarks.md): a loop that holds one batch at a
    time sees two slots, whatever the ring's depth."""
    loader = make_loader(_stream(data, n=20), 0, prefetch_factor=4)  # 6 slots
    seen = set()
    for b in loader:
        assert _in_ring(loader, b["image"])
        seen.add(b["image"].data_ptr())
    assert len(seen) == 2
    loader.close()


# ---------------------------------------------------------------- issue 53's hand-over failures


def test_two_threads_iterating_one_loader_without_workers_never_get_wrong_data(data):
    """One loader at num_workers=0, its pass on this thread paused between writing a batch into
    its slot and handing it out, while another thread runs a pass of its own: that pass waits for
    the batch to be handed out, this one's next step is refused in one line (or it ends first),
    and every batch either thread holds is the samples its keys name (the second pass wrote its
    first batch into the slot the first was writing: wrong data without an error, 6 of 20 attempts)."""
    loader = make_loader(_stream(data, n=8), 0, prefetch_factor=8, record=False)  # a slot for every batch
    lend, calls, other = loader.ring.lend, [0], {}

    def second_pass():
        other["batches"] = list(loader)

    def paused(*a):
        calls[0] += 1
        if calls[0] == 3:
            other["thread"] = threading.Thread(target=second_pass)
            other["thread"].start()
            other["thread"].join(2)  # it runs its pass, or waits for this one's batch to be handed out
        return lend(*a)

    loader.ring.lend = paused
    held = []
    try:
        for b in loader:
            held.append(b)
    except RuntimeError as e:  # the other pass began: this one ends here (the loader's line, or the stream's)
        assert "iterated again while this pass was being read" in str(e) or \
            "another pass began on this stream" in str(e), str(e)
    other["thread"].join(HANG)
    assert len(held) >= 3 and len(other["batches"]) == 8
    for b in held + other["batches"]:
        assert _wrong(data, b["key"], b["image"], b["label"], b["source"]) == []


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_two_threads_iterating_one_loader_again_and_again_never_get_wrong_data(data, workers):
    """The same with real threads and no pause, many attempts, with and without workers: each pass
    either ends or is refused in one line, and every batch held is the samples its keys name
    (with 2 workers both threads once read the same pipes and slots: 653 wrong samples in 15
    attempts, an IndexError from the workers' start, or a pass waiting for good)."""
    loader = make_loader(_stream(data, n=8), workers, prefetch_factor=8, record=False, timeout=HANG)
    wrong, errors, batches = [], [], [0]
    was = sys.getswitchinterval()

    def run():
        for _ in range(100 if workers == 0 else 30):
            held = []
            try:
                for b in loader:
                    held.append(b)
            except RuntimeError as e:  # the other thread's pass began: the loader's line, or the stream's
                if "iterated again" not in str(e) and "another pass began on this stream" not in str(e):
                    errors.append(repr(e))
            except Exception as e:  # noqa: BLE001 - anything else fails the test, from the main thread
                errors.append(repr(e))
            batches[0] += len(held)
            for b in held:
                wrong.extend(_wrong(data, b["key"], b["image"], b["label"], b["source"]))

    sys.setswitchinterval(0.005)  # Python's default: a thread paused mid-batch lets the other run a while
    try:
        threads = [threading.Thread(target=run) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(HANG)
    finally:
        sys.setswitchinterval(was)
    assert not any(t.is_alive() for t in threads)
    assert errors == [] and wrong == [] and batches[0] >= 8


@pytest.mark.parametrize("timeout", [math.nan, -1, 0, math.inf, "3", 1e300, True])
def test_a_timeout_that_is_not_a_finite_positive_number_is_refused_at_once(data, timeout):
    with pytest.raises(ValueError, match=r"timeout must be a finite number of seconds above 0 .*, got"):
        make_loader(_stream(data), 2, timeout=timeout)


def test_a_huge_batch_without_workers_is_refused_up_front_in_one_line(data):
    """The estimate and one-line refusal that workers get (their shared memory), at 0 workers too
    (torch's allocator said it could not allocate 113 GB)."""
    with open("/proc/meminfo") as f:
        available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    batch = available // (3 * 32 * 32) + 1  # one batch larger than all the memory available
    with pytest.raises(ValueError, match=r"the loader needs \d+ MiB for its batches .* available: lower --batch-size"):
        make_loader(MixedStream(train_sources(data.dir), HALF, batch, epoch_samples=batch, normalize=False), 0)


STUCK = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from helpers import HALF, train_sources
from pipeline.data.streams.stream import MixedStream
from pipeline.data.handover.loader import make_loader

s = MixedStream(train_sources({folder!r}), HALF, 4, epoch_samples=4 * 30, normalize=False)
loader = make_loader(s, 2, prefetch_factor=1, timeout=2, record=False)
first = [k for b in loader for k in b["key"]]
s.set_epoch(0)
it = iter(loader)
next(it)
stuck = loader.workers.procs[1]
os.kill(stuck.pid, signal.SIGSTOP)  # as a worker in uninterruptible I/O
try:
    for _ in it:
        pass
except TimeoutError as e:
    print("TIMEOUT", e, flush=True)
print("KILLED", not stuck.is_alive(), flush=True)
s.set_epoch(0)
print("NEXT", [k for b in loader for k in b["key"]] == first, flush=True)
"""


@pytest.mark.slow
def test_a_worker_that_times_out_is_replaced_and_the_process_can_end(data):
    """A stopped worker meets make_loader's timeout with one line naming it; it is killed, the next
    pass starts the workers again and reads its whole epoch, and the interpreter exits (it sent to
    the same stuck worker, failed again, and hung at exit joining it)."""
    script = STUCK.format(tests=os.path.join(ROOT, "tests"), folder=data.dir)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=HANG,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 0, p.stderr[-2000:]
    lines = p.stdout.splitlines()
    assert lines[0].startswith("TIMEOUT loader worker 1 (pid ") and "sent nothing for 2 s" in lines[0], p.stdout
    assert "it was killed, and the next pass starts the workers again" in lines[0]
    assert lines[1:] == ["KILLED True", "NEXT True"], p.stdout


class _Pausing(dict):
    """A lent table whose iteration stops after its first slot until `meanwhile()` has run, or a
    while (`meanwhile` is blocked: the table is read under the lock it needs)."""

    meanwhile = None

    def __iter__(self):
        it = dict.__iter__(self)
        yield next(it)
        if self.meanwhile is not None:
            t = threading.Thread(target=self.meanwhile)
            t.start()
            t.join(2)
        yield from it


def test_the_forks_copy_of_kept_batches_reads_the_lent_table_under_its_lock(data):
    """A batch dropped on another thread while this one forks: the at-fork hook copies the lent
    slots from a table that does not change under it (it failed, printed as ignored, and the child
    kept no copy); the child still has the batches it was given."""
    loader = make_loader(_stream(data), 1, prefetch_factor=2)
    it = iter(loader)
    kept = [next(it) for _ in range(3)]
    before = kept[1]["image"].clone()
    table = _Pausing(loader.ring.lent[0])
    table.meanwhile = functools.partial(kept.pop, 0)  # the first batch dropped, on another thread
    loader.ring.lent[0] = table
    failures = []
    hook, sys.unraisablehook = sys.unraisablehook, lambda u: failures.append(repr(u.exc_value))
    try:
        pid = os.fork()
        if pid == 0:
            os._exit(0 if torch.equal(kept[0]["image"], before) else 1)
        _, status = os.waitpid(pid, 0)
    finally:
        sys.unraisablehook = hook
    table.meanwhile = None
    assert failures == [] and os.waitstatus_to_exitcode(status) == 0 and len(kept) == 2
    kept.clear()
    assert len(list(it)) == 17
    loader.close()


class _NeverDone:
    """A CUDA event of a copy that has not completed: query() says so, synchronize() blocks a while."""

    def __init__(self):
        self.queries = self.waits = 0

    def query(self):
        self.queries += 1
        if self.queries > 1000:
            raise AssertionError("the consumer polls the copy's event")
        return False

    def synchronize(self):
        import time
        self.waits += 1
        time.sleep(0.02)


@pytest.mark.slow
def test_a_slot_waiting_for_a_gpu_copy_is_not_polled_and_the_timeout_still_fires(data):
    """While a slot waits for a GPU copy's event and its worker sends nothing, the consumer blocks
    on the event (never polls it every millisecond), and make_loader's timeout still fires (it
    never did)."""
    loader = make_loader(_stream(data, n=30), 1, prefetch_factor=1, timeout=1)
    it = iter(loader)
    next(it)
    event = _NeverDone()
    loader.ring._pending.append((event, 0, 0, -1))  # as `hand` leaves a slot whose copy is queued
    os.kill(loader.workers.procs[0].pid, signal.SIGSTOP)
    with pytest.raises(TimeoutError, match=r"loader worker 0 \(pid \d+\) sent nothing for 1 s"):
        for _ in it:
            pass
    assert event.waits >= 1
    loader.ring._pending.clear()
    loader.close()


# ---------------------------------------------------------------- CUDA (skipped where none)


@CUDA
@pytest.mark.parametrize("workers", [0, 2])
def test_cuda_batches_arrive_on_the_device_and_held_ones_keep_their_bytes(data, workers):
    s = _stream(data)
    loader = make_loader(s, workers, prefetch_factor=1, device="cuda")
    held = []
    for epoch in range(3):
        s.set_epoch(epoch)
        for b in loader:
            assert b["image"].is_cuda and b["label"].is_cuda and all(isinstance(k, str) for k in b["key"])
            held.append((b, b["image"].clone()))
    torch.cuda.synchronize()
    for b, image in held:
        assert torch.equal(b["image"], image)
        _check(data, b)
    loader.close()


@CUDA
@pytest.mark.parametrize("workers", [0, 2])
def test_cuda_copies_on_a_side_stream_of_batches_dropped_before_any_wait_are_whole(data, workers):
    """Pinned CPU views copied by the user on a stream of their own, dropped at once: the slot goes
    back only after a device synchronisation begun after the drop, so no copy reads a rewritten slot."""
    loader = make_loader(_stream(data, n=40), workers, prefetch_factor=1, pin_memory=True)
    side = torch.cuda.Stream()
    copies = []
    for b in loader:
        assert b["image"].is_pinned()
        with torch.cuda.stream(side):
            image = b["image"].to("cuda", non_blocking=True)
        copies.append((b["key"], image, b["label"].clone(), b["source"].clone()))
        del b
    torch.cuda.synchronize()
    for keys, image, label, source in copies:
        assert _wrong(data, keys, image.cpu(), label, source) == []
    loader.close()


@CUDA
def test_cuda_a_refused_page_lock_is_one_warning_and_the_batches_are_right(data, monkeypatch):
    from pipeline.data.handover import ring

    monkeypatch.setattr(ring, "_register", lambda memory: False)
    loader = make_loader(_stream(data), 2, prefetch_factor=1, device="cuda")
    with pytest.warns(RuntimeWarning, match="cudaHostRegister refused .* not pinned"):
        batches = list(loader)
    for b in batches:
        _check(data, b)
    loader.close()


@CUDA
@pytest.mark.parametrize("how", ["close", "kill"])
def test_cuda_workers_started_again_after_the_ring_was_page_locked_work(data, how):
    s = _stream(data)
    loader = make_loader(s, 2, prefetch_factor=1, device="cuda")
    first = [k for b in loader for k in b["key"]]
    assert loader.ring._registered
    if how == "close":
        loader.workers.close()
    else:
        os.kill(loader.workers.procs[0].pid, signal.SIGKILL)
        loader.workers.procs[0].join(HANG)
    s.set_epoch(0)
    again = list(loader)
    assert [k for b in again for k in b["key"]] == first and loader.ring._registered
    for b in again:
        _check(data, b)
    gc.collect()
    loader.close()


# ---------------------------------------------------------------- batches sent in groups


def _sent(fd):
    """(pass, kind, slot) of each message waiting in a pipe (non-blocking), in order."""
    from pipeline.data.handover.workers import HEADER
    data = b""
    while True:
        try:
            data += os.read(fd, 1 << 16)
        except BlockingIOError:
            break
    out = []
    while data:
        got, kind, slot, _, size = HEADER.unpack_from(data)
        out.append((got, kind, slot))
        data = data[HEADER.size + size:]
    return out


def test_a_worker_sends_a_passs_first_batch_at_once_then_its_batches_in_groups():
    """Past a pass's first batch, a worker's batches go GROUP to a write (a waiting consumer is
    woken once for them); the END and an ERROR go after those held back; a pass left drops them."""
    from pipeline.data.handover.workers import BATCH, END, ERROR, GROUP, _Outbox
    r, w = os.pipe()
    os.set_blocking(r, False)
    out = _Outbox(w)
    out.hold = math.inf  # a loaded machine's pause between two calls here is no slow worker
    out.begin(7)
    out.batch(0, 4, b"first")
    assert _sent(r) == [(7, BATCH, 0)]
    for k in range(1, GROUP):
        out.batch(k, 4, b"x" * 5000)
        assert _sent(r) == []
    out.batch(GROUP, 4, b"x")
    assert _sent(r) == [(7, BATCH, k) for k in range(1, GROUP + 1)]
    out.batch(5, 3, b"x")
    out.send(END, b"")
    assert _sent(r) == [(7, BATCH, 5), (7, END, -1)]
    out.begin(8)
    out.batch(1, 4, b"x")
    out.batch(2, 4, b"x")
    assert _sent(r) == [(8, BATCH, 1)]
    out.send(ERROR, b"boom")
    assert _sent(r) == [(8, BATCH, 2), (8, ERROR, -1)]
    out.batch(3, 4, b"x")  # held (the pass's first went), then the consumer left the pass
    out.begin(9)
    out.batch(4, 4, b"x")
    assert _sent(r) == [(9, BATCH, 4)]
    os.close(r)
    os.close(w)


def test_a_worker_out_of_slots_sends_what_it_held_back_before_it_waits():
    """The consumer may be waiting for the batches a worker holds back, and the worker for a slot
    the consumer gives back only after them: they go first."""
    from pipeline.data.handover.workers import BATCH, SLOT, _Outbox, _Slots
    r, w = os.pipe()
    os.set_blocking(r, False)
    free_r, free_w = os.pipe()
    out = _Outbox(w)
    out.hold = math.inf
    slots = _Slots(free_r, [3], 0, out)
    slots.begin(3, [0, 1])
    out.begin(3)
    out.batch(slots.take(), 4, b"x")
    out.batch(slots.take(), 4, b"x")  # held back, and no slot left: the next take sends it, then waits
    assert _sent(r) == [(3, BATCH, 0)]
    os.write(free_w, SLOT.pack(3, 0))  # the consumer gives slot 0 back once it has batch 1
    assert slots.take() == 0
    assert _sent(r) == [(3, BATCH, 1)]
    for fd in (r, w, free_r, free_w):
        os.close(fd)


def _slow(sample):
    time.sleep(0.15)
    return sample


@pytest.mark.slow
def test_a_slow_worker_sends_each_batch_at_once_and_meets_a_timeout_a_few_batches_long(data):
    """A worker making a batch in 0.3 s sends it at once: held back GROUP to a write, the consumer
    waited 1.2 s for them and the worker was killed for make_loader's timeout of 1 s."""
    s = _stream(data, n=6, batch=2, sample_stages=(_slow,))
    first = [k for b in make_loader(s, 0) for k in b["key"]]
    s.set_epoch(0)
    loader = make_loader(s, 1, timeout=1)
    try:
        assert [k for b in loader for k in b["key"]] == first
    finally:
        loader.close()


FORKED = """
import os, sys
sys.path.insert(0, {tests!r})
from helpers import HALF, train_sources
from pipeline.data.streams.stream import MixedStream
from pipeline.data.handover.loader import make_loader

s = MixedStream(train_sources({folder!r}), HALF, 4, epoch_samples=4 * 60, normalize=False)
loader = make_loader(s, 2, prefetch_factor=1, timeout=20)  # most of the pass still to be made at the fork
first = [k for b in loader for k in b["key"]]
s.set_epoch(0)
it = iter(loader)
got = [k for _ in range(3) for k in next(it)["key"]]
pid = os.fork()
if pid == 0:
    sys.exit(0)  # the interpreter's exit, with multiprocessing's exit handler
os.waitpid(pid, 0)
got += [k for b in it for k in b["key"]]
print("WHOLE", got == first, flush=True)
"""


def test_a_child_forked_in_the_loop_leaves_the_passs_workers_alone_when_it_exits(data):
    """A process forked with os.fork from the loop, which never touches the loader and ends with
    sys.exit(0): multiprocessing's exit handler there terminated the workers it inherited in its
    list of children (they are the parent's), and the parent's pass ended with a dead worker."""
    script = FORKED.format(tests=os.path.join(ROOT, "tests"), folder=data.dir)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=HANG,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.splitlines() == ["WHOLE True"], p.stdout


class _Gate:
    """A sample stage that makes the worker's first 16 samples (4 batches of 4) at once, then
    waits, up to 20 s, for a file the consumer writes once it holds batch 3 (its 4th)."""

    def __init__(self, path):
        self.path, self.made = path, 0

    def __call__(self, sample):
        self.made += 1
        if self.made > 16:
            end = time.monotonic() + 20
            while not os.path.exists(self.path):
                if time.monotonic() > end:
                    raise RuntimeError("batches 1-3 never reached the consumer while the next was made")
                time.sleep(0.01)
        return sample


def test_batches_held_back_reach_the_consumer_while_the_next_is_still_made(data, tmp_path):
    """Batches made fast and held back to go together go within `hold` seconds, not when the next
    batch is made, which may take any time: a batch held until a slow one was ready reached the
    consumer seconds late (or past make_loader's timeout, the worker killed for sending nothing)."""
    gate = tmp_path / "got-batch-3"
    s = _stream(data, n=8, batch=4, sample_stages=(_Gate(str(gate)),))
    loader = make_loader(s, 1, prefetch_factor=8)
    try:
        keys = []
        for i, b in enumerate(loader):
            keys += b["key"]
            if i == 3:
                gate.touch()
        assert len(keys) == 32
    finally:
        loader.close()
