"""A batch's fixed-shape fields (`Field`) and where each lies in a slot of bytes (`Spec`).

The batch layout (fields.batch.Layout) says which fields a schema's batch has; a Spec places
them in one block of bytes, aligned, so a batch is written once into the memory that the
hand-over's ring (pipeline.data.handover.ring) lends and the consumer reads in place.
"""
import ctypes
import math

import numpy as np
import torch

ALIGN = 64  # bytes: every field of a slot starts on a cache line (and any dtype's alignment)


class Field:
    """One fixed-shape field of a batch: `shape` per sample, `dtype` a numpy dtype."""

    def __init__(self, name, dtype, shape=()):
        self.name, self.dtype, self.shape = name, np.dtype(dtype), tuple(int(x) for x in shape)

    def nbytes(self, n):
        return n * self.dtype.itemsize * math.prod(self.shape)

    def __repr__(self):
        return f"Field({self.name!r}, {self.dtype}, {self.shape})"


class Spec:
    """The fixed-shape fields of a batch of at most `batch` samples, and where each lies in a slot."""

    def __init__(self, fields, batch):
        self.fields, self.batch = tuple(fields), int(batch)
        self.offsets, at = [], 0
        for f in self.fields:
            self.offsets.append(at)
            at += -(-f.nbytes(self.batch) // ALIGN) * ALIGN
        self.slot_bytes = max(at, ALIGN)
        self._ctype = ctypes.c_uint8 * self.slot_bytes

    def __getstate__(self):  # a ctypes array type does not pickle: made again where it arrives
        return {k: v for k, v in self.__dict__.items() if k != "_ctype"}

    def __setstate__(self, state):
        self.__dict__.update(state, _ctype=ctypes.c_uint8 * state["slot_bytes"])

    @property
    def names(self):
        return [f.name for f in self.fields]

    def arrays(self, memory, n):
        """{name: numpy view (n, *shape)} of a slot's bytes (a uint8 numpy array), to write into."""
        return {f.name: memory[o:o + f.nbytes(n)].view(f.dtype).reshape(n, *f.shape)
                for f, o in zip(self.fields, self.offsets)}

    def holder(self, memory):
        """A new object exporting a slot's bytes (a uint8 numpy array): arrays made over it keep
        it as their base (numpy would collapse a view of a view to the ring's own array), so it
        lives exactly as long as any tensor of the batch. A ctypes array: it can be weakly
        referenced, and building three tensors over it cost about half what torch's slicing and
        reinterpreting of one uint8 tensor did."""
        return self._ctype.from_buffer(memory)

    def tensors(self, holder, n):
        """{name: tensor (n, *shape)} viewing the slot's bytes that `holder` exports."""
        return {f.name: torch.from_numpy(np.ndarray((n, *f.shape), f.dtype, holder, o))
                for f, o in zip(self.fields, self.offsets)}

    def views(self, base, n):
        """{name: tensor (n, *shape)} viewing a uint8 tensor of slot_bytes of its own (a batch copied
        out, or made while every slot was lent): torch views of `base`, so that torch's pinned-memory
        allocator knows when an asynchronous copy from them has completed before it reuses `base`."""
        return {f.name: base[o:o + f.nbytes(n)].view(torch.from_numpy(np.empty(0, f.dtype)).dtype).view(n, *f.shape)
                for f, o in zip(self.fields, self.offsets)}

    def own(self, pin):
        """(a new uint8 tensor of slot_bytes, pinned if asked, and a numpy view of it to write into)."""
        base = torch.empty(self.slot_bytes, dtype=torch.uint8, pin_memory=pin)
        return base, base.numpy()
