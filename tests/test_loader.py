"""pipeline.data.handover.loader, ring and workers: batches written once into ring slots, handed out as
views of them, slots back only when nothing refers to a batch; workers that persist across
passes and follow set_epoch; errors and deaths of workers."""
import os
import signal
import time

import numpy as np
import pytest
import torch

from helpers import HALF, key_index, keys_of, run_epoch, train_sources
from pipeline.data.fields.spec import Field, Spec
from pipeline.data.handover.ring import Ring
from pipeline.data.streams.stream import MixedStream
from pipeline.data.handover.loader import make_loader
from pipeline.data.handover.workers import WorkerDied
from pipeline.errors import InputError


def _check_pixels(data, batch):
    """Every image of a uint8 batch equals its original, MNIST's zero border included."""
    for i, (key, src) in enumerate(zip(batch["key"], batch["source"].tolist())):
        name = ("mnist", "cifar10")[src]
        original = data.synth[name, "train"].image(key_index(key))
        img = batch["image"][i].numpy()
        if src == 0:
            expect = np.zeros((3, 32, 32), np.uint8)
            expect[:, 2:30, 2:30] = original[0]
            assert (img == expect).all(), key
        else:
            assert (img == original).all(), key


def _in_ring(loader, tensor):
    memory = loader.ring.memory
    lo, hi = memory.data_ptr(), memory.data_ptr() + memory.numel()
    return lo <= tensor.data_ptr() < hi


@pytest.mark.slow
def test_worker_batches_are_views_of_the_ring_and_reused_slots_start_clean(data):
    """40 batches over 2 workers reuse each of a worker's 6 slots several times: every batch's
    image is a view of the shared ring (no copy in this process), and a CIFAR10 image left in a slot must
    not show through the border of a later MNIST one. Normalised by the workers, the float32
    batches equal Layout.normalize of the uint8 ones, bit for bit."""
    def stream(normalize):
        return MixedStream(train_sources(data.dir), HALF, 8, epoch_samples=8 * 40, normalize=normalize)

    u8, f32 = stream(False), stream(True)
    loaders = make_loader(u8, 2), make_loader(f32, 2)
    count = 0
    for a, b in zip(*loaders):
        count += 1
        for loader, batch in zip(loaders, (a, b)):
            assert _in_ring(loader, batch["image"])  # the small fields are tensors of their own
            assert not any(_in_ring(loader, batch[k]) for k in ("label", "source"))
        assert a["image"].dtype == torch.uint8 and b["image"].dtype == torch.float32
        _check_pixels(data, a)
        assert torch.equal(u8.layout.normalize(a["image"], a["source"]), b["image"])
    assert count == 40 and all(loader.ring.copied == 0 for loader in loaders)


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_batches_the_user_keeps_are_never_overwritten(data, workers):
    """Hold every batch of an epoch (3 x the ring's slots, and more): each keeps the bytes it had
    when it arrived. The loader copies a batch out instead of lending its slot once the user
    holds all but one of a worker's slots, so the workers never wait for good."""
    stream = MixedStream(train_sources(data.dir), HALF, 4, epoch_samples=4 * 60, normalize=False)
    loader = make_loader(stream, workers, prefetch_factor=2)
    slots = loader.ring.depth * max(workers, 1)
    held, first = [], []
    for b in loader:
        held.append(b)
        first.append(b["image"].clone())
    assert len(held) == 60 >= 3 * slots
    for b, image in zip(held, first):
        assert torch.equal(b["image"], image)
        _check_pixels(data, b)


@pytest.mark.slow
def test_a_slot_goes_back_only_when_its_last_tensor_is_gone(data):
    """A view of a batch (a slice, a numpy array of it) keeps its slot; dropping everything frees it."""
    stream = MixedStream(train_sources(data.dir), HALF, 4, epoch_samples=4 * 12, normalize=False)
    loader = make_loader(stream, 1, prefetch_factor=2)
    it = iter(loader)
    b = next(it)
    part = b["image"][1:3].numpy()
    saved = part.copy()
    assert loader.ring.held[0] == 1
    del b
    assert loader.ring.held[0] == 1  # the numpy view still holds it
    rest = [x["key"] for x in it]
    assert np.array_equal(part, saved) and len(rest) == 11
    del part
    assert loader.ring.held[0] == 0


