"""Batches onto the GPU one step ahead, so the copy of batch n+1 overlaps step n.

The loader hands over pinned uint8 batches (a quarter of float32's bytes); here their tensors
are copied with non_blocking=True on a side CUDA stream as soon as the previous batch is
handed out, and the main stream waits for that copy only when the batch is used. On a CPU
(or with nothing to overlap) the batches pass through unchanged and the trainer's own
`.to(device)` is a no-op move.
"""
import torch

MOVED = ("image", "label", "source")


def ahead(batches, device):
    """Yield each batch with `batch["on_device"]` = its MOVED tensors on `device`, copied one
    batch ahead; the CPU tensors stay where they are (counts and keys are read there)."""
    if device.type != "cuda":
        yield from batches
        return
    side = torch.cuda.Stream(device)
    it = iter(batches)
    pending = _send(next(it, None), device, side)
    while pending is not None:
        torch.cuda.current_stream(device).wait_stream(side)
        for t in pending["on_device"]:
            t.record_stream(torch.cuda.current_stream(device))  # the side stream's allocator must not reuse it early
        upcoming = _send(next(it, None), device, side)
        yield pending
        pending = upcoming


def _send(batch, device, side):
    if batch is None:
        return None
    with torch.cuda.stream(side):
        batch["on_device"] = tuple(batch[k].to(device, non_blocking=True) for k in MOVED)
    return batch


def on_device(batch, device):
    """(image, label, source) on `device`: the copies `ahead` made, or made now."""
    if "on_device" in batch:
        return batch["on_device"]
    return tuple(batch[k].to(device, non_blocking=True) for k in MOVED)
