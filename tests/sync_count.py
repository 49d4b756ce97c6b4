"""Counts the calls in the trainer's step loop that make the host wait for the device: a
tensor read into Python (`.item()`, `.tolist()`, `bool()`, `float()`, `int()`, `.numpy()`,
`.cpu()`) and a collective of ours (torch.distributed's Python functions; DDP's own gradient
all-reduce runs in C++ and is not one of them). Each is recorded with the step it follows.
The loader's own work (pulling the next batch) is left out: it waits for workers, not for the
device. Installed in the process that trains (`install`), by tests/test_sync.py in-process and
by its torchrun script in each rank."""
import atexit
import functools
import json

import torch.distributed as dist
from torch.overrides import TorchFunctionMode

READS = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy", "cpu"}
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "gather_object", "broadcast", "broadcast_object_list",
               "barrier", "reduce", "gather", "scatter")


class Syncs(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.step, self.paused, self.seen = 0, 0, []

    def note(self, what):
        if not self.paused:
            self.seen.append((self.step, what))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in READS:
            self.note(func.__name__)
        return func(*args, **(kwargs or {}))


def install(record=None, patch=setattr):
    """Patch the trainer (with `patch`, e.g. pytest's monkeypatch.setattr) so that every epoch's
    step loop runs under the returned `Syncs`; `record(seen)`, if given, gets its list of
    (step, call) when the process ends."""
    from pipeline.train import loop, run as run_module

    syncs = Syncs()
    syncs.paused = 1  # outside train_epoch nothing is counted

    real_epoch, real_step = loop.train_epoch, run_module.Run.step_once

    def train_epoch(run, loader, *a, **kw):
        syncs.step = run.step
        syncs.paused -= 1
        try:
            with syncs:
                return real_epoch(run, pulled(loader), *a, **kw)
        finally:
            syncs.paused += 1

    def step_once(self, *a, **kw):
        out = real_step(self, *a, **kw)
        syncs.step = self.step
        return out

    def pulled(batches):
        it = iter(batches)
        while True:
            syncs.paused += 1
            try:
                batch = next(it)
            except StopIteration:
                return
            finally:
                syncs.paused -= 1
            yield batch

    def counted(name, fn):
        @functools.wraps(fn)
        def wrapper(*a, **kw):
            if not kw.get("async_op"):
                syncs.note(name)
            return fn(*a, **kw)
        return wrapper

    patch(loop, "train_epoch", train_epoch)
    patch(run_module.Run, "step_once", step_once)
    for name in COLLECTIVES:
        if hasattr(dist, name):
            patch(dist, name, counted(name, getattr(dist, name)))
    if record is not None:
        atexit.register(lambda: record(syncs.seen))
    return syncs


def write_to(path):
    def record(seen):
        with open(path, "w") as f:
            json.dump(seen, f)
    return record


if __name__ == "__main__":  # under torchrun: python tests/sync_count.py OUT_PREFIX TRAINER_ARGS...
    import os
    import sys

    prefix = sys.argv[1]
    install(write_to(f"{prefix}-rank{os.environ.get('RANK', '0')}.json"))
    from pipeline.train import loop as _loop

    sys.exit(_loop.main(sys.argv[2:]))
