"""CUDA paths below the loader and the trainer, one GPU in this process: the trainer's bf16
autocast on the recipe's model, the per-source normalisation on the device against the CPU's,
and nccl on one rank (all_reduce, the CPU round trip, all_gather, a DDP step)."""
import math
import time

import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from gpucheck.data import BATCH, SHAPES, train_sources
from gpucheck.runner import Failed
from pipeline.data.streams.stream import MixedStream
from pipeline.train import dist
from pipeline.train.model import Net
from pipeline.train.run import autocast

TOLERANCE = 1e-5


def autocast_check(steps=30):
    """The trainer's bf16 autocast (pipeline.train.autocast) on the GPU recipe's model, loss
    computed the trainer's way. A few SGD steps on one fixed batch must lower the loss (a
    broken backward would not), and time a model-only samples/s to set beside the loader's."""
    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    model = Net(20, 64).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = torch.randn(BATCH, 3, 32, 32, device=dev), torch.randint(0, 20, (BATCH,), device=dev)

    def step():
        with autocast(dev):
            logits = model(x)
            loss = F.cross_entropy(logits.float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return logits.dtype, loss

    dtype, first = step()  # also the warm-up: cuDNN picks its kernels
    first = first.item()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        _, last = step()
    torch.cuda.synchronize()
    rate = steps * BATCH / (time.perf_counter() - t)
    grads = torch.stack([torch.isfinite(p.grad).all() for p in model.parameters()]).all().item()
    figures = {"loss_first": first, "loss_last": last.item(), "logits_dtype": str(dtype), "grads_finite": grads,
               "model_samples_per_s": round(rate, 1), "peak_memory_mib": torch.cuda.max_memory_allocated(dev) >> 20,
               "summary": f"loss {first:.3f} -> {last.item():.3f}, logits {str(dtype)[6:]}, "
                          f"model alone {rate:,.0f} samples/s (width 64, batch {BATCH})"}
    problems = [text for bad, text in ((not (math.isfinite(first) and math.isfinite(last.item())), "loss not finite"),
                                       (not grads, "gradients not finite"),
                                       (dtype != torch.bfloat16, f"logits {dtype}, not bf16"),
                                       (not last.item() < first, "the loss did not fall on a fixed batch")) if bad]
    if problems:
        raise Failed("; ".join(problems), figures)
    return figures


def normalize_check(folder):
    """The GPU branch of Layout.normalize (per-source stats copied to the device once, indexed
    by a device tensor) against its numpy branch, on a real stream batch pinned and copied
    the way the trainer copies its batches; twice, so the cached device stats are used too."""
    dev = torch.device("cuda", 0)
    ms = MixedStream(train_sources(folder), dict.fromkeys(SHAPES, 1.0), BATCH, epoch_samples=BATCH, normalize=False)
    batch = next(iter(ms))
    image, source = batch["image"].pin_memory(), batch["source"].pin_memory()
    on_cpu = ms.layout.normalize(batch["image"], batch["source"])
    diffs = []
    for _ in range(2):
        on_gpu = ms.layout.normalize(image.to(dev, non_blocking=True), source.to(dev, non_blocking=True))
        diffs.append((on_gpu.cpu() - on_cpu).abs().max().item())
    pinned_out = ms.layout.normalize(image, source).is_pinned()
    figures = {"max_abs_diff": max(diffs), "sources_in_batch": sorted(set(source.tolist())),
               "cpu_output_pinned": pinned_out,
               "summary": f"max |GPU - CPU| {max(diffs):.2e} over {BATCH} samples (tolerance {TOLERANCE:g})"}
    if not max(diffs) <= TOLERANCE:
        raise Failed(f"GPU and CPU normalisation differ by up to {max(diffs):.2e}", figures)
    if not pinned_out:
        raise Failed("the CPU normalisation of a pinned batch is not pinned", figures)
    return figures


def nccl_check():
    """nccl on one GPU in this process: all_reduce, pipeline.train.dist's round trip of CPU tensors
    through the GPU (nccl reduces only CUDA tensors), all_gather_object, a buffer broadcast and
    a DDP step. A one-GPU trainer run uses none of them."""
    dev = torch.device("cuda", 0)
    tdist.init_process_group("nccl", store=tdist.HashStore(), rank=0, world_size=1, device_id=dev)
    try:
        on_gpu = torch.arange(4.0, device=dev)
        tdist.all_reduce(on_gpu)
        on_cpu = dist.all_reduce_sum(torch.ones(3, dtype=torch.float64))
        gathered = dist.all_gather({"rank": 0})
        model = DDP(Net(20, 16).to(dev), device_ids=[0])
        with autocast(dev):
            loss = F.cross_entropy(model(torch.randn(8, 3, 32, 32, device=dev)).float(),
                                   torch.zeros(8, dtype=torch.int64, device=dev))
        loss.backward()
        dist.sync_buffers(model.module)
        torch.cuda.synchronize()
    finally:
        tdist.destroy_process_group()
    ok = on_gpu.tolist() == [0, 1, 2, 3] and on_cpu.tolist() == [1, 1, 1] and gathered == [{"rank": 0}]
    figures = {"collectives_ok": ok, "ddp_loss": loss.item(),
               "summary": f"1-rank nccl: all_reduce, CPU round trip, all_gather, DDP step (loss {loss.item():.3f})"}
    if not ok or not math.isfinite(loss.item()):
        raise Failed("a collective returned the wrong value or the DDP loss is not finite", figures)
    return figures
