"""The stages of one source's samples inside one (rank, loader worker), in order:

    plan        the pair's run of the epoch's positions (pipeline.ordering.deal), as the
                windows that hold them (pipeline.ordering.order): `RunPlan`
    read        each window's shards read once: members grouped into samples, labels
                parsed, members the source doesn't use dropped unread (`Reader`)
    shuffle     one seeded permutation of each window's samples
    take        the next n samples decoded, through the user's sample stages
                (`SourceStream.take`)

and across sources, `mix.RandomMix` takes each batch's samples from the sources its
`deal.Choices` name.

Every stage has one method, `next(n)`: its next item (for a source's stages, the chunk of
the next n positions), pulled from the stage before it, its `upstream`, as webdataset's and
torchdata's stages pull theirs. Stages keep no state a checkpoint needs.

Every stage before `take` is a pure function of (seed, epoch, source, position):
where a stream stands is, per source, how many positions of its run it has read
(`SourceStream.state`), and any such point is reached again without reading what
came before it. Positions count whether the sample there was kept, skipped as
damaged or dropped by a stage, so a pure stage of the user's resumes exactly.

Two stages are written here rather than taken from webdataset, for measured
reasons (docs/benchmarks.md, "Why some stages are our own"): tar reading (`pipeline.data.shards.read`),
and the shuffle, a permutation per window instead of `wds.shuffle`'s buffer,
which costs a `random.randint` per sample and holds state no checkpoint can reach.
"""
import functools
from dataclasses import dataclass

import numpy as np

from pipeline.ordering import order
from pipeline.data.fields import member_values
from pipeline.data.decoding import gpujpeg, rgbx
from pipeline.data.decoding.decode import decode_batch
from pipeline.data.decoding.labelling import class_of
from pipeline.errors import InputError, ShardError
from pipeline.data.shards.readbuffer import Rows
from pipeline.data.fields.member_values import user_stage
from pipeline.data.streams.plans import Window
from pipeline.data.streams.windowdata import WindowData


@dataclass
class Chunk:
    """What moves down a source's chain: the samples at positions [lo, hi) of a window's
    order, filled in stage by stage (the rows of `data`, then decoded columns)."""

    window: Window
    lo: int
    hi: int
    data: WindowData = None
    idx: np.ndarray = None
    crops: np.ndarray = None  # the window's crop table, taken by idx where images are decoded
    seed0: int = 0  # the seed of position lo; the user's stages number on from it
    kept: np.ndarray = None  # which of the chunk's places hold a sample that decoded (None: all)
    places: int = 0  # the chunk's places (hi - lo, or fewer at an evaluation window's end)
    empty: np.ndarray = None  # rows past the window's samples at its places: samples it lacks (WindowData.places)
    keys: list = None
    pixels: np.ndarray = None
    labels: np.ndarray = None
    seeds: np.ndarray = None
    sizes: np.ndarray = None  # JPEG bytes in each pixel row, 0 for pixels (gpujpeg.pack; only if encoded)


class Positions:
    """The plan's windows, handed down as ranges of their places; `position()` is how many
    positions of the run the chain has taken: all a resume needs of it."""

    upstream = None  # the first stage: it pulls from the plan

    def __init__(self, plan):
        self.plan, self.window, self.at = plan, None, 0

    def next(self, n):
        w = self.window
        if w is None or self.at >= (w.size if w.size is not None else self.at + 1):
            w = self.window = self.plan.next()
            if w is None:
                raise StopIteration
            self.at = w.skip
        if w.size is None:  # evaluation: the window's length is known once read
            lo, self.at = self.at, self.at + n
            return Chunk(w, lo, self.at)
        lo, self.at = self.at, min(self.at + n, w.size)
        return Chunk(w, lo, self.at)

    def exhausted(self):
        """The current window read to its end (a shard that holds fewer samples than its manifest)."""
        if self.window is not None:
            self.at = self.window.size if self.window.size is not None else float("inf")

    def position(self):
        return self.plan.state(self.at - (self.window.skip if self.window else 0))


class Read:
    """Each window's pieces read once (`Reader`), kept while its positions are taken."""

    def __init__(self, reader, plan=None):
        self.reader, self.window, self.data = reader, None, None
        self.upcoming = getattr(plan, "upcoming", None)  # the windows after, whose remote shards are fetched ahead

    def next(self, n):
        chunk = self.upstream.next(n)
        if not chunk.window.same(self.window):
            self.data = self.reader(chunk.window, self.upcoming)
        self.window = chunk.window
        chunk.data = self.data
        return chunk


