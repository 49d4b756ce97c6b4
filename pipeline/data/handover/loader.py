"""The hand-over from the stream to the loop that consumes it.

`make_loader` reads a stream (MixedStream or EvalStream) in worker processes, or in this
process with no workers. Either way each batch is written once, by its producer, into a
slot of a `ring.Ring` (page-locked for the GPU copy where CUDA is), and handed out as
tensors that view the slot: the consuming process does O(1) work a batch, whatever its
size, and a batch the user keeps is never overwritten. With workers, `workers.Workers`
runs the processes; each pass begins with the stream's plan, so every `set_epoch`,
`load_state_dict` or `set_workers` made before it reaches them.
"""
import collections
import multiprocessing
import os

import torch

from pipeline.data.handover.budget import PREFETCH
from pipeline.data.handover.ring import Ring
from pipeline.ordering.topology import Worker
from pipeline.data.handover.workers import BATCH, END, Workers, raise_error, unpack


def make_loader(stream, num_workers=0, pin_memory=False, prefetch_factor=PREFETCH, start_method="fork", record=True,
                timeout=None):
    """A loader over a stream: iterate it once per epoch (after `stream.set_epoch`); its workers
    persist across epochs. With record=False the stream does not take a batch's place as it
    arrives: a consumer that pulls batches ahead of using them (the trainer's copy to the GPU
    one step ahead) records each one as it uses it (`stream.record(batch["state"])`), so a
    checkpoint never counts a batch not trained. pin_memory: batches page-locked for
    asynchronous copies to the GPU (where CUDA is). timeout: seconds a worker may send nothing
    before the pass fails (TimeoutError; default: wait, as torch's DataLoader does).

    Each worker holds `prefetch_factor` + 2 slots; it works ahead as long as one is free.
    Forking a process while another of its Python threads starts or exits can deadlock the
    child inside os.fork() on Python 3.8-3.11 (CPython gh-112275, the interpreter's
    HEAD_LOCK); it happened here when the trainer's evaluation loader forked as tqdm's
    monitor thread exited with the epoch's bar (the trainer now runs tqdm without it).
    Workers fork once, at `start()` or the first pass, so start loaders while no thread comes
    or goes. start_method="forkserver" avoids forking the caller at all, at ~300 MiB for the
    server and a re-import of the main script per worker (the script then needs an
    `if __name__ == "__main__":` guard).
    """
    return Loader(stream, num_workers, pin_memory=pin_memory, prefetch_factor=prefetch_factor,
                  start_method=start_method, record=record, timeout=timeout)


