"""The one batch layout of every stream, and the one place images are normalised.

Every source has a schema (pipeline.data.fields.schema): its own, or the default one, an image at
its manifest's shape and a class label (columns.default_columns). A batch is a dict of the
union of the sources' fields (pipeline.data.fields.columns says how each field type is held): with
the default schema, `image` (B, 3, H, W) with H, W the largest over the sources (smaller
images zero-padded around the centre, grey ones repeated to 3 channels) and `label` int64
with each source's classes offset (MNIST 0-9, CIFAR10 10-19 when listed in that order, so
classes never collide; a `class` field of any schema is offset the same way); beside them
`source` the source index of each sample, `key` the sample keys, `skipped` the malformed
samples skipped while making it, and, from a training stream, `state` (where the worker
that made it stands; see MixedStream.state_dict).

Every field stays as decoded (images uint8) but `image` when the stream normalises it
(`Layout.collate` into a float32 slot, with each source's own mean and std from its
manifest); the trainer takes uint8, a quarter of the bytes to the GPU, and normalises
there (`Layout.normalize`).
"""
import contextlib
import copy
import dataclasses
import threading

import numpy as np
import torch

from pipeline.data.fields.columns import canvas, default_columns, fields_of, form, put, said
from pipeline.data.decoding.gpujpeg import SIZES
from pipeline.data.fields.keys import Keys
from pipeline.data.fields.spec import Field, Spec, channels_last
from pipeline.errors import InputError


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


