"""A loader's worker processes: each writes its batches into its slots of a `ring.Ring`
and tells the consumer which slot holds the next one.

torch's DataLoader sends every batch through a multiprocessing queue, and the
consuming process pays 116-150 us of its own CPU a batch for that (the index sent back,
a feeder thread, the pickled batch), with nothing in the batch at all: 0.45-0.59 us a
sample at 256, more than the consumer may spend (docs/benchmarks.md, "The hand-over from
workers", and `python tools/bench_loader.py --handover`). Here a batch costs one message of
a few hundred bytes on a pipe (which slot, how many samples, the batch's small fields
pickled) and the slot's return is 4 bytes on another; past a pass's first batch a worker writes
its messages GROUP at a time while they come fast, so a consumer that waits for its workers is
woken once for several batches (`_Outbox`).

Each worker persists across passes: a pass begins with a message carrying its plan (the
stream's immutable plan of the epoch), so whatever the consumer set since the worker
started (epoch, weights, a loaded state, another worker count) reaches it; messages of
a pass the consumer left are dropped, their slots freed.
"""
import multiprocessing.process
import os
import pickle
import select
import signal
import struct
import threading
import time
import traceback
import weakref

import numpy as np
import torch

from pipeline.data.fields.keys import SEP, Keys
from pipeline.ordering.topology import Worker
from pipeline.errors import cut
from pipeline.data.store.transports import end_commands, end_process

HEADER = struct.Struct("<qiiii")  # pass, kind, slot, samples, payload bytes
BATCH, END, ERROR = 0, 1, 2
SLOT = struct.Struct("<qi")  # a slot given back: the pass it was given back in, the slot
GROUP = 4  # batches a worker sends in one write once its pass is under way (_Outbox)
HOLD_S = 0.03  # a batch made in more than this goes at once (_Outbox): the consumer is not kept waiting for it
READ = 1 << 16  # bytes asked of a worker's pipe at a time (a pipe holds 64 KiB)
POLL_S = 0.2  # how often a worker waiting for a slot looks whether its pass was left or it should stop
STOP = -1


class WorkerDied(RuntimeError):
    """A worker process ended without saying why (killed, out of memory, a crash in C)."""


class RemoteTraceback(Exception):
    """The traceback of an error raised in a worker, as the cause of its re-raise here."""

    def __init__(self, text):
        super().__init__(text)

    def __str__(self):
        return self.args[0]


