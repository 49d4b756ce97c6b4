"""The trainer on the GPU: the real job under torchrun (nccl when more than one rank) with the
default model and with --model resnet18, read back from the files it writes for people; the
trainer's own step on one batch already on the GPU (the model-alone rate the trainer is held
against); and the trainer's synchronising calls, which must come only where it reads the device
on purpose (metrics lines, the epoch's end)."""
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time

import torch

from gpucheck import ROOT
from gpucheck.data import BATCH, SHAPES, train_sources
from gpucheck.runner import Failed
from pipeline.data.streams.stream import resolve
from pipeline.files import read_json

TRAIN_FLAGS = ["--epochs", "1", "--batch-size", str(BATCH), "--workers", "8", "--width", "64", "--log-every", "50"]
SAMPLES = {"cnn": 600_000, "resnet18": 200_000}  # an epoch of each model's run: short runs mislead (NOTES.md)
TARGETS = {"trainer_share": 0.9, "data_wait": 0.03, "first_batch_s": 2.0}


def model_flags(model):
    return ["--model", model, "--epoch-samples", str(SAMPLES.get(model, SAMPLES["resnet18"]))]


def trainer_command(folder, out, nproc, model="cnn"):
    spec = folder.rstrip("/") + "/"
    sources = [x for kind in ("--train", "--eval") for n in SHAPES for x in (kind, f"{n}={spec}")]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", "pipeline.train", *sources, *TRAIN_FLAGS, *model_flags(model), "--out", out, "--overwrite"]


def trainer_args(folder, out, extra=(), model="cnn"):
    spec = folder.rstrip("/") + "/"
    return [*(x for n in SHAPES for x in ("--train", f"{n}={spec}")), *TRAIN_FLAGS, *model_flags(model), "--out", out,
            "--overwrite", *extra]


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


def train(folder, work, nproc, timeout, model="cnn"):
    out, log = os.path.join(work, f"run-{model}"), os.path.join(work, f"train-{model}.log")
    print(f"   torchrun, {nproc} rank(s), --model {model}, up to {timeout} s; log: {log}", flush=True)
    rc = run_trainer(trainer_command(folder, out, nproc, model), log, timeout)
    if rc != 0:
        raise Failed(f"trainer exited with {rc}: {cause(log)}; last lines of {log}:\n{tail(log)}")
    return read_run(out, nproc, {n: resolve(n, folder, "test").total for n in SHAPES})


def model_check(folder, work, trained, model="cnn", steps=300):
    """The trainer's own step (Run.step_once: normalise and augment on the GPU, bf16 autocast, the
    fused SGD step that skips on the device) on one batch already there, with the trainer's
    flags: the samples/s the trainer is held against. `trained`: the train step's figures."""
    from pipeline.data.store import remote
    from pipeline.data.handover.loader import make_loader
    from pipeline.ordering.topology import Topology
    from pipeline.train import options
    from pipeline.train.run import Run

    dev = torch.device("cuda", 0)
    args = options.parse(trainer_args(folder, os.path.join(work, f"model-{model}"), model=model))
    run = Run(args, Topology(), dev, train_sources(folder), [], policy=remote.Policy(), started=time.perf_counter(),
              startup={})
    loader = make_loader(run.stream, 0)
    batch = {k: v.to(dev) if torch.is_tensor(v) else v for k, v in next(iter(loader)).items()}
    loader.close()
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
    width = f", width {args.width}" if model == "cnn" else ""
    figures = {"model": model, "model_samples_per_s": round(rate, 1), "trainer_share": round(share, 3),
               "summary": f"--model {model}: the trainer's step alone {rate:,.0f} samples/s (batch {args.batch_size}"
                          f"{width}, bf16); the trainer reached {share:.0%} of it (target >= "
                          f"{TARGETS['trainer_share']:.0%})"}
    if not torch.isfinite(losses).all() or found.item():
        raise Failed("the step's loss or gradients are not finite", figures)
    return figures


def nosync_check(folder, work, steps=60, log_every=20):
    """One rank of the trainer in this process with torch.cuda.set_sync_debug_mode("warn") on
    inside its epochs: every synchronising CUDA call warns, and is recorded with the step it
    follows (the loader's own work, the copy to the device included, left out: every loader
    the trainer makes is wrapped). Passes if they all come at metrics lines (every --log-every
    steps) or the epoch's last step."""
    import warnings as w

    from pipeline import stream as stream_module
    from pipeline.train import loop, run as run_module

    at = {"step": 0, "on": False}
    seen = []
    real = (loop.train_epoch, run_module.Run.step_once, stream_module.make_loader, w.showwarning)

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

    def make_loader(*a, **kw):
        return Quiet(real[2](*a, **kw), at)

    loop.train_epoch, run_module.Run.step_once, stream_module.make_loader, w.showwarning = \
        train_epoch, step_once, make_loader, show
    try:
        with w.catch_warnings():
            w.simplefilter("always")
            w.showwarning = show
            code = loop.main(trainer_args(folder, os.path.join(work, "nosync"), [
                "--epoch-samples", str(BATCH * steps), "--workers", "2", "--log-every", str(log_every),
                "--stop-signals", ""]))
    finally:
        loop.train_epoch, run_module.Run.step_once, stream_module.make_loader, w.showwarning = real
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


class Quiet:
    """A loader whose own work is left out of nosync_check's count: recording is off while it
    makes a batch, and back to what it was after (on inside an epoch, off in evaluation)."""

    def __init__(self, loader, at):
        self._loader, self._at = loader, at

    def __getattr__(self, name):
        return getattr(self._loader, name)

    def __len__(self):
        return len(self._loader)

    def start(self):
        self._loader.start()
        return self

    def __iter__(self):
        it = iter(self._loader)
        while True:
            was, self._at["on"] = self._at["on"], False
            try:
                batch = next(it)
            except StopIteration:
                return
            finally:
                self._at["on"] = was
            yield batch


def channels_last_check(device, cases=(("cnn", 64, 256), ("resnet18", 0, 128)), rounds=30, side=32):
    """The trainer's step (Run.step_once) with and without --channels-last, paired rounds
    (tools/bench_channels_last.py): the figure that says whether the flag should be the default
    on GPUs, where PyTorch recommends that layout for convolutions under mixed precision."""
    import argparse

    import bench_channels_last as bench

    figures, said = {}, []
    for model, width, batch in cases:
        plain, last, _ = bench.medians(argparse.Namespace(model=model, width=width or 16, batch_size=batch, side=side,
                                                          rounds=rounds, device=device))
        figures[model] = {"contiguous_s": round(plain, 6), "channels_last_s": round(last, 6),
                          "ratio": round(last / plain, 3)}
        said.append(f"{model} {last / plain:.2f}x")
    figures["summary"] = (f"--channels-last step time over the contiguous step's ({device}, batch of {side}x{side}, "
                          f"medians of {rounds - 2} paired steps): {', '.join(said)}")
    return figures

