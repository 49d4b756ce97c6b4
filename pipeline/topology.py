"""Kept so that `from pipeline.topology import ...` works: the module is `pipeline.ordering.topology`."""
import sys

from pipeline.ordering import topology

sys.modules[__name__] = topology
