"""The training side's data stream: shards -> samples -> mixed, equal-length batches.

Per source and DataLoader worker the stages are plain generators, in this order:

    shard_passes     passes over this epoch's shards of one (rank, worker) slot, forever
    read_shards      open (local, http(s) via curl, pipe:), parse USTAR, group members
    wds.shuffle      a seeded sample shuffle buffer
    decode_samples   check and decode only the members make_shards writes

`MixedStream` then draws each batch's sources from the weights and collates the
samples into one batch format (`collate`). Every rank yields exactly
`batches_per_epoch` batches whatever its shards hold: sources repeat rather than
end, so no rank is ever left waiting in an all-reduce.

Two webdataset stages are replaced here, for measured reasons (tools/bench_loader.py
and README): `tarfile`-based tar reading costs ~100 us per member against ~5 us for
`shards.iter_members`, and `wds.RandomMix` costs ~10 us per sample (it rebuilds a
numpy cumsum per draw and uses the global `random` module, so it can't be seeded per
rank and worker) against ~0.1 us for one seeded draw per batch. Shards are split by
(rank, worker) slot from the `Topology` we are handed, the same slicing as
`wds.split_by_node` + `wds.split_by_worker`, without reading the environment.
"""
import functools
import io
import itertools
import json
import math
import multiprocessing
import os
import random
import re
import threading
import time
import typing
import urllib.error
import urllib.request
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from hashlib import sha256

import numpy as np
import torch
import webdataset as wds
from braceexpand import braceexpand

from . import png
from .dist import Topology
from .shards import ShardError, iter_members, iter_samples, manifest_name

REMOTE_RE = re.compile(r"^(https?|pipe|s3|gs|ftps?|sftp|scp):")
SHARD_RE = re.compile(r"[A-Za-z0-9_]+-[A-Za-z0-9_]+-\d+\.tar")


@dataclass
class Source:
    """One data set split as the stream sees it: shard URLs plus manifest facts."""

    name: str
    urls: list
    counts: list
    digests: list
    encoding: str
    shape: tuple
    classes: list
    mean: list
    std: list

    @property
    def total(self):
        return sum(self.counts)


def is_remote(url):
    return bool(REMOTE_RE.match(url))


def resolve(name, spec, split):
    """Turn a SPEC into a Source. Raises ShardError naming what is missing.

    SPEC is a manifest (`shards/mnist-train.json`, an http(s) URL or a `pipe:` command
    ending in one), a folder or base URL holding `<name>-<split>.json` (trailing
    slash for URLs), or a brace pattern of shards whose manifest lies beside them.
    Shards always live next to their manifest: a shard's URL is the manifest's with
    the manifest file name replaced by the shard's.
    """
    patterned = None
    if spec.endswith(".json"):
        manifest_url = spec
    elif spec.endswith("/") or (not is_remote(spec) and os.path.isdir(spec)):
        manifest_url = spec.rstrip("/") + "/" + manifest_name(name, split)
    else:
        patterned = list(braceexpand(spec))
        m = SHARD_RE.search(patterned[0]) if patterned else None
        if not m:
            raise ShardError(f"{name}={spec}: not a manifest (.json), a folder, or a pattern of *-NNNNNN.tar shards")
        manifest_url = patterned[0][:m.start()] + manifest_name(name, split) + patterned[0][m.end():]
    manifest = load_manifest(manifest_url)
    listed = {s["name"]: s["samples"] for s in manifest["shards"]}
    digests = {s["name"]: s.get("sha256") for s in manifest["shards"]}
    base = re.findall(r"[^/\s]+\.json", manifest_url)[-1]
    head, _, tail = manifest_url.rpartition(base)
    if patterned is None:
        names = list(listed)
        urls = [head + n + tail for n in names]
    else:
        names = [SHARD_RE.search(u).group(0) for u in patterned]
        unknown = [n for n in names if n not in listed]
        if unknown:
            raise ShardError(f"{name}={spec}: {len(unknown)} shard(s) not in {manifest_url}, e.g. {unknown[0]}")
        urls = patterned
    if not urls:
        raise ShardError(f"{name}={spec}: no shards")
    missing = [u for u in urls if not is_remote(u) and not os.path.exists(u)]
    missing += unreachable([u for u in urls if u.startswith(("http://", "https://"))])
    if missing:
        raise ShardError(f"{name}={spec}: {len(missing)} shard(s) missing, e.g. {missing[0]}")
    return Source(name, urls, [listed[n] for n in names], [digests[n] for n in names], manifest["encoding"],
                  tuple(manifest["shape"]),
                  manifest["classes"], manifest["mean"], manifest["std"])