class Shuffle:
    """One permutation of each window's samples, and each sample's crop, drawn from the
    window's key; windows without a key (evaluation) keep their order."""

    def __init__(self, shuffle=True):
        self.shuffle, self.window, self.order, self.crops, self.seed0 = shuffle, None, None, None, 0

    def next(self, n):
        chunk = self.upstream.next(n)
        w = chunk.window
        if not w.same(self.window):
            # a training window is shuffled over all its places as its manifest counts them, those
            # of the samples it lacks (refused or lost while read) among them, each at its own place
            # (WindowData.slots): damage empties the places its samples had, at random as an
            # undecodable image does, and every other sample keeps its place, so that the positions
            # an epoch passes hold the damaged samples an undamaged read puts there (`skipped`)
            d = chunk.data
            k = len(d) if w.size is None else d.places
            if self.shuffle and w.key is not None:
                rng = order.generator(*w.key)
                self.order = rng.permutation(k)
                # crops place random crops of decoded images; raw pixels have none to place
                self.crops = None if d.exts == "raw" else rng.random((k, 2))
            else:
                self.order, self.crops = np.arange(k), None
            if d.slots is not None and w.size is not None:  # the order's places as rows (past them: none)
                self.order = d.slots[self.order]
                self.crops = None if self.crops is None else self.crops[d.where]  # each row its place's crop
            self.seed0 = order.seed_of(w.key) if w.key is not None else 0
        self.window = w
        idx, chunk.crops, chunk.seed0 = self.order[chunk.lo:chunk.hi], self.crops, self.seed0 + chunk.lo
        chunk.places, chunk.idx = len(idx), idx
        if len(self.order) > len(chunk.data):  # the window lacks samples (the masks cost 2% of a raw batch)
            held = idx < len(chunk.data)
            chunk.idx, chunk.empty = idx[held], idx[~held]
            if len(chunk.empty):
                chunk.kept = np.flatnonzero(held)
        return chunk


class Decode:
    """The chunk's images decoded to the source's shape; what fails to decode is reported
    to the error policy (through the reader) and left out."""

    def __init__(self, reader):
        self.reader, self.target = reader, reader.target
        self.schema = getattr(reader, "schema", None)
        self.encoded = False  # exact JPEGs left as bytes for the device (SourceStream.encode_jpegs)
        self.view = "rgbx"  # JPEGs as a CHW view for the batch's copy to make CHW (SourceStream.lay_out_jpegs)

    def next(self, n):
        chunk = self.upstream.next(n)
        if self.schema is not None:
            return self._fields(chunk)
        d, idx = chunk.data, chunk.idx
        if isinstance(d.images, Rows):
            chunk.pixels = d.images.take(idx).reshape(len(idx), *self.target.shape)
            chunk.sizes = np.zeros(len(idx), np.int32) if self.encoded else None
        else:
            rows = idx.tolist()
            how = gpujpeg.pack if self.encoded else functools.partial(decode_batch, view=self.view)
            pixels, kept, errors, *sizes = how([d.images[i] for i in rows], [d.exts[i] for i in rows], self.target,
                                               None if chunk.crops is None else chunk.crops[idx])
            chunk.sizes = sizes[0] if sizes else None
            for k, message in errors if not chunk.window.spare else ():  # a replacement's damage: not again
                self.reader.bad(d.urls[rows[k]], d.keys[rows[k]], message)
            if errors:
                kept = np.asarray(kept, np.int64)
                chunk.kept, idx = kept if chunk.kept is None else chunk.kept[kept], idx[kept]
            chunk.pixels = pixels
        chunk.keys, chunk.labels = d.key_column[idx].tolist(), d.labels[idx]
        return chunk

    def _fields(self, chunk):
        """A schema's source: each sample's fields decoded and through the schema's stages, seeded by
        its position as the user's stages are (`__seed__`); chunk.pixels is then an object array of
        {field: value}. What does not fit its field is reported and left out, like an undecodable
        image; a sample a stage of the schema drops is left out unreported, as UserStage does."""
        d, idx = chunk.data, chunk.idx
        seeds = np.arange(chunk.places, dtype=np.uint64) + np.uint64(chunk.seed0)
        seeds = seeds if chunk.kept is None else seeds[chunk.kept]
        source, rows, masked = self.reader.source.name, idx.tolist(), [s & SEED_MASK for s in seeds.tolist()]
        decoded = self.schema.decode_images([d.images[i] for i in rows], masked)
        classes = functools.partial(class_of, target=self.target, lookup=self.reader.lookup)
        values, kept = [], []
        for j, (i, seed) in enumerate(zip(rows, masked)):
            try:
                v = self.schema.sample(d.images[i], seed, d.keys[i], source, decoded[j], classes=classes)
            except InputError:  # a stage of the user's that failed: the user's to fix, not the sample's
                raise
            except ValueError as e:
                if not chunk.window.spare:  # a replacement's damage is not counted again
                    self.reader.bad(d.urls[i], d.keys[i], e)
                continue
            if v is not None:
                values.append(v)
                kept.append(j)
        if len(kept) < len(idx):
            kept = np.asarray(kept, np.int64)
            chunk.kept, idx, seeds = kept if chunk.kept is None else chunk.kept[kept], idx[kept], seeds[kept]
        chunk.pixels = np.empty(len(values), object)
        for j, v in enumerate(values):
            chunk.pixels[j] = v
        chunk.seeds = seeds
        chunk.keys, chunk.labels = d.key_column[idx].tolist(), np.zeros(len(idx), np.int64)
        return chunk


