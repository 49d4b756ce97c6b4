"""One-command GPU check: run the real trainer on every visible GPU, then check one by one
the CUDA paths it relies on, and print figures ready to paste into docs/benchmarks.md.

    python tools/gpu_check.py                     # synthetic shards, all visible GPUs
    python tools/gpu_check.py --shards shards/ --nproc 2 --json bench-out/gpu-check.json

Steps, each timed and reported; a failed step does not stop the ones that do not need it:
  shards     synthetic MNIST/CIFAR10 look-alikes written by pipeline.writers.shards (or --shards DIR),
             and a JPEG WebDataset of the same shapes, indexed in place, for the scaling step
  train      pipeline.train under torchrun --standalone (nccl when more than one rank), 8 workers,
             batch 256, width 64: samples/s after the first metrics line, data-wait share, time to
             the first batch, test accuracy, from summary.json and metrics.jsonl
  model      the trainer's own step (pipeline.train.run.Run.step_once: bf16 autocast, the fused SGD
             step, augmentation) on one batch already on the GPU: the model-alone samples/s the
             trainer is held against (target: the trainer at >= 90% of it, data wait < 3%,
             first batch < 2 s)
  no sync    one rank of the trainer in this process under torch.cuda.set_sync_debug_mode: every
             call that makes the host wait for the GPU is recorded with its step; it passes
             if they come only at metrics lines and the epoch's end
  scaling    the stream alone at 0, 4, 8 and cores-2 workers, raw and JPEG shards, float (C) and
             uint8 (C8) batches, pinned: samples/s over a timed window after the first batches
             (worker start-up timed apart), busy cores, the consuming process's CPU a sample
  normalize  Layout.normalize of a pinned uint8 batch copied with non_blocking=True equals
             the CPU normalisation
  loader     make_loader with pinned memory, batches copied one ahead, a model step each, with
             0, 2 and 4 workers: every batch pinned; samples/s and share of time waited for data
  nccl       a one-rank nccl process group in this process: all_reduce, pipeline.train.dist's CPU
             round trip, a DDP step (a one-GPU trainer run makes no process group and no DDP)

Speed targets are reported as met or missed; a step fails on wrong results, not on speed.
The whole check keeps within --budget seconds (a step past its share is stopped and fails).
Exit codes: 0 all passed (or no CUDA device: it says so and checks nothing), 1 a step failed,
2 bad command line.
"""
import argparse
import faulthandler
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from contextlib import contextmanager, nullcontext

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from pipeline.cli import Parser  # noqa: E402

SHAPES = {"mnist": (1, 28, 28), "cifar10": (3, 32, 32)}
TRAIN_N, TEST_N = 20000, 2000
TRAIN_FLAGS = ["--epochs", "1", "--epoch-samples", "600000", "--batch-size", "256", "--workers", "8", "--width", "64",
               "--log-every", "50"]
BATCH = 256
TOLERANCE = 1e-5
AFTER_TRAIN_S = 300  # kept back from the trainer for the in-process checks after it
TARGETS = {"trainer_share": 0.9, "data_wait": 0.03, "first_batch_s": 2.0, ("raw", "C8"): 1_000_000,
           ("raw", "C"): 600_000, ("jpg", "C8"): 150_000}


def parse(argv=None):
    """The command line, checked with nothing but the standard library: the `__main__` block
    parses it before torch loads, so --help and a bad flag answer at once."""
    p = Parser(prog="gpu_check", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shards", metavar="DIR", help="real shards: a folder holding mnist-train.json, "
                   "cifar10-train.json, mnist-test.json, cifar10-test.json (default: build synthetic ones)")
    p.add_argument("--nproc", type=int, metavar="N", help="trainer ranks, one GPU each (default: every visible GPU)")
    p.add_argument("--json", default="bench-out/gpu-check.json", metavar="PATH",
                   help="where the report goes as JSON (default: bench-out/gpu-check.json)")
    p.add_argument("--work", metavar="DIR", help="keep shards, run folder and trainer log here "
                                                 "(default: a temporary folder, removed at the end)")
    p.add_argument("--budget", type=int, default=540, metavar="S",
                   help="seconds for the whole check: a step that overruns its share is stopped and fails, "
                        f"the trainer may use all but {AFTER_TRAIN_S + 30} s of what is left (default: 540)")
    args = p.parse_args(argv)
    if args.shards:
        missing = [f"{n}-{s}.json" for n in SHAPES for s in ("train", "test")
                   if not os.path.exists(os.path.join(args.shards, f"{n}-{s}.json"))]
        if missing:
            p.error(f"--shards {args.shards}: no {', '.join(missing)}")
    if args.nproc is not None and args.nproc < 1:
        p.error(f"--nproc must be at least 1, got {args.nproc}")
    if args.budget < AFTER_TRAIN_S + 120:
        p.error(f"--budget must be at least {AFTER_TRAIN_S + 120}, got {args.budget}")
    return args, p


