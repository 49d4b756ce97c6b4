"""One-command GPU check (`make gpu-check`): every CUDA path the loader and the trainer take, each
case its own PASS or FAIL line, then the issue-45 figures, ready to paste into docs/benchmarks.md.

    python tools/gpu_check.py                     # synthetic shards, all visible GPUs
    python tools/gpu_check.py --shards shards/ --nproc 2 --json bench-out/gpu-check.json

Steps, in order, each within its share of --budget (parts in tools/gpucheck/):
  shards       synthetic MNIST/CIFAR10 look-alikes (or --shards DIR) and a JPEG WebDataset of the
               same shapes, indexed in place
  hand-over    kept batches never overwritten, bytes compared with a plain pass: make_loader(device=)
               at 0 and 4 workers holding every batch of 3 epochs; the user's own copies on a side
               stream, each CPU batch dropped before any wait; copies made and dropped in another
               thread; workers started again after the ring was registered; a refused page-lock
               (one warning, batches still whole); the loader's rate feeding a model step
  no sync      one rank of the trainer in this process under torch.cuda.set_sync_debug_mode: every
               call that makes the host wait for the GPU is recorded with its step; passes if they
               come only at metrics lines and the epoch's end
  JPEG decode  make_loader(decode="device"): 32x32 JPEGs decoded by nvJPEG after the hand-over
               beside the host decoder, the same batches (within the IDCTs' rounding), samples/s of each
  kernels      bf16 autocast; normalisation on the GPU against the CPU's; nccl on one rank
  train        pipeline.train under torchrun --standalone (nccl when more than one rank), 8 workers,
               batch 256: the default model (width 64) and --model resnet18, each followed by the
               trainer's step alone on one batch already on the GPU (the rate it is held against);
               samples/s, data-wait share, first batch, accuracy (targets: trainer >= 90% of the
               model alone, data wait < 3%, first batch < 2 s)
  scaling      the stream alone at 0, 4, 8 and cores-2 workers, raw and JPEG shards, float (C) and
               uint8 (C8) batches (targets at cores-2 workers: raw C8 >= 1M, C >= 600k samples/s)

Speed targets are reported as met or missed; a step fails on wrong results, not on speed.
Exit codes: 0 all passed (or no CUDA device: it says so and checks nothing), 1 a step failed,
2 bad command line (or webdataset/braceexpand missing: see below).

A GPU machine without a package index: bring webdataset and braceexpand (pure Python) as wheels,
downloaded where there is one into a folder git ignores, e.g.
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux2014_x86_64 -d .whl webdataset braceexpand
and on the GPU machine
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site:. python3 tools/gpu_check.py
"""
import argparse
import importlib.util
import os
import sys
import tempfile
import time
from contextlib import nullcontext

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tools")]

from pipeline.cli import Parser  # noqa: E402

SPLITS = {n: ("train", "test") for n in ("mnist", "cifar10")}
WORKERS = 4  # the hand-over cases' worker count beside 0
TRAIN_S = {"cnn": 75, "resnet18": 60}  # the most each trainer run may take


def parse(argv=None):
    """The command line, checked with nothing but the standard library: the `__main__` block
    parses it before torch loads, so --help and a bad flag answer at once."""
    p = Parser(prog="gpu_check", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shards", metavar="DIR", help="real shards: a folder holding mnist-train.json, "
                   "cifar10-train.json, mnist-test.json, cifar10-test.json (default: build synthetic ones)")
    p.add_argument("--nproc", type=int, metavar="N", help="trainer ranks, one GPU each (default: every visible GPU)")
    p.add_argument("--json", default="bench-out/gpu-check.json", metavar="PATH",
                   help="where the report goes as JSON (default: bench-out/gpu-check.json)")
    p.add_argument("--work", metavar="DIR", help="keep shards, run folders and trainer logs here "
                                                 "(default: a temporary folder, removed at the end)")
    p.add_argument("--budget", type=int, default=300, metavar="S",
                   help="seconds for the whole check: a step past its share is stopped and fails, a step with "
                        "no time left is skipped and fails (default: 300)")
    args = p.parse_args(argv)
    if args.shards:
        missing = [f"{n}-{s}.json" for n, splits in SPLITS.items() for s in splits
                   if not os.path.exists(os.path.join(args.shards, f"{n}-{s}.json"))]
        if missing:
            p.error(f"--shards {args.shards}: no {', '.join(missing)}")
    if args.nproc is not None and args.nproc < 1:
        p.error(f"--nproc must be at least 1, got {args.nproc}")
    if args.budget < 120:
        p.error(f"--budget must be at least 120, got {args.budget}")
    missing = [m for m in ("webdataset", "braceexpand") if importlib.util.find_spec(m) is None]
    if missing:
        p.error(f"{' and '.join(missing)} not importable: install them, or bring their wheels (see --help)")
    return args, p