def unreachable(urls, timeout=10):
    """HTTP shards that fail a HEAD request, with the reason: a 404 is reported
    before training starts rather than by one rank in the middle of an epoch."""
    def check(url):
        try:
            urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout).close()
        except OSError as e:
            return f"{url} ({e})"
    with ThreadPoolExecutor(16) as pool:
        return [r for r in pool.map(check, urls) if r]


def load_manifest(url):
    if is_remote(url):
        try:
            text = fetch(url, retries=1)
        except OSError as e:
            raise ShardError(f"cannot read manifest {url}: {e}") from None
    else:
        try:
            with open(url, "rb") as f:
                text = f.read()
        except OSError:
            raise ShardError(f"no manifest at {url} (build it with tools/make_shards.py)") from None
    try:
        m = json.loads(text)
        for key in ("shards", "encoding", "shape", "classes", "mean", "std"):
            m[key]
    except (ValueError, KeyError, TypeError) as e:
        raise ShardError(f"{url}: not a shard manifest ({e!r})") from None
    return m


def parse_weights(text):
    """'mnist=0.5,cifar10=0.5' -> {'mnist': 0.5, 'cifar10': 0.5}; raises ValueError."""
    weights = {}
    for part in filter(None, text.split(",")):
        name, sep, value = part.partition("=")
        if name.strip() in weights:
            raise ValueError(f"weights {text!r}: {name.strip()} given twice")
        try:
            weights[name.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep or not name.strip():
            raise ValueError(f"weights {text!r}: expected NAME=W,NAME=W, e.g. mnist=0.5,cifar10=0.5")
    return weights


def check_weights(weights, names):
    """Weights normalised to sum 1, in the order of `names`; raises ValueError on bad ones."""
    unknown = sorted(set(weights) - set(names))
    if unknown:
        raise ValueError(f"weights name unknown source(s) {', '.join(unknown)}; sources are {', '.join(names)}")
    w = [float(weights.get(n, 0.0)) for n in names]
    if any(not 0 <= x < math.inf for x in w) or sum(w) <= 0:  # also NaN and inf (inf/inf is NaN)
        raise ValueError(f"weights must be >= 0 with a positive sum, got {weights}")
    return [x / sum(w) for x in w]


# ---------------------------------------------------------------- stages


def shard_passes(urls, *, seed, epoch, source, slot, slots, resample=False):
    """Passes over the shards of one (rank, worker) slot, forever: each a list of URLs.

    The epoch's shard order is the same on every rank (seeded by seed, epoch and
    source); slot k takes every slots-th shard, so slots read disjoint shards. When
    its shards run out the slot rereads its own shards in a new order: samples then
    repeat within a worker, never across workers. With fewer shards than slots, or
    `resample`, the one endless pass draws shards with replacement instead of idling.
    """
    tag = f"{seed}/{epoch}/{source}"
    if resample or len(urls) < slots:
        rng = random.Random(f"{tag}/{slot}/resample")
        yield (urls[rng.randrange(len(urls))] for _ in itertools.count())
        return
    order = list(range(len(urls)))
    random.Random(tag).shuffle(order)
    mine = [urls[i] for i in order[slot::slots]]
    rng = random.Random(f"{tag}/{slot}")
    while True:
        yield list(mine)
        rng.shuffle(mine)


def fetch(url, retries=3, delay=1.0, timeout=30):
    """All bytes of a remote URL, with `retries` bounded retries and doubling delays.

    http(s) goes through urllib rather than webdataset's curl pipe: a stalled server
    then fails after `timeout` seconds instead of hanging a rank, and the error says
    "HTTP Error 404" rather than "curl exit 22". pipe: and other schemes use wds.gopen.
    """
    for attempt in range(retries + 1):
        try:
            if url.startswith(("http://", "https://")):
                with urllib.request.urlopen(url, timeout=timeout) as r:
                    return r.read()
            stream = wds.gopen(url)
            try:
                data = stream.read()
            finally:
                stream.close()  # a pipe's exit status is checked here
            return data
        except OSError as e:  # URLError, socket timeout, a pipe's non-zero exit
            permanent = isinstance(e, urllib.error.HTTPError) and 400 <= e.code < 500 and e.code not in (408, 429)
            if permanent:  # a 404 won't go away by waiting
                raise OSError(f"{url}: {e}") from None
            if attempt == retries:
                raise OSError(f"{url}: failed after {retries + 1} attempts: {e}") from None
            warnings.warn(f"{url}: {e}; retrying in {delay * 2 ** attempt:g} s", stacklevel=2)
            time.sleep(delay * 2 ** attempt)


def cache_path(cache_dir, url):
    """A file name under cache_dir derived from the URL that can't escape the folder."""
    tail = re.sub(r"[^A-Za-z0-9_.-]", "_", url.rstrip("/ -").split("/")[-1])[-64:].lstrip(".")
    return os.path.join(cache_dir, f"{sha256(url.encode()).hexdigest()[:16]}-{tail}")


def open_shard(url, cache_dir=None, retries=3, digest=None):
    """A readable binary stream over one shard: local file, cached copy, or fetched bytes.

    Remote shards are fetched whole, so their sha256 is checked against the manifest
    (cheap next to the transfer) before anything is read or cached. Local files are
    not hashed on every read: `make_shards.py --verify` checks them.
    """
    if not is_remote(url):
        return open(url, "rb")
    path = cache_path(cache_dir, url) if cache_dir else None
    if path and os.path.exists(path):
        return open(path, "rb")
    data = fetch(url, retries)
    if digest and sha256(data).hexdigest() != digest:
        raise ShardError("sha256 differs from the manifest")
    if path is None:
        return io.BytesIO(data)
    os.makedirs(cache_dir, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    return open(path, "rb")


def read_shards(urls, source, stats, *, strict=False, cache_dir=None, retries=3):
    """Sample dicts from each shard in turn. A malformed shard is skipped from the
    point of damage with a warning (its unread samples counted in stats['skipped']),
    or raises under `strict`. I/O errors that outlast the retries always raise."""
    counts, digests = dict(zip(source.urls, source.counts)), dict(zip(source.urls, source.digests))
    yielded_any = False
    for n, url in enumerate(urls, 1):
        got = 0
        try:
            with open_shard(url, cache_dir, retries, digests.get(url)) as stream:
                for sample in iter_samples(iter_members(stream), url):
                    got += 1
                    yield sample
        except ShardError as e:
            if strict:
                raise ShardError(f"{url}: {e}") from None
            lost = max(counts.get(url, got) - got, 1)
            stats["skipped"] += lost
            warnings.warn(f"{url}: {e}; skipped {lost} sample(s)", stacklevel=2)
        yielded_any = yielded_any or got > 0
        if n % len(counts) == 0 and not yielded_any:
            raise ShardError(f"no readable samples in {len(counts)} shard(s), e.g. {url}")


def shuffle(samples, bufsize, rng):
    """A shuffle buffer: each incoming sample swaps with a random one in the buffer.

    The same idea as `wds.shuffle(bufsize, initial=bufsize)`, which costs ~4 us a
    sample here in `rng.randint`; one `rng.random()` costs ~0.1 us. The buffer drains
    (shuffled) when the input ends.
    """
    buf = []
    for sample in samples:
        if len(buf) < bufsize:
            buf.append(sample)
            continue
        i = int(rng.random() * bufsize)
        buf[i], sample = sample, buf[i]
        yield sample
    rng.shuffle(buf)
    yield from buf


def decode_samples(samples, source, stats, *, strict=False):
    """(key, image, label) from sample dicts, touching only `.cls` and the image member.

    Nothing is unpickled or torch.load-ed: a shard from an untrusted server can hold
    `.pyd` or `.pth` members, and those stay unread bytes. Images stay bytes until
    `collate` turns a batch of them into pixels at once: raw ones as they are, a PNG
    inflated to its filtered rows (`png.rows`, which checks size and mode first).
    """
    ext, shape, nclasses = source.encoding, tuple(source.shape), len(source.classes)
    nbytes = int(np.prod(shape))
    for s in samples:
        try:
            img, cls = s.get(ext), s.get("cls")
            if img is None or cls is None:
                raise ValueError(f"missing .{ext} or .cls member (has {sorted(k for k in s if k[0] != '_')})")
            label = int(cls)
            if not 0 <= label < nclasses:
                raise ValueError(f"label {label} outside 0..{nclasses - 1}")
            if ext == "raw":
                if len(img) != nbytes:
                    raise ValueError(f"{len(img)} raw bytes, expected {nbytes} for shape {shape}")
            else:
                img = png.rows(img, shape)
        except ValueError as e:
            if strict:
                raise ShardError(f"{s.get('__url__')}: sample {s.get('__key__')}: {e}") from None
            stats["skipped"] += 1
            warnings.warn(f"{s.get('__url__')}: skipped sample {s.get('__key__')}: {e}", stacklevel=2)
            continue
        yield s["__key__"], img, label


# ---------------------------------------------------------------- batches


class Layout:
    """The one batch format shared by every source.

    Images become float32 (B, 3, H, W) with H, W the largest over sources: smaller
    images are zero-padded around the centre, grey ones repeated to 3 channels, and
    each source normalised with its own training-set mean and std. Labels are offset
    per source (MNIST 0-9, CIFAR10 10-19 in that order), so classes never collide.
    """

    def __init__(self, sources):
        self.names = [s.name for s in sources]
        self.sources = list(sources)
        self.offsets = list(np.cumsum([0] + [len(s.classes) for s in sources[:-1]]))
        self.num_classes = sum(len(s.classes) for s in sources)
        self.hw = (max(s.shape[1] for s in sources), max(s.shape[2] for s in sources))
        self.encodings = [s.encoding for s in sources]
        mean = torch.tensor([_rgb(s.mean) for s in sources]).view(-1, 3, 1, 1)
        std = torch.tensor([_rgb(s.std) for s in sources]).view(-1, 3, 1, 1)
        self.scale, self.shift = 1.0 / (255.0 * std), mean / std
        self._on_device = {}

    def __getstate__(self):  # workers get the CPU stats only, never a GPU copy
        return dict(self.__dict__, _on_device={})

    def index(self, name):
        try:
            return self.names.index(name)
        except ValueError:
            raise ValueError(f"unknown source {name!r}; sources are {', '.join(self.names)}") from None

    def normalize(self, image, source, pin_memory=None):
        """uint8 (B, 3, H, W) images -> normalised float32, on whatever device they are.

        On the CPU this runs in numpy, in one thread: torch spreads a batch this small
        over every core, and its idle threads then spin, so the in-process loader used
        1.95 cores for the work of one (tools/bench_loader.py, C/raw, workers 0).
        The result is pinned if `pin_memory`, by default if the images are.
        """
        if image.device.type == "cpu":
            pin = image.is_pinned() if pin_memory is None else pin_memory
            out = torch.empty(image.shape, dtype=torch.float32, pin_memory=pin)
            o, src = out.numpy(), source.numpy()
            o[...] = image.numpy()
            o *= self.scale.numpy()[src]
            o -= self.shift.numpy()[src]
            return out
        if image.device not in self._on_device:  # copy the stats to a GPU once, not every step
            self._on_device[image.device] = (self.scale.to(image.device), self.shift.to(image.device))
        scale, shift = self._on_device[image.device]
        return image.float().mul_(scale[source]).sub_(shift[source])

    def collate(self, items, skipped=0, normalize=True, encodings=None, take=None):
        """[(source index, key, image, label)] -> batch dict; see the class docstring.

        Images are bytes from `decode_samples`, in each source's encoding (`encodings`,
        by source index; the training sources' by default). In a worker, `take(n)` may
        lend a zeroed buffer from the loader's `BatchRing`: the batch then carries its
        `RingBuffer` in place of the images.

        With normalize=False the images stay uint8: 4x less to move to the GPU; call
        `normalize` where they land. Inside a DataLoader worker the images always stay
        uint8 and `label` and `source` numpy arrays; `make_loader` finishes the batch in
        the main process (see `_arrive`).
        """
        b = len(items)
        h, w = self.hw
        shape = (b, 3, h, w)
        lent, canvas = take(b) if take else (None, None)
        if canvas is None:
            canvas = _batch_tensor(shape, np.uint8)
        u8 = canvas.numpy()  # a view: torch.from_numpy(u8) would lose the shared-memory flag and be copied
        src = np.fromiter((it[0] for it in items), np.int64, b)
        for i, s in enumerate(self.sources):
            idx = np.flatnonzero(src == i)
            if len(idx) == 0:
                continue
            data = b"".join(items[j][2] for j in idx)
            if (encodings or self.encodings)[i] == "raw":
                arr = np.frombuffer(data, np.uint8).reshape(len(idx), *s.shape)
            else:
                arr = png.unfilter(data, len(idx), s.shape)
            top, left = (h - s.shape[1]) // 2, (w - s.shape[2]) // 2
            u8[idx, :, top:top + s.shape[1], left:left + s.shape[2]] = arr
        label = np.fromiter((it[3] for it in items), np.int64, b) + np.asarray(self.offsets, np.int64)[src]
        batch = {"image": lent or canvas, "label": label, "source": src, "key": [it[1] for it in items],
                 "skipped": skipped}
        return batch if _in_worker() else _arrive(self if normalize else None, None, False, batch)


def _in_worker():
    return torch.utils.data.get_worker_info() is not None


def _batch_tensor(shape, dtype):
    """An empty tensor for a batch, zero-filled; in shared memory inside a DataLoader worker.

    A worker's tensors reach the main process through shared memory: a tensor made in
    ordinary memory is copied there when it is sent. Made there from the start, the
    batch is written once (default_collate does the same).
    """
    if not _in_worker():  # numpy, as torch.zeros would fill a large tensor with every core
        return torch.from_numpy(np.zeros(shape, dtype))
    return _shared_zeros(shape, dtype)


def _shared_zeros(shape, dtype):
    """A tensor in a new shared-memory file: it reads as zeros, and its pages cost
    nothing until written (torch.zeros(...).share_memory_() would write them twice)."""
    like = torch.from_numpy(np.empty(0, dtype))
    return like.new(like._typed_storage()._new_shared(math.prod(shape))).view(shape)


class RingBuffer(typing.NamedTuple):
    """Which `BatchRing` buffer holds a batch's images (a named tuple survives pin_memory)."""
    worker: int
    index: int


class BatchRing:
    """Shared-memory buffers that a loader's workers collate uint8 images into, so that
    only a `RingBuffer` travels through the DataLoader's queue.

    A tensor sent from a worker costs a new shared-memory file for every batch, its
    pages faulted in by both processes, and a file-descriptor hand-over through
    multiprocessing's resource sharer (a socket handshake with HMAC authentication).
    These buffers are made once, before the workers start, and stay mapped; the main
    process copies or normalises each batch out of its buffer and frees it at once
    (`_arrive`). Each worker has `depth` of them, more than it can have batches in
    flight (the loader's prefetch_factor, plus the one being finished); should none be
    free all the same, the worker falls back to a new shared tensor.
    """

    def __init__(self, workers, depth, batch_shape):
        self.images = _shared_zeros((workers, depth, *batch_shape), np.uint8)
        self.busy = _shared_zeros((workers, depth), np.uint8)

    def take(self, worker, n):
        """(RingBuffer, its first n images zeroed) for a worker; (None, None) if all are busy."""
        busy = self.busy[worker].numpy()
        free = np.flatnonzero(busy == 0)
        if len(free) == 0:
            return None, None
        k = int(free[0])
        busy[k] = 1
        images = self.images[worker, k, :n]
        images.numpy().fill(0)  # padding around smaller images must read as zeros
        return RingBuffer(worker, k), images

    def release(self, buffer):
        """A buffer whose batch the main process has copied out."""
        self.busy[buffer] = 0

    def free(self, worker):
        """All of a worker's buffers, as it starts a pass: batches of an abandoned pass
        were discarded unread by the DataLoader."""
        self.busy[worker].numpy().fill(0)


class _RingFed(torch.utils.data.IterableDataset):
    """A stream whose worker batches leave through a `BatchRing`."""

    def __init__(self, stream, ring):
        self.stream, self.ring = stream, ring

    def __len__(self):
        return len(self.stream)

    def __iter__(self):
        worker = torch.utils.data.get_worker_info().id
        self.ring.free(worker)
        return self.stream.batches(functools.partial(self.ring.take, worker))


def _arrive(layout, ring, pin, batch):
    """Finish a batch in the process that consumes it: label and source become int64
    tensors, images come out of their `BatchRing` buffer (which is then freed), and
    they are normalised when `layout` is given.

    Workers send uint8 images: float32 would be 4x the bytes, and normalising here
    (0.9 ms a batch of 256) cost less CPU than sending floats. Labels travel as numpy
    arrays inside the pickle, where a tensor would cost its own shared-memory file.
    """
    batch["label"], batch["source"] = torch.from_numpy(batch["label"]), torch.from_numpy(batch["source"])
    image = batch["image"]
    if isinstance(image, RingBuffer):
        lent = ring.images[image][:len(batch["label"])]
        if layout is not None:
            batch["image"] = layout.normalize(lent, batch["source"], pin)
        else:
            batch["image"] = torch.empty(lent.shape, dtype=torch.uint8, pin_memory=pin)
            batch["image"].numpy()[...] = lent.numpy()
        ring.release(image)
    elif layout is not None:
        batch["image"] = layout.normalize(image, batch["source"])
    return batch


def _rgb(values):
    return list(values) * 3 if len(values) == 1 else list(values)


def worker_slot(topo):
    """(slot, slots, worker, workers) of the calling process for this topology."""
    info = torch.utils.data.get_worker_info()
    worker, workers = (info.id, info.num_workers) if info else (0, 1)
    return topo.rank * workers + worker, topo.world * workers, worker, workers


class MixedStream(torch.utils.data.IterableDataset):
    """Batches mixing several sources by weight, the same count on every rank.

    An epoch is `epoch_samples` samples over all ranks (default: all training
    samples of all sources together), so each rank yields
    epoch_samples // (world * batch_size) batches whatever `num_workers` is; the
    workers split that count between them. Call `set_epoch` before each epoch, as
    with DistributedSampler: the order depends on (seed, epoch, rank, worker).
    """

    def __init__(self, sources, weights, batch_size, topo=Topology(), *, seed=0, epoch_samples=None,
                 shuffle_buffer=1000, resample=False, strict=False, cache_dir=None, retries=3, normalize=True):
        if batch_size < 1:
            raise ValueError(f"batch size must be at least 1, got {batch_size}")
        self.layout = Layout(sources)
        self.probs = check_weights(weights, self.layout.names)
        self.weights = dict(zip(self.layout.names, self.probs))
        self.batch_size, self.topo, self.seed = batch_size, topo, seed
        self.epoch_samples = epoch_samples or sum(s.total for s in sources)
        if self.epoch_samples < 1:
            raise ValueError(f"epoch samples must be at least 1, got {self.epoch_samples}")
        self.shuffle_buffer, self.resample, self.strict = shuffle_buffer, resample, strict
        self.cache_dir, self.retries, self.normalize = cache_dir, retries, normalize
        self.epoch = 0
        self._shared = None  # (epoch, probs) in shared memory once persistent workers hold copies

    def set_epoch(self, epoch, weights=None):
        """Select the epoch (and optionally new weights, e.g. from a schedule)."""
        self.epoch = epoch
        if weights is not None:
            self.probs = check_weights(weights, self.layout.names)
            self.weights = dict(zip(self.layout.names, self.probs))
        if self._shared is not None:
            self._shared[0].value = epoch
            self._shared[1][:] = self.probs

    def share(self, ctx):
        """Keep epoch and weights in shared memory, so that persistent DataLoader workers
        (each holding a pickled copy of this stream) see every later `set_epoch`."""
        if self._shared is None:
            self._shared = (ctx.Value("q", self.epoch, lock=False), ctx.Array("d", self.probs, lock=False))

    @property
    def batches_per_epoch(self):
        return max(1, self.epoch_samples // (self.topo.world * self.batch_size))

    def __len__(self):
        return self.batches_per_epoch

    def short_sources(self, num_workers):
        """Names of sources with fewer shards than rank x worker slots."""
        slots = self.topo.world * max(1, num_workers)
        return [s.name for s in self.layout.sources if len(s.urls) < slots]

    def _samples(self, i, slot, slots, worker, stats):
        """(key, image, label) of source i for this slot, forever.

        The shuffle buffer drains at the end of each pass over the slot's shards, so
        it never reads ahead into the next pass: within an epoch a sample repeats only
        after every sample of the slot has been seen.
        """
        s = self.layout.sources[i]
        passes = shard_passes(s.urls, seed=self.seed, epoch=self.epoch, source=i, slot=slot, slots=slots,
                              resample=self.resample)
        for n, urls in enumerate(passes):
            samples = read_shards(urls, s, stats, strict=self.strict, cache_dir=self.cache_dir,
                                  retries=self.retries)
            rng = random.Random(f"{self.seed}/{self.epoch}/{i}/{self.topo.rank}/{worker}/{n}")
            samples = shuffle(samples, self.shuffle_buffer, rng)
            got = 0
            for got, sample in enumerate(decode_samples(samples, s, stats, strict=self.strict), 1):
                yield sample
            if got == 0:
                raise ShardError(f"{s.name}: no readable samples in this worker's shards, e.g. {urls[0]}")

    def __iter__(self):
        return self.batches()

    def batches(self, take=None):
        """This epoch's batches for the calling rank and worker (`take`: see `Layout.collate`)."""
        if self._shared is not None:  # a persistent worker: take the epoch the main process set
            self.epoch, self.probs = self._shared[0].value, list(self._shared[1])
        slot, slots, worker, workers = worker_slot(self.topo)
        n = self.batches_per_epoch
        count = n // workers + (worker < n % workers)
        if count == 0:
            return
        stats = {"skipped": 0}
        streams = [self._samples(i, slot, slots, worker, stats) for i in range(len(self.probs))]
        rng = np.random.default_rng([self.seed, self.epoch, self.topo.rank, worker])
        reported = 0
        for _ in range(count):
            choice = rng.choice(len(streams), size=self.batch_size, p=self.probs).tolist()
            items = [(c, *next(streams[c])) for c in choice]
            yield self.layout.collate(items, stats["skipped"] - reported, self.normalize, take=take)
            reported = stats["skipped"]

    def eval_stream(self, source, batch_size=None):
        """A finite stream over one source's test shards in this stream's batch format."""
        return EvalStream(self.layout, source, batch_size or self.batch_size, self.topo, strict=self.strict,
                          cache_dir=self.cache_dir, retries=self.retries, normalize=self.normalize)


class EvalStream(torch.utils.data.IterableDataset):
    """Every test sample of one source exactly once across all ranks and workers.

    Shards are split by (rank, worker) slot without shuffling or repeating, so ranks
    may yield different numbers of batches: evaluate with the plain module (not the
    DDP wrapper, whose forward can sync) and all-reduce the counts afterwards.
    """

    def __init__(self, layout, source, batch_size, topo=Topology(), *, strict=False, cache_dir=None, retries=3,
                 normalize=True):
        self.layout, self.source, self.batch_size, self.topo = layout, source, batch_size, topo
        self.index = layout.index(source.name)
        if tuple(source.shape) != tuple(layout.sources[self.index].shape):
            raise ShardError(f"{source.name}: test shards are {tuple(source.shape)}, training shards "
                             f"{tuple(layout.sources[self.index].shape)}")
        self.strict, self.cache_dir, self.retries, self.normalize = strict, cache_dir, retries, normalize
        self.encodings = list(layout.encodings)
        self.encodings[self.index] = source.encoding  # a test split may be encoded unlike its training split

    def __iter__(self):
        return self.batches()

    def batches(self, take=None):
        """This worker's share of the test batches (`take`: see `Layout.collate`)."""
        slot, slots, _, _ = worker_slot(self.topo)
        stats = {"skipped": 0}
        urls = self.source.urls[slot::slots]
        if not urls:
            return
        samples = read_shards(urls, self.source, stats, strict=self.strict, cache_dir=self.cache_dir,
                              retries=self.retries)
        items, reported = [], 0
        for key, img, label in decode_samples(samples, self.source, stats, strict=self.strict):
            items.append((self.index, key, img, label))
            if len(items) == self.batch_size:
                yield self.layout.collate(items, stats["skipped"] - reported, self.normalize, self.encodings, take)
                items, reported = [], stats["skipped"]
        if items or stats["skipped"] > reported:
            yield self.layout.collate(items, stats["skipped"] - reported, self.normalize, self.encodings, take)


def make_loader(stream, num_workers=0, pin_memory=False, prefetch_factor=4, start_method="fork"):
    """A WebLoader over a stream; warns when shards are too few for every slot.

    Workers persist across epochs: make the loader once and call `set_epoch` before
    each pass. Forking a process that has threads (gloo, tqdm's monitor, a finished
    loader's queue feeders) can deadlock the child inside os.fork() while another
    thread holds an interpreter lock; it happened here once, when an evaluation loader
    forked right after a training epoch's loader shut down. Persistent workers fork
    once, at their loader's first pass. start_method="forkserver" avoids forking the
    caller at all, at ~300 MiB for the server and a re-import of the main script per
    worker (the script then needs an `if __name__ == "__main__":` guard). Batches
    leave the workers through a `BatchRing` of prefetch_factor + 2 buffers a worker.
    """
    mixed = isinstance(stream, MixedStream)
    short = stream.short_sources(num_workers) if mixed else []
    if short:
        warnings.warn(f"{', '.join(short)}: fewer shards than ranks x workers "
                      f"({stream.topo.world} x {max(1, num_workers)}); those sources draw shards with "
                      f"replacement, so samples may repeat across workers. Write more, smaller shards.",
                      stacklevel=2)
    if not num_workers:
        return wds.WebLoader(stream, batch_size=None, collate_fn=_as_is, num_workers=0, pin_memory=pin_memory)
    ctx = worker_context(start_method)
    if mixed:
        stream.share(ctx)
    ring = BatchRing(num_workers, prefetch_factor + 2, (stream.batch_size, 3, *stream.layout.hw))
    loader = wds.WebLoader(_RingFed(stream, ring), batch_size=None, collate_fn=_as_is, num_workers=num_workers,
                           pin_memory=pin_memory, prefetch_factor=prefetch_factor, persistent_workers=True,
                           multiprocessing_context=ctx, worker_init_fn=functools.partial(_exit_with, os.getpid()))
    pin = pin_memory and torch.cuda.is_available()
    return loader.map(functools.partial(_arrive, stream.layout if stream.normalize else None, ring, pin))


def _as_is(batch):
    """Batches are already collated; DataLoader's default_convert would walk every key
    string of every batch (13% of the loader's time in a profile)."""
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
        ctx.set_forkserver_preload(["torch", "pipeline.stream"])
    return ctx
