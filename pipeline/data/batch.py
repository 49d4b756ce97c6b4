"""The batch format shared by every source, and the one place images are normalised.

A batch is a dict: `image` (B, 3, H, W) with H, W the largest over the sources
(smaller images zero-padded around the centre, grey ones repeated to 3
channels), `label` int64 with each source's classes offset (MNIST 0-9, CIFAR10
10-19 when listed in that order, so classes never collide), `source` the source
index of each sample, `key` the sample keys, `skipped` the malformed samples
skipped while making it, and, from a training stream, `state` (where the
worker that made it stands; see MixedStream.state_dict).

Images stay uint8 unless the stream normalises them (`Layout.collate` into a float32
slot, with each source's own mean and std from its manifest); the trainer takes uint8, a
quarter of the bytes to the GPU, and normalises there (`Layout.normalize`).
"""
import contextlib
import threading

import numpy as np
import torch

from pipeline.data.node import Node
from pipeline.data.ring import Field, Spec


def _rgb(values):
    return list(values) * 3 if len(values) == 1 else list(values)


def _alone():
    """True where torch may be switched to one thread for a moment: no other Python thread
    runs but multiprocessing's queue feeders (a DataLoader's, which only pickle and write).
    torch.set_num_threads also sets the count that a thread takes when it first runs a
    parallel op, so another thread doing that inside the switch would keep one thread for
    good, even after choosing its own count."""
    me = threading.current_thread()
    return all(t is me or t.name.startswith("QueueFeederThread") for t in threading.enumerate())


@contextlib.contextmanager
def one_torch_thread():
    """torch's ops inside run in one thread; the count is put back after, also on an error."""
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _to_canvas(pixels, h, w):
    """(n, C, sh, sw) uint8 images as (n, C, h, w), zero-padded around the centre. Padding
    here, in a small array, and then placing whole rows in the batch with one fancy
    assignment costs half what one windowed assignment into the batch did (it copies
    28-byte runs for MNIST). A grey channel is not repeated here: the assignment into the
    batch broadcasts it to 3, which costs about half of np.repeat and then the assignment
    (docs/benchmarks.md, "Small choices in the batch code")."""
    c, sh, sw = pixels.shape[1:]
    if (sh, sw) != (h, w):
        top, left = (h - sh) // 2, (w - sw) // 2
        pad = np.zeros((len(pixels), c, h, w), np.uint8)
        pad[:, :, top:top + sh, left:left + sw] = pixels
        pixels = pad
    return pixels


