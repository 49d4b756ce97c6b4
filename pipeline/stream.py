"""The public API of the data stream: what users' scripts and the trainer import.

    from pipeline.stream import MixedStream, make_loader, resolve

The stream itself lives in pipeline.data.streams.stream and knows no loader; the loader that
hands its batches over lives on top of it, in pipeline.data.handover.loader. This module is
where the two meet for the user, above the writers too: its `resolve` indexes a set that has no
manifest on first use (pipeline.writers.autoindex), which the data path itself never does
(pipeline.data.manifests.manifest.resolve only reads manifests). Any other name of
pipeline.data.streams.stream is reached through here as well, for scripts that took it from here
when this module stood for that one."""
from pipeline.data.fields.schema import Column, Schema
from pipeline.data.handover.loader import make_loader
from pipeline.data.manifests.manifest import Source
from pipeline.data.streams import stream as _stream
from pipeline.data.streams.evaluation import EvalStream
from pipeline.data.streams.mix import RandomMix
from pipeline.data.streams.stream import MixedStream
from pipeline.ordering.weights import check_weights, parse_weights
from pipeline.writers.autoindex import resolve

__all__ = ["MixedStream", "EvalStream", "Source", "resolve", "make_loader", "parse_weights", "check_weights",
           "RandomMix", "Schema", "Column"]


def __getattr__(name):
    return getattr(_stream, name)
