"""`bench_loader.py --stores`: the same shards, in one run (issue 39, "fetched ahead"), read

    local             from local files
    http              from a local S3-compatible server (moto's server mode) as plain unsigned
                      http:// URLs
    s3                from that server as s3:// URLs, reached through AWS_ENDPOINT_URL as users
                      reach MinIO or R2: differs from http only in what the store path adds
    s3 via s3fs       the same s3:// URLs read through s3fs's file object (storage.Reader), as
                      they were before the signed GETs: the measured reason for those
    s3 proxy+0ms      through a TCP proxy on 127.0.0.1 that adds nothing
    s3 proxy+50ms     through the same proxy holding the first byte of each answer 50 ms
    ... no-prefetch   the same without fetching ahead (stages.PREFETCH_THREADS = 0)

Each path is this stream (MixedStream, uint8 batches, as the trainer takes them) over one
epoch of the mnist source, interleaved by repeat, each repeat starting one path later. The
targets: s3's CPU per sample against http's, and the rate with 50 ms against the same proxy's
without (after the first batch: the wait for an epoch's first window is paid once an epoch
and shown apart).

The servers run in a process of their own (`serve`), and its CPU time is taken out of the
figures: CPU per sample is the reading side's, the benchmarking process and its DataLoader
workers. On a machine of few cores the servers still compete with the reader for them.

    python tools/bench_loader.py --stores --synthetic --workers 0   # 120 shards of 500 MNIST-shaped samples
    python tools/bench_loader.py --stores --shards DIR               # DIR's mnist-train.json shards
"""
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

LATENCY = 0.050  # seconds added before each answer's first byte
BUCKET = "bench-stores"
SHARDS, PER_SHARD = 120, 500  # --synthetic: MNIST-shaped raw shards, as many samples as MNIST's training set


# ------------------------------------------------------------ the servers' process


def serve(latency=LATENCY):
    """moto's S3 server and two proxies in front of it, one adding `latency` and one adding
    none (the same proxy's own cost, to measure the latency against), on 127.0.0.1; prints
    their ports as one JSON line, then runs until stdin closes."""
    import logging
    import socket
    import threading

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s3_port = s.getsockname()[1]
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=s3_port, verbose=False)
    moto.start()

    def pump(src, dst, before=None, after=None):
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                if before:
                    before()
                dst.sendall(data)
                if after:
                    after()
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def proxied(client, latency):
        upstream = socket.create_connection(("127.0.0.1", s3_port))
        for s in (client, upstream):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        asked = threading.Event()  # the client sent a request: the next answer's first byte waits

        def hold():
            if asked.is_set():
                time.sleep(latency)
                asked.clear()
        threading.Thread(target=pump, args=(client, upstream), kwargs={"after": asked.set}, daemon=True).start()
        pump(upstream, client, before=hold)

    def proxy(latency):
        """A port whose connections are moto's, each answer's first byte held `latency` s."""
        server = socket.create_server(("127.0.0.1", 0), backlog=128)

        def accept():
            while True:
                client, _ = server.accept()
                threading.Thread(target=proxied, args=(client, latency), daemon=True).start()
        threading.Thread(target=accept, daemon=True).start()
        return server.getsockname()[1]

    print(json.dumps({"s3": s3_port, "s3_proxy": proxy(0.0), "s3_latency": proxy(latency)}), flush=True)
    sys.stdin.read()
    moto.stop()


@contextlib.contextmanager
def servers():
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "serve"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        ports = json.loads(proc.stdout.readline())
        ports["pid"] = proc.pid
        yield ports
    finally:
        proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ------------------------------------------------------------ the runs


def build(work):
    from pipeline.writers import shards
    from pipeline.writers.sources import SyntheticSource

    out = os.path.join(work, "store-shards")
    shards.build(SyntheticSource("mnist", "train", SHARDS * PER_SHARD, (1, 28, 28), 0), out, encoding="raw",
                 maxcount=PER_SHARD, progress=False)
    return out