class Loader:
    """Batches of a stream, one pass per iteration (see make_loader)."""

    def __init__(self, stream, num_workers=0, *, pin_memory=False, prefetch_factor=PREFETCH, start_method="fork",
                 record=True, timeout=None):
        if num_workers < 0 or prefetch_factor < 1 or (timeout is not None and timeout <= 0):
            raise ValueError(f"num_workers must be at least 0, prefetch_factor at least 1 and a timeout above 0, got "
                             f"{num_workers}, {prefetch_factor}, {timeout}")
        depth = prefetch_factor + 2
        spec = stream.batch_spec()
        if num_workers:
            check_shared_memory(num_workers * depth * spec.slot_bytes)
        if hasattr(stream, "set_workers"):
            stream.set_workers(max(1, num_workers))
        self.stream, self.num_workers, self.record = stream, num_workers, record
        self._early = None  # (plan, pass id) of a pass `start` began
        self._passes = 0  # passes begun here: an iterator of an earlier one stops (at 0 workers)
        self._record = getattr(stream, "record", None) if record else None
        self.pin = bool(pin_memory) and torch.cuda.is_available()
        if num_workers:
            self.ring = Ring(num_workers, depth, spec, shared=True, pin=self.pin)
            self.workers = Workers(stream, num_workers, self.ring, worker_context(start_method), timeout)
        else:
            self.ring = Ring(1, depth, spec, shared=False, pin=self.pin)
            self.workers = None
            self._free = collections.deque()  # each pass fills it (`__iter__`)
            self.ring.give_back = lambda producer, k: self._free.append(k)

    def __len__(self):
        return len(self.stream)

    def start(self):
        """Start the workers now, and with them the pass the stream would read next (they start
        at the first pass otherwise): while the caller builds its model and CUDA starts, the
        workers fork, open their shards and fill their slots. Should the stream's plan change
        before the pass (a state loaded, another epoch set), that work is dropped."""
        if self.workers is not None and not self.workers.started:
            self.workers.start()
            self.ring.page_lock()
            if hasattr(self.stream, "plan"):
                plan = self.stream.plan(begin=False)  # a state just loaded still decides the epoch
                self._early = (plan, self.workers.begin(plan))
        return self

    def __iter__(self):
        plan = self.stream.plan() if hasattr(self.stream, "plan") else None
        self._passes += 1
        if self.workers is None:
            free = self.ring.free_slots(self._fresh)[0]  # first: it puts a new deque in self._free
            self._free.extend(free)
            return self._here(plan, self._passes)
        self.start()
        early, self._early = self._early, None
        return self._from_workers(early[1] if early is not None and early[0] is plan else self.workers.begin(plan))

    def _from_workers(self, pass_id):
        """Round robin over the workers, each dropped when its share ends: the order a
        DataLoader over an IterableDataset gives."""
        active = list(range(self.num_workers))
        while active:
            for w in list(active):
                kind, slot, n, payload = self.workers.receive(w, pass_id)
                if kind == END:
                    active.remove(w)
                    continue
                if kind != BATCH:
                    raise_error(payload, w)
                batch = unpack(payload, n)
                batch.update(self.ring.lend(w, slot, n))
                yield self._arrived(batch)

    def _here(self, plan, pass_id):
        """A pass in this process: the stream writes into this loader's own slots (or, while the
        user holds all of them, into new memory)."""
        for batch in self.stream.batches(Worker(), self._borrow, plan):
            if pass_id != self._passes:
                raise RuntimeError("the loader was iterated again while this pass was being read; "
                                   "a loader runs one pass at a time")
            kind, k, n = batch.pop("slot")
            batch.update(self.ring.lend(0, k, n) if kind == "slot" else self.ring.spec.views(k, n))
            yield self._arrived(batch)

    def _fresh(self):
        self._free = collections.deque()  # what is given back from now on; the pass's free slots join it

    def _borrow(self, n):
        self.ring.reap()
        if self._free:
            k = self._free.popleft()
            return ("slot", k, n), self.ring.arrays(0, k, n)
        base, memory = self.ring.spec.own(self.pin)
        return ("own", base, n), self.ring.spec.arrays(memory, n)

    def _arrived(self, batch):
        if self._record is not None and "state" in batch:
            self._record(batch["state"])
        return batch

    def close(self):
        """Stop the workers now (they also stop when the loader is collected or the process ends)."""
        if self.workers is not None:
            self.workers.close()
        self.ring.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - at interpreter exit, whatever is left
            pass


def check_shared_memory(nbytes, folder="/dev/shm"):
    """ValueError (one line) when the workers' ring would not fit in the shared memory left:
    its pages are taken as batches are written, and a write past the end of /dev/shm kills the
    worker with SIGBUS (a container's default is 64 MiB)."""
    try:
        st = os.statvfs(folder)
    except OSError:  # no such file system here: torch's shared memory goes elsewhere
        return
    free = st.f_bavail * st.f_frsize
    if nbytes > free:
        raise ValueError(f"the loader's workers need {nbytes / 2**20:.0f} MiB of shared memory for their batches, "
                         f"{folder} has {free / 2**20:.0f} MiB free: lower --workers or --batch-size, or give the "
                         f"container more (docker run --shm-size)")


def worker_context(start_method="fork"):
    ctx = multiprocessing.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(["torch", "pipeline.data.streams.stream"])
    return ctx