class UserStage:
    """A function of the user's on each decoded sample, a dict {"__key__", "__source__",
    "image", "label", "__seed__"}; it returns the sample or None to drop it. The stream
    counts positions, not kept samples, so a stage that depends only on its sample
    resumes exactly."""

    def __init__(self, fn, source, shape, classes):
        self.fn, self.source, self.shape, self.classes = fn, source, tuple(shape), classes

    def next(self, n):
        chunk = self.upstream.next(n)
        if chunk.seeds is None:  # the first of the user's stages: each position's seed
            seeds = np.arange(chunk.places, dtype=np.uint64) + np.uint64(chunk.seed0)
            chunk.seeds = seeds if chunk.kept is None else seeds[chunk.kept]
        if chunk.pixels.dtype == object:  # a schema's source: the stage sees and returns its fields
            return self._fields(chunk)
        keep, pixels, labels = [], [], []
        for i, (key, image, label, seed) in enumerate(zip(chunk.keys, chunk.pixels, chunk.labels,
                                                          chunk.seeds.tolist())):
            sample = self._apply({"__key__": key, "__source__": self.source, "image": image.copy(),
                                  "label": int(label), "__seed__": seed & SEED_MASK})
            if sample is not None:
                keep.append(i)
                pixels.append(np.asarray(sample["image"]))
                labels.append(int(sample["label"]))
        c, h, w = self.shape
        chunk.keys = [chunk.keys[i] for i in keep]
        chunk.pixels = np.stack(pixels) if pixels else np.zeros((0, c, h, w), np.uint8)
        chunk.labels, chunk.seeds = np.array(labels, np.int64), chunk.seeds[keep]
        return chunk

    def _fields(self, chunk):
        schema = self.upstream_schema()
        keep, values = [], []
        for i, (key, v, seed) in enumerate(zip(chunk.keys, chunk.pixels, chunk.seeds.tolist())):
            v = user_stage(self.fn, v, key, self.source, seed & SEED_MASK, schema.final)
            if v is not None:
                keep.append(i)
                values.append(v)
        chunk.keys = [chunk.keys[i] for i in keep]
        chunk.pixels = np.empty(len(values), object)
        for j, v in enumerate(values):
            chunk.pixels[j] = v
        chunk.labels, chunk.seeds = chunk.labels[keep], chunk.seeds[keep]
        return chunk

    def upstream_schema(self):
        """The schema of the Decode stage this stage follows (through the user's stages before it)."""
        node = self.upstream
        while not isinstance(node, Decode):
            node = node.upstream
        return node.schema

    def _apply(self, sample):
        key, fn = sample["__key__"], self.fn
        sample = member_values.call_stage(fn, sample, key)
        if sample is None:
            return None
        image = np.asarray(sample.get("image"))
        if image.shape != self.shape or image.dtype != np.uint8:
            raise InputError(f"sample stage {_name(fn)} returned a {image.dtype} image of shape {image.shape}; "
                             f"it must stay uint8 {self.shape}")
        label = sample.get("label")
        if isinstance(label, bool) or not isinstance(label, (int, np.integer)) or not 0 <= label < self.classes:
            raise InputError(f"sample stage {_name(fn)} returned label {label!r}; it must stay an integer in "
                             f"0..{self.classes - 1}")
        return sample


