"""The test side's stream: `EvalStream` reads a source's test shards once, split over ranks and
workers, in the training stream's batch layout; and `in_process`, one pass of a stream in this
process, which is what iterating either stream does."""
import dataclasses

import numpy as np
import torch

from pipeline.data.store import remote
from pipeline.data.streams import stages
from pipeline.data.streams import reading
from pipeline.data.streams import plans
from pipeline.data.fields.batch import NOTHING, Layout
from pipeline.data.fields.schema import Schema
from pipeline.errors import Errors, ShardError
from pipeline.ordering.topology import Topology, Worker


def layout_of(sources):
    """The batch layout of the sources, whatever their schemas (batch.Layout: there is one)."""
    return Layout(sources)


def _error_mode(on_error, strict):
    """The Errors mode from `on_error` ("warn", "skip", "raise") or the older `strict` flag."""
    if strict and on_error not in (None, "raise"):
        raise ValueError(f"strict=True asks to raise on damage, on_error={on_error!r} not")
    return on_error or ("raise" if strict else "warn")


class EvalStream(torch.utils.data.IterableDataset):
    """Every test sample of one source exactly once across all ranks and workers.

    Shards are split by (rank, worker) without shuffling or repeating, so ranks may
    yield different numbers of batches: evaluate with the plain module (not the DDP
    wrapper, whose forward can sync) and all-reduce the counts afterwards.
    """

    def __init__(self, layout, source, batch_size, topo=None, *, strict=False, on_error=None,
                 cache_dir=None, policy=remote.Policy(), normalize=True):
        topo = Topology.from_env() if topo is None else topo
        self.layout, self.batch_size, self.topo = layout, batch_size, topo
        self.index = layout.index(source.name)
        train = layout.sources[self.index]
        if getattr(train, "schema", None) is not None or getattr(source, "schema", None) is not None:
            if source.schema is None:  # fields: the test manifest's, else the training's without its stages
                source = dataclasses.replace(source, schema=Schema(train.schema.columns))
            self.layout = layout_of([source if i == self.index else s for i, s in enumerate(layout.sources)])
        elif source.shape != train.shape:  # test images are decoded to the shape the model trains on
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
                             f"the test shards with the training split's classes (make-shards --index "
                             f"{source.name}:{source.split}=SHARDS --classes-from {train.manifest} --out DIR)")
        self.on_error = _error_mode(on_error, strict)
        self.cache_dir, self.policy, self.normalize = cache_dir, policy, normalize

    def __iter__(self):
        return in_process(self)

    def batch_spec(self):
        return self.layout.spec(self.batch_size, self.normalize)

    def batches(self, worker=None, borrow=None, plan=None):
        """This worker's share of the test batches, as a producer makes them (see
        MixedStream.batches; an evaluation pass has no plan)."""
        worker, borrow = worker or Worker.current(), borrow or self.batch_spec().lend_new
        errors = Errors(self.on_error)
        reader = reading.Reader(self.source, errors, policy=self.policy, cache_dir=self.cache_dir)
        stream = stages.SourceStream(plans.OncePlan(plans.split(self.source.urls, self.topo, worker)), reader,
                                     shuffle=False)
        stream.lay_out_jpegs(self.layout.channels_last)
        parts = [NOTHING] * len(self.layout.sources)
        reported = 0
        try:
            while True:
                keys, pixels, labels = stream.take(self.batch_size)
                if not keys and errors.skipped == reported:
                    return
                parts[self.index] = (keys, pixels, labels)
                handle, out = borrow(len(keys))
                batch = self.layout.collate(np.full(len(keys), self.index), parts, errors.skipped - reported, out)
                reported = errors.skipped
                if handle is not None:
                    batch["slot"] = handle
                yield batch
                if len(keys) < self.batch_size:
                    return
        finally:  # its fetch threads go with the pass (reading.Reader.close)
            reader.close()


def _preview(names, n=3):
    return ", ".join(names[:n]) + (", ..." if len(names) > n else "")


def in_process(stream):
    """One pass in this process with no ring: a stream iterated directly (`iter(stream)`), which
    is also what a DataLoader of the user's own runs in each of its workers. It lives with the
    stream, not the loader, so the stream needs no loader to be iterated."""
    plan = stream.plan() if hasattr(stream, "plan") else None
    names = stream.batch_spec().names
    for batch in stream.batches(None, None, plan):  # each batch in new memory, laid out as a slot
        for name in names:
            batch[name] = torch.from_numpy(batch[name])
        if "state" in batch:
            stream.arrive(batch["state"])  # a loader's pass begun on the stream since ends this one
        yield batch
