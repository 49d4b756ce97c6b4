"""The training side's data stream: several sources, mixed by weight, in equal-length batches.

    per epoch, per source:          order.SourceOrder: where each position's sample lies
                                    (shards dealt per pass, cut into windows, shuffled)
    per epoch, for the world:       deal.Segment: each (rank, worker) pair's run of
                                    positions per source and its exact mix (deal.Choices)
    in each (rank, worker):         stages.SourceStream per source:
                                    run -> read -> shuffle -> decode -> your stages
    across sources:                 mix.RandomMix takes each batch from the sources its choices name
    then:                           batch.Collate; the hand-over (pipeline.data.handover.loader)
                                    reads the stream, the stream knows no loader

Every rank yields exactly `batches_per_epoch` batches whatever its shards hold, so no
rank is ever left waiting in an all-reduce. Within an epoch no position is read by two
pairs, and a source's sample is read a second time only once all of its samples were
read (a source smaller than its share of the epoch starts a new pass). `EvalStream`
reads a source's test shards once, split over ranks and workers.

Where the stream stands is one immutable `cursor.Cursor` (epoch, weights, workers, the pass's
plan, a loaded state) that `set_epoch`, `set_workers` and `load_state_dict` each replace whole;
the class itself holds the settings and produces batches from the cursor's plan.
A stream's state (`state_dict`, pipeline.ordering.state_format) is the epoch's segment (the world
that reads it, and the worlds before it with what each consumed), the batches each rank
made of it, the positions its workers passed over, and each source's shard-list digest:
everything else is recomputed. `load_state_dict` goes on where that state stopped: on
the same world with the same segment, bit for bit; on another, with what every pair
left, dealt to the new world's pairs (`deal.Segment.after`).
"""
import dataclasses
import os
import threading

import numpy as np
import torch

from pipeline.data.store import remote
from pipeline.data.streams import stages
from pipeline.data.streams import reading
from pipeline.data.streams import plans
from pipeline.data.streams.cursor import (Cursor, Start, dealt, epoch_clash, epoch_number, every_rank, locked,
                                          workers_number)
from pipeline.ordering import deal, order, state_format
from pipeline.data.fields.batch import Collate
from pipeline.errors import Errors, short
from pipeline.data.manifests.manifest import Source, resolve  # noqa: F401  (part of this module's API)
from pipeline.data.streams.mix import RandomMix
from pipeline.ordering.topology import Topology, Worker, own_items
from pipeline.ordering.weights import check_weights, parse_weights  # noqa: F401  (part of this module's API)
from pipeline.data.streams.evaluation import EvalStream, _error_mode, in_process, layout_of

__all__ = ["MixedStream", "EvalStream", "Source", "resolve", "parse_weights", "check_weights", "in_process"]
WINDOW_SAMPLES = 10_000  # a shuffle window: shards adding up to about this many samples...
WINDOW_BYTES = 256 << 20  # ...and no more bytes than this (plus one shard)
HEADER_BYTES = 1024  # a sample's tar headers, for sources whose manifest gives no shard sizes


def _remote(source):
    return any(remote.kind(u) in ("http", "store") for u in source.urls[:1])


