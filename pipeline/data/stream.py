"""The training side's data stream: several sources, mixed by weight, in equal-length batches.

    per source, fixed for the run:       partition.Partition deals its shards to K slots
    in each (rank, worker), per source:  stages.SourceStream, the chain of stages
                                         slots (a stages.SlotPlan) -> read -> shuffle -> decode -> your stages
    across sources:                      stages.Mix draws the source of every sample (RandomMix)
    then:                                batch.Collate, loader.make_loader's hand-over

Each stage is a pipeline.data.node.Node (next, state, reset), pulling from the one before.

Every rank yields exactly `batches_per_epoch` batches whatever its shards hold:
sources repeat rather than end, so no rank is ever left waiting in an
all-reduce. `EvalStream` reads a source's test shards once, split over ranks
and workers.

A stream's position is small (`state_dict`): per source the consumed count of each
slot this rank owns, and per worker the batches it made (the mixture's position);
everything before is a pure function of those. `load_state_dict` continues an
interrupted epoch by one path whatever the world: the slots are dealt to this
world's (rank, worker) pairs and each goes on from its count. With the same world
size and workers that is exactly where the run stopped.
"""
import collections
import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch

from pipeline.data import partition, remote, stages
from pipeline.data.batch import NOTHING, Collate, Layout
from pipeline.errors import Errors, ShardError
from pipeline.data.loader import Arrival, make_loader  # noqa: F401  (part of this module's API)
from pipeline.data.manifest import Source, resolve  # noqa: F401  (part of this module's API)
from pipeline.data.topology import Topology, Worker
from pipeline.data.weights import check_weights, parse_weights  # noqa: F401  (part of this module's API)

__all__ = ["MixedStream", "EvalStream", "Source", "resolve", "make_loader", "parse_weights", "check_weights"]
STATE_VERSION = 2
MAX_WORLD = 1 << 16  # ranks a stream state may say it ran on (as a checkpoint's world)
MAX_WORKERS = 1 << 10  # DataLoader workers per rank (as --workers)


