"""Two code trees measured epoch by epoch in turn (issue 52's "no lower than at c64ded4, back to
back"): one long-lived process a tree, each holding its stream and loader across epochs as
training does, runs one epoch when told, so load from other jobs falls on both alike. Prints,
per tree, the median samples per CPU-second of the whole process tree and the consuming
process's own CPU a sample, and the median of the per-round ratios to the first tree.

    python tools/bench/paired.py --workers 2 --normalize 0 --keep label --rounds 16 \\
        old=/path/to/c64ded4:/path/to/its/raw/shards new=.:/path/to/raw/shards

A tree is read through its public API only (pipeline.stream's MixedStream, make_loader,
resolve; pipeline.topology's Topology; tools/bench/cpu.py's tree_cpu), so an old commit checked
out elsewhere serves as it is: the shards are each tree's own `make_shards.py --synthetic
--encoding raw` output (MNIST and CIFAR10 shapes, "train"), or any set with those two sources
(--sources)."""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def serve(tree, folder, workers, normalize, keep, sources, batch):
    """In the tree's own process: build the loader, run epoch 0, then one epoch a line of stdin."""
    sys.path[:0] = [tree, os.path.join(tree, "tools")]
    import torch

    torch.set_num_threads(1)
    from pipeline.stream import MixedStream, make_loader, resolve
    from pipeline.topology import Topology
    from bench.cpu import tree_cpu

    srcs = [resolve(n, folder, "train") for n in sources]
    s = MixedStream(srcs, {n: 1.0 for n in sources}, batch, Topology(), seed=0, normalize=normalize)
    loader = make_loader(s, num_workers=workers)
    epoch = 0
    s.set_epoch(epoch)
    for _ in loader:
        pass
    print("ready", flush=True)
    for _ in sys.stdin:
        epoch += 1
        s.set_epoch(epoch)
        kept = []
        (m0, r0), t0, n = tree_cpu(), time.process_time(), 0
        for b in loader:
            n += len(b["key"])
            if keep:
                kept.append(b[keep])
        own, (m1, r1) = time.process_time() - t0, tree_cpu()
        del kept
        print(json.dumps({"per_cpu_s": n / ((m1 - m0) + (r1 - r0)), "consumer_us": own / n * 1e6}), flush=True)


def run(trees, rounds, args):
    """{name: [per-epoch results]}: each round runs one epoch of every tree, the order rotated."""
    procs = {}
    for name, tree, folder in trees:
        cmd = [sys.executable, os.path.abspath(__file__), "--serve", tree, folder, "--workers", str(args.workers),
               "--normalize", str(args.normalize), "--keep", args.keep, "--batch-size", str(args.batch_size),
               "--sources", *args.sources]
        procs[name] = subprocess.Popen(cmd, cwd=tree, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if procs[name].stdout.readline().strip() != "ready":
            raise SystemExit(f"paired: {name} ({tree}) did not start")
    names = [t[0] for t in trees]
    out = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            procs[name].stdin.write("go\n")
            procs[name].stdin.flush()
            out[name].append(json.loads(procs[name].stdout.readline()))
    for p in procs.values():
        p.stdin.close()
        p.wait()
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trees", nargs="*", help="NAME=TREE:SHARDS, the first is the reference")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--normalize", type=int, choices=(0, 1), default=0, help="1: C (float32), 0: C8 (uint8)")
    p.add_argument("--keep", default="", metavar="FIELD", help="the loop keeps this field of each batch (label; "
                   "caption for an image-text set) until the epoch ends; default: nothing")
    p.add_argument("--rounds", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--sources", nargs="+", default=["mnist", "cifar10"])
    p.add_argument("--serve", nargs=2, metavar=("TREE", "SHARDS"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        return serve(*args.serve, args.workers, bool(args.normalize), args.keep, args.sources, args.batch_size)
    trees = []
    for spec in args.trees:
        name, _, rest = spec.partition("=")
        tree, _, folder = rest.partition(":")
        if not (name and tree and folder):
            p.error(f"a tree is NAME=TREE:SHARDS, got {spec!r}")
        trees.append((name, os.path.abspath(tree), os.path.abspath(folder)))
    if not trees:
        p.error("name at least one tree")
    res = run(trees, args.rounds, args)
    first = trees[0][0]
    what = f"{'C' if args.normalize else 'C8'} {args.workers}w keep {args.keep or 'nothing'}"
    for name, _, _ in trees:
        rate = statistics.median(x["per_cpu_s"] for x in res[name])
        us = statistics.median(x["consumer_us"] for x in res[name])
        ratio = statistics.median(a["per_cpu_s"] / b["per_cpu_s"] for a, b in zip(res[name], res[first]))
        print(f"{what}: {name:<8} {rate:9,.0f} samples/cpu-s  consumer {us:.3f} us a sample  {name}/{first} "
              f"{ratio:.3f} (median of {args.rounds} paired epochs)", flush=True)


if __name__ == "__main__":
    main()
