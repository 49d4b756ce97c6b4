"""The streaming API users import: `from pipeline.stream import MixedStream, make_loader, resolve`.

It sits above the data path and the writers, because its `resolve` indexes a set that has no
manifest on first use (pipeline.writers.autoindex), which the data path itself never does
(pipeline.data.stream.resolve only reads manifests). Every other name of pipeline.data.stream is
reached through here as well, so older scripts that imported it from this module keep working.
"""
from pipeline.data import stream as _stream
from pipeline.data.stream import EvalStream, MixedStream, Source, make_loader  # noqa: F401  (the API)
from pipeline.writers.autoindex import resolve  # noqa: F401  (the API: indexes on first use)

__all__ = ["EvalStream", "MixedStream", "Source", "make_loader", "resolve"]


def __getattr__(name):
    return getattr(_stream, name)
