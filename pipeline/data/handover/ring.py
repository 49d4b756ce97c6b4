"""Batches written once, where the consumer reads them: a ring of slots per loader.

A producer (a loader's worker process, or the consuming process itself at 0 workers)
collates each batch straight into a free slot; the consumer hands out tensors that view
the slot, no copy and no allocation, and the slot goes back to its producer only when
nothing refers to those tensors any more. A user who keeps a batch therefore never sees
it overwritten, and a batch costs the consumer O(1) whatever its size
(docs/benchmarks.md, "The hand-over from workers").

The ring of a loader with workers is shared memory mapped by every process; with CUDA it
is page-locked in the consumer (cudaHostRegister), so the copy to the GPU reads it
directly and asynchronously. A copy the loader makes itself (make_loader's `device`)
returns its slot once an event recorded on the loader's copy stream has completed
(`hand`). A page-locked batch lent to the user, who may copy it on any stream of theirs,
returns its slot once a synchronisation of the whole device begun after it was dropped
has ended (`wait`): no event recorded in a finalizer, on whatever stream or device is
current on whatever thread drops it.

Small fields (at most SMALL_BYTES a sample: labels, sources, sizes, lengths, masks) reach
the user as tensors of their own, copied out of the slot on arrival: keeping them keeps
their own bytes, never the slot.
"""
import atexit
import collections
import ctypes
import functools
import gc
import itertools
import mmap
import os
import threading
import warnings
import weakref

import numpy as np
import torch

from pipeline.data.fields.spec import SMALL_BYTES, Field, Spec  # noqa: F401  (what a slot holds; they live with the fields)

MAP_FIXED = 0x10  # Linux (every architecture): mmap at exactly the address given


def shared_bytes(n):
    """A uint8 tensor of n bytes in a new shared-memory file: it reads as zeros, and its pages
    cost nothing until written (torch.zeros(...).share_memory_() would write them twice)."""
    like = torch.from_numpy(np.empty(0, np.uint8))
    return like.new(like._typed_storage()._new_shared(max(int(n), 1)))


