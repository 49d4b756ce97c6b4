"""The training side's data stream: several sources, mixed by weight, in equal-length batches.

    in each (rank, worker), per source:  stages.windows -> stages.Reader -> stages.SourceStream
    across sources:                      stages.RandomMix draws the source of every sample
    then:                                batch.Layout.collate, loader.make_loader's hand-over

Every rank yields exactly `batches_per_epoch` batches whatever its shards hold:
sources repeat rather than end, so no rank is ever left waiting in an
all-reduce. `EvalStream` reads a source's test shards once, split over ranks
and workers.

A stream's position is small (`state_dict`): per worker, its batch count, its
RandomMix generator and, per source, a window index and a position in it; the
stages before are pure functions of those. `load_state_dict` continues an
interrupted epoch: with the same world size and workers exactly where it
stopped, or on another world size with what the interrupted epoch had left
(see `leftover_segment`).
"""
import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from pipeline.data import remote, stages
from pipeline.data.batch import Layout
from pipeline.errors import ShardError
from pipeline.data.loader import Arrival, make_loader  # noqa: F401  (part of this module's API)
from pipeline.data.manifest import Source, resolve  # noqa: F401  (part of this module's API)
from pipeline.data.topology import Topology, Worker, slot
from pipeline.data.weights import check_weights, parse_weights  # noqa: F401  (part of this module's API)

__all__ = ["MixedStream", "EvalStream", "Source", "resolve", "make_loader", "parse_weights", "check_weights"]
STATE_VERSION = 1
_NOTHING = ([], np.zeros((0, 1, 1, 1), np.uint8), np.zeros(0, np.int64))


@dataclass
class Segment:
    """The part of an epoch a stream runs: all of it, or what an interrupted run left.

    batches: per rank; generation: how many resumes on another world size led here;
    origin: per source name, the windows the interrupted epoch had left, shared out over
    this world's slots; states: per logical worker, where it stood (same-world resume);
    rotation: which logical worker the DataLoader's worker 0 plays, so that batches
    arrive in the order an uninterrupted run would have them.
    """

    epoch: int
    batches: int
    generation: int = 0
    origin: dict = None
    states: dict = field(default_factory=dict)
    rotation: int = 0