if __name__ == "__main__":
    parse()

import torch  # noqa: E402
import torch.distributed as tdist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from pipeline.train import dist  # noqa: E402
from pipeline.writers import shards  # noqa: E402
from pipeline.files import read_json, write_json_atomic  # noqa: E402
from pipeline.train.prefetch import ahead, on_device  # noqa: E402
from pipeline.train.model import Net  # noqa: E402
from pipeline.writers.sources import SyntheticSource  # noqa: E402
from pipeline.data.stream import MixedStream, make_loader, resolve  # noqa: E402
from pipeline.train.run import autocast  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "tools"))
from bench.cpu import tree_cpu  # noqa: E402  (the process tree's CPU, as bench_loader counts it)


class Failed(Exception):
    """A step that ran but whose figures are wrong; the figures still go in the report."""

    def __init__(self, message, figures=None):
        super().__init__(message)
        self.figures = figures or {}


def cuda_device_count():
    """Visible CUDA devices, 0 without a driver (a CUDA build of torch warns then: kept quiet,
    the caller says it in one line)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.cuda.device_count() if torch.cuda.is_available() else 0


def machine(nproc):
    props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    nccl = torch.cuda.nccl.version() if hasattr(torch.cuda, "nccl") else None
    return {"gpus": [f"{p.name} ({p.total_memory / 2**30:.0f} GiB)" for p in props], "nproc": nproc,
            "cpu_cores": os.cpu_count(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(), "nccl": ".".join(map(str, nccl)) if nccl else None}


# ---------------------------------------------------------------- 1. shards


def build_synthetic(folder, train_n=TRAIN_N, test_n=TEST_N):
    """Look-alikes in the real shapes, written by the project's own writer, so that the
    check needs no data set on the GPU machine."""
    workers = min(8, os.cpu_count() or 1)
    for name, shape in SHAPES.items():
        for split, n in (("train", train_n), ("test", test_n)):
            shards.build(SyntheticSource(name, split, n, shape), folder, encoding="raw", maxcount=500,
                         workers=workers, progress=False)


def build_jpeg(folder, n=TRAIN_N, per_shard=500):
    """The same shapes as JPEG files (quality 90) in tar shards another tool could have written
    (one .jpg and one .cls member a sample), indexed in place: the decode-bound case."""
    import io
    import tarfile

    import numpy as np
    from PIL import Image

    from pipeline.writers import index

    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    for name, (c, h, w) in SHAPES.items():
        count = -(-n // per_shard)
        for k in range(count):
            with tarfile.open(os.path.join(folder, f"{name}-train-{k:06d}.tar"), "w", format=tarfile.USTAR_FORMAT) as tar:
                for i in range(k * per_shard, min(n, (k + 1) * per_shard)):
                    pixels = rng.integers(0, 256, (h, w, 3) if c == 3 else (h, w), dtype=np.uint8)
                    buf = io.BytesIO()
                    Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
                    for ext, data in (("jpg", buf.getvalue()), ("cls", str(i % 10).encode())):
                        info = tarfile.TarInfo(f"{name}{i:07d}.{ext}")
                        info.size, info.mtime, info.mode = len(data), 0, 0o644
                        tar.addfile(info, io.BytesIO(data))
        index.index(name, "train", os.path.join(folder, f"{name}-train-{{000000..{count - 1:06d}}}.tar"), folder,
                    shape=(c, h, w), workers=min(8, os.cpu_count() or 1), progress=False)


def describe_shards(folder):
    """Resolve every split the trainer will read, so a missing or damaged manifest fails
    here in one line rather than inside torchrun."""
    found = {f"{n}-{s}": resolve(n, folder, s) for n in SHAPES for s in ("train", "test")}
    synthetic = all(src.synthetic for src in found.values())
    count = sum(len(src.urls) for src in found.values())
    samples = {k: src.total for k, src in found.items()}
    return {"folder": folder, "synthetic": synthetic, "shards": count, "samples": samples,
            "summary": f"{'synthetic' if synthetic else 'real'} data, {count} shards: "
                       + ", ".join(f"{k} {v}" for k, v in samples.items())}


def train_sources(folder):
    return [resolve(n, folder, "train") for n in SHAPES]


# ---------------------------------------------------------------- 2. the trainer under torchrun


def trainer_command(folder, out, nproc, flags=TRAIN_FLAGS):
    spec = folder.rstrip("/") + "/"
    sources = [x for kind in ("--train", "--eval") for n in SHAPES for x in (kind, f"{n}={spec}")]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", "pipeline.train", *sources, *flags, "--out", out, "--overwrite"]


def run_trainer(cmd, log_path, timeout):
    """Run the job with its output in a log; returns its exit code. Stopped on timeout or
    on any error here: torchrun ends its ranks on SIGTERM, and the ranks end with it."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
               PYTHONUNBUFFERED="1")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise Failed(f"trainer still running after {timeout} s, stopped; last lines of {log_path}:\n"
                         + tail(log_path)) from None
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def log_lines(path):
    """A log's lines, tqdm's carriage-return updates counted as lines."""
    with open(path, errors="replace") as f:
        return [ln for ln in f.read().replace("\r", "\n").splitlines() if ln.strip()]


