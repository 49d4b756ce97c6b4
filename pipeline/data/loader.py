"""The hand-over from DataLoader workers to the process that trains.

Workers collate uint8 images into shared-memory buffers made once per loader
(`BatchRing`) and send only which buffer holds a batch; the main process turns
the batch into tensors, copies or normalises the images out, frees the buffer
and records where the worker that made it stands (`Arrival`). A tensor sent
from a worker costs a new shared-memory file per batch, its pages faulted in by
both processes, and a file-descriptor hand-over through multiprocessing's
resource sharer (a socket handshake with HMAC): more than the batch's own
work for small images.
"""
import functools
import math
import multiprocessing
import os
import threading
import time
import typing

import numpy as np
import torch
import webdataset as wds

from pipeline.data.budget import PREFETCH
from pipeline.data.topology import Worker


class RingBuffer(typing.NamedTuple):
    """Which `BatchRing` buffer holds a batch's images (a named tuple survives pin_memory)."""
    worker: int
    index: int


def shared_zeros(shape, dtype):
    """A tensor in a new shared-memory file: it reads as zeros, and its pages cost
    nothing until written (torch.zeros(...).share_memory_() would write them twice)."""
    like = torch.from_numpy(np.empty(0, dtype))
    return like.new(like._typed_storage()._new_shared(math.prod(shape))).view(shape)


class BatchRing:
    """Shared-memory buffers that a loader's workers collate uint8 images into.

    Made once, before the workers start, and mapped in every process; each worker
    has `depth` of them, more than it can have batches in flight (the loader's
    prefetch_factor, plus the one being finished). Should none be free all the
    same, the worker falls back to a new shared tensor.
    """

    def __init__(self, workers, depth, batch_shape):
        self.images = shared_zeros((workers, depth, *batch_shape), np.uint8)
        self.busy = shared_zeros((workers, depth), np.uint8)

    def take(self, worker, n):
        """(RingBuffer, its first n images as numpy, as the last batch left them) for a worker;
        (None, None) if all are busy. batch.Layout.collate writes every byte, padding included."""
        busy = self.busy[worker].numpy()
        free = np.flatnonzero(busy == 0)
        if len(free) == 0:
            return None, None
        k = int(free[0])
        busy[k] = 1
        return RingBuffer(worker, k), self.images[worker, k, :n].numpy()

    def release(self, buffer):
        """A buffer whose batch the main process has copied out."""
        self.busy[buffer] = 0

    def free(self, worker):
        """All of a worker's buffers, as it starts a pass: batches of an abandoned pass
        were discarded unread by the DataLoader."""
        self.busy[worker].numpy().fill(0)


class EpochShare:
    """The epoch and mixture weights the main process sets, as persistent DataLoader
    workers see them: each worker holds a pickled copy of the stream, made at the
    loader's first pass, so later `set_epoch` calls reach it only through shared memory.
    `started` tells the main process a worker has taken its copy (a state loaded after
    that would not reach it)."""

    def __init__(self, ctx, epoch, probs):
        self._epoch = ctx.Value("q", epoch, lock=False)
        self._probs = ctx.Array("d", list(probs), lock=False)
        self._started = ctx.Value("b", 0, lock=False)

    def publish(self, epoch, probs):
        self._epoch.value = epoch
        self._probs[:] = list(probs)

    def take(self):
        """(epoch, probs) as the main process last set them; marks a worker started."""
        self._started.value = 1
        return self._epoch.value, list(self._probs)

    @property
    def started(self):
        return bool(self._started.value)


class _RingFed(torch.utils.data.IterableDataset):
    """A stream's raw batches; in workers their images leave through a `BatchRing`."""

    def __init__(self, stream, ring=None):
        self.stream, self.ring = stream, ring

    def __len__(self):
        return len(self.stream)

    def __iter__(self):
        worker = Worker.current()
        if self.ring is None:
            return self.stream.batches(worker)
        self.ring.free(worker.id)
        return self.stream.batches(worker, functools.partial(self._borrow_buffer, worker.id))

    def _borrow_buffer(self, worker, n):
        handle, images = self.ring.take(worker, n)
        if handle is None:
            images = shared_zeros((n, *self.ring.images.shape[3:]), np.uint8).numpy()
        return handle, images