class SourceStream:
    """One source's samples for one (rank, worker): a chain of stages, each pulling from
    the one before, in this order:

        positions  the plan's windows as ranges of places (`Positions`): the only place kept
        read     each window's shards read once (`Read`)
        shuffle  a seeded permutation and crops per window (`Shuffle`)
        decode   images to the source's shape (`Decode`)
        stage:…  the user's sample stages, in order (`UserStage`)

    `take(n)` returns the next n good samples as (keys, uint8 images (n, C, H, W),
    labels); a training plan never runs out, an evaluation plan may return fewer.
    `position()` is how many positions of the run were read, from which a new chain goes on.
    """

    def __init__(self, plan, reader, *, shuffle=True, sample_stages=()):
        self.reader, self.target = reader, reader.target
        source = reader.source
        self.stages = [("positions", Positions(plan)), ("read", Read(reader, plan)), ("shuffle", Shuffle(shuffle)),
                       ("decode", Decode(reader))]
        self.stages += [(f"stage:{_name(fn)}", UserStage(fn, source.name, self.target.shape, self.target.classes))
                        for fn in sample_stages]
        for (_, before), (_, after) in zip(self.stages, self.stages[1:]):
            after.upstream = before
        self.plan, self.last = plan, self.stages[-1][1]
        self.empty, self.window, self.window_good = 0, None, True  # windows in a row that gave nothing usable
        self.limit = 2 * len(source.urls) + 2
        self.readable = False  # a window read held a sample: later passes will give one, so wait longer

    def encode_jpegs(self):
        """Leave the exact-size JPEGs encoded (pipeline.data.decoding.gpujpeg): `take` then gives each
        sample's JPEG length too. The layout says which sources (batch.Layout.decoded_on)."""
        dict(self.stages)["decode"].encoded = True

    def lay_out_jpegs(self, channels_last):
        """Hand decoded JPEGs on as the view the batch copies fastest (decode.decode_batch's `view`):
        HWC into channels-last batches, RGBX into NCHW ones."""
        dict(self.stages)["decode"].view = "hwc" if channels_last else "rgbx"

    def position(self):
        """Positions of the run read (the positions stage's): what a worker's batch carries, and
        where a chain rebuilt for a resume starts (`RunPlan(..., at)`)."""
        return self.stages[0][1].position()

    def next(self, n=None):
        return self.take(n)

    def take(self, n):
        keys, parts, labels, sizes = [], [], [], []
        while n > 0:
            try:
                chunk = self.last.next(n)
            except StopIteration:
                break
            if chunk.window is not self.window:
                self._opened(chunk.window)
            d = chunk.data
            self.readable = self.readable or len(d) > 0
            if not chunk.places and chunk.lo >= (len(d) if chunk.window.size is None else d.places):
                self._passed(chunk, chunk.window.size and chunk.window.size - chunk.lo)  # fewer than its manifest
                self.stages[0][1].exhausted()
                continue
            self._passed(chunk)
            if chunk.keys:
                self.window_good = True
            keys += chunk.keys
            parts.append(chunk.pixels)
            labels.append(chunk.labels)
            sizes += [chunk.sizes] if chunk.sizes is not None else []
            n -= len(chunk.keys)
        c, h, w = self.target.shape
        more = (np.concatenate(sizes or [np.zeros(0, np.int32)]),) if dict(self.stages)["decode"].encoded else ()
        if not parts:
            return ([], np.zeros((0, c, h, w), np.uint8), np.zeros(0, np.int64)) + more
        return (keys, parts[0] if len(parts) == 1 else rgbx.concatenate(parts), np.concatenate(labels)) + more

    def _passed(self, chunk, beyond=0):
        """Name and count the places of a training window's chunk that hold no sample (`chunk.empty`,
        rows past the window's samples): a sample refused while its shards were read (row len + k:
        WindowData.refused[k]), else one lost with a damaged or short shard (named when read);
        `beyond`: places past all the window's rows. Each place is passed by one chain, once, so
        the count is the same on any number of workers; a spare window's are replacements, not
        counted again."""
        w, d = chunk.window, chunk.data
        if w.size is None or w.spare:
            return
        lost = beyond
        for k in (chunk.empty - len(d)).tolist() if chunk.empty is not None else ():
            if k < len(d.refused):
                self.reader.bad(*d.refused[k])
            else:
                lost += 1
        self.reader.errors.skipped += lost

    def _opened(self, window):
        """Raises ShardError when more windows in a row than twice the source's shards gave no usable
        sample and none held a sample that read; else (samples read, but none decoded or passed the
        user's stages) after MORE_WINDOWS more: a pair whose places held only damaged samples goes on
        into later passes, each a fresh draw, so one that finds none there finds no good sample."""
        self.empty = 0 if self.window_good else self.empty + 1
        if self.empty > self.limit + (MORE_WINDOWS if self.readable else 0):
            stages = [name for name, _ in self.stages if name.startswith("stage:")]
            why = f", or the sample stages ({', '.join(s[6:] for s in stages)}) dropped every one" if stages else ""
            raise ShardError(f"{self.reader.source.name}: no readable samples in this worker's shards "
                             f"(e.g. {self.reader.source.urls[0]}): {self.empty} windows in a row, every "
                             f"sample in them refused or damaged{why}{self.reader.none_readable()}")
        self.window, self.window_good = window, False


MORE_WINDOWS = 64  # windows in a row without a usable sample, past SourceStream.limit, once samples were read
SEED_MASK = (1 << 63) - 1  # a sample's seed fits an int64 and any numpy or torch generator


def _name(fn):
    return member_values.stage_name(fn)
