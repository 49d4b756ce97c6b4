"""The public API of the data stream: what users' scripts and the trainer import.

    from pipeline.stream import MixedStream, make_loader, resolve

The stream itself lives in pipeline.data.streams.stream and knows no loader; the loader that
hands its batches over lives on top of it, in pipeline.data.handover.loader. This module is
where the two meet for the user."""
from pipeline.data.fields.schema import Column, Schema
from pipeline.data.handover.loader import make_loader
from pipeline.data.manifests.manifest import Source, resolve
from pipeline.data.streams.mix import RandomMix
from pipeline.data.streams.stream import MixedStream
from pipeline.data.streams.evaluation import EvalStream
from pipeline.ordering.weights import check_weights, parse_weights

__all__ = ["MixedStream", "EvalStream", "Source", "resolve", "make_loader", "parse_weights", "check_weights",
           "RandomMix", "Schema", "Column"]
