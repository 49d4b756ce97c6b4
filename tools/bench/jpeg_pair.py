"""The JPEG path of this tree against another tree's, paired: one long-lived process per tree,
each timing in turn bare simplejpeg and its stream (0 workers, uint8 batches of 128, after the
first batch) over a set `tools/bench_loader.py --jpeg` built, in the same rounds, alternating
the order every round. On a machine others load, a stream's figure moves by a tenth between
runs of the full benchmark; a ratio taken within one round moves far less.

    python tools/bench/jpeg_pair.py --other /path/to/other/checkout --work-dir bench-out --set small

prints, per tree, the median microseconds a sample of each job, the stream's share of its own
process's bare decoder (the issue's measure) and this tree's streams' speed over the other's
contiguous stream, and over the other's channels-last stream where that tree has one. The other
tree's tools/bench/jpeg.py times its stream as that tree makes it (a tree without memory_format
answers only for its NCHW batches).
"""
import argparse
import inspect
import math
import os
import statistics
import subprocess
import sys
import time

JOBS = [("other", "bare"), ("other", "contiguous"), ("other", "channels_last"), ("this", "bare"),
        ("this", "contiguous"), ("this", "channels_last")]


def serve(folder, name):
    """Answer each line on stdin ("bare" or a memory format) with microseconds a sample."""
    import torch

    sys.path.insert(0, "tools")
    torch.set_num_threads(1)
    from bench import jpeg

    datas = jpeg.jpegs_of(folder, name)
    n = len(datas) // jpeg.BATCH * jpeg.BATCH
    large = name.endswith("large")
    bare = jpeg.decoders((3, 224, 224) if large else (3, 32, 32), large)["simplejpeg scaled" if large else "simplejpeg"]
    formats = "memory_format" in inspect.signature(jpeg.stream_run).parameters
    for line in sys.stdin:
        what = line.strip()
        if what not in ("bare", "contiguous") and not formats:
            print("nan", flush=True)  # no such batches in that tree
            continue
        if what == "bare":
            t0 = time.process_time()
            bare(datas[:n])
            rate = (time.process_time() - t0) / n
        else:
            batches = jpeg.stream_run(folder, name, n, 0, *((what,) if formats else ()))
            k = next(batches)
            t0 = time.process_time()
            for size in batches:
                k += size
            rate = (time.process_time() - t0) / (k - jpeg.BATCH)
        print(rate * 1e6, flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--other", required=True, help="the other checkout's root (its pipeline and tools)")
    p.add_argument("--work-dir", default="bench-out", help="where bench_loader --jpeg built the sets")
    p.add_argument("--set", choices=("small", "large"), default="small")
    p.add_argument("--rounds", type=int, default=16)
    args = p.parse_args(argv)
    folder, name = os.path.abspath(os.path.join(args.work_dir, f"jpeg-{args.set}")), f"jpeg{args.set}"
    roots = {"this": os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
             "other": os.path.abspath(args.other)}
    procs = {t: subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", folder, name], cwd=root,
                                 env=dict(os.environ, PYTHONPATH=root), stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True) for t, root in roots.items()}

    def ask(tree, what):
        procs[tree].stdin.write(what + "\n")
        procs[tree].stdin.flush()
        return float(procs[tree].stdout.readline())

    try:
        jobs = [job for job in JOBS if not math.isnan(ask(*job))]  # one-off costs first; nan: a job the tree lacks
        got = {job: [] for job in jobs}
        for r in range(args.rounds):
            for job in (jobs if r % 2 == 0 else jobs[::-1]):
                got[job].append(ask(*job))
    finally:
        for proc in procs.values():
            proc.stdin.close()
            proc.wait()
    med = statistics.median
    print(f"{args.set} set, {args.rounds} rounds, load {os.getloadavg()[0]:.1f}: us a sample (median), "
          f"share of the same process's bare simplejpeg (median [min-max] of the rounds)")
    for tree, what in jobs:
        line = f"  {tree:5} {what:14} {med(got[(tree, what)]):7.2f} us"
        if what != "bare":
            shares = [b / s for b, s in zip(got[(tree, "bare")], got[(tree, what)])]
            line += f"   {med(shares):.3f} [{min(shares):.3f}-{max(shares):.3f}] of bare"
        print(line)
    for what in ("contiguous", "channels_last"):
        for other in sorted({"contiguous", what} & {w for t, w in jobs if t == "other"}, reverse=True):
            speed = [o / t for o, t in zip(got[("other", other)], got[("this", what)])]
            print(f"  this {what} over the other's {other} stream: {med(speed):.3f}x")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(*sys.argv[2:4])
    else:
        main()
