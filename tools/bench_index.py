"""Indexing on first use over HTTP against `make_shards --index` of the same set (issue 54).

Writes --shards wds.ShardWriter shards (--per-shard samples each: a small JPEG, a caption in
.txt, a class in .cls, numbers in .json), serves them with `python -m http.server` on
127.0.0.1, and times, each in a fresh process: `make_shards.py --index` of the brace pattern,
the stream's `resolve` of the same pattern with no manifest (inference, then the index), and
`resolve` again (the cached index: one HEAD a shard, no shard read). Prints one JSON line per
run (seconds, imports not timed; the peak RSS of the process after its imports and at the end,
and of its largest child, any process it waited for, in MiB), then the ratio of the first use
to make_shards.

    python tools/bench_index.py --shards 1000 --per-shard 10 --workers 8 --work-dir /tmp/bench_index
"""
import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from pipeline.cli import Parser  # noqa: E402

MEASURED = """
import json, resource, sys, time
{setup}
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
t0 = time.perf_counter()
{body}
seconds = time.perf_counter() - t0
mib = lambda who: resource.getrusage(who).ru_maxrss / 1024
print("BENCH", json.dumps({{"seconds": round(seconds, 2), "peak_after_imports_mib": round(before, 1),
                           "peak_mib": round(mib(resource.RUSAGE_SELF), 1),
                           "child_peak_mib": round(mib(resource.RUSAGE_CHILDREN), 1)}}))
"""
MAKE_SHARDS = ("from pipeline.writers.make_shards import main", "assert not main({argv!r})")
FIRST_USE = ("from pipeline.stream import resolve",
             "src = resolve('bench', {spec!r}, 'train', cache_dir={cache!r}, workers={workers}, progress=False)\n"
             "assert src.total == {total}, src.total")


def parse_args(argv):
    p = Parser(prog="bench_index", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--shards", type=int, default=1000, metavar="N", help="shards to write and index (default 1000)")
    a("--per-shard", type=int, default=10, metavar="N", help="samples a shard (default 10)")
    a("--workers", type=int, default=8, metavar="N", help="indexing processes, both ways (default 8)")
    a("--work-dir", required=True, metavar="DIR", help="where the shards, manifest and cache go (empty or new)")
    args = p.parse_args(argv)
    p.at_least(args, {"shards": 1, "per_shard": 1, "workers": 1})
    return args


def write(folder, shards, per_shard):
    import io

    import numpy as np
    import webdataset as wds
    from PIL import Image

    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    with wds.ShardWriter(os.path.join(folder, "wds-%06d.tar"), maxcount=per_shard, verbose=0) as sink:
        for i in range(shards * per_shard):
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(buf, "JPEG", quality=90)
            sink.write({"__key__": f"{i:08d}", "jpg": buf.getvalue(), "cls": str(i % 10).encode(),
                        "txt": f"a picture, number {i}, of class {i % 10}".encode(),
                        "json": json.dumps({"width": 32, "height": 32, "similarity": (i % 97) / 97}).encode()})


def measured(code, env, **kw):
    """One run in a fresh process, timed after its imports (torch's among them for the stream)."""
    setup, body = code
    out = subprocess.run([sys.executable, "-c", MEASURED.format(setup=setup, body=body.format(**kw))], cwd=ROOT,
                         env=env, capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"bench_index: a run failed: {out.stderr[-2000:]}")
    return json.loads(next(ln for ln in out.stdout.splitlines()[::-1] if ln.startswith("BENCH "))[6:])


def main(argv=None):
    args = parse_args(argv)
    work = os.path.abspath(args.work_dir)
    if os.path.exists(work) and os.listdir(work):
        sys.exit(f"bench_index: --work-dir {work}: not empty")
    shards = os.path.join(work, "shards")
    write(shards, args.shards, args.per_shard)
    port = 20000 + os.getpid() % 20000
    server = subprocess.Popen([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port), "--directory",
                               shards], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(1.0)  # the server binds
        spec = f"http://127.0.0.1:{port}/wds-{{000000..{args.shards - 1:06d}}}.tar"
        env = dict(os.environ, PYTHONPATH=ROOT)
        total = args.shards * args.per_shard
        cache = os.path.join(work, "cache")
        first = dict(spec=spec, cache=cache, workers=args.workers, total=total)
        runs = {
            "make_shards_index": measured(MAKE_SHARDS, env, argv=["--index", f"bench:train={spec}", "--out",
                                                                  os.path.join(work, "out"), "--workers",
                                                                  str(args.workers), "--quiet"]),
            "first_use": measured(FIRST_USE, env, **first),
            "cached": measured(FIRST_USE, env, **first),
        }
    finally:
        server.terminate()
        server.wait()
    for name, r in runs.items():
        print(json.dumps({"run": name, "shards": args.shards, "samples": total, "workers": args.workers, **r}))
    print(json.dumps({"first_use_over_make_shards": round(runs["first_use"]["seconds"] /
                                                          runs["make_shards_index"]["seconds"], 2)}))


if __name__ == "__main__":
    main()