def tail(path, n=12):
    return "\n".join("    " + ln for ln in log_lines(path)[-n:])


def cause(path):
    """What a failed rank said: the trainer's one-line error, else the last exception line
    that is not torchrun's own (its report of a failed child buries the rank's words above it)."""
    lines = log_lines(path)
    own = [ln for ln in lines if ln.startswith("pipeline-train: error:")]
    raised = [ln for ln in lines if re.match(r"[\w.]*(Error|Exception)\b", ln) and "ChildFailedError" not in ln]
    return (own or raised or ["see the log"])[-1]


def read_run(out, nproc, test_counts):
    """Figures of a finished run from the files the trainer writes for people; fails if it
    ran off CUDA, on another world size, stopped early, or counted a test sample twice or never."""
    summary = read_json(os.path.join(out, "summary.json"))
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rates = [r["samples_per_s"] for r in map(json.loads, filter(str.strip, f)) if r.get("kind") == "train"]
    rate = statistics.median(rates[1:] or rates) if rates else float("nan")  # the first line holds the warm-up
    world, acc = summary["world_size"], summary["accuracy"]
    synthetic = all(d.get("synthetic") for d in summary["data"].values())
    first = summary.get("startup", {}).get("first_batch_s")
    figures = {"synthetic": synthetic, "samples_per_s": rate, "samples_per_s_per_gpu": round(rate / world, 1),
               "data_wait_share": summary["data_wait_share"], "first_batch_s": first, "startup": summary.get("startup"),
               "accuracy": acc, "wall_time_s": summary["wall_time_s"],
               "world_size": world, "device": summary["device"], "global_batch": summary["global_batch"],
               "epochs": len(summary["epochs"]), "steps": summary["steps_done"],
               "summary": f"{'synthetic' if synthetic else 'real'} data, {world} rank(s): {rate:,.0f} samples/s, "
                          f"data wait {summary['data_wait_share']:.1%} (target < {TARGETS['data_wait']:.0%}), first "
                          f"batch {first} s (target < {TARGETS['first_batch_s']:g} s), test accuracy "
                          + ", ".join(f"{k} {v:.4f}" for k, v in acc.items())
                          + (" (1 rank: no nccl, no DDP)" if world == 1 else f" (nccl and DDP over {world} ranks)")}
    problems = [] if summary["device"].startswith("cuda") else [f"ran on {summary['device']}, not CUDA"]
    if world != nproc:
        problems.append(f"world size {world}, expected {nproc}")
    if not summary["finished"]:
        problems.append("the run did not finish")
    counts = {k: v["count"] for k, v in summary["eval"].items()}
    if counts != test_counts:
        problems.append(f"evaluated {counts} test samples, the manifests hold {test_counts}")
    if not all(math.isfinite(v) and 0 <= v <= 1 for v in acc.values()) or not math.isfinite(rate):
        problems.append("an accuracy or samples/s is not a number")
    if problems:
        raise Failed("; ".join(problems), figures)
    return figures