class Ring:
    """`depth` slots for each of `producers`; `give_back(producer, slot)` returns a slot to
    the producer that wrote it (a pipe to a worker, or a list in this process).

    shared: the memory is a shared-memory file (workers fork or are given it); else it is
    this process's own, page-locked when `pin`. A producer that finds none of its slots
    free waits for one; so that the wait always ends, the consumer copies a batch out
    instead of lending its slot when the user already holds all of that producer's other
    slots (batches kept in a list, say)."""

    def __init__(self, producers, depth, spec, *, shared, pin=False):
        if depth < 2:
            raise ValueError(f"a ring needs at least 2 slots a producer, got {depth}")
        self.producers, self.depth, self.spec = producers, depth, spec
        size = producers * depth * spec.slot_bytes
        self.memory = shared_bytes(size) if shared else torch.empty(size, dtype=torch.uint8, pin_memory=pin)
        self.buf = self.memory.numpy()
        self._view = memoryview(self.buf)  # what each batch's holder exports (Spec.holder)
        self.pin = pin
        self.give_back = None  # set by whoever owns the producers
        self.lent = [{} for _ in range(producers)]  # per producer, slot -> (token, weakref or None) lent from it
        self._tokens = itertools.count()  # a lend's token: a late return of an earlier lend of the slot is ignored
        self.copied = 0  # batches handed out as copies (the user held every other slot)
        # (ticket, producer, slot, token) of slots a GPU copy may still read: a CUDA event of the
        # loader's copy stream (`hand`), or the count of device synchronisations begun when a
        # page-locked batch lent to the user was dropped (`_dropped`; it goes back after the next)
        self._pending = collections.deque()
        self._syncs = 0  # device synchronisations begun (`wait`)
        self._synced = 0  # ... and ended
        self._lock = threading.Lock()
        self._pid = os.getpid()  # a process forked from this one drops copies of batches, not slots
        self._registered = False
        self._locked = pin and torch.cuda.is_available() and not shared  # page-locked now (a shared ring: `page_lock`)
        self.cuda_device = torch.cuda.current_device() if self._locked else None
        self.forking = False  # set while this ring's own workers fork: they keep the ring shared
        if shared:
            _shared_rings.add(self)

    def __getstate__(self):  # a worker started by forkserver or spawn: the memory and its layout only
        return {"producers": self.producers, "depth": self.depth, "spec": self.spec, "memory": self.memory}

    def __setstate__(self, state):
        buf = state["memory"].numpy()
        self.__dict__.update(state, buf=buf, _view=memoryview(buf), pin=False, give_back=None,
                             lent=[{} for _ in range(state["producers"])], forking=True)

    @property
    def held(self):
        """How many slots of each producer are lent out (or wait for a GPU copy)."""
        return [len(s) for s in self.lent]

    def free_slots(self, install):
        """Per producer, the slots nothing holds, for producers beginning a pass; `install()` is
        called in the same step, for whoever owns the producers to mark what they give back from
        then on, so that a slot dropped before is in the answer and one dropped after is given
        back: none twice, none lost. Each pass starts again from here, so a slot lost between a
        worker's message and its lend (a Ctrl-C caught there), or one whose batch died while its
        return was cut short, is free again at the next pass. A slot a GPU copy may still read
        stays out until its copy is known to be done (`reap`). The collector is held off
        meanwhile: a batch it collects would come back here and find the lock taken."""
        was = gc.isenabled()
        gc.disable()
        try:
            with self._lock:
                pending = {(producer, k, token) for _, producer, k, token in self._pending}
                orphans = [(slots, k, done) for producer, slots in enumerate(self.lent)
                           for k, (token, done) in slots.items()
                           if (done is None or done() is None) and (producer, k, token) not in pending]
                if orphans and self._locked:  # a copy from one may be queued still
                    torch.cuda.synchronize(self.cuda_device)
                for slots, k, done in orphans:  # its batch is gone, but its return never came
                    del slots[k]  # and with it the weakref: a return still on its way finds another token
                install()
                return [[k for k in range(self.depth) if k not in slots] for slots in self.lent]
        finally:
            if was:
                gc.enable()

    def page_lock(self):
        """Page-lock a shared ring for the GPU copy (cudaHostRegister), once. The loader calls it
        after its workers forked, so that they start before CUDA does in this process. Returns
        whether the ring is page-locked; where CUDA refuses (a container's memlock limit), one
        warning says that batches come out pageable (the copies to the GPU then wait for the host)."""
        if self.pin and not self._registered and not self._locked and torch.cuda.is_available():
            self._registered = self._locked = _register(self.memory)
            if self._registered:
                self.cuda_device = torch.cuda.current_device()
            else:
                self.pin = False
                warnings.warn(f"cudaHostRegister refused to page-lock the loader's {self.memory.numel() / 2**20:.0f} "
                              f"MiB ring (often a container's memlock limit: ulimit -l): its batches are not pinned "
                              f"and each copy to the GPU waits for the host", RuntimeWarning, stacklevel=3)
        return self._registered

    def unlock(self):
        """Undo `page_lock` before workers fork again: CUDA maps page-locked memory MADV_DONTFORK,
        so a worker forked while the ring is registered would not have it. Waits for every copy
        still reading the ring. Returns whether it was locked (`page_lock` then locks it again)."""
        if not self._registered:
            return False
        torch.cuda.synchronize(self.cuda_device)
        torch.cuda.cudart().cudaHostUnregister(self.memory.data_ptr())
        with self._lock:
            self._registered = self._locked = False
            self._syncs += 1  # the synchronisation above counts for every batch dropped before it
            self._synced = self._syncs
        self.reap()
        return True

    def offset(self, producer, k):
        """Where slot k of a producer starts in the ring's memory (bytes)."""
        return (producer * self.depth + k) * self.spec.slot_bytes

    def slot(self, producer, k):
        """Slot k of a producer, as a uint8 numpy array (a new view object each call)."""
        start = self.offset(producer, k)
        return self.buf[start:start + self.spec.slot_bytes]

    def arrays(self, producer, k, n):
        return self.spec.arrays(self.slot(producer, k), n)

    def lend(self, producer, k, n):
        """The first n samples of slot k as tensors that view it (small fields copied out); the
        slot goes back when the last of them (or anything sharing their storage) is gone. A copy
        instead, and the slot back at once, when the producer would otherwise be left with no
        slot but those the user holds."""
        if self._pending:
            self.reap()
        lent = self.lent[producer]
        if len(lent) + 1 >= self.depth and self._pending:
            self.wait()  # slots that wait for a GPU copy are not the user's: free them first
        if len(lent) + 1 >= self.depth:
            base, copy = self.spec.own(self.pin)
            copy[:] = self.slot(producer, k)
            self.copied += 1
            self.give_back(producer, k)
            return self.spec.views(base, n)
        holder = self.spec.holder(self._view, self.offset(producer, k))
        if not self.spec.large:  # every field copied out: nothing views the slot
            out = self.spec.tensors(holder, n)
            self.give_back(producer, k)
            return out
        token = next(self._tokens)
        # a weakref whose callback returns the slot: cheaper than weakref.finalize, and dropped with
        # its entry here (`free_slots`), it calls nothing
        done = weakref.ref(holder, functools.partial(self._dropped, producer, k, token))
        with self._lock:
            lent[k] = token, done
        return self.spec.tensors(holder, n)

    def view(self, producer, k, n):
        """The first n samples of slot k as tensors that view it, every field, for the loader's
        own copy out of it (`hand` then says when the slot may go back)."""
        return {f.name: torch.from_numpy(a) for f, a in zip(self.spec.fields, self.arrays(producer, k, n).values())}

    def hand(self, producer, k, event):
        """Slot k, copied out by the loader (make_loader's `device`), goes back to its producer once
        `event` (recorded on the copy's stream after the copy) has completed; at once with None
        (a copy on the CPU, or from pageable memory: done when it returns)."""
        if event is None:
            self.give_back(producer, k)
            return
        token = next(self._tokens)
        with self._lock:
            self.lent[producer][k] = token, None
            self._pending.append((event, producer, k, token))

    def _dropped(self, producer, k, token, _ref=None):
        """The tensors of a slot are gone. Page-locked, a copy the user queued from it may still
        read it, on any stream: the slot goes back after a device synchronisation begun from now
        (`wait`). Nothing touches CUDA here: a weakref's callback runs on whatever thread drops the batch."""
        if _process.pid != self._pid:  # a forked child's copy of a batch: the slot is still the parent's
            return
        if _process.exiting:  # the interpreter is ending: nobody waits for the slot
            return
        if self._locked:
            with self._lock:
                self._pending.append((self._syncs, producer, k, token))
            return
        self._back(producer, k, token)

    def _back(self, producer, k, token):
        with self._lock:  # with `free_slots`: a slot goes back once, to the producer that lacks it
            if self.lent[producer].get(k, (None,))[0] != token:
                return  # freed by `free_slots` already (and maybe lent again since)
            del self.lent[producer][k]
            if self.give_back is not None:
                self.give_back(producer, k)

    def _ready(self, ticket):
        return ticket < self._synced if isinstance(ticket, int) else ticket.query()

    def reap(self):
        """Slots whose copies to the GPU are known to be done go back to their producers."""
        while self._pending:
            with self._lock:
                if not self._pending or not self._ready(self._pending[0][0]):
                    return
                _, producer, k, token = self._pending.popleft()
            self._back(producer, k, token)

    def wait(self):
        """Block, without polling, until the oldest slot that waits for a GPU copy may go back,
        and give back every slot that may: the event's own wait, or a synchronisation of the device."""
        with self._lock:
            if not self._pending:
                return
            ticket = self._pending[0][0]
            if isinstance(ticket, int):
                self._syncs += 1
                begun = self._syncs
        if isinstance(ticket, int):
            torch.cuda.synchronize(self.cuda_device)
            with self._lock:
                self._synced = max(self._synced, begun)
        else:
            ticket.synchronize()
        self.reap()

    @property
    def waiting(self):
        """Whether slots wait for a GPU copy to complete (a consumer waiting for a producer must reap)."""
        return bool(self._pending)

    def lent_pages(self):
        """[(address, bytes)] of the whole pages holding the slots lent out, copied now. The lent
        table is read under the lock (a batch dropped on another thread changes it), the collector
        held off as in `free_slots`."""
        was = gc.isenabled()
        gc.disable()
        try:
            with self._lock:
                starts = sorted(self.offset(producer, k) for producer, slots in enumerate(self.lent) for k in slots)
        finally:
            if was:
                gc.enable()
        page, base = mmap.PAGESIZE, self.memory.data_ptr()
        spans = []
        for start in starts:
            start += base
            lo, hi = start // page * page, -(-(start + self.spec.slot_bytes) // page) * page
            if spans and lo <= spans[-1][1]:
                spans[-1][1] = max(spans[-1][1], hi)
            else:
                spans.append([lo, hi])
        return [(lo, ctypes.string_at(lo, hi - lo)) for lo, hi in spans]

    def close(self):
        if self._registered:
            self._registered = False
            try:
                torch.cuda.synchronize(self.cuda_device)
                torch.cuda.cudart().cudaHostUnregister(self.memory.data_ptr())
            except Exception:  # noqa: BLE001 - best effort at the end
                pass


