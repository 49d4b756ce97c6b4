"""Kept so that `from pipeline.stream import ...` works: the module is `pipeline.data.stream`."""
import sys

from pipeline.data import stream

sys.modules[__name__] = stream