def trainer_args(folder, out, extra=()):
    spec = folder.rstrip("/") + "/"
    return [*(x for n in SHAPES for x in ("--train", f"{n}={spec}")), *TRAIN_FLAGS, "--out", out, "--overwrite",
            *extra]


def train(folder, work, nproc, timeout):
    out, log = os.path.join(work, "run"), os.path.join(work, "train.log")
    print(f"   torchrun, {nproc} rank(s), up to {timeout} s; log: {log}", flush=True)
    rc = run_trainer(trainer_command(folder, out, nproc), log, timeout)
    if rc != 0:
        raise Failed(f"trainer exited with {rc}: {cause(log)}; last lines of {log}:\n{tail(log)}")
    return read_run(out, nproc, {n: resolve(n, folder, "test").total for n in SHAPES})


# ---------------------------------------------------------------- 3. in-process CUDA checks


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


def model_check(folder, work, trained, steps=300):
    """The trainer's own step (Run.step_once: normalise and augment on the GPU, bf16 autocast, the
    fused SGD step that skips on the device) on one batch already there, with the trainer's
    flags: the samples/s the trainer is held against. `trained`: the train step's figures."""
    from pipeline.data import remote
    from pipeline.ordering.topology import Topology
    from pipeline.train import options
    from pipeline.train.run import Run

    dev = torch.device("cuda", 0)
    args = options.parse(trainer_args(folder, os.path.join(work, "model-run")))
    run = Run(args, Topology(), dev, train_sources(folder), [], policy=remote.Policy(), started=time.perf_counter(),
              startup={})
    batch = next(iter(make_loader(run.stream, 0, pin_memory=True)))
    batch["on_device"] = tuple(batch[k].to(dev) for k in ("image", "label", "source"))
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):  # warm-up: cuDNN picks its kernels
        run.step_once(batch, gen)
    torch.cuda.synchronize(dev)
    t = time.perf_counter()
    for _ in range(steps):
        losses, _, found = run.step_once(batch, gen)
    torch.cuda.synchronize(dev)
    rate = steps * args.batch_size / (time.perf_counter() - t)
    share = trained.get("samples_per_s", float("nan")) / rate if trained else float("nan")
    figures = {"model_samples_per_s": round(rate, 1), "trainer_share": round(share, 3),
               "summary": f"the trainer's step alone {rate:,.0f} samples/s (batch {args.batch_size}, width "
                          f"{args.width}, bf16); the trainer reached {share:.0%} of it (target >= "
                          f"{TARGETS['trainer_share']:.0%})"}
    if not torch.isfinite(losses).all() or found.item():
        raise Failed("the step's loss or gradients are not finite", figures)
    return figures


def nosync_check(folder, work, steps=60, log_every=20):
    """One rank of the trainer in this process with torch.cuda.set_sync_debug_mode("warn") on
    inside its epochs: every synchronising CUDA call warns, and is recorded with the step it
    follows (the loader's own work left out). Passes if they all come at metrics lines (every
    --log-every steps) or the epoch's last step."""
    import warnings as w

    from pipeline.train import loop, prefetch, run as run_module

    at = {"step": 0, "on": False}
    seen = []
    real = (loop.train_epoch, run_module.Run.step_once, prefetch.ahead, w.showwarning)

    def show(message, category, *a, **kw):
        if at["on"] and "synchroniz" in str(message):
            seen.append(at["step"])
        else:
            real[3](message, category, *a, **kw)

    def train_epoch(run, *a, **kw):
        at["step"], at["on"] = run.step, True
        torch.cuda.set_sync_debug_mode("warn")
        try:
            return real[0](run, *a, **kw)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            at["on"] = False

    def step_once(self, *a, **kw):
        out = real[1](self, *a, **kw)
        at["step"] = self.step
        return out

    def ahead(batches, device):
        it = real[2](batches, device)
        while True:
            at["on"] = False
            try:
                batch = next(it)
            except StopIteration:
                return
            finally:
                at["on"] = True
            yield batch

    loop.train_epoch, run_module.Run.step_once, prefetch.ahead, w.showwarning = train_epoch, step_once, ahead, show
    try:
        with w.catch_warnings():
            w.simplefilter("always")
            w.showwarning = show
            code = loop.main(trainer_args(folder, os.path.join(work, "nosync"), [
                "--epoch-samples", str(BATCH * steps), "--workers", "2", "--log-every", str(log_every),
                "--stop-signals", ""]))
    finally:
        loop.train_epoch, run_module.Run.step_once, prefetch.ahead, w.showwarning = real
    allowed = set(range(log_every, steps + 1, log_every)) | {steps}
    stray = sorted({s for s in seen if s not in allowed})
    figures = {"syncs": len(seen), "steps_with_syncs": sorted(set(seen)), "stray_steps": stray,
               "summary": f"{len(seen)} synchronising calls in {steps} steps, at steps {sorted(set(seen))} "
                          f"(allowed: every {log_every} and the last)"}
    if code != 0:
        raise Failed(f"the trainer exited with {code}", figures)
    if stray:
        raise Failed(f"synchronising calls between metrics lines, at steps {stray}", figures)
    return figures