class Layout:
    """The one batch layout: where each source's fields go in a batch, and how its images are
    normalised. Every source has a schema, its own or the default one (image and class,
    columns.default_columns); a field several sources have is one batch field (columns.form)."""

    def __init__(self, sources):
        self.sources = list(sources)
        self.names = [s.name for s in self.sources]
        self.finals = [s.schema.final if getattr(s, "schema", None) else default_columns(s) for s in self.sources]
        union, first = {}, {}
        for s, cols in zip(self.sources, self.finals):
            for col in cols:
                have = union.setdefault(col.name, col)
                first.setdefault(col.name, s.name)
                if form(have) != form(col):
                    raise ValueError(f"field {col.name!r} is {said(have)} in source {first[col.name]} and "
                                     f"{said(col)} in source {s.name}; one batch field needs one type and shape: "
                                     f"give the sources' schemas the same, or another name")
                if canvas(col):  # the canvas: the largest height, width and channels
                    union[col.name] = dataclasses.replace(have, size=tuple(np.maximum(have.size, col.size).tolist()),
                                                          channels=max(have.channels, col.channels))
        self.columns = list(union.values())
        self.masked = [c.name for c in self.columns
                       if any(all(o.name != c.name for o in cols) or any(o.name == c.name and o.optional for o in cols)
                              for cols in self.finals)]
        self.fixed = [f for c in self.columns for f in fields_of(c)]
        self.fixed += [Field(n + "_mask", np.bool_) for n in self.masked] + [Field("source", np.int64)]
        self.zeroed = [f.name for c in self.columns if c.padded or c.name in self.masked for f in fields_of(c)]
        sizes = [len(s.classes) for s in self.sources]
        self.offsets = np.cumsum([0] + sizes[:-1]).astype(np.int64)  # each source's first class in the batch
        self.classes = sum(sizes)
        image = union.get("image")
        c = image.channels if image is not None and image.kind == "image" else 3
        stats = lambda v: list(v) * c if len(v) == 1 else list(v)[:c]  # noqa: E731 (grey stats on an RGB canvas)
        mean = torch.tensor([stats(s.mean) for s in self.sources], dtype=torch.float32).view(-1, c, 1, 1)
        std = torch.tensor([stats(s.std) for s in self.sources], dtype=torch.float32).view(-1, c, 1, 1)
        self.scale, self.shift = 1.0 / (255.0 * std), mean / std
        self._on_device = {}
        self._u8 = None
        self.encoded = [False] * len(self.sources)  # sources whose exact JPEGs travel as bytes (`decoded_on`)

    def decoded_on(self, where, sample_stages=()):
        """This layout (a copy if it changes) with the `image` field's JPEGs decoded on the "host" (in
        the producer) or the "device" (after the hand-over, pipeline.data.decoding.gpujpeg; make_loader's
        decode=). On the device: those of the default schema's sources whose image is the canvas's own
        shape (no padding, no grey to repeat); the rest, and all beside sample stages (they see
        pixels), on the host. A copy: another stream sharing this layout (an EvalStream) keeps its own."""
        if where not in ("host", "device"):
            raise ValueError(f"make_loader's decode must be 'host' or 'device', got {where!r}")
        if where == "device" and sample_stages:
            raise ValueError("decode='device' leaves JPEGs encoded until the hand-over, and sample stages need "
                             "their pixels: drop the sample stages or decode on the host (decode='host')")
        image = next((f for f in self.fixed if f.name == "image"), None)
        encoded = [where == "device" and image is not None and not getattr(s, "schema", None)
                   and tuple(s.shape) == image.shape for s in self.sources]
        if encoded == self.encoded:
            return self
        other = copy.copy(self)
        other.encoded = encoded
        return other

    MEMORY_FORMATS = {"contiguous": False, torch.contiguous_format: False, "channels_last": True,
                      torch.channels_last: True}

    @property
    def channels_last(self):
        """Whether the image fields' bytes hold (H, W, C) a sample (`laid_out`)."""
        return any(f.channels_last for f in self.fixed)

    def laid_out(self, memory_format):
        """This layout (a copy if it changes) with its image fields in `memory_format`: "contiguous"
        (N, C, H, W bytes, as always) or "channels_last" (N, H, W, C bytes: the same (N, C, H, W)
        tensors with torch.channels_last strides; make_loader's memory_format=). Channels last,
        the HWC pixels libjpeg-turbo writes reach the batch by a straight copy, not a transpose
        to planes; raw and PNG pixels, and the device's decode, are copied in transposed."""
        try:
            last = self.MEMORY_FORMATS[memory_format]
        except (KeyError, TypeError):
            raise ValueError(f"memory_format must be 'contiguous' or 'channels_last' (or torch's), got "
                             f"{memory_format!r}") from None
        if last == self.channels_last:
            return self
        images = {c.name for c in self.columns if c.kind == "image"}
        other = copy.copy(self)
        other.fixed = [Field(f.name, f.dtype, f.shape, channels_last=last) if f.name in images else f
                       for f in self.fixed]
        other._u8 = None
        return other

    def __getstate__(self):  # workers get the CPU stats only, never a GPU copy, nor a canvas
        return dict(self.__dict__, _on_device={}, _u8=None)

    def index(self, name):
        try:
            return self.names.index(name)
        except ValueError:
            raise ValueError(f"unknown source {name!r}; sources are {', '.join(self.names)}") from None

    def trained(self):
        """(image column, label column) the trainer takes: an image field `image` and a class
        field `label` every source has; other fields ride along. InputError, one line, else."""
        cols = {c.name: c for c in self.columns}
        image, label = cols.get("image"), cols.get("label")
        problem = None
        if image is None or image.kind != "image" or image.padded:
            problem = "no image field `image` fitted to one size (fit resize, center-crop or random-crop)"
        elif label is None or label.kind != "class":
            problem = "no class field `label` (e.g. --fields '... label:class=cls' or label:class=json:class)"
        elif "image" in self.masked or "label" in self.masked:
            problem = "sources where `image` or `label` is missing or optional"
        if problem:
            return None, InputError(f"the trainer takes an image and a class label, and the stream has {problem}; "
                                    f"fields are {', '.join(c.name + ' (' + c.kind + ')' for c in self.columns)} "
                                    f"(docs/data.md, 'Fields')")
        return (image, label), None

    def _need(self):
        cols, error = self.trained()
        if error is not None:
            raise error
        return cols

    @property
    def num_classes(self):
        """Classes over the sources, each source's offset past those before it."""
        self._need()
        return self.classes

    @property
    def hw(self):
        """(H, W) of the `image` field: the canvas every source's images are placed on."""
        return self._need()[0].size

    def batch_shape(self, batch_size):
        return (batch_size, self._need()[0].channels, *self.hw)

    def spec(self, batch_size, normalize=False):
        """The batch's fixed-shape fields as a ring lays them out (pipeline.data.handover.ring); the
        `image` field float32 when the producer normalises it, every other field as it is."""
        normalize = normalize and not any(self.encoded)  # JPEG bytes in `image` rows: normalised after the decode
        fixed = [Field(f.name, np.float32, f.shape, f.channels_last)
                 if normalize and f.name == "image" and self._normalizable() else f
                 for f in self.fixed]
        return Spec(fixed + [Field(SIZES, np.int32)] * any(self.encoded), batch_size)

    def _normalizable(self):
        image = next((c for c in self.columns if c.name == "image"), None)
        return image is not None and image.kind == "image" and not image.padded

    def memory(self, batch_size):
        """(bytes of one batch with every field at its cap, bytes of the largest image field as
        decoded): what pipeline.data.handover.budget counts for this layout."""
        listed = sum(c.max_bytes + 64 for c in self.columns if c.listed)
        batch = sum(f.nbytes(batch_size) for f in self.fixed) + batch_size * listed
        image = max([c.channels * c.size[0] * c.size[1] for c in self.columns if c.kind == "image"] or [0])
        return batch, image

    def collate(self, choice, parts, skipped=0, out=None):
        """One batch from each source's taken samples.

        choice: the source index of each position; parts[s]: (keys, values, labels) of source
        s, as many as choice names it: values uint8 images (a default-schema source: its labels
        beside) or an object array of {field: value} (a schema's source); out: the arrays of a
        ring slot to fill (pipeline.data.handover.ring), else they are made. A float32 `image` gets the
        images normalised (collated into a uint8 canvas first, kept for the next batch): the
        producer normalises, so the consumer only hands the batch on. Every byte of `out` is
        written, padding included, so a reused slot needs no zeroing first.
        """
        b = len(choice)
        arrays = dict(out or {})
        for f in self.fixed:
            if f.name not in arrays:
                arrays[f.name] = f.array(b)
        image = arrays.get("image")
        floats = image is not None and image.dtype == np.float32
        if floats:
            arrays["image"] = self._canvas(b)
        for name in self.zeroed:
            arrays[name][...] = 0
        for name in self.masked:
            arrays[name + "_mask"][...] = False
        if SIZES in arrays:
            arrays[SIZES][...] = 0
        lists = {c.name: [None] * b for c in self.columns if c.listed}
        keys = np.empty(b, object)
        for s, (k, values, labels, *sizes) in enumerate(parts):
            idx = np.flatnonzero(choice == s)
            if not len(idx):
                continue
            if not len(k):  # places nothing was taken for read as zeros, as they always have
                for f in self.fixed:
                    arrays[f.name][idx] = 0
                continue
            keys[idx] = k
            by_name = {"image": values, "label": labels} if values.dtype != object else None
            for col in self.finals[s]:
                vals = by_name[col.name] if by_name else [v[col.name] for v in values]
                put(col, arrays, lists, idx, vals, col.name in self.masked, self.offsets[s])
            if sizes:  # a source whose JPEGs travel as bytes (gpujpeg.pack)
                arrays[SIZES][idx] = sizes[0]
        arrays["source"][:] = choice
        if floats:
            self._normalize_cpu(torch.from_numpy(image), torch.from_numpy(arrays["image"]),
                                torch.from_numpy(arrays["source"]))
            arrays["image"] = image
        arrays.pop(SIZES, None)  # in the slot for the hand-over to decode by (gpujpeg.unpack), never in a batch
        return dict(arrays, **lists, key=Keys.of(keys.tolist()), skipped=skipped)  # one type through every door

    def _canvas(self, b):
        """A uint8 `image` canvas of b images, in the field's memory format, made once per process and reused."""
        if self._u8 is None or len(self._u8) < b:
            self._u8 = next(f for f in self.fixed if f.name == "image").array(b)
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
            out = torch.empty(image.shape, dtype=torch.float32, pin_memory=pin,  # the layout kept, as on a GPU below
                              memory_format=torch.channels_last if channels_last(image) else torch.contiguous_format)
            return self._normalize_cpu(out, image, source)
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


class Collate:
    """The last stage: what `upstream` (a `stages.Mix`) took, as one batch in this layout,
    with the samples skipped since the last batch (`errors.skipped`), written into the arrays
    `borrow(n)` lends when given ((handle, {field: array}): a ring slot); the batch then
    carries the handle as "slot"."""

    def __init__(self, upstream, layout, errors, borrow=None):
        self.upstream, self.layout, self.errors, self.borrow = upstream, layout, errors, borrow
        self.reported = 0
        for source, encoded in zip(getattr(upstream, "datasets", ()), layout.encoded):
            source.lay_out_jpegs(layout.channels_last)
            if encoded:  # the layout decodes this source's JPEGs on the device: its chain leaves them encoded
                source.encode_jpegs()

    def next(self, n=None):
        choice, parts = self.upstream.next(n)
        handle, out = self.borrow(len(choice)) if self.borrow else (None, None)
        batch = self.layout.collate(choice, [p if p is not None else NOTHING for p in parts],
                                    self.errors.skipped - self.reported, out)
        self.reported = self.errors.skipped
        if handle is not None:
            batch["slot"] = handle
        return batch
