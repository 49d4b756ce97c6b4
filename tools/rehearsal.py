"""A rehearsal at scale on one machine: a million synthetic samples in 2,000 shards, served
over HTTP on 127.0.0.1, trained on by 2 ranks x 2 workers for a bounded number of steps.

    python tools/rehearsal.py                       # 1,000,000 samples, 2,000 shards, 300 steps
    python tools/rehearsal.py --samples 20000 --shards 100 --steps 30 --work /tmp/small

Reports: manifest load and start-up time (HEAD checks included), time to the first batch,
loader samples/s over HTTP against the same shards read locally, the process tree's peak
RSS while it trains (from its first metrics line on), and the peaks of the first and last
thirds of that time (flat means within 5%), and the size of the shard cache (--cache-dir) on disk. Everything is written to
--json. The shards are written once under --work and reused; the data is synthetic, and
the figures say so.
"""
import argparse
import json
import os
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from pipeline.writers import shards  # noqa: E402
from pipeline.cli import Parser  # noqa: E402
from pipeline.data.manifests.manifest import manifest_name  # noqa: E402

SOURCES = (("big_grey", (1, 28, 28), 0.6), ("big_colour", (3, 32, 32), 0.4))  # name, shape, share of samples


class Cheap:
    """Synthetic samples fast enough to write a million: ten class templates plus one of 256
    noise images. Sample i's label is i % 10; its key encodes i."""

    def __init__(self, name, n, shape, seed=0):
        self.name, self.split, self.shape, self.n = name, "train", tuple(shape), n
        self.classes = [f"class{i}" for i in range(10)]
        self.origin = {"kind": "synthetic", "note": "rehearsal data: class templates plus noise, not real images"}
        rng = np.random.default_rng(seed)
        self.templates = rng.integers(0, 128, (10, *shape), dtype=np.uint8)
        self.noise = rng.integers(0, 128, (256, *shape), dtype=np.uint8)

    def __len__(self):
        return self.n

    def image(self, i):
        return self.templates[i % 10] + self.noise[(i * 7919) % 256]

    def label(self, i):
        return i % 10


def write(work, samples, shard_count, workers):
    """The shard sets under work/shards (kept and reused when already complete)."""
    folder = os.path.join(work, "shards")
    for name, shape, share in SOURCES:
        n = int(samples * share)
        per = max(1, -(-n // max(1, round(shard_count * share))))
        path = os.path.join(folder, manifest_name(name, "train"))
        if os.path.exists(path):
            with open(path) as f:
                m = json.load(f)
            if m["total"] == n and m["maxcount"] == per:
                continue
        print(f"writing {n} samples of {name} in shards of {per} ...", flush=True)
        shards.build(Cheap(name, n, shape), folder, encoding="raw", maxcount=per, workers=workers, progress=True)
    return folder


def serve(folder, port):
    """`python -m http.server` on 127.0.0.1, as the issue's recipe has it."""
    proc = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                             "--directory", folder], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 20
    import urllib.request

    while time.time() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/{manifest_name(SOURCES[0][0], 'train')}", timeout=2)
            return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the HTTP server did not come up")


def tree_memory_mib(pid):
    """(sum of VmRSS, sum of Pss) over a process and all its descendants, in MiB. RSS counts
    pages forked workers share with their parent once per process; Pss splits them."""
    from bench.proc import proc_kib, tree_pids  # /proc only: neither torch nor numpy

    pids = tree_pids(pid)
    return (sum(proc_kib(f"/proc/{p}/status", "VmRSS:") for p in pids) / 1024,
            sum(proc_kib(f"/proc/{p}/smaps_rollup", "Pss:") for p in pids) / 1024)


def train(base, work, steps, cache, samples):
    """The trainer under torchrun, 2 ranks x 2 workers, with the tree's RSS sampled every 0.2 s."""
    out = os.path.join(work, "run")
    epochs = -(-steps * 2 * 256 // samples)  # enough epochs for `steps` steps; --stop-after-steps ends it
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
            "pipeline.train", *[a for name, _, _ in SOURCES for a in ("--train", f"{name}={base}")],
            "--workers", "2", "--batch-size", "256", "--width", "8", "--epochs", str(epochs), "--stop-after-steps",
            str(steps), "--log-every", "20", "--cache-dir", cache, "--out", out, "--overwrite"]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    samples = []
    stop = threading.Event()

    def sample():  # from the first metrics line on: start-up is not what "flat" is about
        metrics = os.path.join(out, "metrics.jsonl")
        while not stop.is_set():
            if os.path.exists(metrics):
                samples.append((time.perf_counter() - t0, *tree_memory_mib(proc.pid)))
            time.sleep(0.2)  # 0.5 s left fewer than 3 samples of a short run on a loaded machine

    threading.Thread(target=sample, daemon=True).start()
    _, err = proc.communicate(timeout=3600)
    stop.set()
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"training failed:\n{err[-3000:]}")
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    return summary, samples, wall