def upload(folder, base):
    """The shards and manifest to the bucket, readable without a signature too: the http path
    reads the same objects from the same server as plain URLs."""
    from pipeline.data.store import storage, writing

    fs = storage.filesystem(storage.parse(base))
    fs.mkdir(BUCKET)
    names = [n for n in sorted(os.listdir(folder)) if n.startswith("mnist-train")]
    for name in names:
        writing.put(os.path.join(folder, name), f"{base}{name}")
        fs.call_s3("put_object_acl", Bucket=BUCKET, Key=storage.parse(base + name).path.split("/", 1)[1],
                   ACL="public-read")
    return names


def epoch(src, workers, batch_size, shuffle_buffer, seed, times):
    """One epoch of `src` as uint8 batches: a generator of batch sizes. `times` gets the clock
    at its start and at its first batch: the wait before training starts is paid once an
    epoch, so it is shown apart from the rate after it."""
    from pipeline import stream

    times.append(time.perf_counter())
    ms = stream.MixedStream([src], {src.name: 1.0}, batch_size, seed=seed, shuffle_buffer=shuffle_buffer,
                            normalize=False)
    for batch in stream.make_loader(ms, num_workers=workers):
        if len(times) == 1:
            times.append(time.perf_counter())
        yield len(batch["image"])


@contextlib.contextmanager
def configured(endpoint=None, threads=None, s3fs_reads=False):
    """AWS_ENDPOINT_URL and stages.PREFETCH_THREADS for one run; with s3fs_reads, s3:// shards
    read through s3fs's file object instead of a signed GET (DataLoader workers are forked,
    so they read the same way)."""
    from pipeline.data.streams import stages
    from pipeline.data.streams import reading
    from pipeline.data.store import storage
    from pipeline.data.store import direct_read

    saved = os.environ.get("AWS_ENDPOINT_URL"), reading.PREFETCH_THREADS, direct_read.direct
    if s3fs_reads:
        direct_read.direct = lambda url, timeout=30.0: None
    if endpoint:
        os.environ["AWS_ENDPOINT_URL"] = endpoint
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()  # a client cached for the other endpoint would go on using it
    if threads is not None:
        reading.PREFETCH_THREADS = threads
    try:
        yield
    finally:
        if saved[0] is None:
            os.environ.pop("AWS_ENDPOINT_URL", None)
        else:
            os.environ["AWS_ENDPOINT_URL"] = saved[0]
        reading.PREFETCH_THREADS, direct_read.direct = saved[1], saved[2]


def measure_run(src, workers, args, seed, expected, server_pid):
    """bench.cpu.measure of one epoch, less the servers' CPU time meanwhile; with the wait for
    the first batch and the rate after it."""
    from bench.cpu import measure
    from bench.proc import proc_stat

    before, times = proc_stat(server_pid), []
    r = measure(epoch(src, workers, args.batch_size, args.shuffle_buffer, seed, times), expected)
    after = proc_stat(server_pid)
    served = (after[1] - before[1]) if before and after else 0.0
    r["server_cpu_s"] = round(served, 4)
    r["cpu_s"] = round(r["cpu_s"] - served, 4)
    r["us_per_sample"] = 1e6 * r["cpu_s"] / r["samples"]
    r["first_batch_s"] = times[1] - times[0]
    r["after_first_per_s"] = (expected - args.batch_size) / max(r["wall_s"] - r["first_batch_s"], 1e-9)
    return r