class Workers:
    """`count` processes running `source.batches(worker, borrow, plan)` for each pass."""

    def __init__(self, source, count, ring, ctx, timeout=None):
        self.source, self.count, self.ring, self.ctx, self.timeout = source, count, ring, ctx, timeout
        self.control = ctx.Array("q", [0] * count, lock=False)  # per worker: the current pass, or STOP
        self.procs, self.commands, self.ready, self.free, self.buffers = [], [], [], [], []
        self.fds = []  # per worker, the file numbers of (ready, free), read once: a batch uses both
        self.pass_id = 0
        self.closing = False  # close() began (from any thread): a pass reading now ends in one line
        # start (with a pass's begin) and close, one at a time whatever the threads: a close() from another
        # thread while the workers forked found half-made lists (an IndexError; a worker forked after its
        # join loop was left running, its pipes unclosed); it now waits for the start, then stops them all
        self.life = threading.RLock()
        self.given_in = 0  # the pass the slots given back now belong to (see `begin`)
        self.parent = os.getpid()
        ring.give_back = self._give_back
        _made.add(self)

    @property
    def started(self):
        return bool(self.procs)

    def start(self):
        """Start the processes (once; again after one died, e.g. killed between passes). Each
        pipe's far end is closed here as soon as its worker has it, so a later worker does not
        inherit it and a dead worker's pipe reads as ended."""
        self._own()
        with self.life:
            self._start()

    def _start(self):
        if self.procs and all(p.is_alive() for p in self.procs):
            return
        if self.procs:
            self._close()
        self.closing = False
        relock = self.ring.unlock()  # page-locked memory is not inherited by a fork (MADV_DONTFORK)
        for w in range(self.count):
            cmd_r, cmd_w = self.ctx.Pipe(duplex=False)
            ready_r, ready_w = self.ctx.Pipe(duplex=False)
            free_r, free_w = self.ctx.Pipe(duplex=False)
            p = self.ctx.Process(target=_serve, name=f"pipeline-loader-{w}", daemon=True,
                                 args=(self.source, w, self.count, self.ring, cmd_r, ready_w, free_r, self.control,
                                       self.parent, self.timeout))
            # Ctrl-C held back in the forked worker until it ignores it (_set_up): one that came while
            # the worker was still starting ended it (seen at a load of 4)
            held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            self.ring.forking = True
            try:
                p.start()
            finally:
                self.ring.forking = False
                signal.pthread_sigmask(signal.SIG_SETMASK, held)
            for end in (cmd_r, ready_w, free_r):
                end.close()
            self.procs.append(p)
            self.commands.append(cmd_w)
            self.ready.append(ready_r)
            self.free.append(free_w)
            self.buffers.append(bytearray())
            self.fds.append((ready_r.fileno(), free_w.fileno()))
        if relock:
            self.ring.page_lock()

    def begin(self, plan):
        """Start a pass with `plan` on every worker; returns its id. Each worker begins it with
        the slots the user holds nothing of (a worker started again too: its predecessor's
        batches stay as they were) and, from its pipe, those given back in this pass; batches of
        earlier passes still in the pipes are dropped as they come (`receive`)."""
        self._own()
        with self.life:  # not half sent when close() comes from another thread
            self._start()
            self.pass_id += 1
            free = self.ring.free_slots(lambda: setattr(self, "given_in", self.pass_id))
            for w in range(self.count):
                self.control[w] = self.pass_id
                self.commands[w].send(("pass", self.pass_id, plan, free[w]))
            return self.pass_id

    def receive(self, w, pass_id):
        """(kind, slot, samples, payload) of worker w's next message of pass `pass_id`."""
        self._own()
        while True:
            if pass_id != self.pass_id:
                raise RuntimeError("the loader was iterated again while this pass was being read; "
                                   "a loader runs one pass at a time")
            if not self.procs:
                raise RuntimeError("the loader was closed while this pass was being read")
            # the message leaves the buffer whole: a Ctrl-C caught between its header and its payload
            # would otherwise leave the next read parsing a payload as a header
            try:
                got, kind, slot, n, size = HEADER.unpack_from(self._fill(w, HEADER.size))
                end = HEADER.size + size
                buf = self._fill(w, end)
            except (IndexError, WorkerDied):  # close() from another thread emptied the lists, or ended the worker
                if self.closing:
                    raise RuntimeError("the loader was closed while this pass was being read") from None
                raise
            with memoryview(buf) as view:
                payload = bytes(view[HEADER.size:end])
            del buf[:end]
            if got == pass_id:
                return kind, slot, n, payload
            # a batch of a pass the consumer left: its slot was free for this pass already (`begin`)

    def _own(self):
        """RuntimeError in a process forked from the one that made these workers: they, their pipes
        and their slots are that process's (a read here would take its batches; multiprocessing
        refuses to watch another's children with a bare AssertionError)."""
        if os.getpid() != self.parent:
            raise RuntimeError(f"a loader cannot be used in a process forked from the one that made it "
                               f"(pid {self.parent}), whose workers it holds; make a new loader there")

    def _fill(self, w, size):
        """Worker w's buffer, holding at least `size` bytes, read as much as is there at a time: a
        message's header and its payload usually arrive in one read (one system call a batch, not two).
        While slots wait for GPU copies and the worker has sent nothing, the wait is the GPU's
        (`Ring.wait`: an event's, or a device synchronisation), never a poll; the timeout counts it."""
        buf = self.buffers[w]
        if len(buf) >= size:
            return buf
        fd = self.fds[w][0]
        deadline = time.monotonic() + self.timeout if self.timeout else None
        while len(buf) < size:
            self.ring.reap()
            if self.ring.waiting and not select.select([fd], [], [], 0)[0]:
                self.ring.wait()  # the worker may be waiting for one of these slots
                if deadline is not None and time.monotonic() >= deadline and not select.select([fd], [], [], 0)[0]:
                    raise self._stuck(w)
                continue
            if deadline is not None and not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                raise self._stuck(w)
            try:
                chunk = os.read(fd, max(size - len(buf), READ))
            except OSError:
                chunk = b""
            if not chunk:
                if self.closing or not self.procs or self.control[w] == STOP:  # close() from another thread
                    raise RuntimeError("the loader was closed while this pass was being read")
                raise self._died(w)
            buf += chunk
        return buf

    def _stuck(self, w):
        """The TimeoutError of worker w, which sent nothing for the timeout: it is killed (a stopped
        process, or one in uninterruptible I/O, would be waited for by the next pass and at exit)."""
        p = self.procs[w]
        end_process(p)  # and its pipe: commands
        return TimeoutError(f"loader worker {w} (pid {p.pid}) sent nothing for {self.timeout:g} s (the loader's "
                            f"timeout: make_loader's, the trainer's --loader-timeout): it was killed, and the next "
                            f"pass starts the workers again")

    def _died(self, w):
        p = self.procs[w]
        p.join(5)
        code = p.exitcode
        how = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
        hint = "; if it was killed for memory, lower --workers or --batch-size" if code else ""
        return WorkerDied(f"loader worker {w} (pid {p.pid}) ended unexpectedly ({how}){hint}; the next pass starts "
                          f"the workers again")

    def _give_back(self, w, slot):
        fds = self.fds  # one list: `close` and `start` replace it
        if w < len(fds):
            try:
                os.write(fds[w][1], SLOT.pack(self.given_in, slot))
            except (OSError, ValueError):  # the worker is gone, or the loader closed
                pass

    def close(self):
        """Stop the workers (they finish what they write, then exit) and close the pipes; from
        another thread while they start, once they have started (`life`). Not in a process forked
        from this one: the workers are not its own (and `life` may have been held at the fork)."""
        if os.getpid() != self.parent:
            return
        with self.life:
            self._close()

    def _close(self):
        if not self.procs:
            return
        self.closing = True
        for w in range(self.count):
            self.control[w] = STOP
            try:
                self.commands[w].send(("stop",))
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 5
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                end_process(p)  # and its pipe: commands, which would outlive it
        self.fds = []  # before the pipes close: a slot given back from another thread finds no file number
        for conn in self.commands + self.ready + self.free:
            conn.close()
        self.procs, self.commands, self.ready, self.free, self.buffers = [], [], [], [], []