def test_a_ring_lends_views_and_copies_once_the_user_holds_all_but_one_slot():
    spec = Spec([Field("image", np.uint8, (16, 16)), Field("label", np.int64)], batch=3)
    ring = Ring(1, 3, spec, shared=False)
    back = []
    ring.give_back = lambda p, k: back.append(k)
    for k in range(3):
        ring.arrays(0, k, 3)["label"][:] = k
    a = ring.lend(0, 0, 3)
    b = ring.lend(0, 1, 2)
    assert ring.held == [2] and back == [] and b["label"].tolist() == [1, 1]
    c = ring.lend(0, 2, 3)  # it would leave the producer no slot: a copy, and the slot back at once
    assert back == [2] and c["label"].tolist() == [2, 2, 2] and ring.copied == 1
    del a
    assert back == [2, 0] and ring.held == [1]
    view = b["image"][0]
    del b
    assert back == [2, 0]
    del view
    assert back == [2, 0, 1] and ring.held == [0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
@pytest.mark.parametrize("workers", [0, 2])
def test_pinned_batches_where_cuda_is(data, workers):
    stream = MixedStream(train_sources(data.dir), HALF, 8, epoch_samples=8 * 6, normalize=False)
    batches = list(make_loader(stream, workers, pin_memory=True))
    assert len(batches) == 6 and all(b["image"].is_pinned() for b in batches)


@pytest.mark.slow
def test_persistent_workers_follow_set_epoch_and_weights(even):
    """One loader for several epochs: its workers must see each set_epoch (and new weights)."""
    def fresh(epoch, weights):
        s = MixedStream(train_sources(even), weights, 8, seed=3, shuffle_buffer=8)
        s.set_epoch(epoch, weights)
        return keys_of(run_epoch(s, workers=2))

    s = MixedStream(train_sources(even), HALF, 8, seed=3, shuffle_buffer=8)
    loader = make_loader(s, 2)
    seen = []
    for epoch, weights in ((0, HALF), (1, HALF), (2, {"mnist": 1.0, "cifar10": 0.0})):
        s.set_epoch(epoch, weights)
        seen.append([k for b in loader for k in b["key"]])
        assert seen[-1] == fresh(epoch, weights)
    assert seen[0] != seen[1]
    assert all(k.startswith("mnist") for k in seen[2])


@pytest.mark.slow
def test_a_pass_left_early_is_dropped_and_the_next_reads_its_own_epoch(even):
    s = MixedStream(train_sources(even), HALF, 8, seed=3, shuffle_buffer=8)
    loader = make_loader(s, 2, prefetch_factor=1)
    s.set_epoch(0)
    for i, _ in enumerate(loader):
        if i == 2:
            break
    s.set_epoch(1)
    got = [k for b in loader for k in b["key"]]
    s2 = MixedStream(train_sources(even), HALF, 8, seed=3, shuffle_buffer=8)
    s2.set_epoch(1)
    assert got == keys_of(run_epoch(s2, workers=2))


class _Boom:
    """A sample stage that fails on the 5th sample a worker decodes."""

    def __init__(self):
        self.n = 0

    def __call__(self, sample):
        self.n += 1
        if self.n == 5:
            raise ValueError("stage failed on purpose")
        return sample


@pytest.mark.slow
def test_a_workers_error_is_raised_here_with_its_type_and_message(data):
    stream = MixedStream(train_sources(data.dir), HALF, 4, epoch_samples=64, sample_stages=[_Boom()])
    with pytest.raises(ValueError, match="stage failed on purpose") as info:
        list(make_loader(stream, 2))
    assert "loader worker" in str(info.value.__cause__)


@pytest.mark.slow
def test_a_killed_worker_is_one_error_not_a_hang(data):
    stream = MixedStream(train_sources(data.dir), HALF, 4, epoch_samples=4 * 40, normalize=False)
    loader = make_loader(stream, 2, prefetch_factor=1)
    it = iter(loader)
    next(it)
    os.kill(loader.workers.procs[1].pid, signal.SIGKILL)
    with pytest.raises(WorkerDied, match=r"loader worker 1 \(pid \d+\) ended unexpectedly \(signal SIGKILL\)"):
        for _ in it:
            pass


@pytest.mark.slow
def test_the_stream_in_a_dataloader_of_the_users_own(data):
    """iter(stream) runs in each worker of a plain torch DataLoader: the same batches as make_loader's."""
    def stream():
        s = MixedStream(train_sources(data.dir), HALF, 8, epoch_samples=8 * 10, normalize=False)
        s.set_workers(2)
        return s

    mine = torch.utils.data.DataLoader(stream(), batch_size=None, num_workers=2)
    assert [k for b in mine for k in b["key"]] == keys_of(run_epoch(stream(), workers=2))


@pytest.mark.slow
def test_a_pass_started_early_is_the_one_read_unless_the_plan_changed(even):
    """start() begins the next pass while the caller builds its model: iterated as planned it is
    that pass; after set_epoch (or a loaded state) its batches are dropped for the new plan's."""
    def expected(epoch):
        s = MixedStream(train_sources(even), HALF, 8, seed=3, shuffle_buffer=8)
        s.set_epoch(epoch)
        return keys_of(run_epoch(s, workers=2))

    s = MixedStream(train_sources(even), HALF, 8, seed=3, shuffle_buffer=8)
    loader = make_loader(s, 2).start()
    first = loader._early[1]
    assert [k for b in loader for k in b["key"]] == expected(0) and loader.workers.pass_id == first
    t = MixedStream(train_sources(even), HALF, 8, seed=3, shuffle_buffer=8)
    loader = make_loader(t, 2).start()
    t.set_epoch(1)
    assert [k for b in loader for k in b["key"]] == expected(1) and loader.workers.pass_id == 2


@pytest.mark.slow
def test_forkserver_workers_read_what_forked_ones_read(even):
    """start_method="forkserver": the stream, its ring and the pipes travel pickled; the same batches."""
    def keys(method):
        s = MixedStream(train_sources(even), HALF, 8, seed=3, shuffle_buffer=8, normalize=False)
        loader = make_loader(s, 2, start_method=method)
        out = []
        for epoch in (0, 1):
            s.set_epoch(epoch)
            out.append([k for b in loader for k in b["key"]])
        loader.close()
        return out

    assert keys("forkserver") == keys("fork")


# ---------------------------------------------------------------- the hostile review's findings


def _stream(data, n=40, **kw):
    return MixedStream(train_sources(data.dir), HALF, 4, epoch_samples=4 * n, normalize=False, **kw)


@pytest.mark.slow
def test_a_worker_killed_between_passes_is_started_again_by_the_next(data):
    s = _stream(data)
    loader = make_loader(s, 2)
    first = [k for b in loader for k in b["key"]]
    os.kill(loader.workers.procs[0].pid, signal.SIGKILL)
    loader.workers.procs[0].join(5)
    s.set_epoch(0)
    assert [k for b in loader for k in b["key"]] == first  # was BrokenPipeError from begin()


@pytest.mark.slow
def test_a_closed_loader_says_so(data):
    loader = make_loader(_stream(data), 2)
    it = iter(loader)
    next(it)
    loader.close()
    with pytest.raises(RuntimeError, match="the loader was closed"):  # was IndexError
        next(it)


@pytest.mark.slow
def test_ctrl_c_to_the_workers_is_left_to_the_consumer(data):
    """A Ctrl-C reaches the terminal's whole process group; the workers ignore it, so a loop that
    catches KeyboardInterrupt and goes on still has its workers (they exited before)."""
    loader = make_loader(_stream(data), 2, prefetch_factor=1)
    it = iter(loader)
    next(it)
    for p in loader.workers.procs:
        os.kill(p.pid, signal.SIGINT)
    assert len(list(it)) == 39


class _Exit:
    def __call__(self, sample):
        raise SystemExit(5)


@pytest.mark.slow
def test_an_exit_raised_in_a_worker_does_not_end_the_consumer(data):
    with pytest.raises(RuntimeError, match="SystemExit: 5"):
        list(make_loader(_stream(data, sample_stages=[_Exit()]), 2))


class _HugeExit(BaseException):
    """Not an Exception: past the stage's own one-line error, to the worker's."""


class _Huge:
    def __init__(self, kind):
        self.kind = kind

    def __call__(self, sample):
        raise self.kind("x" * (10 << 20))


@pytest.mark.slow
@pytest.mark.parametrize("kind, arrives", [(ValueError, InputError), (_HugeExit, RuntimeError)])
def test_a_huge_error_from_a_worker_arrives_cut(data, kind, arrives):
    """A 10 MiB message (a 200 MiB one arrived whole, 1.2 GB of the consumer's memory): cut where the
    stage's error line is made, or, for what passes that, where the worker sends it."""
    with pytest.raises(arrives) as e:
        list(make_loader(_stream(data, sample_stages=[_Huge(kind)]), 1))
    assert len(str(e.value)) < 100_000 and "more characters" in str(e.value)


@pytest.mark.slow
def test_a_forked_child_dropping_a_batch_leaves_the_parents_slot_alone(data):
    """The child's copy of a lent batch dies with the child: the slot stays the parent's (it was given
    back to the worker, which overwrote the batch the parent still held)."""
    loader = make_loader(_stream(data), 1, prefetch_factor=1)
    it = iter(loader)
    kept = next(it)
    next(it)  # the loader's own reference moves on: the child's copy of `kept` is its last
    before = kept["image"].clone()
    pid = os.fork()
    if pid == 0:
        del kept
        import gc
        gc.collect()
        os._exit(0)
    os.waitpid(pid, 0)
    rest = list(it)
    assert len(rest) == 38 and torch.equal(kept["image"], before)


def _kill_mid_pass(loader, it):
    os.kill(loader.workers.procs[0].pid, signal.SIGKILL)
    with pytest.raises(WorkerDied):
        for _ in it:
            pass


@pytest.mark.slow
@pytest.mark.parametrize("how", ["close", "kill"])
def test_batches_kept_across_a_restart_of_the_workers_are_never_overwritten(data, how):
    """Workers started again (after close(), or after one died: the error says the next pass does
    it) begin without the slots the user still holds, and each of those goes back once, when
    dropped: the kept batches of the pass before, and every batch of the pass after, keep their
    bytes (the new worker took all its slots as free: 2 of 2 kept batches overwritten; a slot
    dropped after the restart was free twice: 1 of 34)."""
    s = _stream(data)
    loader = make_loader(s, 1, prefetch_factor=2)
    it = iter(loader)
    kept = [next(it) for _ in range(2)]
    last = next(it)  # dropped after the restart, as a loop's variable is when the retried loop rebinds it
    if how == "close":
        loader.close()
    else:
        _kill_mid_pass(loader, it)
    before = [b["image"].clone() for b in kept]
    s.set_epoch(1)
    held = []
    for i, b in enumerate(loader):
        if i == 1:
            del last
        held.append((b, b["image"].clone()))
    assert len(held) == 40
    assert all(torch.equal(b["image"], image) for b, image in zip(kept, before))
    for b, image in held:
        assert torch.equal(b["image"], image)
        _check_pixels(data, b)  # the new worker writes where the consumer reads: the ring is still shared


@pytest.mark.slow
def test_a_ctrl_c_between_a_messages_header_and_its_payload_loses_nothing(data):
    """A KeyboardInterrupt caught while the consumer waits for a batch's payload, its header read:
    the next pass still reads whole messages (it parsed the payload as the next header)."""
    from pipeline.data.handover.workers import HEADER

    s = _stream(data)
    loader = make_loader(s, 1, timeout=30)  # a payload read as a header waits for bytes that never come
    first = [k for b in loader for k in b["key"]]
    s.set_epoch(0)
    fill, armed = loader.workers._fill, [True]

    def interrupted(w, size):
        if armed[0] and size > HEADER.size:
            armed[0] = False
            fill(w, HEADER.size)
            raise KeyboardInterrupt
        return fill(w, size)

    loader.workers._fill = interrupted
    with pytest.raises(KeyboardInterrupt):
        next(iter(loader))
    assert [k for b in loader for k in b["key"]] == first


@pytest.mark.slow
def test_a_ctrl_c_between_a_batchs_message_and_its_lend_loses_no_slot(data, monkeypatch):
    """A KeyboardInterrupt caught after a worker's message left the pipe but before its slot was
    lent, once a pass for more passes than the worker has slots: each pass begins with every slot
    nobody holds, so the last pass still reads its whole epoch (it waited for a slot for good)."""
    import pipeline.data.handover.loader as loader_module

    s = _stream(data)
    loader = make_loader(s, 1, prefetch_factor=2, timeout=30)  # 4 slots
    first = [k for b in loader for k in b["key"]]
    unpack = loader_module.unpack

    def interrupted(payload, n):
        monkeypatch.setattr(loader_module, "unpack", unpack)
        raise KeyboardInterrupt

    for _ in range(loader.ring.depth + 1):
        s.set_epoch(0)
        monkeypatch.setattr(loader_module, "unpack", interrupted)
        with pytest.raises(KeyboardInterrupt):
            next(iter(loader))
    s.set_epoch(0)
    assert [k for b in loader for k in b["key"]] == first


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the Ctrl-C Python ignores
def test_a_batch_whose_return_was_cut_short_frees_its_slot_at_the_next_pass(data):
    """A Ctrl-C as a dropped batch's finalizer begins: Python prints it as ignored and the slot's
    return never runs. The next pass finds the batch gone and frees the slot, so the worker keeps
    its slots and no batch is copied out (every batch was copied out from the third pass on)."""
    import sys

    s = _stream(data)
    loader = make_loader(s, 1, prefetch_factor=2)  # 4 slots
    armed = [False]

    def profile(frame, event, arg):
        if armed[0] and event == "call" and frame.f_code is Ring._dropped.__code__:
            armed[0] = False
            raise KeyboardInterrupt

    for epoch in range(loader.ring.depth + 1):
        s.set_epoch(epoch)
        for i, b in enumerate(loader):
            if i == 2:
                armed[0] = True
                sys.setprofile(profile)  # the batch is dropped as the loop moves on
            elif i == 4:
                sys.setprofile(None)
        sys.setprofile(None)
        assert not armed[0]  # the finalizer was cut short
    assert loader.ring.copied == 0


def _compare_later(batch, expect, go, result):
    go.wait(60)
    result.put(torch.equal(batch["image"], expect))


@pytest.mark.slow
def test_a_process_forked_in_the_loop_keeps_the_batch_it_was_given(data):
    """A batch handed to a forked process (a writer, say) stays what it was there after the
    consumer dropped it and its worker wrote the slot again (the child saw the slot's next batch)."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    go, result = ctx.Event(), ctx.Queue()
    loader = make_loader(_stream(data), 2, prefetch_factor=1)
    child = None
    for i, b in enumerate(loader):
        if i == 3:
            child = ctx.Process(target=_compare_later, args=(b, b["image"].clone(), go, result))
            child.start()
    assert loader.ring.copied == 0  # every slot was lent and written again
    go.set()
    assert result.get(timeout=120) is True
    child.join(60)
    assert child.exitcode == 0


def test_a_second_pass_at_zero_workers_stops_the_first(data):
    loader = make_loader(_stream(data), 0)
    first = iter(loader)
    next(first)
    second = iter(loader)
    next(second)
    with pytest.raises(RuntimeError, match="iterated again"):  # both ran before: 27 batches read twice
        next(first)


def test_a_ring_that_would_not_fit_in_shared_memory_is_one_line(tmp_path):
    from pipeline.data.handover.loader import check_shared_memory

    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    check_shared_memory(free // 2, str(tmp_path))
    with pytest.raises(ValueError, match=r"MiB of shared memory .* lower --workers or --batch-size"):
        check_shared_memory(free + (1 << 30), str(tmp_path))


class _Sleep:
    def __call__(self, sample):
        import time
        time.sleep(30)
        return sample


@pytest.mark.slow
def test_a_worker_that_sends_nothing_fails_the_pass_after_the_timeout(data):
    with pytest.raises(TimeoutError, match=r"loader worker \d \(pid \d+\) sent nothing for 2 s"):
        list(make_loader(_stream(data, sample_stages=[_Sleep()]), 2, timeout=2))


@pytest.mark.slow
def test_close_from_another_thread_while_the_workers_start_never_hangs_or_leaks(data):
    """close() from another thread at a random moment of start() or of a first pass (forking, the
    pass begun, the first batch read): both threads end (a hang fails), start/next either finish
    or raise the one 'the loader was closed' line, no worker process is left, no thread raises
    anything else, and the loader's next pass reads the rest of the epoch."""
    import multiprocessing
    import random
    import threading

    rng = random.Random(5)
    before = set(multiprocessing.active_children())
    for i in range(24):
        loader = make_loader(_stream(data, n=4), 2, prefetch_factor=1)
        errors, first, delay = [], rng.random() < 0.5, rng.random() * 0.04  # start() alone, or a first batch
        free_slots, pause = loader.ring.free_slots, rng.random() * 0.05  # a pass begun: forked, not yet told
        loader.ring.free_slots = lambda install, f=free_slots, s=pause: time.sleep(s) or f(install)

        def run(fn):
            try:
                fn()
            except RuntimeError as e:
                if "the loader was closed" not in str(e):
                    errors.append(e)
            except BaseException as e:  # noqa: BLE001 - anything else is what this test looks for
                errors.append(e)

        got = []  # the first batch's keys, where the starter read one
        starter = threading.Thread(target=run, args=((lambda: got.extend(next(iter(loader))["key"])) if first
                                                     else loader.start,))
        closer = threading.Thread(target=run, args=(lambda: time.sleep(delay) or loader.close(),))
        starter.start(), closer.start()
        for t in (starter, closer):
            t.join(60)  # a hang guard, not a speed test
            assert not t.is_alive(), f"round {i}: a thread still runs after close()"
        assert not errors, f"round {i}: {errors[0]!r}"
        if i % 6 == 5:  # and the loader is whole: its next pass starts the workers again, reads the rest
            rest = [k for b in loader for k in b["key"]]
            assert len(got + rest) == len(set(got + rest)) == 16, (got, rest)
        loader.close()
        left = [p for p in multiprocessing.active_children() if p not in before]
        assert not left, f"round {i}: {len(left)} worker process(es) left: {left}"


@pytest.mark.slow
def test_a_process_forked_from_the_consumer_does_not_stop_its_workers(data):
    """close() in a child forked from the consumer (a loader collected there, a user's fork) is not
    the consumer's: its pipes are inherited copies, and it told the workers to stop."""
    loader = make_loader(_stream(data, n=4), 2).start()
    pid = os.fork()
    if pid == 0:
        try:
            loader.workers.close()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    for p in loader.workers.procs:
        p.join(1)  # a worker told to stop ends within it (it did, before)
    assert all(p.is_alive() for p in loader.workers.procs)
    assert len([k for b in loader for k in b["key"]]) == 16
    loader.close()


def test_a_loader_used_in_a_process_forked_from_its_consumer_is_one_line(data):
    """Its workers are the consumer's: a new pass or the consumer's pass continued in a forked
    child is a RuntimeError saying so (it was multiprocessing's bare AssertionError, or batches
    taken from the consumer's pipes); close() there does nothing; the consumer reads on."""
    loader = make_loader(_stream(data, n=8), 2)
    it = iter(loader)
    got = list(next(it)["key"])
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        said = []
        for use in (lambda: next(it), lambda: next(iter(loader))):
            try:
                use()
                said.append("no error")
            except BaseException as e:  # noqa: BLE001 - reported to the parent
                said.append(f"{type(e).__name__}: {e}")
        loader.close()
        os.write(w, "\n".join(said).encode())
        os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    with os.fdopen(r) as f:
        said = f.read().splitlines()
    assert len(said) == 2 and all(x.startswith("RuntimeError: a loader cannot be used in a process forked")
                                  for x in said), said
    got += [k for b in it for k in b["key"]]
    assert len(got) == len(set(got)) == 32
    loader.close()
