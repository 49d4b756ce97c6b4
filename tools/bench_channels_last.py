"""The trainer's step with and without --channels-last, on this machine's CPU (or GPU).

Builds synthetic 3-channel raw shards in a temporary folder, makes the trainer's Run twice (the
same seed, one with --channels-last), collects each one's batches from its own loader, then times
Run.step_once (normalise, augment, forward, backward, SGD) in rounds that alternate which layout
goes first, and prints the median seconds a step of each and their ratio: one JSON line.

    python tools/bench_channels_last.py --model cnn --width 16 --batch-size 128 --side 32 --rounds 40

On the CPU it counts the process's CPU time (time.process_time) in one torch thread; with
--device cuda, wall time after a synchronisation. The loader's own work is not in it.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from pipeline.cli import Parser  # noqa: E402


def parse_args(argv):
    p = Parser(prog="bench_channels_last", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--model", default="cnn", help="as the trainer's --model (default: cnn)")
    a("--width", type=int, default=16, metavar="N", help="the cnn's width (default: 16)")
    a("--batch-size", type=int, default=128, metavar="N", help="samples a step (default: 128)")
    a("--side", type=int, default=32, metavar="PX", help="the images' height and width (default: 32)")
    a("--rounds", type=int, default=40, metavar="N", help="steps of each layout, the first 2 not counted (default: 40)")
    a("--device", default="cpu", choices=("cpu", "cuda"), help="where the steps run (default: cpu)")
    args = p.parse_args(argv)
    p.at_least(args, {"width": 1, "batch_size": 1, "side": 4, "rounds": 3})
    return args


def step_times(args, folder):
    """{False: [seconds a step], True: [...]} (False: contiguous, True: --channels-last)."""
    import torch

    from pipeline.data.store import remote
    from pipeline.data.streams.stream import resolve
    from pipeline.ordering.topology import Topology
    from pipeline.stream import make_loader
    from pipeline.train import options
    from pipeline.train.evaluate import memory_format
    from pipeline.train.run import Run

    device = torch.device(args.device)
    runs = {}
    for last in (False, True):
        run_args = options.parse(["--train", f"cifar10={folder}/", "--model", args.model, "--width", str(args.width),
                                  "--batch-size", str(args.batch_size), "--workers", "0",
                                  "--out", os.path.join(folder, "run")] + ["--channels-last"] * last)
        sources = [resolve(n, spec, "train") for n, spec in run_args.train.items()]
        run = Run(run_args, Topology(), device, sources, [], policy=remote.Policy(), started=0.0, startup={})
        loader = make_loader(run.stream, 0, memory_format=memory_format(run_args), record=False)
        batches = [{k: v.clone().to(device) if isinstance(v, torch.Tensor) else v for k, v in b.items()}
                   for b in loader]
        runs[last] = (run, batches, torch.Generator().manual_seed(0), [])
    clock = time.process_time if device.type == "cpu" else time.perf_counter
    for r in range(args.rounds):
        for last in (False, True) if r % 2 == 0 else (True, False):
            run, batches, gen, times = runs[last]
            if device.type == "cuda":
                torch.cuda.synchronize()
            t = clock()
            run.step_once(batches[r % len(batches)], gen)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(clock() - t)
    return {last: times[2:] for last, (_, _, _, times) in runs.items()}


def medians(args):
    """(median seconds a contiguous step, a channels-last one, steps timed of each) over synthetic
    3-channel raw shards of 4 batches built in a temporary folder (also make gpu-check's case)."""
    from pipeline.writers import shards
    from pipeline.writers.sources import SyntheticSource

    with tempfile.TemporaryDirectory() as folder:
        n = args.batch_size * 4
        shards.build(SyntheticSource("cifar10", "train", n, (3, args.side, args.side)), folder, encoding="raw",
                     maxcount=args.batch_size, progress=False)
        times = step_times(args, folder)
    return statistics.median(times[False]), statistics.median(times[True]), len(times[False])


def main(argv=None):
    args = parse_args(argv)
    import torch

    torch.set_num_threads(1)
    plain, last, steps = medians(args)
    print(json.dumps({"model": args.model, "width": args.width, "batch_size": args.batch_size, "side": args.side,
                      "device": args.device, "steps": steps, "contiguous_s": round(plain, 5),
                      "channels_last_s": round(last, 5), "ratio": round(last / plain, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