# ---------------------------------------------------------------- in the worker


_made = weakref.WeakSet()  # this process's Workers, whose processes a process forked from it must leave alone


def _disown_in_child():
    """In a process forked from the consumer (os.fork in the user's loop), forget the loaders'
    worker processes: they are not its children, and multiprocessing's exit handler would
    otherwise terminate them (daemons it believes its own) when it exits, ending the
    consumer's pass (a forked child's sys.exit(0) did)."""
    for workers in list(_made):
        for p in list(workers.procs):
            multiprocessing.process._children.discard(p)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_disown_in_child)


def _serve(source, w, count, ring, commands, ready, free, control, parent, timeout=None):
    """A worker's life: passes as the consumer asks, until it says stop or is gone."""
    _set_up(w, count, parent)
    out = _Outbox(ready.fileno(), timeout)
    slots = _Slots(free.fileno(), control, w, out)
    worker = Worker(w, count)
    while True:
        try:
            msg = commands.recv()
        except (EOFError, OSError, KeyboardInterrupt):
            return
        if msg[0] != "pass":
            return
        _, pass_id, plan, free_slots = msg
        slots.begin(pass_id, free_slots)
        out.begin(pass_id)
        try:
            for batch in source.batches(worker, slots.borrower(ring, w), plan):
                k, n = batch.pop("slot")
                out.batch(k, n, pack(batch, ring.spec.names))
                if control[w] != pass_id:
                    break
            else:
                out.send(END, b"")
        except _Left:
            pass
        except BrokenPipeError:
            return  # the consumer is gone
        except BaseException as e:  # noqa: BLE001 - every error goes to the consumer, which raises it
            try:
                out.send(ERROR, _pickled_error(e))
            except BrokenPipeError:
                return


