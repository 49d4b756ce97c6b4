"""Process-group set-up and teardown, and the few collectives the trainer uses.

Nothing below `train` reads RANK or WORLD_SIZE itself: the stream is handed a
`Topology` (pipeline.ordering.topology), so sharding logic can be tested in one process
for any world size.
"""
import ctypes
import datetime
import os
import signal
import sys
from contextlib import contextmanager

import numpy as np
import torch
import torch.distributed as dist

from pipeline.data.handover.budget import local_world_size
from pipeline.ordering.topology import Topology  # noqa: F401  (re-exported: the trainer's "who am I")


def set_threads(environ=os.environ):
    """torch's threads for this process's share of the cores it may run on: the cores of its
    affinity mask over the ranks torchrun starts on the machine (LOCAL_WORLD_SIZE). torch's
    default is every core for every process, so N ranks on one machine ran N times as many
    threads as cores, spinning against each other (docs/benchmarks.md, "Threads per rank").
    OMP_NUM_THREADS, when set, is kept. Returns the thread count."""
    if not environ.get("OMP_NUM_THREADS"):
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // local_world_size(environ)))
    return torch.get_num_threads()


def busy_line(threads, workers, cores=None, load=None):
    """One line when this process's torch threads and its loader workers want more cores than
    the machine has free (its cores less the 1-minute load average), else None: on a loaded
    machine two ranks with two threads each ran 4x slower than with one (36.1 s against 8.7 s,
    docs/benchmarks.md "Threads per rank"), and nothing on screen said why."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if load is None:
        try:
            load = os.getloadavg()[0]
        except OSError:  # no load average on this system: nothing to compare
            return None
    free = max(0.0, cores - load)  # shown as compared, to a tenth: "1.6 of 2 free", not "2 of 2 free"
    if threads <= 1 or threads + workers <= free:
        return None
    loaders = f" and {workers} loader worker{'s' if workers != 1 else ''}" if workers else ""
    fewer = " (or fewer --workers)" if workers else ""  # with none, fewer is no advice
    return (f"{threads} torch threads{loaders} in this process, {free:.1f} of {cores} cores free "
            f"(load average {load:.1f}): threads that wait for busy cores run slower than one; set "
            f"OMP_NUM_THREADS=1{fewer} on a busy machine")


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
    global _VOTES
    topo = Topology.from_env()
    device = device_for(topo)
    if topo.world > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        store = restart_store(timeout)
        dist.init_process_group(backend, timeout=timeout,
                                **({"store": store, "rank": topo.rank, "world_size": topo.world} if store else {}),
                                **({"device_id": device} if device.type == "cuda" else {}))
        _VOTES = dist.new_group(backend="gloo")  # the stop votes' own group, on the CPU whatever the backend
    try:
        yield topo, device
    finally:
        _VOTES = None
        if dist.is_initialized():
            dist.destroy_process_group()


_VOTES = None


class Votes:
    """The ranks' stop votes, added up a step late on the CPU: each step casts its votes in an
    asynchronous all-reduce of a group of its own (gloo) and reads the sums of the step
    before, which finished while the step ran. Every rank casts once a step, so all of them
    learn the same sums after the same step, and a signal stops the run one step after it
    was noted, without the step waiting for the device or for the other ranks. In a single
    process the votes are this step's."""

    def __init__(self):
        self.pending = None

    def cast(self, votes):
        """This step's votes in; the sums of the previous step's out (None at the first)."""
        if _VOTES is None:
            return list(votes)
        summed = self.drain()
        sums = np.array(votes, dtype=np.float64)  # read back through numpy: no tensor read in the step
        self.pending = (dist.all_reduce(torch.from_numpy(sums), group=_VOTES, async_op=True), sums)
        return summed

    def drain(self):
        """The sums of the last cast (None if none is pending), once it is done."""
        if self.pending is None:
            return None
        work, sums = self.pending
        self.pending = None
        work.wait()
        return sums.tolist()


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


def all_gather(obj):
    """Every rank's `obj` (JSON-like), in rank order; [obj] in a single process."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def gather_to_main(obj):
    """Every rank's `obj` (picklable) in rank order on rank 0, None on the other ranks; [obj]
    in a single process. One collective for what only rank 0 needs (the checkpoint it writes).
    On nccl the objects travel through the current CUDA device, which device_for sets."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def exit_with_launcher():
    """Under torchrun, end this rank when its launcher dies, even by SIGKILL.

    torchrun puts every rank in a process group of its own, so killing the launcher's
    group leaves the ranks running to the end of the job, writing into --out with no
    one to collect them. Linux delivers SIGTERM to a process whose parent exits once
    PR_SET_PDEATHSIG is set; elsewhere this does nothing.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the launcher died before the call
        os.kill(os.getpid(), signal.SIGTERM)


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