def stream_rate(folder, workers, normalize, seconds):
    """The stream alone through make_loader with pinned memory: the first batch's time (worker
    start-up), then samples/s, busy cores and the consuming process's own CPU a sample over a
    timed window that starts once the workers are warm (a quarter of `seconds` later)."""
    ms = MixedStream(train_sources(folder), dict.fromkeys(SHAPES, 1.0), BATCH, epoch_samples=BATCH * 2000,
                     shuffle_buffer=2000, normalize=normalize)
    loader = make_loader(ms, workers, pin_memory=True)
    pinned = torch.cuda.is_available()  # (the steps that need no GPU run on a CPU in tests/test_gpu_check.py)
    epoch = [0]

    def batches():
        while True:
            ms.set_epoch(epoch[0])
            yield from loader
            epoch[0] += 1

    it = batches()
    t0 = time.perf_counter()
    next(it)
    first = time.perf_counter() - t0
    while time.perf_counter() - t0 < first + seconds / 4:
        next(it)
    (m0, r0), c0, t1, n, unpinned = tree_cpu(), time.process_time(), time.perf_counter(), 0, 0
    while time.perf_counter() - t1 < seconds * 3 / 4:
        b = next(it)
        n += len(b["key"])
        unpinned += pinned and not b["image"].is_pinned()
    wall, (m1, r1), consumer = time.perf_counter() - t1, tree_cpu(), time.process_time() - c0
    it.close()
    loader.close()
    return {"workers": workers, "first_batch_s": round(first, 3), "samples": n, "samples_per_s": round(n / wall, 1),
            "busy_cores": round(((m1 - m0) + (r1 - r0)) / wall, 2),
            "consumer_us_per_sample": round(consumer / max(n, 1) * 1e6, 3), "unpinned": unpinned,
            "startup_share": round(first / (first + seconds), 3)}


def scaling_check(folders, seconds):
    """stream_rate for every encoding, worker count (0, 4, 8, cores-2) and batch kind (C: float32,
    C8: uint8), within `seconds` in all; the targets of the 16-core, one-GPU machine reported."""
    counts = sorted({0, 4, 8, max(1, (os.cpu_count() or 2) - 2)})
    configs = [(enc, w, m) for enc in folders for w in counts for m in ("C", "C8")]
    per = max(2.0, seconds / len(configs) - 1.5)
    rows = []
    for enc, w, method in configs:
        r = stream_rate(folders[enc], w, method == "C", per)
        rows.append(dict(r, encoding=enc, method=method))
        print(f"   {enc:<4} {method:<3} {w:>2} workers: {r['samples_per_s']:>12,.0f} samples/s, {r['busy_cores']:5.2f} "
              f"cores, consumer {r['consumer_us_per_sample']:.3f} us/sample, first batch {r['first_batch_s']} s",
              flush=True)
    top = max(counts)
    met = {f"{enc}/{m} at {top} workers >= {t:,}": next(r["samples_per_s"] for r in rows if r["encoding"] == enc
                                                          and r["method"] == m and r["workers"] == top) >= t
           for (enc, m), t in ((k, v) for k, v in TARGETS.items() if isinstance(k, tuple) and k[0] in folders)}
    figures = {"runs": rows, "targets": met,
               "summary": "; ".join(f"{r['encoding']}/{r['method']} {r['workers']}w {r['samples_per_s']:,.0f}/s"
                                    for r in rows if r["workers"] in (0, top))
                          + "; targets " + ", ".join(f"{k}: {'met' if v else 'missed'}" for k, v in met.items())}
    bad = [f"{r['encoding']}/{r['method']} {r['workers']} workers: {r['unpinned']} batches not pinned"
           for r in rows if r["unpinned"]]
    if bad:
        raise Failed("; ".join(bad), figures)
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


