"""Process-group set-up and the "who am I" value passed into every stage.

Nothing below `train` reads RANK or WORLD_SIZE itself: the stream is handed a
`Topology`, so sharding logic can be tested in one process for any world size.
"""
import datetime
import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Topology:
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
        """Read torchrun's variables; a plain `python` run is rank 0 of 1."""
        env = os.environ
        return cls(int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0)))


def device_for(topo):
    """cuda:LOCAL_RANK when CUDA is there, else CPU. LOCAL_RANK, not the global rank:
    on the second node rank 8 still drives GPU 0..7 of its own machine."""
    if torch.cuda.is_available():
        torch.cuda.set_device(topo.local_rank)
        return torch.device("cuda", topo.local_rank)
    return torch.device("cpu")


@contextmanager
def distributed(timeout_s=600):
    """Initialise the process group from torchrun's environment, always tear it down.

    Yields (topology, device). A single process runs without a process group.
    `timeout_s` bounds how long a rank waits in a collective for the others.
    """
    topo = Topology.from_env()
    device = device_for(topo)
    if topo.world > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        store = restart_store(timeout)
        dist.init_process_group(backend, timeout=timeout,
                                **({"store": store, "rank": topo.rank, "world_size": topo.world} if store else {}),
                                **({"device_id": device} if device.type == "cuda" else {}))
    try:
        yield topo, device
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def restart_store(timeout):
    """A key space of its own for a restarted attempt on one node, else None (torch's default).

    torchrun keeps one TCPStore for the whole job, and the process group's keys
    carry no attempt number. After `--max-restarts` restarts the killed
    attempt's keys are still there, so a new rank can read a dead peer's
    address and fail in gloo/NCCL set-up ("Connection refused"). One agent
    gives all its workers the same TORCHELASTIC_RESTART_COUNT; across nodes the
    counts can differ, so there use `--rdzv-backend=c10d` with
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (a fresh store per round).
    """
    env = os.environ
    attempt = int(env.get("TORCHELASTIC_RESTART_COUNT", 0))
    if attempt == 0 or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or env.get("GROUP_WORLD_SIZE", "1") != "1":
        return None
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"pipeline/attempt-{attempt}", store)


def all_reduce_sum(tensor):
    """Sum a tensor over ranks in place (a no-op in a single process); returns it.

    NCCL reduces only CUDA tensors, so CPU bookkeeping tensors take a round trip.
    """
    if dist.is_initialized():
        if dist.get_backend() == "nccl" and tensor.device.type != "cuda":
            on_gpu = tensor.cuda()
            dist.all_reduce(on_gpu)
            tensor.copy_(on_gpu.cpu())
        else:
            dist.all_reduce(tensor)
    return tensor


def barrier():
    """Wait for every rank (a no-op in a single process)."""
    if dist.is_initialized():
        dist.barrier()


def sync_buffers(module, src=0):
    """Copy rank src's buffers (BatchNorm running stats) to every rank.

    DDP broadcasts buffers at the start of each forward, so after the last training
    step every rank holds slightly different running stats; evaluation and the
    checkpoint must use one set.
    """
    if dist.is_initialized():
        for b in module.buffers():
            dist.broadcast(b, src)