class MixedStream(torch.utils.data.IterableDataset):
    """Batches mixing several sources by weight, the same count on every rank.

    `topo`: this process's place among the ranks (default: torchrun's environment,
    `Topology.from_env()`, so each rank reads its own share).

    An epoch is `epoch_samples` samples over all ranks (default: all training samples
    of all sources together), split between the sources by the weights, so each rank
    yields epoch_samples // (world * batch_size) batches whatever `num_workers` is; the
    workers split that count between them. Call `set_epoch` before each epoch, as with
    DistributedSampler: the order depends on (seed, epoch). `shuffle_buffer` is about how
    many samples a shuffle window holds (whole shards, at most `window_bytes` bytes plus
    one shard); a batch draws on every shard of its window. `sample_stages` are functions
    applied to every decoded sample, a dict {"__key__", "__source__", "image": uint8 C,H,W
    array, "label": int, "__seed__": int, a pure function of the sample's position}; each
    returns the sample (image of the same shape and dtype) or None to drop it.
    `on_error`: the pipeline.errors.Errors policy ("warn", "skip", "raise"; strict=True is
    "raise"). `schemas`: {source name: pipeline.data.fields.schema.Schema} (or one Schema for
    every source), the fields read from its samples in place of its manifest's (None: the
    default schema, image and class label); every batch holds the union of the sources'
    fields (pipeline.data.fields.batch.Layout), and the sample stages of a source with a schema see
    and return its fields. `normalize`: the `image` field float32, normalised with each
    source's mean and std, whatever the schemas; every other field stays as decoded.
    """

    def __init__(self, sources, weights, batch_size, topo=None, *, seed=0, epoch_samples=None,
                 shuffle_buffer=WINDOW_SAMPLES, window_bytes=WINDOW_BYTES, resample=False, strict=False,
                 cache_dir=None, policy=remote.Policy(), normalize=True, sample_stages=(), on_error=None,
                 fetch_ahead=reading.FETCH_AHEAD, schemas=None):
        if batch_size < 1:
            raise ValueError(f"batch size must be at least 1, got {batch_size}")
        if shuffle_buffer < 1 or window_bytes < 1:
            raise ValueError(f"shuffle window must be at least 1 sample and 1 byte, got {shuffle_buffer}, "
                             f"{window_bytes}")
        self.layout = layout_of(with_schemas(sources, schemas))
        self.sources = self.layout.sources
        probs = check_weights(weights, self.layout.names)
        empty = [s.name for s in self.sources if not s.total]
        if empty:
            raise ValueError(f"training source {empty[0]}: its manifest lists no samples")
        topo = Topology.from_env() if topo is None else topo  # under torchrun each rank its own share by default
        self.batch_size, self.topo, self.seed = batch_size, topo, seed
        self.epoch_samples = epoch_samples or sum(s.total for s in sources)
        if self.epoch_samples < topo.world * batch_size:
            raise ValueError(f"an epoch of {self.epoch_samples} samples is less than one batch on every rank "
                             f"({topo.world} x {batch_size}); lower --batch-size or raise --epoch-samples")
        self.resample, self.cache_dir, self.policy = resample, cache_dir, policy
        self.on_error = _error_mode(on_error, strict)
        Errors(self.on_error)  # checked now, not in a worker
        self.normalize, self.sample_stages = normalize, tuple(sample_stages)
        self.shuffle_buffer, self.window_bytes = shuffle_buffer, window_bytes
        if fetch_ahead < 0:
            raise ValueError(f"fetch_ahead must be at least 0 bytes, got {fetch_ahead}")
        self.fetch_ahead = fetch_ahead
        self.cursor = Cursor(tuple(probs))  # where the stream stands (cursor.py), replaced whole
        self.arrived = {}  # the batch states arrived under the cursor's plan, by logical worker
        self.passing = None  # the plan id of the pass begun last: another's batches end their pass (`arrive`)
        self._orders = {}
        self._lock, self._lock_pid = threading.RLock(), os.getpid()

    def _guard(self):
        """The stream's lock; a forked process makes its own (another thread may have held the parent's)."""
        if self._lock_pid != os.getpid():
            self._lock, self._lock_pid = threading.RLock(), os.getpid()
        return self._lock

    def __getstate__(self):
        state = dict(self.__dict__)
        del state["_lock"]  # a lock does not pickle (forkserver or spawn workers): each process its own
        return state

    def __setstate__(self, state):
        self.__dict__.update(state, _lock=threading.RLock(), _lock_pid=os.getpid())

    @property
    def epoch(self):
        """The epoch the stream stands in."""
        return self.cursor.epoch

    @property
    def workers(self):
        """Loader workers per rank the stream is dealt to (1 until a loader or `set_workers` says)."""
        return self.cursor.workers

    @property
    def probs(self):
        return list(self.cursor.probs)

    @property
    def weights(self):
        return dict(zip(self.layout.names, self.probs))

    @property
    def batches_per_epoch(self):
        return self.epoch_samples // (self.topo.world * self.batch_size)

    def targets(self, probs=None):
        """Positions of each source this epoch: the epoch's samples split by the weights."""
        return order.apportion(self.epoch_samples, self.cursor.probs if probs is None else probs)

    def _passes(self):
        """Positions in a pass of each source: its samples (0 when resampled: passes differ)."""
        return tuple(0 if self.resample else int(s.total) for s in self.sources)

    # ------------------------------------------------------------ where the stream stands
    #
    # The stream's place is one immutable cursor.Cursor plus the batches that arrived under its
    # plan. `set_epoch`, `set_workers` and `load_state_dict` each make a new cursor from the old
    # one and put it in place whole (`_move`); the plan is made when first needed (`_placed`),
    # whatever order those calls came in.

    def _move(self, cursor):
        """Put `cursor` in place; the batches that arrived belong to the old one's plan."""
        if cursor.plan is not self.cursor.plan:
            self.arrived = {}
        self.cursor = cursor

    def _placed(self, cur):
        """`cur` with its plan: the epoch's start, or a loaded state dealt to its workers."""
        if cur.plan is not None:
            return cur
        if cur.loaded is not None:
            try:
                segment, start = dealt(cur.loaded, self.topo.rank, (self.topo.world, cur.workers, self.batch_size))
            except ValueError as e:  # before a loader: the state's own workers would take it
                if cur.workers_given:
                    raise
                raise ValueError(f"{e}, or give the workers first (make_loader(stream, "
                                 f"{cur.loaded.segment.workers}) or set_workers)") from None
            return cur.with_plan(segment, start, cur.loaded.targets)
        targets = self.targets(cur.probs)
        segment = deal.first(cur.epoch, targets, world=self.topo.world, workers=cur.workers,
                             batch_size=self.batch_size, batches=self.batches_per_epoch, seed=self.seed,
                             passes=self._passes())
        return cur.with_plan(segment, Start(), targets)

    def _place(self):
        self._move(self._placed(self.cursor))
        return self.cursor

    @locked
    def current(self):
        """The segment the stream stands in: its epoch's first, or one dealt from a loaded state."""
        return self._place().plan.segment

    def __len__(self):
        """Batches the next pass yields on this rank (`remaining`): a loop sized by len() and one
        counting what it gets agree, after a partial pass or a resume too (len() said the whole
        plan's batches, 150 on a resume whose pass yielded 110)."""
        return self.remaining()

    @locked
    def remaining(self):
        """Batches the next pass yields on this rank: all of its epoch's, or what a resumed or
        partly read epoch has left (after a finished epoch: the next one's, which that pass reads)."""
        cur = self._place()
        if cur.finished(self.arrived):
            return self.batches_per_epoch
        return cur.plan.segment.batches - cur.made(self.arrived)

    @locked
    def plan(self, begin=True, shared=False):
        """The plan of the pass about to begin (the loader asks as each pass begins): where the
        stream stands, with the batches that arrived since the last plan folded in. A pass
        after a finished epoch reads the next epoch (torchdata's rule; call `set_epoch` to
        choose). begin=False: a look ahead (a loader starting its workers early), after which
        a state just loaded still decides which epoch may be set. Each pass begun gets a plan
        of its own (its id the stream's `passing`), so that the batches of a pass begun before
        it are told apart (`arrive`); shared=True: one more producer of the same pass (`batches`)."""
        cur = self._placed(self.cursor.unpinned() if begin else self.cursor)
        if cur.finished(self.arrived):  # read to its end, or dealt to this world with nothing left
            cur = self._placed(cur.restarted(cur.epoch + 1))
        elif self.arrived or (begin and not shared and cur.plan.id == self.passing):
            cur = cur.folded(self.arrived)
        self._move(cur)
        if begin and not shared:
            self.passing = cur.plan.id
        return cur.plan

    @locked
    def arrive(self, state, record=True):
        """A batch arrived (the loader and `iter(stream)` call this): RuntimeError when its pass is
        no longer the stream's, else (record=True) its state recorded, one step under the lock (a
        pass begun between the two read a batch handed out uncounted again). A pass ends when
        another begins (another loader's: it would read the same samples) or anything makes a new
        plan (a loader's start(), set_workers, set_epoch, load_state_dict): its later batches
        would count against no plan."""
        plan = self.cursor.plan
        if self.passing is not None and (state.get("plan") != self.passing or plan is None
                                         or plan.id != self.passing):
            raise RuntimeError("another pass began on this stream, or its plan changed (another loader over it? "
                               "set_workers, set_epoch or load_state_dict?) while this pass was being read; a "
                               "stream runs one pass at a time")
        if record:
            self.record(state)

    @locked
    def set_epoch(self, epoch, weights=None):
        """Select the epoch (and optionally new weights, e.g. from a schedule): a pass reads
        epoch `epoch` from its start; the epoch the stream stands in goes on where it is, and
        starts over once finished. Right after `load_state_dict`, only the state's epoch (or,
        for a state saved at its epoch's end, the next) may be set: the state decides. New weights
        for the epoch the stream is inside are refused: its mixture was fixed when it began."""
        epoch = epoch_number(epoch)
        if weights is not None and not isinstance(weights, dict):
            raise ValueError(f"set_epoch({epoch}, {short(weights, 60)}): weights are a dict {{source name: weight}} "
                             f"(parse_weights('a=0.5,b=0.5') makes one from text)")
        probs = self.cursor.probs if weights is None else check_weights(weights, self.layout.names)
        self._move(self.cursor.at_epoch(epoch, probs, self.arrived))

    @locked
    def set_workers(self, workers):
        """How many loader workers read this stream (make_loader says). What was read of the
        epoch so far is dealt to them again: the rest of this rank's share on one rank; on
        several, the workers change only where the epoch has not begun on this rank. 0 (a
        loader with no worker processes) is 1. A loaded state these workers cannot be dealt (this
        rank's alone, from other workers) is refused now, the stream as it was."""
        asked, workers = workers, workers_number(workers)
        cur = self.cursor
        if workers == cur.workers:
            self._move(self._dealable(dataclasses.replace(cur, workers_given=True)))
            return
        made = cur.made(self.arrived)
        if not made:
            self._move(self._dealable(cur.with_workers(workers)))
            return
        if self.topo.world > 1:
            raise ValueError(f"this rank read {made} batches of epoch {cur.epoch} with {cur.workers} worker(s); "
                             f"going on with {workers}{' (0 workers read as 1)' * (asked == 0)} re-deals what "
                             f"every rank left: load every rank's state_dict() (a list) into streams made for "
                             f"{workers} workers, or change workers at an epoch's start")
        new = self._adopt(self.state_dict())  # the rest of the epoch, dealt again when the plan is made
        self._move(dataclasses.replace(new, workers=workers, workers_given=True))

    def window_held(self):
        """The most bytes one (rank, worker) holds for a shuffle window of one source: about
        `shuffle_buffer` samples, at most `window_bytes`, plus the one shard that crosses it;
        for a remote source, also the later shards fetched ahead (reading.Reader): at most
        `fetch_ahead` bytes, or one shard."""
        most = 0
        for i, s in enumerate(self.sources):
            o = self.source_order(i, self.epoch)  # the window as the order cuts it
            largest = int(max(s.sizes) if s.sizes else max(s.counts) * o.sample_bytes)
            ahead = max(self.fetch_ahead, min(largest, reading.WHOLE_SHARD)) if _remote(s) else 0
            most = max(most, int(o.window * o.sample_bytes + largest) + ahead)
        return most

    def fetches_ahead(self):
        """Whether a source is remote: its reader holds shards fetched ahead (`fetch_ahead`)."""
        return any(_remote(s) for s in self.sources)

    def source_order(self, i, epoch):
        """Source i's `order.SourceOrder` for an epoch (kept for the current one)."""
        key = (i, epoch)
        if key not in self._orders:
            if len(self._orders) >= 2 * len(self.sources):
                self._orders.clear()
            s = self.sources[i]
            self._orders[key] = order.SourceOrder(
                s.counts, s.sizes, seed=self.seed, epoch=epoch, source=i, window_samples=self.shuffle_buffer,
                window_bytes=self.window_bytes, sample_bytes=int(np.prod(s.shape)) + HEADER_BYTES,
                resample=self.resample)
        return self._orders[key]

    # ------------------------------------------------------------ batches

    def __iter__(self):
        return in_process(self)

    def batch_spec(self):
        """The batch's fixed-shape fields (pipeline.data.handover.ring)."""
        return self.layout.spec(self.batch_size, self.normalize)

    def batches(self, worker=None, borrow=None, plan=None):
        """One pass's batches for the calling rank and worker, as a producer makes them: numpy
        images (float32 if the stream normalises, else uint8), labels and sources, written
        into the arrays `borrow(n)` lends when given (else new ones, `Spec.lend_new`), and the
        worker's `state` after the batch. `plan`: the pass's Plan (the loader sends it to its
        workers), else `plan()`, taken now: the producers of one pass (one call per worker) share it."""
        return self._batches(worker, borrow or self.batch_spec().lend_new, plan or self.plan(shared=True))

    def _batches(self, worker, borrow, plan):
        seg, start = plan.segment, plan.start
        worker = worker or Worker.current()
        if worker.count != seg.workers:
            raise RuntimeError(f"{worker.count} loader workers, the stream was set for {seg.workers} "
                               f"(make_loader sets it; a DataLoader of your own needs set_workers first)")
        # the list of pairs as split_by_node / split_by_worker deal it, each physical worker
        # playing the logical one `start.first_logical` gives it
        pairs = [r + ((w + start.first_logical) % seg.workers) * seg.world
                 for w in range(seg.workers) for r in range(seg.world)]
        pair = own_items(pairs, self.topo, worker)[0]
        logical = pair // seg.world
        errors = Errors(self.on_error)
        runs, reserves = seg.runs(pair), seg.reserves(pair, plan.targets)
        at = start.positions.get(logical, [0] * len(self.sources))
        streams = [stages.SourceStream(plans.RunPlan(self.source_order(i, seg.epoch), s.urls, runs[i], at[i],
                                                      reserves[i], 2 * (int(plan.targets[i]) + s.total)),
                                       self._reader(s, errors), sample_stages=self.sample_stages)
                   for i, s in enumerate(self.sources)]
        mix = RandomMix(streams, choices=seg.choices(pair), batch_size=self.batch_size, at=start.done.get(logical, 0))
        out = Collate(mix, self.layout, errors, borrow)
        count = seg.worker_batches(logical)
        try:
            while mix.at < count:
                batch = out.next()
                batch["state"] = {"plan": plan.id, "worker": logical, "batches": mix.at,
                                  "positions": [s.position() for s in streams]}
                yield batch
        finally:  # the pass ended or was left: its readers' fetch threads go now, not when the collector finds them
            for s in streams:
                s.reader.close()

    def _reader(self, source, errors):
        return reading.Reader(source, errors, policy=self.policy, cache_dir=self.cache_dir, ahead=self.fetch_ahead)

    # ------------------------------------------------------------ state

    @locked
    def record(self, state):
        """The worker state of a batch that arrived (the loader calls this in the consuming
        process, the trainer as it trains the batch); a batch of an older plan is not counted."""
        plan = self.cursor.plan
        if plan is not None and state.get("plan") == plan.id:
            self.arrived[state["worker"]] = state

    @locked
    def state_dict(self):
        """Where this rank stands in its epoch, JSON-serialisable: the segment (how it was dealt),
        the batches each rank made of it, and the positions this rank's workers passed over
        without a sample (pipeline.ordering.state_format). `load_state_dict` takes a list of every rank's
        (or one, to go on on the same world)."""
        cur = self._place()
        seg, start = cur.plan.segment, cur.start_now(self.arrived)
        done = sum(start.done.values())
        made = [start.done.get(w, 0) for w in range(seg.workers)]
        if made != [seg.worker_done(w, done) for w in range(seg.workers)]:
            raise ValueError(f"this rank's workers made {made} batches: not in turn, as the loader hands them over "
                             f"(a DataLoader of your own with in_order=False?); the stream's state needs them in turn")
        passed = {}
        for w, at in start.positions.items():
            took = seg.taken(self.topo.rank + w * seg.world, done)
            passed[w] = [int(p) - int(t) for p, t in zip(at, took)]
            if min(passed[w], default=0) < 0:
                raise ValueError(f"worker {w} read {list(at)} positions, fewer than its {done} batches took "
                                 f"({[int(t) for t in took]}): a batch recorded from another stream?")
        return state_format.encode(seg, list(cur.plan.targets), self.layout.names, self._listings(), self.seed,
                                   self.topo.rank, done, passed, self._order_settings())

    def _listings(self):
        return [state_format.listing(s) for s in self.sources]

    def _order_settings(self):
        return {"window_samples": self.shuffle_buffer, "window_bytes": self.window_bytes,
                "resample": bool(self.resample)}

    @locked
    def load_state_dict(self, state):
        """Go on from `state_dict()`: one rank's, or a list of every rank's. Before or after
        `set_epoch` (the state's epoch), before or after `make_loader`: the next pass starts
        where the state stopped. A state saved at its epoch's end goes on at the next epoch's start.

        With the same world, workers and batch size the segment goes on as it stopped;
        otherwise every rank's state is needed, and what each pair left is dealt to this
        world. A state inside an epoch over other shards than this stream's (its sources'
        shard-list digests differ) is refused, and so is one the stream's workers (where a
        loader or `set_workers` gave them) cannot be dealt. Returns what it did, as the stream is set
        now: {"deal": "same", "re-deal" or "next epoch", "generation": ..., "from": [world,
        workers, batch size], "to": [...], "passed": {rank: positions passed over without a
        sample}}."""
        cur = self.cursor
        epoch_before = cur.epoch if cur.epoch_given and cur.pinned is None else None
        seg, done, ranks, passed, ended, targets = self._check(state)
        if epoch_before is not None and epoch_before not in ((seg.epoch, seg.epoch + 1) if ended else (seg.epoch,)):
            raise ValueError(epoch_clash(seg.epoch, ended, epoch_before, "load_state_dict after set_epoch"))
        self._move(self._dealable(dataclasses.replace(cur.after_load(seg, done, ranks, passed, ended, targets),
                                                      pinned=(seg.epoch, ended))))
        # before make_loader the workers are not known yet (the stream assumes 1): the loader's decide
        given = cur.workers_given
        here = (self.topo.world, cur.workers if given else None, self.batch_size)
        was = (seg.world, seg.workers, seg.batch_size)
        same = was[::2] == here[::2] and self.topo.rank in ranks and (was[1] == here[1] or not given)
        kind = "next epoch" if ended else ("same" if given else "same on as many workers") if same else "re-deal"
        return {"deal": kind, "generation": 0 if ended else seg.generation + (kind == "re-deal"),
                "from": list(was), "to": list(here),
                "passed": {r: sum(sum(v) for p, v in passed.items() if p % seg.world == r) for r in ranks}}

    def _dealable(self, cur):
        """`cur`, checked that its loaded state can be dealt to its workers where they are known:
        refused now (ValueError, nothing changed), not at every len(), state_dict() and pass after."""
        if cur.loaded is not None and cur.workers_given and cur.plan is None:
            self._placed(cur)
        return cur

    @locked
    def goes_on_at(self, state):
        """(the epoch the next pass reads once `state` is loaded, whether that epoch was begun: a
        batch of it made), checked as `load_state_dict` checks it, the stream unchanged
        (StatefulLoader checks its own state against it)."""
        seg, done, _, _, ended, _ = self._check(state)
        return seg.epoch + ended, bool(done) and not ended

    def _check(self, state):
        """(segment, done, ranks, passed, ended, targets) of a state, every number checked (a state is input)."""
        try:
            root, ranks = state_format.merge(state)
            seg, done, ranks, passed, ended = state_format.check(
                root, ranks, names=self.layout.names, listings=self._listings(), seed=self.seed,
                targets=self.targets(), passes=self._passes(), order_of=self._order_settings())
        except RecursionError:
            raise ValueError("the stream state is nested too deep to be one state_dict() (a damaged or edited "
                             "state: load the one state_dict() gave)") from None
        if not ended and len(ranks) != seg.world:
            if (seg.world, seg.batch_size) != (self.topo.world, self.batch_size):
                raise ValueError(every_rank(seg, ranks, (self.topo.world, self.workers, self.batch_size)))
            if self.topo.rank not in ranks:
                raise ValueError(f"the stream state holds rank(s) {sorted(ranks)}'s place only; this stream is rank "
                                 f"{self.topo.rank}: load this rank's own state, or a list of every rank's")
        return seg, done, ranks, passed, ended, root["targets"]

    def _adopt(self, state):
        """The cursor a state loaded into this one makes (set_workers re-deals the epoch's rest by it)."""
        return self.cursor.after_load(*self._check(state))

    def eval_stream(self, source, batch_size=None):
        """A finite stream over one source's test shards in this stream's batch format."""
        return EvalStream(self.layout, source, batch_size or self.batch_size, self.topo, on_error=self.on_error,
                          cache_dir=self.cache_dir, policy=self.policy, normalize=self.normalize)


def with_schemas(sources, schemas):
    """The sources with the schemas given by name (or one for all) in place of their manifests'."""
    if schemas is None:
        return list(sources)
    names = [s.name for s in sources]
    given = {n: schemas for n in names} if not isinstance(schemas, dict) else dict(schemas)
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise ValueError(f"schemas for unknown source(s) {', '.join(unknown)}; sources are {', '.join(names)}")
    return [dataclasses.replace(s, schema=given[s.name]) if s.name in given else s for s in sources]