class _Process:
    """This process's id, kept here as forks happen (os.getpid is a system call a batch), and
    whether the interpreter is ending (a batch dropped then has nobody to give its slot to)."""
    pid = os.getpid()
    exiting = False


_process = _Process()
atexit.register(setattr, _process, "exiting", True)
_shared_rings = weakref.WeakSet()  # this process's shared rings, whose lent slots a forked process keeps
_at_fork = []  # (address, bytes) of the lent slots' pages, copied just before a fork


def _before_fork():
    """A process forked from the consumer (not a worker of the ring) keeps the batches lent out
    then as they were, although their slots go back to the workers: their pages are copied
    here, before the fork, and mapped privately in the child from the copy, which the child
    sees as it was at the fork whenever it runs (copied in the child, they were sometimes
    already overwritten)."""
    _at_fork[:] = [span for ring in list(_shared_rings) if not ring.forking and any(ring.lent)
                   for span in ring.lent_pages()]


def _after_fork_in_parent():
    _at_fork.clear()


def _after_fork_in_child():
    _process.pid = os.getpid()
    for address, data in _at_fork:
        _map_private(address, data)
    _at_fork.clear()


def _map_private(address, data):
    """`data` mapped at `address` (whole pages) as this process's own memory."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                            ctypes.c_int, ctypes.c_int, ctypes.c_long]
    got = libc.mmap(address, len(data), mmap.PROT_READ | mmap.PROT_WRITE,
                    mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_FIXED, -1, 0)
    if got != address:
        raise OSError(ctypes.get_errno(), "a forked process could not keep its batches (mmap)")
    ctypes.memmove(address, data, len(data))


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                        after_in_child=_after_fork_in_child)


def _register(memory):
    """Page-lock shared memory for the GPU copy (cudaHostRegister); False where CUDA refuses."""
    try:
        err = torch.cuda.cudart().cudaHostRegister(memory.data_ptr(), memory.numel(), 0)
    except Exception:  # noqa: BLE001 - no CUDA runtime binding: the batches are just not page-locked
        return False
    return int(getattr(err, "value", err)) == 0