class MixedStream(torch.utils.data.IterableDataset):
    """Batches mixing several sources by weight, the same count on every rank.

    An epoch is `epoch_samples` samples over all ranks (default: all training samples
    of all sources together), so each rank yields epoch_samples // (world * batch_size)
    batches whatever `num_workers` is; the workers split that count between them.
    Call `set_epoch` before each epoch, as with DistributedSampler: the order depends
    on (seed, epoch, rank, worker). `shuffle_buffer` is how many samples are shuffled
    together (whole shards: a window). `sample_stages` are functions applied to every
    decoded sample, a dict {"__key__", "__source__", "image": uint8 C,H,W array,
    "label": int}; each returns the sample (image of the same shape and dtype) or None
    to drop it.
    """

    def __init__(self, sources, weights, batch_size, topo=Topology(), *, seed=0, epoch_samples=None,
                 shuffle_buffer=1000, resample=False, strict=False, cache_dir=None, policy=remote.Policy(),
                 normalize=True, sample_stages=()):
        if batch_size < 1:
            raise ValueError(f"batch size must be at least 1, got {batch_size}")
        if shuffle_buffer < 1:
            raise ValueError(f"shuffle buffer must be at least 1, got {shuffle_buffer}")
        self.layout = Layout(sources)
        self.sources = self.layout.sources
        self.probs = check_weights(weights, self.layout.names)
        self.batch_size, self.topo, self.seed = batch_size, topo, seed
        self.epoch_samples = epoch_samples or sum(s.total for s in sources)
        if self.epoch_samples < topo.world * batch_size:
            raise ValueError(f"an epoch of {self.epoch_samples} samples is less than one batch on every rank "
                             f"({topo.world} x {batch_size}); lower the batch size or raise the epoch samples")
        self.resample, self.strict, self.cache_dir, self.policy = resample, strict, cache_dir, policy
        self.normalize, self.sample_stages = normalize, tuple(sample_stages)
        self.window_shards = [max(1, math.ceil(shuffle_buffer * len(s.urls) / s.total)) for s in sources]
        self.workers = 1
        self.epoch = 0
        self.segment = Segment(0, self.batches_per_epoch)
        self.consumed = {}
        self._pending = None
        self._shared = None  # (epoch, probs, started) in shared memory once persistent workers hold copies

    @property
    def weights(self):
        return dict(zip(self.layout.names, self.probs))

    @property
    def batches_per_epoch(self):
        return self.epoch_samples // (self.topo.world * self.batch_size)

    def __len__(self):
        return self.segment.batches if self.segment.epoch == self.epoch else self.batches_per_epoch

    def remaining(self):
        """Batches a pass over the current epoch yields on this rank: all of them, or what a
        resumed epoch has left."""
        if self.segment.epoch != self.epoch:
            return self.batches_per_epoch
        return self.segment.batches - sum(s["batches"] for s in self.segment.states.values())

    def set_epoch(self, epoch, weights=None):
        """Select the epoch (and optionally new weights, e.g. from a schedule)."""
        if epoch != self.segment.epoch:
            self.segment, self.consumed, self._pending = Segment(epoch, self.batches_per_epoch), {}, None
        self.epoch = epoch
        if weights is not None:
            self.probs = check_weights(weights, self.layout.names)
        if self._shared is not None:
            self._shared[0].value = epoch
            self._shared[1][:] = self.probs

    def set_workers(self, workers):
        """How many DataLoader workers iterate this stream (make_loader says)."""
        self.workers = workers
        if self._pending is not None:
            self.load_state_dict(self._pending)

    def share(self, ctx):
        """Keep epoch and weights in shared memory, so that persistent DataLoader workers
        (each holding a pickled copy of this stream) see every later `set_epoch`."""
        if self._shared is None:
            self._shared = (ctx.Value("q", self.epoch, lock=False), ctx.Array("d", self.probs, lock=False),
                            ctx.Value("b", 0, lock=False))

    def short_sources(self, num_workers):
        """Names of sources with fewer shards than rank x worker slots."""
        slots = self.topo.world * max(1, num_workers)
        return [s.name for s in self.sources if len(s.urls) < slots]

    # ------------------------------------------------------------ batches

    def __iter__(self):
        return map(Arrival(self), self.batches())

    def batches(self, worker=None, lend=None):
        """This epoch's batches for the calling rank and worker, as a worker sends them:
        uint8 images (in a buffer from `lend(n)` when given), numpy labels and sources,
        and the worker's `state` after the batch."""
        if self._shared is not None:  # a persistent worker: take what the main process set
            self.epoch, self.probs = self._shared[0].value, list(self._shared[1])
            self._shared[2].value = 1
        if self.segment.epoch != self.epoch:
            self.segment = Segment(self.epoch, self.batches_per_epoch)
        seg = self.segment
        worker = worker or Worker.current()
        logical = Worker((worker.id + seg.rotation) % worker.count, worker.count)
        count = seg.batches // worker.count + (logical.id < seg.batches % worker.count)
        saved = seg.states.get(logical.id)
        stats = {"skipped": 0}
        streams = [stages.SourceStream(self._plan(i, logical, seg), self._reader(s, stats),
                                       sample_stages=self.sample_stages) for i, s in enumerate(self.sources)]
        mix = stages.RandomMix(streams, self.probs,
                               seed=[self.seed, self.epoch, self.topo.rank, logical.id, seg.generation])
        done = 0
        if saved:
            mix.restore(saved["mix"])
            for stream, state in zip(streams, saved["sources"]):
                stream.restore(state)
            done = saved["batches"]
        reported = 0
        for b in range(done, count):
            choice = mix.draw(self.batch_size)
            wanted = np.bincount(choice, minlength=len(streams))
            parts = [stream.take(int(k)) if k else _NOTHING for stream, k in zip(streams, wanted)]
            handle, canvas = lend(self.batch_size) if lend else (None, None)
            batch = self.layout.collate(choice, parts, stats["skipped"] - reported, canvas)
            reported = stats["skipped"]
            if handle is not None:
                batch["image"] = handle
            batch["state"] = {"worker": logical.id, "batches": b + 1, "mix": mix.state(),
                              "sources": [stream.state() for stream in streams]}
            yield batch

    def _reader(self, source, stats):
        return stages.Reader(source, stats, strict=self.strict, policy=self.policy, cache_dir=self.cache_dir)

    def _plan(self, i, worker, seg, topo=None, workers=None):
        """The windows source i's stream reads in one (rank, worker) of a segment."""
        topo = topo or self.topo
        pieces = ()
        if seg.origin:
            k, slots = slot(topo, worker)
            pieces = share_out([stages.Window(*w) for w in seg.origin[self.sources[i].name]],
                               self.sources[i], slots)[k]
        return stages.windows(self.sources[i].urls, seed=self.seed, epoch=f"{seg.epoch}.{seg.generation}"
                              if seg.generation else seg.epoch, source=i, topo=topo, worker=worker,
                              window_shards=self.window_shards[i], resample=self.resample, pieces=pieces)

    # ------------------------------------------------------------ state

    def record(self, state):
        """A consumed batch's worker state (the hand-over calls this in the consuming process)."""
        self.consumed[state["worker"]] = state

    def state_dict(self):
        """Where this rank stands in its epoch: what `load_state_dict` needs to go on from
        the batch after the last one consumed. JSON-serialisable."""
        seg = self.segment
        return {"version": STATE_VERSION, "sources": self.layout.names, "seed": self.seed, "epoch": seg.epoch,
                "rank": self.topo.rank, "world": self.topo.world, "workers": self.workers,
                "batch_size": self.batch_size, "batches": seg.batches, "generation": seg.generation,
                "origin": seg.origin, "consumed": {str(w): s for w, s in sorted(self.consumed.items())}}

    def load_state_dict(self, state):
        """Continue from `state_dict()` (one rank's) or {"ranks": [every rank's]}.

        With the same world size and worker count (and this rank's state among them) the
        stream goes on exactly where it stopped. Otherwise it needs every rank's state and
        continues the interrupted epoch on this world: see `leftover_segment`. Call it
        before the loader's first pass: workers take their copy of the stream then.
        """
        if self._shared is not None and self._shared[2].value:
            raise RuntimeError("load_state_dict after the loader's workers started: load it before the first pass")
        ranks = state["ranks"] if "ranks" in state else [state]
        first = ranks[0]
        if first.get("version") != STATE_VERSION:
            raise ValueError(f"stream state version {first.get('version')}, expected {STATE_VERSION}")
        if first["sources"] != self.layout.names or first["seed"] != self.seed:
            raise ValueError(f"the stream state is for sources {first['sources']} with seed {first['seed']}; "
                             f"this stream has {self.layout.names} with seed {self.seed}")
        self._pending = state
        self.epoch = first["epoch"]
        if self._shared is not None:
            self._shared[0].value = self.epoch
        same = first["world"] == self.topo.world and first["workers"] == self.workers and \
            any(r["rank"] == self.topo.rank for r in ranks)
        if same:
            mine = next(r for r in ranks if r["rank"] == self.topo.rank)
            states = {int(w): s for w, s in mine["consumed"].items()}
            done = sum(s["batches"] for s in states.values())
            self.segment = Segment(mine["epoch"], mine["batches"], mine["generation"], mine["origin"], states,
                                   rotation=done % self.workers)
        else:
            self.segment = self.leftover_segment(ranks)
        self.consumed = dict(self.segment.states)

    def leftover_segment(self, ranks):
        """The rest of an epoch that ran on another world size (or worker count), for this one.

        Every rank had consumed the same number of batches k of its n. What is left,
        (n - k) x old world x batch samples, becomes this world's epoch segment, in equal
        batches per rank. Per source, every old (rank, worker)'s unfinished windows of its
        current pass (from the position it reached) are pooled and cut into equal runs,
        one per new slot: no sample consumed before the interruption is read again while
        a slot's run lasts, and none is skipped but what the last partial batches leave.
        A slot whose run is used up goes on with passes of its own, as an exhausted
        source always does. Resampled streams (--resample) have no passes to finish:
        they go on with fresh draws.
        """
        first = ranks[0]
        world, workers = first["world"], first["workers"]
        if sorted(r["rank"] for r in ranks) != list(range(world)):
            raise ValueError(f"resuming on {self.topo.world} ranks from a run on {world} needs every rank's "
                             f"stream state; have ranks {sorted(r['rank'] for r in ranks)}")
        done = {sum(s["batches"] for s in r["consumed"].values()) for r in ranks}
        if len(done) != 1:
            raise ValueError(f"the ranks' stream states disagree on how many batches were consumed ({sorted(done)})")
        left = (first["batches"] - done.pop()) * world * first["batch_size"]
        origin = {}
        for i, source in enumerate(self.sources):
            pieces = []
            for r in sorted(ranks, key=lambda r: r["rank"]):
                old = Segment(r["epoch"], r["batches"], r["generation"], r["origin"])
                topo = Topology(r["rank"], world)
                for w in range(workers):
                    saved = r["consumed"].get(str(w))
                    plan = self._plan(i, Worker(w, workers), old, topo)
                    pieces += stages.leftovers(plan, saved["sources"][i] if saved else None)
            origin[source.name] = [[list(p.urls), p.tag, "origin", p.start, p.stop] for p in pieces]
        return Segment(first["epoch"], left // (self.topo.world * self.batch_size), first["generation"] + 1, origin)

    def eval_stream(self, source, batch_size=None):
        """A finite stream over one source's test shards in this stream's batch format."""
        return EvalStream(self.layout, source, batch_size or self.batch_size, self.topo, strict=self.strict,
                          cache_dir=self.cache_dir, policy=self.policy, normalize=self.normalize)


def share_out(pieces, source, parts):
    """Cut the samples of `pieces` (windows, in order) into `parts` consecutive runs of
    nearly equal size, by the manifest's counts; returns a list of windows per part."""
    counts = dict(zip(source.urls, source.counts))
    sizes = []
    for p in pieces:
        total = sum(counts.get(u, 0) for u in p.urls)
        sizes.append(max(0, min(total if p.stop is None else p.stop, total) - p.start))
    whole = sum(sizes)
    bounds = [whole * i // parts for i in range(parts + 1)]
    out = [[] for _ in range(parts)]
    offset = 0
    for p, size in zip(pieces, sizes):
        for i in range(parts):
            lo, hi = max(bounds[i], offset), min(bounds[i + 1], offset + size)
            if lo < hi:
                stop = p.stop if hi == offset + size else p.start + hi - offset
                out[i].append(stages.Window(tuple(p.urls), p.tag, "origin", p.start + lo - offset, stop))
        offset += size
    return out


class EvalStream(torch.utils.data.IterableDataset):
    """Every test sample of one source exactly once across all ranks and workers.

    Shards are split by (rank, worker) without shuffling or repeating, so ranks may
    yield different numbers of batches: evaluate with the plain module (not the DDP
    wrapper, whose forward can sync) and all-reduce the counts afterwards.
    """

    def __init__(self, layout, source, batch_size, topo=Topology(), *, strict=False, cache_dir=None,
                 policy=remote.Policy(), normalize=True):
        self.layout, self.batch_size, self.topo = layout, batch_size, topo
        self.index = layout.index(source.name)
        train = layout.sources[self.index]
        if source.shape != train.shape:  # test images are decoded to the shape the model trains on
            if "raw" in source.target.image_exts:
                raise ShardError(f"{source.name}: raw test shards are {source.shape}, training shards {train.shape}; "
                                 f"raw pixels cannot be resized")
            source = dataclasses.replace(source, target=dataclasses.replace(source.target, shape=train.shape))
        self.source = source
        if list(source.classes) != list(train.classes) or source.target.label_values != train.target.label_values \
                or bool(source.target.names) != bool(train.target.names):  # names, or integers the classes name
            raise ShardError(f"{source.name}: the test manifest lists {len(source.classes)} classes "
                             f"({_preview(source.classes)}), the training manifest {len(train.classes)} "
                             f"({_preview(train.classes)}); their labels would not match the model's head: index "
                             f"the test shards with the training split's classes (tools/make_shards.py --index "
                             f"{source.name}:{source.split}=SHARDS --classes-from {train.manifest} --out DIR)")
        self.strict, self.cache_dir, self.policy, self.normalize = strict, cache_dir, policy, normalize

    def __iter__(self):
        return map(Arrival(self), self.batches())

    def batches(self, worker=None, lend=None):
        """This worker's share of the test batches, as a worker sends them."""
        worker = worker or Worker.current()
        stats = {"skipped": 0}
        reader = stages.Reader(self.source, stats, strict=self.strict, policy=self.policy, cache_dir=self.cache_dir)
        stream = stages.SourceStream(stages.eval_windows(self.source.urls, self.topo, worker), reader, shuffle=False)
        parts = [_NOTHING] * len(self.layout.sources)
        reported = 0
        while True:
            keys, pixels, labels = stream.take(self.batch_size)
            if not keys and stats["skipped"] == reported:
                return
            parts[self.index] = (keys, pixels, labels)
            handle, canvas = lend(len(keys)) if lend else (None, None)
            batch = self.layout.collate(np.full(len(keys), self.index), parts, stats["skipped"] - reported, canvas)
            reported = stats["skipped"]
            if handle is not None:
                batch["image"] = handle
            yield batch
            if len(keys) < self.batch_size:
                return


def _preview(names, n=3):
    return ", ".join(names[:n]) + (", ..." if len(names) > n else "")