class Arrival:
    """Finish a batch in the process that consumes it: label and source become int64
    tensors, images come out of their `BatchRing` buffer (which is then freed) and are
    normalised if the stream says so, and the stream records the worker's position.

    Normalising here rather than in the workers: float32 is 4x the bytes to send, and
    normalising cost less CPU than sending floats (tools/bench_loader.py).
    """

    def __init__(self, stream, ring=None, pin=False, record=True):
        self.stream, self.ring, self.pin, self.record = stream, ring, pin, record
        self.layout = stream.layout if getattr(stream, "normalize", True) else None

    def __call__(self, batch):
        source = torch.from_numpy(batch["source"])
        batch["label"], batch["source"] = torch.from_numpy(batch["label"]), source
        image = batch["image"]
        if isinstance(image, RingBuffer):
            lent = self.ring.images[image][:len(source)]
            if self.layout is not None:
                batch["image"] = self.layout.normalize(lent, source, self.pin)
            else:
                batch["image"] = torch.empty(lent.shape, dtype=torch.uint8, pin_memory=self.pin)
                batch["image"].numpy()[...] = lent.numpy()
            self.ring.release(image)
        else:
            image = torch.from_numpy(image) if isinstance(image, np.ndarray) else image
            batch["image"] = self.layout.normalize(image, source, self.pin) if self.layout is not None else image
        if "state" in batch and self.record:
            self.stream.record(batch["state"])
        return batch


def make_loader(stream, num_workers=0, pin_memory=False, prefetch_factor=PREFETCH, start_method="fork", record=True):
    """A WebLoader over a stream (MixedStream or EvalStream). With record=False the stream
    does not take a batch's place as it arrives: a consumer that pulls batches ahead of
    using them (the trainer's copy to the GPU one step ahead) records each one as it uses
    it (`stream.record(batch["state"])`), so a checkpoint never counts a batch not trained.

    Workers persist across epochs: make the loader once and call `set_epoch` before
    each pass. Forking a process while another of its Python threads starts or exits
    can deadlock the child inside os.fork() on Python 3.8-3.11 (CPython gh-112275, the
    interpreter's HEAD_LOCK); it happened here when the trainer's evaluation loader
    forked as tqdm's monitor thread exited with the epoch's bar (the trainer now runs
    tqdm without it). Persistent workers fork once, at their loader's first pass, so
    start loaders while no thread comes or goes. start_method="forkserver" avoids forking the
    caller at all, at ~300 MiB for the server and a re-import of the main script per
    worker (the script then needs an `if __name__ == "__main__":` guard).
    """
    if hasattr(stream, "set_workers"):
        stream.set_workers(max(1, num_workers))
    pin = pin_memory and torch.cuda.is_available()
    if not num_workers:
        return wds.WebLoader(_RingFed(stream), batch_size=None, collate_fn=_as_is).map(Arrival(stream, None, pin,
                                                                                               record))
    ctx = worker_context(start_method)
    if hasattr(stream, "share"):
        stream.share(ctx)
    ring = BatchRing(num_workers, prefetch_factor + 2, stream.layout.batch_shape(stream.batch_size))
    loader = wds.WebLoader(_RingFed(stream, ring), batch_size=None, collate_fn=_as_is, num_workers=num_workers,
                           pin_memory=False, prefetch_factor=prefetch_factor, persistent_workers=True,
                           multiprocessing_context=ctx, worker_init_fn=functools.partial(_exit_with, os.getpid()))
    return loader.map(Arrival(stream, ring, pin, record))


def _as_is(batch):
    """Batches are already collated; DataLoader's default_convert would walk every key
    string of every batch, a large share of the loader's time (docs/benchmarks.md, "Small
    choices in the batch code")."""
    return batch


def _exit_with(parent, worker_id):
    """End this worker when the process that made its loader is gone.

    DataLoader's own watchdog watches the worker's parent, which for forkserver workers
    is the forkserver, and the forkserver lives while any worker does: a trainer killed
    without cleanup would leave both behind, holding the job's stdout open.
    """
    def watch():
        while True:
            time.sleep(1)
            try:
                os.kill(parent, 0)
            except ProcessLookupError:
                os._exit(1)

    threading.Thread(target=watch, daemon=True, name="exit-with-trainer").start()


def worker_context(start_method="fork"):
    ctx = multiprocessing.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(["torch", "pipeline.data.stream"])
    return ctx