if __name__ == "__main__":
    parse()

from gpucheck import handover, jpegdecode, kernels, scaling, trainer  # noqa: E402
from gpucheck.data import build_jpeg, build_synthetic, describe_shards  # noqa: E402
from gpucheck.runner import cuda_device_count, machine, run_step, summary_lines  # noqa: E402
from pipeline.files import write_json_atomic  # noqa: E402


def plan(args, nproc, work, report, left):
    """[(name, step(), most seconds, needs the shards)] in the order they run."""
    import torch

    dev = torch.device("cuda", 0)
    folder = os.path.abspath(args.shards) if args.shards else os.path.join(work, "shards")
    jpeg = os.path.join(work, "shards-jpg")

    def shards_step():
        if not args.shards:
            build_synthetic(folder)
        build_jpeg(jpeg)
        return describe_shards(folder)

    ranks = f"{nproc} rank{'s' if nproc > 1 else ''}"
    steps = [("shards", shards_step, 90, False)]
    steps += [(name, lambda fn=fn: fn(folder), 30, True) for name, fn in handover.cases(dev, WORKERS)]
    steps += [("loader to GPU", lambda: handover.loader_rate(folder, dev), 40, True),
              ("JPEG decoded on the GPU beside the host", lambda: jpegdecode.check(os.path.join(work, "photos"), dev),
               60, False),
              ("no sync in steps", lambda: trainer.nosync_check(folder, work), 60, True),
              ("autocast bf16", kernels.autocast_check, 20, False),
              ("normalize on GPU", lambda: kernels.normalize_check(folder), 20, True),
              ("nccl 1 rank", kernels.nccl_check, 30, False)]
    for model, most in TRAIN_S.items():
        name = f"train --model {model} ({ranks})"
        steps += [(name, lambda m=model, most=most: trainer.train(folder, work, nproc, min(most, left()) - 10, m),
                   most, True),
                  (f"--model {model} alone", lambda m=model, name=name: trainer.model_check(
                      folder, work, report["steps"][name], m), 30, True)]
    steps.append(("--channels-last step", lambda: trainer.channels_last_check(dev), 40, False))
    steps.append(("scaling", lambda: scaling.scaling_check({"raw": folder, "jpg": jpeg}, min(90, left() - 10)),
                  110, True))
    return steps


def run_all(args, nproc, work):
    """Every step in order within --budget; a step that needs shards is skipped without them."""
    deadline = time.monotonic() + args.budget
    report = {"machine": machine(nproc), "budget_s": args.budget, "steps": {}}

    def left():
        return int(deadline - time.monotonic())

    for name, fn, most, needs_shards in plan(args, nproc, work, report, left):
        share = min(most, left())
        why = ("no shards" if needs_shards and not report["steps"]["shards"]["ok"] else
               "out of time (--budget)" if share < 15 else None)
        if why:
            report["steps"][name] = {"ok": False, "seconds": 0.0, "error": f"skipped: {why}"}
            print(f"FAIL {name}: skipped, {why}", flush=True)
        else:
            run_step(report, name, fn, share)
    report["passed"] = all(s["ok"] for s in report["steps"].values())
    return report


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