def run(args, work):
    from pipeline.data.streams import stages, stream
    from pipeline.data.streams import reading
    from pipeline.files import write_json_atomic

    from bench.host import git_state, host_facts
    from bench.report import fmt_spread, log, spread

    folder = build(work) if args.synthetic else args.shards[0]
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench-key-id")  # moto takes any key
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench-secret")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    base = f"s3://{BUCKET}/shards/"
    with servers() as ports:
        direct, proxied, slow = (f"http://127.0.0.1:{ports[k]}" for k in ("s3", "s3_proxy", "s3_latency"))
        with configured(direct):
            upload(folder, base)
            s3_src = stream.resolve("mnist", base, "train")
        local_src = stream.resolve("mnist", folder, "train")
        http_src = stream.resolve("mnist", f"{direct}/{BUCKET}/shards/", "train")  # the same objects, unsigned
        paths = [("local", local_src, None, None), ("http", http_src, None, None), ("s3", s3_src, direct, None),
                 ("s3 via s3fs", s3_src, direct, None, True),
                 ("s3 proxy+0ms", s3_src, proxied, None), ("s3 proxy+50ms", s3_src, slow, None),
                 ("s3 proxy+50ms no-prefetch", s3_src, slow, 0)]
        n = local_src.total // args.batch_size * args.batch_size
        log(f"stores: {len(local_src.urls)} shards, {local_src.total} samples (epoch {n}), batch {args.batch_size}, "
            f"shuffle buffer {args.shuffle_buffer}, prefetch threads {reading.PREFETCH_THREADS}, fetch ahead "
            f"{reading.FETCH_AHEAD >> 20} MiB, latency "
            f"{LATENCY * 1000:.0f} ms, {args.repeats} repeat(s)")
        rows = {}
        for workers in args.workers:
            for name, src, *how in paths:  # untimed: imports, connections, the page cache
                with configured(*how):
                    sum(epoch(src, workers, args.batch_size, args.shuffle_buffer, 0, []))
            for r in range(args.repeats):  # each repeat starts one path later: none always follows the same one
                for name, src, *how in paths[r % len(paths):] + paths[:r % len(paths)]:
                    with configured(*how):
                        m = measure_run(src, workers, args, r + 1, n, ports["pid"])
                    rows.setdefault((workers, name), []).append(m)
                    log(f"  workers {workers} {name:<26} {m['samples_per_s']:>9,.0f} samples/s "
                        f"{m['us_per_sample']:>7.1f} CPU us/sample, first batch {1000 * m['first_batch_s']:,.0f} ms, "
                        f"{m['after_first_per_s']:,.0f} samples/s after it")
    entries = []
    for (workers, name), runs in rows.items():
        entries.append({"workers": workers, "path": name, "samples_per_s": spread([m["samples_per_s"] for m in runs]),
                        "after_first_per_s": spread([m["after_first_per_s"] for m in runs]),
                        "first_batch_ms": spread([1000 * m["first_batch_s"] for m in runs]),
                        "us_per_sample": spread([m["us_per_sample"] for m in runs]), "runs": runs})
    log(f"\nmedians [min-max] of {args.repeats}; CPU: the reading side's, the servers' process left out; "
        f"x proxy: the rate after the first batch against s3 proxy+0ms's")
    log(f"{'workers':>7} {'path':<27}{'samples/s (epoch)':>26}{'after 1st batch':>26}{'1st batch ms':>16}"
        f"{'CPU us/sample':>20}{'x proxy':>9}{'x http CPU':>12}")
    for e in entries:
        same = {x["path"]: x for x in entries if x["workers"] == e["workers"]}
        rate = e["after_first_per_s"]["median"] / same["s3 proxy+0ms"]["after_first_per_s"]["median"]
        cpu = e["us_per_sample"]["median"] / same["http"]["us_per_sample"]["median"]
        e["vs_proxy_after_first"], e["vs_http_cpu"] = rate, cpu
        log(f"{e['workers']:>7} {e['path']:<27}{fmt_spread(e['samples_per_s'], 0):>26}"
            f"{fmt_spread(e['after_first_per_s'], 0):>26}{fmt_spread(e['first_batch_ms'], 0):>16}"
            f"{fmt_spread(e['us_per_sample'], 1):>20}{rate:>9.2f}{cpu:>12.2f}")
    record = {"command": [os.path.basename(sys.executable), *sys.argv], "git": git_state(), "host": host_facts(),
              "latency_s": LATENCY, "prefetch_threads": reading.PREFETCH_THREADS, "fetch_ahead": reading.FETCH_AHEAD, "shards": len(local_src.urls),
              "samples": local_src.total, "batch_size": args.batch_size, "shuffle_buffer": args.shuffle_buffer,
              "stores": entries, "loadavg_at_end": os.getloadavg()}
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    write_json_atomic(args.json, record)
    log(f"record: {args.json}")
    return 0


def main(args):
    if args.synthetic:
        work = tempfile.mkdtemp(prefix="bench-stores-")
        try:
            return run(args, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return run(args, args.work_dir)


if __name__ == "__main__" and sys.argv[1:2] == ["serve"]:
    serve()