def loader_check(folder, batches=200, workers=(0, 2, 4)):
    """The trainer's data path to one GPU for each worker count: uint8 pinned batches, copied
    one batch ahead on a side stream (pipeline.train.prefetch.ahead), normalised there, then a
    forward and backward pass of the recipe's model so that the copy has a step to overlap.
    Figures: samples/s and the share of the loop's time spent waiting for the loader. The
    first batch (workers starting) is not timed."""
    dev = torch.device("cuda", 0)
    runs, problems, model = [], [], None
    for w in workers:
        ms = MixedStream(train_sources(folder), dict.fromkeys(SHAPES, 1.0), BATCH,
                         epoch_samples=(batches + 1) * BATCH, shuffle_buffer=2000, normalize=False)
        model = model or Net(ms.layout.num_classes, 64).to(dev)
        loader = make_loader(ms, w, pin_memory=True)
        ms.set_epoch(0)
        it = ahead(loader, dev)
        next(it)
        wait, got, unpinned, finite = 0.0, 0, 0, True
        torch.cuda.synchronize(dev)
        start = time.perf_counter()
        while True:
            t = time.perf_counter()
            batch = next(it, None)
            wait += time.perf_counter() - t
            if batch is None:
                break
            unpinned += not batch["image"].is_pinned()
            x, y, s = on_device(batch, dev)
            with autocast(dev):
                loss = torch.nn.functional.cross_entropy(model(ms.layout.normalize(x, s)).float(), y)
            loss.backward()
            finite &= bool(torch.isfinite(loss))  # waits for the GPU: copy, normalisation and step are timed
            got += 1
        elapsed = time.perf_counter() - start
        del it, loader  # ends the persistent workers
        rate = got * BATCH / elapsed
        runs.append({"workers": w, "batches": got, "samples_per_s": round(rate, 1),
                     "wait_share": round(wait / elapsed, 4), "unpinned_batches": unpinned})
        if got != batches or unpinned or not finite:
            problems.append(f"workers {w}: {got} of {batches} batches, {unpinned} not pinned, finite {finite}")
    figures = {"runs": runs, "summary": "; ".join(f"{r['workers']} workers {r['samples_per_s']:,.0f} samples/s, "
                                                  f"waited {r['wait_share']:.1%}" for r in runs)}
    if problems:
        raise Failed("; ".join(problems), figures)
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


# ---------------------------------------------------------------- running and reporting


