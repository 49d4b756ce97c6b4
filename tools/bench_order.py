"""Shards written in class order against the same images written shuffled (issue 36).

Takes the first --per-class images of each class of an ImageFolder tree for training and the
next --test-per-class for a held-out test split, writes the training images twice with
`wds.ShardWriter` (1,000 to a shard, the image's bytes as `jpg`, {"label": "<class>"} as
`json`): once walking the classes in order, once in a seeded random order; the test split once.
Indexes each set in place with tools/make_shards.py (train and test in one command, so they share
classes), counts the distinct classes in each batch the stream gives (one process: 0 and 2
workers; 2 ranks of 1 and 2 workers), trains each set with the same flags and prints one JSON line.

    python tools/bench_order.py --cifar-folder CIFAR_FOLDER/train --work-dir /tmp/bench_order

WORK-DIR must be empty or new: it gets ordered/, shuffled/ (train shards and manifests),
test/ (test shards), runs/ordered/ and runs/shuffled/ (the training runs).
"""
import argparse
import json
import os
import random
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from pipeline.cli import Parser, printable  # noqa: E402

NAME = "cifar10"  # both sets under CIFAR10's name: the trainer flips it, the same for both
SETS = ("ordered", "shuffled")
LAYOUTS = {"w0": (1, 0), "w2": (1, 2), "ranks2_w1": (2, 1), "ranks2_w2": (2, 2)}  # (world, workers)


