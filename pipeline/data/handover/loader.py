"""The hand-over from the stream to the loop that consumes it.

`make_loader` reads a stream (MixedStream or EvalStream) in worker processes, or in this
process with no workers. Either way each batch is written once, by its producer, into a
slot of a `ring.Ring` (page-locked for the GPU copy where CUDA is), and handed out as
tensors that view the slot: the consuming process does O(1) work a batch, whatever its
size, and a batch the user keeps is never overwritten. With workers, `workers.Workers`
runs the processes; each pass begins with the stream's plan, so every `set_epoch`,
`load_state_dict` or `set_workers` made before it reaches them. With `device`, the loader
copies each batch to the device itself (pipeline.data.handover.device) and the slot goes back once
that copy is done.
"""
import collections
import multiprocessing
import os
import threading

import torch

from pipeline.data.handover.budget import PREFETCH
from pipeline.data.handover.device import REFUSED, ToDevice, decoding, parse_device
from pipeline.data.handover.ring import Ring
from pipeline.ordering.topology import Worker
from pipeline.data.handover.workers import BATCH, END, Workers, raise_error, unpack


def make_loader(stream, num_workers=0, pin_memory=False, prefetch_factor=PREFETCH, start_method="fork", record=True,
                timeout=None, device=None, decode="host", memory_format="contiguous"):
    """A loader over a stream: iterate it once per epoch (after `stream.set_epoch`); its workers
    persist across epochs. One pass at a time: a new iteration (from any thread) ends the one
    before, whose next step raises RuntimeError. With record=False the stream does not take a
    batch's place as it arrives: a consumer that pulls batches ahead of using them records each
    one as it uses it (`stream.record(batch["state"])`), so a checkpoint never counts a batch
    not trained. timeout: seconds a worker may send nothing, its start and its first batch
    included (it sends up to 4 batches at once, workers.GROUP, none held longer than a sixteenth
    of the timeout) before the pass fails (TimeoutError naming the worker, which is killed; the
    next pass starts the workers again; default: wait, as torch's DataLoader does).

    device: None, "cuda", "cuda:N", a torch.device, or "cpu". With a CUDA device each batch's
    tensors arrive on it, copied by the loader on a stream of its own, which the current stream
    of the thread that takes the batch waits on (docs/training.md, "Handing batches over");
    "cpu" copies them out of the ring the same way, on the CPU. Without a device, tensors view
    the ring (small fields, at most ring.SMALL_BYTES a sample, are copied out), and pin_memory
    page-locks it where CUDA is: a user who copies them to the GPU with non_blocking=True, on any
    stream, is safe, because a dropped page-locked batch's slot goes back only after a
    synchronisation of the device that began after the drop (the loader makes one when a worker
    would otherwise wait); `device=` is the faster way to the GPU. decode="device" (with a device):
    a MixedStream's JPEGs of its batch's image size are decoded there, after the hand-over, in one
    torchvision.io.decode_jpeg call a batch (pipeline.data.decoding.gpujpeg), not in the workers.
    memory_format="channels_last": image fields come as (B, C, H, W) tensors with channels-last
    strides (`t.is_contiguous(memory_format=torch.channels_last)`), the same values; decoded JPEGs
    then reach the batch without a transpose (fields.batch.Layout.laid_out). Default "contiguous".
    Such a batch's `.view(n, -1)` raises and its `.numpy()` has (H, W, C) strides: `.reshape` or
    `.contiguous()` it (docs/training.md).

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
                  start_method=start_method, record=record, timeout=timeout, device=device, decode=decode,
                  memory_format=memory_format)


class Loader:
    """Batches of a stream, one pass per iteration (see make_loader)."""

    def __init__(self, stream, num_workers=0, *, pin_memory=False, prefetch_factor=PREFETCH, start_method="fork",
                 record=True, timeout=None, device=None, decode="host", memory_format="contiguous"):
        if num_workers < 0 or prefetch_factor < 1:
            raise ValueError(f"num_workers must be at least 0 and prefetch_factor at least 1, got "
                             f"{num_workers}, {prefetch_factor}")
        if timeout is not None and not (isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
                                        and 0 < timeout <= threading.TIMEOUT_MAX):
            raise ValueError(f"make_loader's timeout must be a finite number of seconds above 0 (or None to wait "
                             f"for good), got {timeout!r}")
        self.device = parse_device(device)
        if hasattr(getattr(stream, "layout", None), "laid_out"):  # before batch_spec, as the decode's below
            stream.layout = stream.layout.laid_out(memory_format)
        elif memory_format not in ("contiguous", torch.contiguous_format):
            raise ValueError(f"memory_format={memory_format!r} needs a stream with a batch layout (a MixedStream "
                             f"or EvalStream), got a {type(stream).__name__}")
        decoder = decoding(stream, decode, self.device)  # before batch_spec: JPEG rows change the slot
        depth = prefetch_factor + 2
        spec = stream.batch_spec()
        if num_workers:
            check_shared_memory(num_workers * depth * spec.slot_bytes)
        else:
            check_memory(depth, spec.slot_bytes)
        if hasattr(stream, "set_workers"):
            stream.set_workers(max(1, num_workers))
        self.stream, self.num_workers, self.record = stream, num_workers, record
        self._arrive = getattr(stream, "arrive", None)  # looked up once: a batch's check and record
        self._early = None  # (plan, pass id) of a pass `start` began
        self._passes = 0  # passes begun here: an iterator of an earlier one stops
        self._pass_lock = threading.RLock()  # a pass begins only between two batches of another, whatever the threads
        cuda = self.device is not None and self.device.type == "cuda"
        self.pin = (bool(pin_memory) or cuda) and torch.cuda.is_available()
        if num_workers:
            self.ring = Ring(num_workers, depth, spec, shared=True, pin=self.pin)
            self.workers = Workers(stream, num_workers, self.ring, worker_context(start_method), timeout)
        else:
            self.ring = Ring(1, depth, spec, shared=False, pin=self.pin)
            self.workers = None
            self._free = collections.deque()  # each pass fills it (`__iter__`)
            self._closed = False  # close() from another thread: the pass under way ends at its next batch
            self.ring.give_back = lambda producer, k: self._free.append(k)
        self._to_device = ToDevice(self.device, self.ring, *decoder) if self.device is not None else None

    def __len__(self):
        return len(self.stream)

    def start(self):
        """Start the workers now, and with them the pass the stream would read next (they start
        at the first pass otherwise): while the caller builds its model and CUDA starts, the
        workers fork, open their shards and fill their slots. Should the stream's plan change
        before the pass (a state loaded, another epoch set), that work is dropped."""
        with self._pass_lock:  # two threads never start (or talk to) the workers at once
            if self.workers is not None and not self.workers.started:
                self.workers.start()
                self.ring.page_lock()  # where CUDA refuses, one warning: the batches are not pinned
                if hasattr(self.stream, "plan"):
                    self._own_workers()
                    plan = self.stream.plan(begin=False)  # a state just loaded still decides the epoch
                    self._early = (plan, self.workers.begin(plan))
        return self

    def __iter__(self):
        if self.workers is None:
            with self._pass_lock:  # not while another thread's pass writes into a slot it took from `_free`
                self._own_workers()
                plan = self.stream.plan() if hasattr(self.stream, "plan") else None
                self._passes, self._closed = self._passes + 1, False
                free = self.ring.free_slots(self._fresh)[0]  # first: it puts a new deque in self._free
                self._free.extend(free)
                return self._here(plan, self._passes)
        with self._pass_lock:  # not while another thread's pass reads the workers' pipes and slots
            self._own_workers()
            plan = self.stream.plan() if hasattr(self.stream, "plan") else None
            self._passes += 1
            self.start()
            early, self._early = self._early, None
            pass_id = early[1] if early is not None and early[0] is plan else self.workers.begin(plan)
            return self._from_workers(pass_id, self._passes)

    def _own_workers(self):
        """The stream dealt to this loader's workers as its pass begins: another loader over the
        same stream (one of another worker count, made later) set it for its own."""
        workers = max(1, self.num_workers)
        if hasattr(self.stream, "set_workers") and getattr(self.stream, "workers", workers) != workers:
            self.stream.set_workers(workers)

    def _from_workers(self, pass_id, here):
        """Round robin over the workers, each dropped when its share ends: the order a
        DataLoader over an IterableDataset gives. Each batch is received under the pass lock,
        which a new pass takes to begin (`here`: this pass's number among this loader's): so two
        threads never read the same pipes and slots, and an older pass ends in one line."""
        active = list(range(self.num_workers))
        while active:
            for w in list(active):
                with self._pass_lock:
                    if here != self._passes:
                        raise RuntimeError("the loader was iterated again while this pass was being read; "
                                           "a loader runs one pass at a time")
                    kind, slot, n, payload = self.workers.receive(w, pass_id)
                    if kind == END:
                        active.remove(w)
                        continue
                    if kind != BATCH:
                        raise_error(payload, w)
                    batch = unpack(payload, n)
                    batch.update(self._hand_over(w, slot, n))
                yield self._arrived(batch)

    def _hand_over(self, producer, k, n):
        """The fixed fields of slot k: copies on the device, or views lent to the user."""
        if self._to_device is not None:
            return self._to_device.slot(producer, k, n)
        return self.ring.lend(producer, k, n)

    def _here(self, plan, pass_id):
        """A pass in this process: the stream writes into this loader's own slots (or, while the
        user holds all of them, into new memory). Each batch is made under the pass lock, which a
        new pass takes to begin: so the free slots it finds are never one this pass is writing."""
        batches = self.stream.batches(Worker(), self._borrow, plan)
        try:
            while True:
                with self._pass_lock:
                    if pass_id != self._passes:
                        raise RuntimeError("the loader was iterated again while this pass was being read; "
                                           "a loader runs one pass at a time")
                    if self._closed:  # as the workers' pass ends (workers.Workers.receive)
                        raise RuntimeError("the loader was closed while this pass was being read")
                    batch = next(batches, None)
                    if batch is None:
                        return
                    kind, k, n = batch.pop("slot")
                    if kind == "slot":
                        batch.update(self._hand_over(0, k, n))
                    elif self._to_device is not None:
                        batch.update(self._to_device.copy(self.ring.spec.views(k, n))[0])
                    else:
                        batch.update(self.ring.spec.views(k, n))
                yield self._arrived(batch)
        finally:
            batches.close()

    def _fresh(self):
        self._free = collections.deque()  # what is given back from now on; the pass's free slots join it

    def _borrow(self, n):
        self.ring.reap()
        if not self._free and self.ring.waiting:  # slots wait for GPU copies: wait for one, not for new memory
            self.ring.wait()
        if self._free:
            k = self._free.pop()  # the slot given back last: its bytes are still in the CPU's cache
            return ("slot", k, n), self.ring.arrays(0, k, n)
        base, memory = self.ring.spec.own(self.pin)
        return ("own", base, n), self.ring.spec.arrays(memory, n)

    def _arrived(self, batch):
        if self._arrive is not None and "state" in batch:  # checked and recorded as one step
            self._arrive(batch["state"], self.record)  # another pass on the stream ends this one
        if self._to_device is not None and REFUSED in batch:  # JPEGs neither decoder took after the hand-over
            batch["skipped"] += batch.pop(REFUSED)  # (decode="device"): skipped
        return batch

    def close(self):
        """Stop the workers now (they also stop when the loader is collected or the process ends),
        and with them the pass under way: its next batch raises RuntimeError. A later pass starts
        again (the workers too)."""
        if self.workers is not None:
            self.workers.close()
        else:
            self._closed = True
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


def check_memory(depth, slot_bytes, meminfo="/proc/meminfo"):
    """ValueError (one line) when the ring of a loader without workers (`depth` batches of
    `slot_bytes`) would not fit in the memory this machine has available: the refusal that
    `check_shared_memory` gives with workers, before the allocator's own error."""
    try:
        with open(meminfo) as f:
            free = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):  # no such figure here: the allocator decides
        return
    if depth * slot_bytes > free:
        raise ValueError(f"the loader needs {depth * slot_bytes / 2**20:.0f} MiB for its batches ({depth} of "
                         f"{slot_bytes / 2**20:.0f} MiB), this machine has {free / 2**20:.0f} MiB available: "
                         f"lower --batch-size (or the batch's fields' sizes)")


def worker_context(start_method="fork"):
    ctx = multiprocessing.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(["torch", "pipeline.data.streams.stream"])
    return ctx