@contextmanager
def time_limit(seconds):
    """Raise TimeoutError in a step that hangs in Python (e.g. waiting on a worker); a hang
    inside a CUDA or NCCL call cannot be interrupted, so the process ends 30 s later."""
    def expired(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    faulthandler.dump_traceback_later(seconds + 30, exit=True)
    try:
        yield
    finally:
        signal.alarm(0)
        faulthandler.cancel_dump_traceback_later()
        signal.signal(signal.SIGALRM, old)


def run_step(report, name, fn, limit):
    """Run one step, record and print PASS/FAIL with its figures; never raises an Exception."""
    print(f"-- {name}", flush=True)
    t = time.perf_counter()
    try:
        with time_limit(limit):
            figures, error = fn(), None
    except Exception as e:  # reported; the next steps still run
        figures, error = getattr(e, "figures", {}), str(e) if isinstance(e, Failed) else f"{type(e).__name__}: {e}"
        if not isinstance(e, Failed):
            traceback.print_exc()
    seconds = round(time.perf_counter() - t, 1)
    report["steps"][name] = dict(figures, ok=error is None, seconds=seconds, **({"error": error} if error else {}))
    text = "; ".join(filter(None, [figures.get("summary"), error]))
    print(f"{'PASS' if error is None else 'FAIL'} {name} ({seconds} s): {text}", flush=True)


def run_all(args, nproc, work):
    """Every step in order within --budget; a step that needs shards is skipped without them."""
    deadline = time.monotonic() + args.budget
    folder = os.path.abspath(args.shards) if args.shards else os.path.join(work, "shards")
    report = {"machine": machine(nproc), "budget_s": args.budget, "steps": {}}

    def left():
        return int(deadline - time.monotonic())

    jpeg = os.path.join(work, "shards-jpg")

    def shards_step():
        if not args.shards:
            build_synthetic(folder)
        build_jpeg(jpeg)
        return describe_shards(folder)

    train_name = f"train ({nproc} rank{'s' if nproc > 1 else ''})"
    # the trainer's limit (None): what is left but AFTER_TRAIN_S; its timeout 30 s less, to stop torchrun in
    plan = [("shards", shards_step, 150, False),
            (train_name, lambda: train(folder, work, nproc, left() - AFTER_TRAIN_S - 30), None, True),
            ("model alone", lambda: model_check(folder, work, report["steps"][train_name]), 45, True),
            ("no sync in steps", lambda: nosync_check(folder, work), 60, True),
            ("scaling", lambda: scaling_check({"raw": folder, "jpg": jpeg}, min(120, left() - 70)), 140, True),
            ("autocast bf16", autocast_check, 30, False),
            ("normalize on GPU", lambda: normalize_check(folder), 20, True),
            ("loader to GPU", lambda: loader_check(folder), 40, True),
            ("nccl 1 rank", nccl_check, 30, False)]
    for name, fn, limit, needs_shards in plan:
        share = left() - AFTER_TRAIN_S if limit is None else min(limit, left())
        why = ("no shards" if needs_shards and not report["steps"]["shards"]["ok"] else
               "out of time (--budget)" if share < (60 if limit is None else 10) else None)
        if why:
            report["steps"][name] = {"ok": False, "seconds": 0.0, "error": f"skipped: {why}"}
            print(f"FAIL {name}: skipped, {why}", flush=True)
        else:
            run_step(report, name, fn, share)
    report["passed"] = all(s["ok"] for s in report["steps"].values())
    return report


def summary_lines(report):
    """The report as a machine line and a Markdown table, to paste into docs/benchmarks.md."""
    m, first = report["machine"], report["steps"].get("shards", {})
    gpus = m["gpus"]
    kind = f"{len(gpus)} x {gpus[0]}" if len(set(gpus)) == 1 else ", ".join(gpus)
    data = "synthetic" if first.get("synthetic") else "real" if first.get("ok") else "none"
    lines = [f"GPU check: {kind}, {m['nproc']} rank(s), {m['cpu_cores']} CPU cores, torch {m['torch']}, "
             f"CUDA {m['cuda']}, cuDNN {m['cudnn']}, NCCL {m['nccl']}; {data} data", "",
             "| step | result | seconds | figures |", "| --- | --- | ---: | --- |"]
    for name, s in report["steps"].items():
        text = s.get("summary") if s["ok"] else "; ".join(filter(None, [s["error"].splitlines()[0], s.get("summary")]))
        lines.append(f"| {name} | {'PASS' if s['ok'] else 'FAIL'} | {s['seconds']} | {text.replace('|', '/')} |")
    lines.append(f"\noverall: {'PASS' if report['passed'] else 'FAIL'}")
    return lines


def main(argv=None):
    args, parser = parse(argv)
    gpus = cuda_device_count()
    if not gpus:
        print("gpu_check: no CUDA device here: nothing to check (run it on a GPU machine)")
        return 0
    nproc = args.nproc or gpus
    if nproc > gpus:
        parser.error(f"--nproc {nproc}: only {gpus} GPU(s) visible")
    if args.work:
        os.makedirs(args.work, exist_ok=True)
    with nullcontext(os.path.abspath(args.work)) if args.work else tempfile.TemporaryDirectory(prefix="gpu-") as work:
        report = run_all(args, nproc, work)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    write_json_atomic(args.json, report)
    print("\n" + "\n".join(summary_lines(report)) + f"\n(JSON: {args.json})")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