class Layout:
    """Where each source's images and labels go in a batch, and how they are normalised."""

    def __init__(self, sources):
        self.sources = list(sources)
        self.names = [s.name for s in sources]
        sizes = [len(s.classes) for s in sources]
        self.offsets = np.cumsum([0] + sizes[:-1]).astype(np.int64)
        self.num_classes = sum(sizes)
        self.hw = (max(s.shape[1] for s in sources), max(s.shape[2] for s in sources))
        mean = torch.tensor([_rgb(s.mean) for s in sources], dtype=torch.float32).view(-1, 3, 1, 1)
        std = torch.tensor([_rgb(s.std) for s in sources], dtype=torch.float32).view(-1, 3, 1, 1)
        self.scale, self.shift = 1.0 / (255.0 * std), mean / std
        self._on_device = {}
        self._u8 = None

    def __getstate__(self):  # workers get the CPU stats only, never a GPU copy, nor a canvas
        return dict(self.__dict__, _on_device={}, _u8=None)

    def index(self, name):
        try:
            return self.names.index(name)
        except ValueError:
            raise ValueError(f"unknown source {name!r}; sources are {', '.join(self.names)}") from None

    def batch_shape(self, batch_size):
        return (batch_size, 3, *self.hw)

    def spec(self, batch_size, normalize):
        """The batch's fixed-shape fields as a ring lays them out (pipeline.data.ring): images
        float32 when the producer normalises them, else uint8."""
        return Spec([Field("image", np.float32 if normalize else np.uint8, (3, *self.hw)), Field("label", np.int64),
                     Field("source", np.int64)], batch_size)

    def collate(self, choice, parts, skipped=0, out=None):
        """One batch from each source's taken samples.

        choice: the source index of each position; parts[s]: (keys, uint8 images, labels)
        of source s, as many as choice names it; out: {"image", "label", "source"} arrays to
        fill (a ring slot's, pipeline.data.ring), else they are made. A float32 `image` gets the
        images normalised (collated into a uint8 canvas first, kept for the next batch): the
        producer normalises, so the consumer only hands the batch on. Every byte of `out` is
        written, padding included, so a reused slot needs no zeroing first.
        """
        b = len(choice)
        h, w = self.hw
        out = dict(out or {})
        image = out.get("image")
        if image is None:
            image = np.empty((b, 3, h, w), np.uint8)
        u8 = image if image.dtype == np.uint8 else self._canvas(b)
        label = out["label"] if "label" in out else np.empty(b, np.int64)
        source = out["source"] if "source" in out else np.empty(b, np.int64)
        keys = np.empty(b, object)
        for s, (k, pixels, labels) in enumerate(parts):
            idx = np.flatnonzero(choice == s)
            if not len(k):
                u8[idx] = 0  # places nothing was taken for read as zeros, as they always have
                continue
            u8[idx] = _to_canvas(pixels, h, w)
            keys[idx] = k
            label[idx] = labels + self.offsets[s]
        source[:] = choice
        if u8 is not image:
            self._normalize_cpu(torch.from_numpy(image), torch.from_numpy(u8), torch.from_numpy(source))
        return {"image": image, "label": label, "source": source, "key": keys.tolist(), "skipped": skipped}

    def _canvas(self, b):
        """A uint8 canvas of b images, made once per process and reused."""
        if self._u8 is None or len(self._u8) < b:
            self._u8 = np.empty((b, 3, *self.hw), np.uint8)
        return self._u8[:b]

    def normalize(self, image, source, pin_memory=None):
        """uint8 (B, 3, H, W) images -> normalised float32, on whatever device they are.

        On the CPU torch runs this in one thread: with more, it spreads a batch this small
        over every core and its idle threads then spin (the in-process loader used about two
        cores for the work of one), and numpy's multiply by a per-sample operand leaves
        its SIMD loops, costing nearly three times torch's ops in one thread. Switching to
        one thread and back is cheap, and CPU training steps with the switch between them
        took as long as without (docs/benchmarks.md, "Where the raw path's time goes"). The switch
        is made only where no other Python thread could run torch ops meanwhile (`_alone`);
        elsewhere numpy does it as before. Both give fl(fl(x * scale) - shift) bit for bit, pinned if
        `pin_memory`, by default if the images are.
        """
        if isinstance(image, np.ndarray):
            image = torch.from_numpy(image)
        source = torch.as_tensor(source)
        if source.dtype.is_floating_point or source.dtype == torch.bool:
            raise TypeError(f"source indices must be integers, got {source.dtype}")
        source = source.long()  # a uint8 tensor would index as a mask
        if image.device.type == "cpu":
            pin = image.is_pinned() if pin_memory is None else pin_memory
            return self._normalize_cpu(torch.empty(image.shape, dtype=torch.float32, pin_memory=pin), image, source)
        if image.device not in self._on_device:  # copy the stats to a GPU once, not every step
            self._on_device[image.device] = (self.scale.to(image.device), self.shift.to(image.device))
        scale, shift = self._on_device[image.device]
        return image.float().mul_(scale[source]).sub_(shift[source])

    def _normalize_cpu(self, out, image, source):
        """Into `out`: torch's ops in one thread where torch has one anyway or this is the only
        Python thread, else numpy's (slower, but no switch)."""
        route = by_torch if torch.get_num_threads() == 1 or _alone() else by_numpy
        source = source.long()
        return route(out, image, self.scale[source], self.shift[source])


def by_torch(out, image, scale, shift):
    """fl(fl(image * scale) - shift) into float32 `out`, torch's ops in one thread
    (`one_torch_thread`); scale and shift broadcast per sample and channel."""
    with one_torch_thread():
        return out.copy_(image).mul_(scale).sub_(shift)


def by_numpy(out, image, scale, shift):
    """The same, bit for bit, with numpy's ufuncs: a cast, then two in place."""
    o = out.numpy()
    np.copyto(o, image.numpy())
    o *= scale.numpy()
    o -= shift.numpy()
    return out


NOTHING = ([], np.zeros((0, 1, 1, 1), np.uint8), np.zeros(0, np.int64))  # what a source not drawn gives


class Collate(Node):
    """The last stage: what `upstream` (a `stages.Mix`) took, as one batch in this layout,
    with the samples skipped since the last batch (`errors.skipped`), written into the arrays
    `borrow(n)` lends when given ((handle, {field: array}): a ring slot); the batch then
    carries the handle as "slot"."""

    def __init__(self, upstream, layout, errors, borrow=None):
        self.upstream, self.layout, self.errors, self.borrow = upstream, layout, errors, borrow
        self.reported = 0

    def next(self, n=None):
        choice, parts = self.upstream.next(n)
        handle, out = self.borrow(len(choice)) if self.borrow else (None, None)
        batch = self.layout.collate(choice, [p if p is not None else NOTHING for p in parts],
                                    self.errors.skipped - self.reported, out)
        self.reported = self.errors.skipped
        if handle is not None:
            batch["slot"] = handle
        return batch
