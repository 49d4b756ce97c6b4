"""Kept so that `from pipeline.topology import ...` works: the module is `pipeline.data.topology`."""
import sys

from pipeline.data import topology

sys.modules[__name__] = topology