def loader_rate(base, batches=200, workers=2):
    """Loader-only samples/s (no model) over `base`, in a fresh process."""
    code = f"""
import time, sys
sys.path.insert(0, {ROOT!r})
from pipeline.data.streams.stream import MixedStream, resolve
from pipeline.data.handover.loader import make_loader
srcs = [resolve(n, {base!r}, "train") for n in {[s[0] for s in SOURCES]!r}]
m = MixedStream(srcs, {{s.name: 1 for s in srcs}}, 256, epoch_samples=256 * {batches}, normalize=False)
t0 = time.perf_counter(); n = sum(len(b["key"]) for b in make_loader(m, {workers}))
print(n / (time.perf_counter() - t0))
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1200,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    if p.returncode != 0:
        raise RuntimeError(f"loader run failed:\n{p.stderr[-3000:]}")
    return float(p.stdout.split()[-1])


def folder_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def thirds(samples, column):
    """Peak of a memory column in the first and last third of the training period (by time)."""
    if len(samples) < 3:
        return None, None
    start, end = samples[0][0], samples[-1][0]
    first = max(s[column] for s in samples if s[0] <= start + (end - start) / 3)
    last = max(s[column] for s in samples if s[0] >= end - (end - start) / 3)
    return first, last


def parse_args(argv):
    p = Parser(prog="rehearsal", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=1_000_000, help="samples over both sources (default: 1,000,000)")
    p.add_argument("--shards", type=int, default=2000, help="shards over both sources (default: 2000)")
    p.add_argument("--steps", type=int, default=300, help="training steps (default: 300)")
    p.add_argument("--work", default="bench-out/rehearsal", help="shards, cache and run go here")
    p.add_argument("--port", type=int, default=0, help="HTTP port on 127.0.0.1 (default: a free one)")
    p.add_argument("--workers", type=int, default=os.cpu_count(), help="processes writing shards")
    p.add_argument("--json", help="where to write the figures (default: WORK/rehearsal.json)")
    args = p.parse_args(argv)
    if args.samples < 1000 or args.shards < 2 or args.steps < 1:
        p.error("--samples >= 1000, --shards >= 2 and --steps >= 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.work, exist_ok=True)
    t0 = time.perf_counter()
    folder = write(args.work, args.samples, args.shards, args.workers)
    write_s = time.perf_counter() - t0
    port = args.port or _free_port()
    server = serve(folder, port)
    cache = os.path.join(args.work, "cache")
    subprocess.run(["rm", "-rf", cache], check=True)
    base = f"http://127.0.0.1:{port}/"
    try:
        summary, rss, wall = train(base, args.work, args.steps, cache, args.samples)
        http_rate, local_rate = loader_rate(base), loader_rate(folder + "/")
    finally:
        server.kill()
        server.wait()
    memory = {}
    for column, name in ((1, "rss"), (2, "pss")):
        first, last = thirds(rss, column)
        memory[name] = {"training": round(max((s[column] for s in rss), default=0)), "first_third": round(first or 0),
                        "last_third": round(last or 0), "last_over_first": round(last / first, 3) if first else None}
    counts = {name: summary["data"][name]["train_samples"] for name, _, _ in SOURCES}
    record = {
        "data": "synthetic (tools/rehearsal.py Cheap: class templates plus noise)",
        "samples": sum(counts.values()), "shards": args.shards, "write_s": round(write_s, 1),
        "steps": summary["steps_done"], "world_size": summary["world_size"], "workers_per_rank": 2,
        "startup_s": summary["startup"], "train_wall_s": round(wall, 1),
        "data_wait_share": summary["data_wait_share"],
        "loader_samples_per_s": {"http": round(http_rate), "local": round(local_rate),
                                 "http_over_local": round(http_rate / local_rate, 3)},
        "peak_memory_mib": memory,
        "rss_samples": len(rss), "cache_mib": round(folder_bytes(cache) / 2 ** 20, 1),
        "shards_mib": round(folder_bytes(folder) / 2 ** 20, 1),
    }
    path = args.json or os.path.join(args.work, "rehearsal.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    for k, v in record.items():
        print(f"{k:>22}: {v}")
    print(f"wrote {path}")
    return 0


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    sys.exit(main())
