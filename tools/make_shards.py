"""Convert MNIST, CIFAR10 or any ImageFolder tree into WebDataset tar shards.

    python tools/make_shards.py --datasets mnist cifar10 --splits train test --root data --out shards

See README.md for the sample format and every option.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pipeline import shards, sources  # noqa: E402
from pipeline.cli import Parser  # noqa: E402


def parse_args(argv):
    p = Parser(prog="make_shards", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--datasets", nargs="+", metavar="NAME",
                   help="built-in data sets to convert: mnist, cifar10 (default: both, unless --imagefolder is given)")
    p.add_argument("--splits", nargs="+", default=["train", "test"], choices=["train", "test"])
    p.add_argument("--root", default="data", help="torchvision data folder (default: data)")
    p.add_argument("--download", action="store_true", help="let torchvision download missing data sets")
    p.add_argument("--synthetic", action="store_true", help="write look-alike synthetic data, no files needed")
    p.add_argument("--fallback-synthetic", action="store_true",
                   help="use synthetic data for any data set that cannot be loaded, saying so in one line")
    p.add_argument("--imagefolder", action="append", default=[], metavar="NAME:SPLIT=DIR",
                   help="shard an ImageFolder tree as data set NAME, split SPLIT (repeatable)")
    p.add_argument("--holdout", type=int, metavar="N",
                   help="split each --imagefolder into train and a test split of N held-out samples")
    p.add_argument("--limit", type=int, help="at most N samples per split (a seeded random subset)")
    p.add_argument("--encoding", choices=shards.ENCODINGS, default="png",
                   help="png: lossless, small (default); raw: uint8 pixels, fastest to decode")
    p.add_argument("--maxcount", type=int, default=500, help="samples per shard (default: 500)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sample order (default: 0)")
    p.add_argument("--workers", type=int, default=os.cpu_count(), help="writer processes (default: all cores)")
    p.add_argument("--part", metavar="I/N", help="write only part I of N of each split (for N machines)")
    p.add_argument("--merge", action="store_true", help="merge the part manifests under --out into one")
    p.add_argument("--verify", action="store_true", help="check the shards under --out against their manifests")
    p.add_argument("--out", default="shards", help="output folder (default: shards)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    args.part = parse_part(p, args.part)
    if args.limit is not None and args.limit < 1:
        p.error("--limit must be at least 1")
    if args.datasets is None:
        args.datasets = [] if args.imagefolder else ["mnist", "cifar10"]
    for name in args.datasets:
        if name not in sources.SHAPES:
            p.error(f"unknown dataset {name!r}; built-in: mnist, cifar10 (use --imagefolder NAME:SPLIT=DIR for others)")
    args.imagefolder = [parse_imagefolder(p, spec) for spec in args.imagefolder]
    return args


def parse_part(p, text):
    if text is None:
        return (0, 1)
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        p.error(f"--part {text!r}: expected I/N, e.g. 0/3")
    if not 0 <= i < n:
        p.error(f"--part {text!r}: need 0 <= I < N")
    return (i, n)


def parse_imagefolder(p, spec):
    name, sep, rest = spec.partition(":")
    split, sep2, folder = rest.partition("=")
    if not (sep and sep2 and name and split and folder):
        p.error(f"--imagefolder {spec!r}: expected NAME:SPLIT=DIR, e.g. pets:train=/data/pets/train")
    if not shards.NAME_RE.match(name) or not shards.NAME_RE.match(split):
        p.error(f"--imagefolder {spec!r}: NAME and SPLIT may hold letters, digits and _ only")
    return name, split, folder


def load_sources(args):
    """Yield each source to write, falling back to synthetic data where asked."""
    for name in args.datasets:
        for split in args.splits:
            if args.synthetic:
                yield sources.synthetic_source(name, split, seed=args.seed)
                continue
            try:
                yield sources.torchvision_source(name, split, args.root, download=args.download)
            except sources.SourceError as e:
                if not args.fallback_synthetic:
                    raise
                print(f"make_shards: {name} {split}: real data unavailable, using synthetic look-alike data ({e})",
                      file=sys.stderr)
                yield sources.synthetic_source(name, split, seed=args.seed)
    for name, split, folder in args.imagefolder:
        src = sources.ImageFolderSource(name, split, folder)
        if args.holdout:
            yield from sources.holdout(src, args.holdout, args.seed)
        else:
            yield src


def check_writable(out):
    os.makedirs(out, exist_ok=True)
    probe = os.path.join(out, ".write-test.tmp")
    with open(probe, "w"):
        pass
    os.remove(probe)


def run(args):
    if args.verify:
        problems = shards.verify(args.out)
        for line in problems:
            print(f"FAIL {line}")
        print(f"verify {args.out}: {'OK' if not problems else f'{len(problems)} problem(s)'}")
        return 1 if problems else 0
    if args.merge:
        for name in args.datasets + [f[0] for f in args.imagefolder]:
            for split in args.splits:
                m = shards.merge_parts(args.out, name, split)
                print(f"merged {name}-{split}: {len(m['shards'])} shards, {m['total']} samples")
        return 0
    check_writable(args.out)
    rows = []
    for src in load_sources(args):
        t0 = time.perf_counter()
        m = shards.build(src, args.out, encoding=args.encoding, maxcount=args.maxcount, seed=args.seed,
                         limit=args.limit, workers=args.workers, part=args.part, progress=not args.quiet)
        dt = time.perf_counter() - t0
        rows.append((f"{src.name}-{src.split}", len(m["shards"]), m["total"],
                     sum(s["bytes"] for s in m["shards"]), dt))
    print(f"{'split':<20}{'shards':>8}{'samples':>10}{'MB':>9}{'seconds':>9}{'samples/s':>11}")
    for name, n, total, size, dt in rows:
        print(f"{name:<20}{n:>8}{total:>10}{size / 1e6:>9.1f}{dt:>9.1f}{total / dt:>11.0f}")
    print(f"wrote manifests and shards to {args.out}/")
    return 0


def main(argv=None):
    args = parse_args(argv)
    try:
        return run(args)
    except (sources.SourceError, shards.ShardError, OSError) as e:
        print(f"make_shards: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("make_shards: interrupted; no manifest was written for the unfinished split", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