@dataclass
class Segment:
    """The part of an epoch a stream runs: all of it, or what an interrupted run left.

    batches: per rank; generation: how many resumes on another world size led here
    (it keys the mixture, so a new world draws afresh); counts: per source, per logical
    worker, the slots it owns and their counts to start from (None: the run's first
    deal, every count 0); borrowed: per source, per logical worker that borrows a slot,
    where it stood (same world only); done: per logical worker, the batches it had made;
    rotation: which logical worker the DataLoader's worker 0 plays, so that batches
    arrive in the order an uninterrupted run would have them.
    """

    epoch: int
    batches: int
    generation: int = 0
    counts: list = None
    borrowed: list = None
    done: dict = field(default_factory=dict)
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
    "label": int, "__seed__": int, a pure function of the sample's slot position}; each
    returns the sample (image of the same shape and dtype) or None to drop it. `slots`:
    K per source (an int or one per source), else fixed at the first pass from the world
    and worker count; `on_error`: the pipeline.errors.Errors policy ("warn", "skip",
    "raise"; strict=True is "raise").
    """

    def __init__(self, sources, weights, batch_size, topo=Topology(), *, seed=0, epoch_samples=None,
                 shuffle_buffer=1000, resample=False, strict=False, cache_dir=None, policy=remote.Policy(),
                 normalize=True, sample_stages=(), slots=None, on_error=None):
        if batch_size < 1:
            raise ValueError(f"batch size must be at least 1, got {batch_size}")
        if shuffle_buffer < 1:
            raise ValueError(f"shuffle buffer must be at least 1, got {shuffle_buffer}")
        self.layout = Layout(sources)
        self.sources = self.layout.sources
        self.probs = check_weights(weights, self.layout.names)
        empty = [s.name for s in self.sources if not s.total]
        if empty:  # no slot would hold a sample, nor any to borrow
            raise ValueError(f"training source {empty[0]}: its manifest lists no samples")
        self.batch_size, self.topo, self.seed = batch_size, topo, seed
        self.epoch_samples = epoch_samples or sum(s.total for s in sources)
        if self.epoch_samples < topo.world * batch_size:
            raise ValueError(f"an epoch of {self.epoch_samples} samples is less than one batch on every rank "
                             f"({topo.world} x {batch_size}); lower the batch size or raise the epoch samples")
        self.resample, self.cache_dir, self.policy = resample, cache_dir, policy
        self.on_error = _error_mode(on_error, strict)
        Errors(self.on_error)  # checked now, not in a worker
        self.normalize, self.sample_stages = normalize, tuple(sample_stages)
        self.shuffle_buffer = shuffle_buffer
        self.asked = None if slots is None else self._check_slots(slots)  # K as the caller fixed it
        self.slots = self.asked
        self.workers = 1
        self.epoch = 0
        self.segment = Segment(0, self.batches_per_epoch)
        self.consumed = {}
        self._pending = None
        self._parts = None
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
        return self.segment.batches - sum(self._done().values())

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
        self.partitions()  # K is fixed before the workers take their copies
        if self._shared is None:
            self._shared = (ctx.Value("q", self.epoch, lock=False), ctx.Array("d", self.probs, lock=False),
                            ctx.Value("b", 0, lock=False))

    # ------------------------------------------------------------ the partition

    def _check_slots(self, slots):
        slots = [slots] * len(self.sources) if isinstance(slots, int) else list(slots)
        if len(slots) != len(self.sources) or any(isinstance(k, bool) or not isinstance(k, int) or
                                                  not 1 <= k <= partition.MAX_SLOTS for k in slots):
            raise ValueError(f"slots {slots}: one count in 1..{partition.MAX_SLOTS} per source "
                             f"({len(self.sources)})")
        return slots

    def partitions(self):
        """Each source's Partition; K is fixed at the first call (from `slots`, a loaded
        state, or the default for this world and worker count) and kept for the run."""
        if self._parts is None:
            if self.slots is None:
                self.slots = [partition.default_slots(self.topo.world, self.workers, len(s.urls))
                              for s in self.sources]
            self._parts = [partition.Partition(s.counts, k, seed=self.seed, source=i)
                           for i, (s, k) in enumerate(zip(self.sources, self.slots))]
        return self._parts

    def slots_fixed(self):
        """K per source, fixed now if it was not yet (a checkpoint records it)."""
        self.partitions()
        return list(self.slots)

    def keep_slots(self, slots):
        """Take K from an earlier run (a checkpoint's), unless the caller fixed K: before the first pass."""
        if self._shared is not None and self._shared[2].value:
            raise RuntimeError("keep_slots after the loader's workers started")
        if self.asked is None:
            self.slots, self._parts = self._check_slots(slots), None

    def short_sources(self, num_workers):
        """Names of sources where some (rank, worker) pair owns no slot with samples: it
        borrows another pair's slot, so samples may repeat across workers."""
        self.workers = max(1, num_workers)
        pairs = self.topo.world * self.workers
        return [s.name for s, p in zip(self.sources, self.partitions())
                if int((p.sizes(self.epoch) > 0).sum()) < pairs]

    def _plan(self, i, worker, seg):
        """The windows source i's stream reads in one (rank, worker) of a segment."""
        part, source = self.partitions()[i], self.sources[i]
        width = max(1, -(-self.shuffle_buffer * len(part.piece_shard) // max(source.total, 1)))
        mine = self._owned(i, worker, seg)
        sizes = part.sizes(seg.epoch)
        if any(sizes[s] > 0 for s in mine):
            return stages.SlotPlan(part, source.urls, seg.epoch, list(mine), mine, width=width,
                                   resample=self.resample)
        pair = self.topo.rank * worker.count + worker.id  # owns no samples: borrow a slot, in orders of its own
        full = np.flatnonzero(sizes)
        slot = int(full[pair % len(full)])
        count = _borrowed_at(seg, i, worker.id) or 0
        return Borrowed(stages.SlotPlan(part, source.urls, seg.epoch, [slot], {slot: count}, width=width,
                                        resample=self.resample, variant=1 + pair), mine)

    def _owned(self, i, worker, seg):
        """{slot: count} of what a logical worker owns of source i in a segment."""
        if seg.counts is not None:
            return seg.counts[i].get(worker.id, {})
        k = self.partitions()[i].slots
        return {s: 0 for s in partition.owned(k, self.topo.rank, self.topo.world, worker.id, worker.count)}

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
        errors = Errors(self.on_error)
        streams = [stages.SourceStream(self._plan(i, logical, seg), self._reader(s, errors),
                                       sample_stages=self.sample_stages) for i, s in enumerate(self.sources)]
        mix = stages.Mix(streams, self.probs, [self.seed, self.epoch, seg.generation, self.topo.rank, logical.id],
                         self.batch_size, at=seg.done.get(logical.id, 0))
        out = Collate(mix, self.layout, errors, lend)
        while mix.at < count:
            batch = out.next()
            batch["state"] = {"worker": logical.id, "batches": mix.at,
                              "sources": [_plan_state(stream.plan, stream.slots_state()) for stream in streams]}
            yield batch

    def _reader(self, source, errors):
        return stages.Reader(source, errors, policy=self.policy, cache_dir=self.cache_dir)

    # ------------------------------------------------------------ state

    def record(self, state):
        """A consumed batch's worker state (the hand-over calls this in the consuming process)."""
        self.consumed[state["worker"]] = state

    def _done(self):
        done = dict(self.segment.done)
        done.update({w: s["batches"] for w, s in self.consumed.items()})
        return done

    def state_dict(self):
        """Where this rank stands in its epoch: what `load_state_dict` needs to go on from
        the batch after the last one consumed. JSON-serialisable: per source and worker
        the owned slots' counts, O(K / world) small integers."""
        seg = self.segment
        self.partitions()
        counts, borrowed = [], []
        for i in range(len(self.sources)):
            per, lent = {}, {}
            for w in range(self.workers):
                if w in self.consumed:
                    src = self.consumed[w]["sources"][i]
                    per[w], got = src["slots"], src.get("borrowed")
                else:
                    per[w], got = self._owned(i, Worker(w, self.workers), seg), _borrowed_at(seg, i, w)
                if got is not None:
                    lent[w] = got
            # each pair's slots in the order its plan lists them (SlotPlan reads the first listed when even)
            counts.append({str(w): {str(k): v for k, v in m.items()} for w, m in per.items()})
            borrowed.append({str(w): v for w, v in lent.items()})
        return {"version": STATE_VERSION, "sources": self.layout.names, "seed": self.seed, "epoch": seg.epoch,
                "rank": self.topo.rank, "world": self.topo.world, "workers": self.workers,
                "batch_size": self.batch_size, "batches": seg.batches, "generation": seg.generation,
                "slots": list(self.slots), "counts": counts, "borrowed": borrowed,
                "done": {str(w): d for w, d in sorted(self._done().items())}}

    def load_state_dict(self, state):
        """Continue from `state_dict()` (one rank's) or {"ranks": [every rank's]}.

        The interrupted epoch's slots are dealt to this world's (rank, worker) pairs and
        each goes on from its count; what is left of the epoch is cut into equal batches
        per rank. With the same world size and worker count (and this rank's state among
        them) the stream goes on exactly where it stopped; otherwise it needs every rank's
        state. Call it before the loader's first pass: workers take their copy then.
        """
        if self._shared is not None and self._shared[2].value:
            raise RuntimeError("load_state_dict after the loader's workers started: load it before the first pass")
        ranks = _rank_states(state)
        first = ranks[0]
        if first["sources"] != self.layout.names or first["seed"] != self.seed:
            raise ValueError(f"the stream state is for sources {first['sources']} with seed {first['seed']}; "
                             f"this stream has {self.layout.names} with seed {self.seed}")
        slots = self._check_slots(first["slots"])
        if self.asked is not None and slots != self.asked:
            raise ValueError(f"the interrupted epoch ran on {slots} slots per source, this stream asks for "
                             f"{self.asked}: the slots change only at an epoch boundary")
        if first["batches"] * first["world"] * first["batch_size"] > self.epoch_samples:
            raise ValueError(f"the stream state's epoch holds {first['batches']} batches of {first['world']} x "
                             f"{first['batch_size']} samples, more than this stream's epoch of {self.epoch_samples}")
        self.slots, self._parts = slots, None
        self._pending = state
        self.epoch = first["epoch"]
        if self._shared is not None:
            self._shared[0].value = self.epoch
        same = first["world"] == self.topo.world and first["workers"] == self.workers and \
            first["batch_size"] == self.batch_size and any(r["rank"] == self.topo.rank for r in ranks)
        if same:
            mine = next(r for r in ranks if r["rank"] == self.topo.rank)
            done = self._check_done(mine)
            counts = [self._workers_counts(mine, i) for i in range(len(self.slots))]
            every = len(ranks) == self.topo.world  # every rank's state: each slot owned once by one of them
            if every:
                self._consumed(ranks)
            for i, per in enumerate(counts):
                maps = [m for r in ranks for m in self._workers_counts(r, i).values()] if every else per.values()
                partition.gather(maps, self.slots[i], complete=every)  # no slot owned twice (or left out)
            borrowed = [_check_map(b, self.workers, "borrowed") for b in _per_source(mine, "borrowed", self.slots)]
            self.segment = Segment(mine["epoch"], mine["batches"], mine["generation"], counts, borrowed, done,
                                   rotation=sum(done.values()) % self.workers)
        else:
            self.segment = self.redeal(ranks)
        self.consumed = {}

    def _consumed(self, ranks):
        """The batches every rank had consumed: one number, or the states are refused."""
        done = sorted({sum(self._check_done(r).values()) for r in ranks})
        if len(done) != 1:
            raise ValueError(f"the ranks' stream states disagree on how many batches were consumed ({done})")
        return done[0]

    def _check_done(self, rank_state):
        """{worker: batches made} of one rank's state: each worker's within its share of the
        segment's batches (so what is left is never negative)."""
        workers, batches = rank_state["workers"], rank_state["batches"]
        done = _check_map(rank_state["done"], workers, "done")
        over = [w for w, d in done.items() if d > batches // workers + (w < batches % workers)]
        if over:
            raise ValueError(f"stream state done: worker {over[0]} made {done[over[0]]} batches, more than its "
                             f"share of the {batches} batches of {workers} worker(s)")
        return done

    def _workers_counts(self, rank_state, i):
        """{worker: {slot: count}} of source i in one rank's state, checked."""
        per = _per_source(rank_state, "counts", self.slots)[i]
        workers = rank_state["workers"]
        if not isinstance(per, dict) or len(per) != workers or sorted(per) != sorted(str(w) for w in range(workers)):
            raise ValueError(f"stream state counts of source {i}: one map per worker 0..{workers - 1} expected")
        return {int(w): _check_map(m, self.slots[i], f"counts[{i}][{w}]") for w, m in per.items()}

    def redeal(self, ranks):
        """The rest of an epoch that ran on another world size (or worker count), for this one.

        Every rank had consumed the same number of batches k of its n. What is left,
        (n - k) x old world x batch samples, becomes this world's segment, in equal
        batches per rank. Per source, the slots, ordered by how much of their pass is
        left (most first), are dealt to this world's pairs by the split rule, and each
        goes on from its count: no sample consumed before the interruption is read again
        while a slot's pass lasts, every pair gets an even share of what is left, and
        none is skipped but what the last partial batches leave. Pairs that borrowed a
        slot start afresh.
        """
        first = ranks[0]
        world = first["world"]
        if sorted(r["rank"] for r in ranks) != list(range(world)):
            raise ValueError(f"resuming on {self.topo.world} ranks from a run on {world} needs every rank's "
                             f"stream state; have ranks {sorted(r['rank'] for r in ranks)}")
        left = (first["batches"] - self._consumed(ranks)) * world * first["batch_size"]
        counts = []
        for i, part in enumerate(self.partitions()):
            merged = partition.gather([m for r in ranks for m in self._workers_counts(r, i).values()], part.slots)
            order = redeal_order(part.sizes(first["epoch"]), merged)
            counts.append({w: {order[j]: merged[order[j]] for j in partition.owned(
                part.slots, self.topo.rank, self.topo.world, w, self.workers)} for w in range(self.workers)})
        return Segment(first["epoch"], left // (self.topo.world * self.batch_size), first["generation"] + 1, counts)

    def eval_stream(self, source, batch_size=None):
        """A finite stream over one source's test shards in this stream's batch format."""
        return EvalStream(self.layout, source, batch_size or self.batch_size, self.topo, on_error=self.on_error,
                          cache_dir=self.cache_dir, policy=self.policy, normalize=self.normalize)


def redeal_order(sizes, counts):
    """The slot list a new world deals: the slots with the most of their pass left first
    (ties by slot), so that the split rule hands every pair an even share of what is left."""
    left = np.maximum(np.asarray(sizes, np.int64) - np.array([counts[s] for s in range(len(sizes))], np.int64), 0)
    return np.lexsort((np.arange(len(sizes)), -left)).tolist()


class Borrowed:
    """A SlotPlan over a slot another pair owns, for a pair whose own slots hold no
    samples; its count is kept apart from the owners' (a re-deal drops it)."""

    def __init__(self, plan, owned):
        self.plan, self.owned = plan, owned

    def next(self):
        return self.plan.next()

    def state(self, pos=0):
        return next(iter(self.plan.state(pos).values()))

    def reset(self, count=None):
        self.plan.reset(None if count is None else dict.fromkeys(self.plan.counts, count))


def _borrowed_at(seg, i, worker):
    """Where a logical worker that borrows a slot of source i stood in a segment, or None."""
    return seg.borrowed[i].get(worker) if seg.borrowed else None


def _plan_state(plan, state):
    if isinstance(plan, Borrowed):
        return {"slots": plan.owned, "borrowed": state}
    return {"slots": state}


STATE_FIELDS = {"version": None, "sources": None, "seed": None, "epoch": (0, partition.MAX_COUNT),
                "rank": (0, MAX_WORLD - 1), "world": (1, MAX_WORLD), "workers": (1, MAX_WORKERS),
                "batch_size": (1, partition.MAX_COUNT), "batches": (0, partition.MAX_COUNT),
                "generation": (0, partition.MAX_COUNT), "slots": None, "counts": None, "borrowed": None, "done": None}
SHARED = ("version", "sources", "seed", "epoch", "world", "workers", "batch_size", "batches", "generation", "slots")


def _rank_states(state):
    """The rank states of a loaded stream state (one rank's, or {"ranks": [...]}), checked
    for their fields and against each other (a checkpoint is input): the ranks must agree
    on everything but their own counts, and each rank appear once."""
    if not isinstance(state, dict):
        raise ValueError(f"stream state: a mapping expected, got {type(state).__name__}")
    ranks = state["ranks"] if "ranks" in state else [state]
    if not isinstance(ranks, list) or not ranks or not all(isinstance(r, dict) for r in ranks):
        raise ValueError("stream state ranks: a non-empty list of per-rank mappings expected")
    for r in ranks:
        if r.get("version") != STATE_VERSION:
            raise ValueError(f"stream state version {_short(r.get('version'))}, expected {STATE_VERSION}")
        missing = [k for k in STATE_FIELDS if k not in r]
        if missing:
            raise ValueError(f"stream state: field {missing[0]} missing")
        for k, bounds in STATE_FIELDS.items():
            if bounds and (type(r[k]) is not int or not bounds[0] <= r[k] <= bounds[1]):
                raise ValueError(f"stream state {k}: {_short(r[k])}; an integer in {bounds[0]}..{bounds[1]} expected")
        if r["rank"] >= r["world"]:
            raise ValueError(f"stream state rank {r['rank']} outside its world of {r['world']}")
    first = ranks[0]
    for r in ranks[1:]:
        for k in SHARED:
            if r[k] != first[k]:
                raise ValueError(f"the ranks' stream states disagree on {k}: {_short(first[k])} and {_short(r[k])}")
    twice = [k for k, n in collections.Counter(r["rank"] for r in ranks).items() if n > 1]
    if twice:
        raise ValueError(f"stream state: rank {twice[0]} appears twice")
    return ranks


def _short(value, n=60):
    text = repr(value)
    return text if len(text) <= n else text[:n] + "..."


def _per_source(rank_state, key, slots):
    v = rank_state[key]
    if not isinstance(v, list) or len(v) != len(slots):
        raise ValueError(f"stream state {key}: one entry per source ({len(slots)}) expected")
    return v


def _error_mode(on_error, strict):
    """The Errors mode from `on_error` ("warn", "skip", "raise") or the older `strict` flag."""
    if strict and on_error not in (None, "raise"):
        raise ValueError(f"strict=True asks to raise on damage, on_error={on_error!r} not")
    return on_error or ("raise" if strict else "warn")


def _check_map(m, size, what):
    """A loaded {int: count} map (a checkpoint is input): keys 0..size-1, counts in range."""
    try:
        return partition.check_counts(m, size)
    except ValueError as e:
        raise ValueError(f"stream state {what}: {e}") from None


class EvalStream(torch.utils.data.IterableDataset):
    """Every test sample of one source exactly once across all ranks and workers.

    Shards are split by (rank, worker) without shuffling or repeating, so ranks may
    yield different numbers of batches: evaluate with the plain module (not the DDP
    wrapper, whose forward can sync) and all-reduce the counts afterwards.
    """

    def __init__(self, layout, source, batch_size, topo=Topology(), *, strict=False, on_error=None,
                 cache_dir=None, policy=remote.Policy(), normalize=True):
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
        self.on_error = _error_mode(on_error, strict)
        self.cache_dir, self.policy, self.normalize = cache_dir, policy, normalize

    def __iter__(self):
        return map(Arrival(self), self.batches())

    def batches(self, worker=None, lend=None):
        """This worker's share of the test batches, as a worker sends them."""
        worker = worker or Worker.current()
        errors = Errors(self.on_error)
        reader = stages.Reader(self.source, errors, policy=self.policy, cache_dir=self.cache_dir)
        stream = stages.SourceStream(stages.OncePlan(stages.split(self.source.urls, self.topo, worker)), reader,
                                     shuffle=False)
        parts = [NOTHING] * len(self.layout.sources)
        reported = 0
        while True:
            keys, pixels, labels = stream.take(self.batch_size)
            if not keys and errors.skipped == reported:
                return
            parts[self.index] = (keys, pixels, labels)
            handle, canvas = lend(len(keys)) if lend else (None, None)
            batch = self.layout.collate(np.full(len(keys), self.index), parts, errors.skipped - reported, canvas)
            reported = errors.skipped
            if handle is not None:
                batch["image"] = handle
            yield batch
            if len(keys) < self.batch_size:
                return


def _preview(names, n=3):
    return ", ".join(names[:n]) + (", ..." if len(names) > n else "")
