"""Batches written once, where the consumer reads them: a ring of slots per loader.

A producer (a loader's worker process, or the consuming process itself at 0 workers)
collates each batch straight into a free slot; the consumer hands out tensors that view
the slot, no copy and no allocation, and the slot goes back to its producer only when
nothing refers to those tensors any more. A user who keeps a batch therefore never sees
it overwritten, and a batch costs the consumer O(1) whatever its size
(docs/benchmarks.md, "The hand-over from workers").

The ring of a loader with workers is shared memory mapped by every process; with CUDA it
is page-locked in the consumer (cudaHostRegister), so the copy to the GPU reads it
directly and asynchronously. A slot whose tensors die while such a copy may still be
reading it goes back only once an event recorded then has completed.
"""
import collections
import ctypes
import gc
import itertools
import mmap
import os
import threading
import weakref

import numpy as np
import torch

from pipeline.data.fields.spec import Field, Spec  # noqa: F401  (what a slot holds; they live with the fields)

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
        self.pin = pin
        self.give_back = None  # set by whoever owns the producers
        self.lent = [{} for _ in range(producers)]  # per producer, slot -> (token, finalizer) of the batch lent from it
        self._tokens = itertools.count()  # a lend's token: a late return of an earlier lend of the slot is ignored
        self.copied = 0  # batches handed out as copies (the user held every other slot)
        self._pending = collections.deque()  # (CUDA event, producer, slot, token): dropped, a copy may still read
        self._lock = threading.Lock()
        self._pid = os.getpid()  # a process forked from this one drops copies of batches, not slots
        self._registered = False
        self._events = pin and torch.cuda.is_available() and not shared  # a shared ring: once `page_lock` took
        self.forking = False  # set while this ring's own workers fork: they keep the ring shared
        if shared:
            _shared_rings.add(self)

    def __getstate__(self):  # a worker started by forkserver or spawn: the memory and its layout only
        return {"producers": self.producers, "depth": self.depth, "spec": self.spec, "memory": self.memory}

    def __setstate__(self, state):
        self.__dict__.update(state, buf=state["memory"].numpy(), pin=False, give_back=None,
                             lent=[{} for _ in range(state["producers"])], forking=True)

    @property
    def held(self):
        """How many slots of each producer are lent out."""
        return [len(s) for s in self.lent]

    def free_slots(self, install):
        """Per producer, the slots nothing holds, for producers beginning a pass; `install()` is
        called in the same step, for whoever owns the producers to mark what they give back from
        then on, so that a slot dropped before is in the answer and one dropped after is given
        back: none twice, none lost. Each pass starts again from here, so a slot lost between a
        worker's message and its lend (a Ctrl-C caught there), or one whose batch died while its
        return was cut short, is free again at the next pass. The collector is held off
        meanwhile: a batch it collects would come back here and find the lock taken."""
        was = gc.isenabled()
        gc.disable()
        try:
            with self._lock:
                pending = {(producer, k, token) for _, producer, k, token in self._pending}
                orphans = [(slots, k, done) for producer, slots in enumerate(self.lent)
                           for k, (token, done) in slots.items()
                           if done.peek() is None and (producer, k, token) not in pending]
                if orphans and self._events:  # a copy from one may be queued still
                    torch.cuda.synchronize()
                for slots, k, done in orphans:  # its batch is gone, but its return never came
                    done.detach()
                    del slots[k]
                install()
                return [[k for k in range(self.depth) if k not in slots] for slots in self.lent]
        finally:
            if was:
                gc.enable()

    def page_lock(self):
        """Page-lock a shared ring for the GPU copy (cudaHostRegister), once. The loader calls it
        after its workers forked, so that they start before CUDA does in this process."""
        if self.pin and not self._registered and not self._events and torch.cuda.is_available():
            self._registered = self._events = _register(self.memory)
        return self._registered

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
        """The first n samples of slot k as tensors that view it; the slot goes back when the last
        of them (or anything sharing their storage) is gone. A copy instead, and the slot back at
        once, when the producer would otherwise be left with no slot but those the user holds."""
        self.reap()
        if len(self.lent[producer]) + 1 >= self.depth:
            base, copy = self.spec.own(self.pin)
            copy[:] = self.slot(producer, k)
            self.copied += 1
            self.give_back(producer, k)
            return self.spec.views(base, n)
        holder = self.spec.holder(self.slot(producer, k))
        token = next(self._tokens)
        done = weakref.finalize(holder, self._dropped, producer, k, token)
        done.atexit = False
        with self._lock:
            self.lent[producer][k] = token, done
        return self.spec.tensors(holder, n)

    def _dropped(self, producer, k, token):
        """The tensors of a slot are gone. With CUDA, a copy from it may still be queued: the slot
        goes back once an event recorded now on the current stream has completed (`reap`)."""
        if os.getpid() != self._pid:  # a forked child's copy of a batch: the slot is still the parent's
            return
        if self._events:
            try:
                event = torch.cuda.Event()
                event.record()
            except Exception:  # noqa: BLE001 - interpreter shutdown, a CUDA error: nothing can read it any more
                event = None
            if event is not None:
                with self._lock:
                    self._pending.append((event, producer, k, token))
                return
        self._back(producer, k, token)

    def _back(self, producer, k, token):
        with self._lock:  # with `free_slots`: a slot goes back once, to the producer that lacks it
            if self.lent[producer].get(k, (None,))[0] != token:
                return  # freed by `free_slots` already (and maybe lent again since)
            del self.lent[producer][k]
            if self.give_back is not None:
                self.give_back(producer, k)

    def reap(self):
        """Slots whose copies to the GPU have completed go back to their producers."""
        while self._pending:
            with self._lock:
                if not self._pending or not self._pending[0][0].query():
                    return
                _, producer, k, token = self._pending.popleft()
            self._back(producer, k, token)

    @property
    def waiting(self):
        """Whether slots wait for a GPU copy to complete (a consumer waiting for a producer must reap)."""
        return bool(self._pending)

    def lent_pages(self):
        """[(address, bytes)] of the whole pages holding the slots lent out, copied now."""
        page, base = mmap.PAGESIZE, self.memory.data_ptr()
        spans = []
        for start in sorted(base + self.offset(producer, k) for producer, slots in enumerate(self.lent) for k in slots):
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
                torch.cuda.synchronize()
                torch.cuda.cudart().cudaHostUnregister(self.memory.data_ptr())
            except Exception:  # noqa: BLE001 - best effort at the end
                pass


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
