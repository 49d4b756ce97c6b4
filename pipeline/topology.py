"""The public API of who reads what: a rank's place among the ranks and workers.

    from pipeline.topology import Topology

It lives in pipeline.ordering.topology, with the rest of the order of samples."""
from pipeline.ordering.topology import Topology, Worker, own_items, stride

__all__ = ["Topology", "Worker", "own_items", "stride"]