def _set_up(w, count, parent):
    """One thread for torch (the worker is one of many); webdataset's split_by_worker reads
    WORKER and NUM_WORKERS; the worker ends when the process that made it is gone."""
    os.environ["WORKER"], os.environ["NUM_WORKERS"] = str(w), str(count)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the consumer's to act on; it ends the workers
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # held back while starting (Workers.start)
    torch.set_num_threads(1)
    np.random.seed((w * 7919 + 17) % (1 << 32))

    def watch():
        while True:
            time.sleep(1)
            try:
                os.kill(parent, 0)
            except ProcessLookupError:
                end_commands(os.getpid())  # its pipe: commands run in sessions of their own
                os._exit(1)

    threading.Thread(target=watch, daemon=True, name="exit-with-consumer").start()


class _Outbox:
    """A worker's messages to the consumer. Past a pass's first batch, batches made fast go
    GROUP to a write: a consumer waiting for its workers is woken once for them, not once a batch,
    and a wake-up (and the cold caches after it) cost it more than the rest of a batch's hand-over
    (docs/benchmarks.md, "The hand-over from workers"). No batch is held longer than `hold`
    seconds (HOLD_S, or a sixteenth of make_loader's timeout): a thread of the worker's sends what
    is held once the oldest has waited that long, since the next batch may take any time (a batch
    held until a slow one was made reached the consumer seconds late, or past its timeout). A
    batch made in more than `hold` goes at once with those held back; and what is held goes at
    once when the worker would otherwise wait for a slot (`_Slots.take`), when the pass ends and
    before an error; one of a pass the consumer left is dropped with it (the consumer frees its
    slot). Every write is made under one lock, whichever thread makes it."""

    def __init__(self, fd, timeout=None):
        self.fd, self.pass_id, self.held, self.first = fd, 0, [], True
        self.hold = min(HOLD_S, timeout / (4 * GROUP)) if timeout else HOLD_S
        self.last = time.monotonic()  # when the last batch (or the pass) began to be made
        self.since = None  # when the oldest batch held back was made
        self.lock, self.late = threading.Condition(), None

    def begin(self, pass_id):
        with self.lock:
            self.pass_id, self.held, self.first, self.since = pass_id, [], True, None
            self.last = time.monotonic()

    def batch(self, slot, n, payload):
        message = HEADER.pack(self.pass_id, BATCH, slot, n, len(payload)) + payload
        with self.lock:
            now = time.monotonic()
            slow, self.last = now - self.last > self.hold, now
            self.held.append(message)
            if self.first or slow or len(self.held) >= GROUP:
                self._flush()
            elif self.since is None:
                self.since = now
                if self.late is None:  # started in the worker, on its first held batch
                    self.late = threading.Thread(target=self._send_late, name="loader-outbox", daemon=True)
                    self.late.start()
                self.lock.notify()

    def send(self, kind, payload):
        """An END or ERROR message, after the batches held back."""
        with self.lock:
            self.held.append(HEADER.pack(self.pass_id, kind, -1, 0, len(payload)) + payload)
            self._flush()

    def flush(self):
        with self.lock:
            self._flush()

    def _flush(self):
        if self.held:
            data, self.held, self.first, self.since = b"".join(self.held), [], False, None
            _write(self.fd, data)

    def _send_late(self):
        with self.lock:
            while True:
                if self.since is None:
                    self.lock.wait()
                    continue
                left = self.since + self.hold - time.monotonic()
                if left > 0:
                    self.lock.wait(left if left < threading.TIMEOUT_MAX else None)
                else:
                    self._flush()


