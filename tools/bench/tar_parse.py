"""The tar parse of raw shards (`regular_members`) of another code tree against this tree's,
interleaved shard by shard in one process, so the machine's load falls on both alike: the
paired epochs of tools/bench/paired.py see a change to it only as a percent or two of the
whole, within their noise on a busy machine. Prints the median time a shard of each and the
median of the per-shard ratios.

    python tools/bench/tar_parse.py /path/to/c64ded4/pipeline/data/read.py /path/to/raw/shards

OLD is the file that holds the other tree's `regular_members` (c64ded4: pipeline/data/read.py;
later: pipeline/data/shards/regular.py); it is loaded by its path, its own imports from this
tree (pipeline.errors and the like), and both must read every shard alike."""
import argparse
import glob
import importlib.util
import os
import statistics
import time

from pipeline.data.shards import regular


def load(path):
    spec = importlib.util.spec_from_file_location("other_tar_parse", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("old", help="the file of the other tree that holds regular_members")
    p.add_argument("shards", help="a folder of raw shards (make_shards.py --encoding raw)")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--every", type=int, default=8, help="every Nth shard of the folder")
    p.add_argument("--exts", nargs=2, default=("raw", "cls"), metavar=("IMAGE", "LABEL"),
                   help="the members' extensions (jpg cls: the JPEG sets of tools/bench_loader.py --jpeg)")
    args = p.parse_args(argv)
    other = load(os.path.abspath(args.old))
    paths = sorted(glob.glob(os.path.join(args.shards, "*.tar")))[::args.every]
    if not paths:
        p.error(f"no .tar files in {args.shards}")
    bufs = [memoryview(bytearray(open(path, "rb").read())) for path in paths]  # as in a window's arena
    for path, buf in zip(paths, bufs):
        a, b = other.regular_members(buf, *args.exts), regular.regular_members(buf, *args.exts)
        if a is None or b is None or a[0] != b[0] or any((x != y).any() for x, y in zip(a[1:], b[1:])):
            raise SystemExit(f"tar_parse: the two trees read {path} differently")
    times_old, times_new, ratios = [], [], []
    for r in range(args.rounds):
        for buf in bufs:
            took = {}
            for who, parse in ((("other", other.regular_members), ("this", regular.regular_members))[::1 - 2 * (r % 2)]):
                t = time.perf_counter()  # in turn first and second: the second finds the shard in the cache
                parse(buf, *args.exts)
                took[who] = time.perf_counter() - t
            times_old.append(took["other"])
            times_new.append(took["this"])
            ratios.append(took["this"] / took["other"])
    print(f"regular_members, {len(bufs)} shards x {args.rounds} rounds: other "
          f"{statistics.median(times_old) * 1e6:.1f} us a shard, this tree {statistics.median(times_new) * 1e6:.1f} "
          f"us, this/other {statistics.median(ratios):.3f} (median of the per-shard ratios)")


if __name__ == "__main__":
    main()