def parse_args(argv):
    p = Parser(prog="bench_order", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--cifar-folder", required=True, metavar="DIR", help="an ImageFolder tree: DIR/<class>/<image>")
    a("--work-dir", required=True, metavar="DIR", help="where shards, manifests and runs go (empty or new)")
    a("--per-class", type=int, default=600, metavar="N", help="training images per class (default 600)")
    a("--test-per-class", type=int, default=100, metavar="N", help="test images per class, the next N (default 100)")
    a("--epochs", type=int, default=4, metavar="N", help="training epochs (default 4)")
    a("--seed", type=int, default=0, help="the shuffled twin's order, the stream's and the trainer's seed (default 0)")
    a("--maxcount", type=int, default=1000, metavar="N", help="samples per shard (default 1000)")
    a("--batch-size", type=int, default=64, metavar="N", help="batch size, counted and trained (default 64)")
    a("--width", type=int, default=16, metavar="N", help="model width (default 16, the CPU choice)")
    a("--workers", type=int, default=1, metavar="N", help="the trainer's DataLoader workers (default 1)")
    a("--no-train", action="store_true", help="write, index and count only")
    args = p.parse_args(argv)
    p.at_least(args, {"per_class": 1, "test_per_class": 1, "epochs": 1, "seed": 0, "maxcount": 1,
                      "batch_size": 1, "width": 1, "workers": 0})
    if not os.path.isdir(args.cifar_folder):
        p.error(f"--cifar-folder {args.cifar_folder}: no such folder")
    if os.path.exists(args.work_dir) and (not os.path.isdir(args.work_dir) or os.listdir(args.work_dir)):
        p.error(f"--work-dir {args.work_dir} exists and is not an empty folder; give a new one")
    return args


def split(folder, per_class, test_per_class):
    """(train, test, classes): [(path, class name)] with the first per_class files of each class
    (sorted by name) for train and the next test_per_class for test, classes in sorted order."""
    classes = sorted(d for d in os.listdir(folder) if os.path.isdir(os.path.join(folder, d)))
    if not classes:
        raise ValueError(f"{folder}: no class folders")
    train, test = [], []
    for c in classes:
        files = sorted(f for f in os.listdir(os.path.join(folder, c)) if os.path.isfile(os.path.join(folder, c, f)))
        if len(files) < per_class + test_per_class:
            raise ValueError(f"{folder}/{c}: {len(files)} images, fewer than {per_class} + {test_per_class}")
        train += [(os.path.join(folder, c, f), c) for f in files[:per_class]]
        test += [(os.path.join(folder, c, f), c) for f in files[per_class:per_class + test_per_class]]
    return train, test, classes


def write(items, out, maxcount):
    """`wds.ShardWriter` shards of items in the order given, as people write them: key
    `<class>/<stem>`, the image's bytes under its extension, {"label": class} as json."""
    import webdataset as wds

    os.makedirs(out, exist_ok=True)
    with wds.ShardWriter(os.path.join(out, "part-%06d.tar"), maxcount=maxcount, verbose=0) as sink:
        for path, c in items:
            stem, ext = os.path.splitext(os.path.basename(path))
            with open(path, "rb") as f:
                data = f.read()
            sink.write({"__key__": f"{c}/{stem.replace('.', '_')}", ext.lstrip(".").lower(): data,
                        "json": json.dumps({"label": c}).encode()})


def write_sets(args, work):
    """Train shards twice (work/ordered/train, work/shuffled/train), test shards once (work/test)."""
    train, test, classes = split(args.cifar_folder, args.per_class, args.test_per_class)
    shuffled = list(train)
    random.Random(args.seed).shuffle(shuffled)
    write(train, os.path.join(work, "ordered", "train"), args.maxcount)
    write(shuffled, os.path.join(work, "shuffled", "train"), args.maxcount)
    write(test, os.path.join(work, "test"), args.maxcount)
    return len(train), len(test), classes


def index_args(work, which):
    """tools/make_shards.py's arguments that index set `which` in place, train and test together."""
    return ["--index", f"{NAME}:train={os.path.join(work, which, 'train')}",
            "--index", f"{NAME}:test={os.path.join(work, 'test')}",
            "--label-key", "json:label", "--out", os.path.join(work, which), "--quiet"]


def classes_per_batch(manifest_dir, batch_size, seed, world, workers):
    """Mean distinct classes in a batch of the stream (defaults otherwise), over every batch of
    every rank and worker of epoch 0, each read in this process."""
    import numpy as np

    from pipeline.data.manifests.manifest import resolve
    from pipeline.data.streams.stream import MixedStream
    from pipeline.ordering.topology import Topology, Worker

    src = resolve(NAME, manifest_dir, "train")
    n, seen = max(workers, 1), []
    for rank in range(world):
        s = MixedStream([src], {NAME: 1}, batch_size, Topology(rank, world), seed=seed)
        s.set_workers(n)
        s.set_epoch(0)
        for w in range(n):
            seen += [len(set(b["label"].tolist())) for b in s.batches(Worker(w, n))]
    return round(float(np.mean(seen)), 3)


def uniform(classes, per_class, batch_size, seed, draws=20_000):
    """Distinct classes in a batch drawn uniformly, without replacement, from the training set."""
    import numpy as np

    rng = np.random.default_rng(seed)
    labels = np.repeat(np.arange(classes), per_class)
    k = min(batch_size, len(labels))
    return round(float(np.mean([len(set(rng.choice(labels, k, replace=False))) for _ in range(draws // k)])), 3)


def train_command(args, work, which):
    d = os.path.join(work, which)
    return [sys.executable, "-m", "pipeline.train", "--train", f"{NAME}={d}", "--eval", f"{NAME}={d}",
            "--epochs", str(args.epochs), "--batch-size", str(args.batch_size), "--workers", str(args.workers),
            "--width", str(args.width), "--seed", str(args.seed), "--log-every", "1000000",
            "--out", os.path.join(work, "runs", which)]


def train(args, work, which):
    """(test accuracy, seconds): one single-process training run of set `which`."""
    t = time.time()
    p = subprocess.run(train_command(args, work, which), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True)
    if p.returncode != 0:
        raise RuntimeError(f"training {which} failed ({p.returncode}): {p.stderr.strip()[-2000:]}")
    with open(os.path.join(work, "runs", which, "summary.json")) as f:
        summary = json.load(f)
    return summary["accuracy"][NAME], round(time.time() - t, 1)


def run(args):
    t0 = time.time()
    work = os.path.abspath(args.work_dir)
    n_train, n_test, classes = write_sets(args, work)
    print(f"bench_order: wrote {n_train} training images twice and {n_test} test images under {work}",
          file=sys.stderr)
    for which in SETS:
        p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "make_shards.py"), *index_args(work, which)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if p.returncode != 0:
            raise RuntimeError(f"indexing {which} failed: {p.stderr.strip()}")
    result = {"per_class": args.per_class, "test_per_class": args.test_per_class, "classes": len(classes),
              "epochs": args.epochs, "batch_size": args.batch_size, "seed": args.seed,
              "classes_per_batch": {which: {k: classes_per_batch(os.path.join(work, which), args.batch_size,
                                                                  args.seed, *v) for k, v in LAYOUTS.items()}
                                    for which in SETS}}
    result["classes_per_batch"]["uniform"] = uniform(len(classes), args.per_class, args.batch_size, args.seed)
    print(f"bench_order: classes per batch {json.dumps(result['classes_per_batch'])}", file=sys.stderr)
    if not args.no_train:
        result["accuracy"], result["train_s"] = {}, {}
        for which in SETS:
            acc, secs = train(args, work, which)
            result["accuracy"][which], result["train_s"][which] = round(acc, 4), secs
            print(f"bench_order: {which}: test accuracy {acc:.4f} in {secs:.0f} s", file=sys.stderr)
    result["wall_s"] = round(time.time() - t0, 1)
    print(json.dumps(result), flush=True)
    return 0


def main(argv=None):
    args = parse_args(argv)  # --help and a bad command line answer before webdataset (and torch) load
    try:
        return run(args)
    except (ValueError, RuntimeError, OSError) as e:
        print(f"bench_order: error: {printable(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