def _write(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def pack(batch, fixed):
    """A batch's small fields (all but the `fixed` ones, which are in its slot), pickled. The keys
    go as one string, which the consumer splits only when they are read (keys.Keys): unpickling
    256 strings cost it about twice what splitting one does, and most loops never read them."""
    small = {k: v for k, v in batch.items() if k not in fixed}
    keys = small.get("key")
    if isinstance(keys, (list, Keys)) and not any(SEP in k for k in keys):  # Layout.collate's Keys, or a list
        small["key"] = SEP.join(keys)
    return pickle.dumps(small, protocol=5)


def unpack(payload, n):
    small = pickle.loads(payload)
    keys = small.get("key")
    if isinstance(keys, (str, list)):  # joined, or a list where a key holds SEP (a Keys pickles as its list)
        small["key"] = Keys(keys, n) if isinstance(keys, str) else Keys.of(keys)
    return small


ERROR_BYTES = 64 << 10  # the most of an error (and of its traceback) a worker sends


def _pickled_error(e):
    """A worker's error as the consumer re-raises it: the exception itself where it travels and
    is small; else a RuntimeError with its text, cut (a message may be a whole shard). An exit
    (SystemExit, GeneratorExit) raised by the user's code does not end the consumer: it is
    re-raised there as a RuntimeError naming it."""
    text = cut("".join(traceback.format_exception(type(e), e, e.__traceback__)), ERROR_BYTES)
    try:
        if not isinstance(e, Exception):
            raise TypeError("not an Exception")
        body = pickle.dumps(e)
        if len(body) > ERROR_BYTES:
            raise ValueError("too large")
        pickle.loads(body)
    except Exception:  # noqa: BLE001 - an exception that cannot travel goes as its text
        body = pickle.dumps(RuntimeError(cut(f"{type(e).__name__}: {e}", ERROR_BYTES)))
    return pickle.dumps((body, text))


def raise_error(payload, w):
    """Re-raise a worker's error here, its traceback as the cause."""
    body, text = pickle.loads(payload)
    error = pickle.loads(body)
    raise error from RemoteTraceback(f"\nin loader worker {w}:\n{text}")


class _Left(Exception):
    """The consumer left this pass (or asked the worker to stop) while it waited for a slot."""


class _Slots:
    """A worker's free slots: at each pass, those the consumer says the user holds nothing of,
    then each it gives back in that pass (one given back earlier is in that list already)."""

    def __init__(self, fd, control, w, out):
        self.free, self.fd, self.control, self.w, self.pass_id = [], fd, control, w, 0
        self.out = out  # its batches held back go before it waits: the consumer may be waiting for them
        self.later = []  # (pass, slot) given back in a pass this worker has not begun yet

    def begin(self, pass_id, free):
        self.pass_id = pass_id
        self.free = list(free) + [k for given_in, k in self.later if given_in == pass_id]
        self.later = [(given_in, k) for given_in, k in self.later if given_in > pass_id]

    def take(self):
        if not self.free:
            self.out.flush()
        while not self.free:
            ready = select.select([self.fd], [], [], POLL_S)[0]
            if self.control[self.w] != self.pass_id:
                raise _Left()
            if ready:
                data = os.read(self.fd, SLOT.size * 64)
                if not data:
                    raise _Left()
                for given_in, k in SLOT.iter_unpack(data):
                    if given_in == self.pass_id:
                        self.free.append(k)
                    elif given_in > self.pass_id:
                        self.later.append((given_in, k))
        return self.free.pop(0)

    def borrower(self, ring, w):
        """borrow(n) for the stream: (handle, {field: array to fill}) in a free slot of the pass begun."""
        def borrow(n):
            k = self.take()
            return (k, n), ring.arrays(w, k, n)
        return borrow
