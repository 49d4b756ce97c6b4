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
SMALL_BYTES = 64  # a field of at most this many bytes a sample is copied out of its slot, not viewed



def channels_last(t):
    """Whether a (B, C, H, W) tensor has channels-last strides and not also the contiguous ones
    (one channel, or 1x1 images, have both): a batch laid out so is kept so (normalisation, the
    trainer's augmentation)."""
    return t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last)

class Field:
    """One fixed-shape field of a batch: `shape` per sample, `dtype` a numpy dtype. An image field
    (shape C, H, W) may be `channels_last`: its bytes hold H, W, C per sample (what a JPEG
    decoder writes), and its arrays and tensors are the same (n, C, H, W) shape with those
    strides (torch.channels_last), so a decoder's HWC pixels go in by a straight copy, no transpose."""

    def __init__(self, name, dtype, shape=(), channels_last=False):
        self.name, self.dtype, self.shape = name, np.dtype(dtype), tuple(int(x) for x in shape)
        if channels_last and len(self.shape) != 3:
            raise ValueError(f"field {name!r} of shape {self.shape} cannot be channels_last: that takes (C, H, W)")
        self.channels_last = bool(channels_last)

    def nbytes(self, n):
        return n * self.dtype.itemsize * math.prod(self.shape)

    @property
    def small(self):
        """Whether a batch hands this field out as a tensor of its own (see SMALL_BYTES)."""
        return self.nbytes(1) <= SMALL_BYTES

    def stored(self, n):
        """The shape of n samples as their bytes lie: (n, H, W, C) if channels_last, else (n, *shape)."""
        return (n, *self.shape[1:], self.shape[0]) if self.channels_last else (n, *self.shape)

    def array(self, n, buffer=None, offset=0):
        """A numpy (n, *shape) array of this field over `buffer` from `offset` (a new one if None),
        with channels_last strides if the field has them."""
        a = np.ndarray(self.stored(n), self.dtype, buffer, offset)
        return a.transpose(0, 3, 1, 2) if self.channels_last else a

    def __repr__(self):
        return f"Field({self.name!r}, {self.dtype}, {self.shape}{', channels_last' * self.channels_last})"


class Spec:
    """The fixed-shape fields of a batch of at most `batch` samples, and where each lies in a slot."""

    def __init__(self, fields, batch):
        self.fields, self.batch = tuple(fields), int(batch)
        self.offsets, at = [], 0
        for f in self.fields:
            self.offsets.append(at)
            at += -(-f.nbytes(self.batch) // ALIGN) * ALIGN
        self.slot_bytes = max(at, ALIGN)
        self.large = not all(f.small for f in self.fields)  # a field views the slot (else it goes back at once)
        self._made()

    def _made(self):
        """What `holder` and `tensors` use for each batch, worked out once: a batch costs the consumer
        these few steps, not the fields' properties again."""
        self._ctype = ctypes.c_uint8 * self.slot_bytes
        self._plan = tuple((f.name, f, o, f.small) for f, o in zip(self.fields, self.offsets))

    def __getstate__(self):  # a ctypes array type does not pickle: made again where it arrives
        return {k: v for k, v in self.__dict__.items() if k not in ("_ctype", "_plan")}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._made()

    @property
    def names(self):
        return [f.name for f in self.fields]

    def arrays(self, memory, n):
        """{name: numpy view (n, *shape)} of a slot's bytes (a uint8 numpy array), to write into."""
        return {name: f.array(n, memory, o) for name, f, o, _ in self._plan}

    def holder(self, memory, offset=0):
        """A new object exporting a slot's bytes (those of `memory`, a writable buffer, from
        `offset`): arrays made over it keep it as their base (numpy would collapse a view of a
        view to the ring's own array), so it lives exactly as long as any tensor of the batch. A
        ctypes array: it can be weakly referenced, and building three tensors over it cost about
        half what torch's slicing and reinterpreting of one uint8 tensor did. The ring passes a
        memoryview made once: a numpy array would describe its format anew for each batch."""
        return self._ctype.from_buffer(memory, offset)

    def tensors(self, holder, n):
        """{name: tensor (n, *shape)} viewing the slot's bytes that `holder` exports; small
        fields copied out of it (a kept label keeps its own bytes, not the slot)."""
        out = {}
        for name, f, o, small in self._plan:
            array = f.array(n, holder, o)
            out[name] = torch.from_numpy(array.copy(order="K") if small else array)
        return out

    def views(self, base, n):
        """{name: tensor (n, *shape)} viewing a uint8 tensor of slot_bytes of its own (a batch copied
        out, or made while every slot was lent): torch views of `base`, so that torch's pinned-memory
        allocator knows when an asynchronous copy from them has completed before it reuses `base`.
        Small fields are copied out of `base`, as in `tensors`."""
        out = {}
        for f, o in zip(self.fields, self.offsets):
            view = base[o:o + f.nbytes(n)].view(torch.from_numpy(np.empty(0, f.dtype)).dtype).view(f.stored(n))
            if f.channels_last:
                view = view.permute(0, 3, 1, 2)
            out[f.name] = view.clone() if f.small else view  # clone keeps the strides (preserve_format)
        return out

    def lend_new(self, n):
        """(None, {name: numpy array}) in new memory laid out as a slot: what a producer without a
        ring's slots writes a batch into (Layout.collate then normalises into a float32 `image` as
        into a slot; the layout's own fields would be uint8, unnormalised)."""
        return None, self.arrays(self.own(False)[1], n)

    def own(self, pin):
        """(a new uint8 tensor of slot_bytes, pinned if asked, and a numpy view of it to write into)."""
        base = torch.empty(self.slot_bytes, dtype=torch.uint8, pin_memory=pin)
        return base, base.numpy()
