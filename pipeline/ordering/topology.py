"""Who am I: the rank, world size and loader worker, read in one place.

They are read the way webdataset reads them (`wds.utils.pytorch_worker_info`):
RANK and WORLD_SIZE from the environment when both are set, else from an
initialised torch.distributed; WORKER and NUM_WORKERS from the environment
when both are set, else from `torch.utils.data.get_worker_info()`. Stages are
handed a `Topology` and a `Worker` instead of reading either themselves, so
any world size and worker count can be tested in one process; nothing here rewrites
the environment.
"""
import os
from dataclasses import dataclass

import torch

import webdataset as wds


@dataclass(frozen=True)
class Topology:
    """This process's place among the ranks of a job."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    def __post_init__(self):
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} outside world size {self.world}")

    @property
    def is_main(self):
        return self.rank == 0

    @classmethod
    def from_env(cls):
        """torchrun's variables (or an initialised process group); a plain `python` run is rank 0 of 1."""
        env = os.environ
        local = int(env.get("LOCAL_RANK", 0))
        if "RANK" in env and "WORLD_SIZE" in env:
            return cls(int(env["RANK"]), int(env["WORLD_SIZE"]), local)
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size(), local)
        return cls(0, 1, local)


@dataclass(frozen=True)
class Worker:
    """This process's place among one rank's loader workers (0 of 1 in the main process)."""

    id: int = 0
    count: int = 1

    def __post_init__(self):
        if not 0 <= self.id < self.count:
            raise ValueError(f"worker {self.id} outside worker count {self.count}")

    @classmethod
    def current(cls):
        env = os.environ
        if "WORKER" in env and "NUM_WORKERS" in env:
            return cls(int(env["WORKER"]), int(env["NUM_WORKERS"]))
        info = torch.utils.data.get_worker_info()
        return cls(info.id, info.num_workers) if info else cls()


def stride(rank, world, worker=0, workers=0):
    """(first, step) of what `wds.split_by_node` then `wds.split_by_worker` give a (rank,
    worker) of a list: rank r takes every world-th item from r, its worker w every
    workers-th of those, i.e. items r + w * world, stepping world * workers. Written out
    for the places that need another pair's share (a re-deal, a simulation of a world);
    a pair finds its own with webdataset's functions (`own_items`)."""
    if not (world >= 1 and 0 <= rank < world and workers >= 0 and 0 <= worker < max(workers, 1)):
        raise ValueError(f"rank {rank} of {world}, worker {worker} of {workers}: out of range")
    return rank + worker * world, world * max(workers, 1)


def own_items(items, topo, worker):
    """This (rank, worker)'s items of a list. Where the process runs as `topo` and `worker`
    say (under torchrun, in a loader worker), `wds.split_by_node` and
    `wds.split_by_worker` deal them, reading the environment as webdataset does, and the
    written-out rule must agree; a simulated world (a test, a rehearsal) uses the rule."""
    first, step = stride(topo.rank, topo.world, worker.id, worker.count)
    ruled = list(items)[first::step]
    env = Topology.from_env()
    if (topo.rank, topo.world) == (env.rank, env.world) and worker == Worker.current():
        dealt = list(wds.split_by_worker(wds.split_by_node(list(items))))
        if dealt != ruled:
            raise RuntimeError(f"wds.split_by_node/split_by_worker gave rank {topo.rank} worker {worker.id} "
                               f"{len(dealt)} items, the stride rule {len(ruled)}: the environment disagrees "
                               f"with the topology the stream was given")
        return dealt
    return ruled
