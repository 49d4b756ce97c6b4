"""A scale rehearsal on paper: plan, save and resume one rank's stream at a thousand GPUs.

    python tools/scale_sim.py                                  # 100,000 shards, 1,024 x 8 -> 768 and 1,280
    python tools/scale_sim.py --shards 2000 --world 16 --workers 2 --to-world 12 --to-world 20

A source of --shards shards is made in memory (no files), and the trainer's own stream
(pipeline.data.stream.MixedStream) is built for rank 0 of --world ranks x --workers
workers: it fixes the canonical partition and plans every worker's first window (what
each worker computes before its first read). Every rank's state after an interruption
part-way through the epoch is written with the stream's own `state_dict`, gathered, and
rank 0 and the last rank of each --to-world resume from it with `load_state_dict` (the
re-deal) and plan their workers' first windows. Prints one JSON line: plan_s, resume_s
(the slowest resume, parsing the gathered state included), state_bytes_per_rank (the
largest), state_bytes_gathered, covered_once (on every new world each slot is dealt to
exactly one (rank, worker), every pair owns one, and the slots' pieces tile every shard),
batches_left (the fewest a resumed rank still makes: the stop was inside the epoch).
"""
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from pipeline.cli import Parser  # noqa: E402

BATCH = 256


def parse_args(argv=None):
    """The command line, checked; it needs neither numpy nor torch, so --help and a bad
    flag answer before they load (the `__main__` block parses first)."""
    ap = Parser(prog="scale_sim", description=__doc__.splitlines()[0])
    ap.add_argument("--shards", type=int, default=100_000)
    ap.add_argument("--world", type=int, default=1024)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--to-world", type=int, action="append", help="default: 768 and 1280")
    ap.add_argument("--samples-per-shard", type=int, default=1000)
    args = ap.parse_args(argv)
    args.to_world = args.to_world or [768, 1280]
    for flag, values, low in (("--shards", [args.shards], 1), ("--world", [args.world], 1),
                              ("--workers", [args.workers], 0), ("--to-world", args.to_world, 1),
                              ("--samples-per-shard", [args.samples_per_shard], 1)):
        for v in values:
            if not low <= v <= 10 ** 7:
                ap.error(f"{flag} {v}: between {low} and 10000000")
    total = args.shards * args.samples_per_shard
    for world in (args.world, *args.to_world):
        if total < world * BATCH:
            ap.error(f"{total} samples are less than one batch of {BATCH} per rank on {world} ranks")
    return args


if __name__ == "__main__":
    parse_args()

import numpy as np  # noqa: E402

from pipeline.data import partition  # noqa: E402
from pipeline.data.decode import Target  # noqa: E402
from pipeline.data.manifest import Source  # noqa: E402
from pipeline.data.stream import MixedStream, redeal_order  # noqa: E402
from pipeline.data.topology import Topology, Worker  # noqa: E402


def big_source(shards, per_shard):
    urls = [f"pipe:cat /corpus/big-{i:06d}.tar" for i in range(shards)]
    return Source("big", urls, [per_shard] * shards, Target((3, 32, 32)), [str(c) for c in range(10)],
                  [0.5] * 3, [0.25] * 3)


def stream_at(src, rank, world, workers, parts=None):
    s = MixedStream([src], {"big": 1}, BATCH, Topology(rank, world))
    s.set_workers(max(workers, 1))
    if parts is not None:  # the same partition (same seed and K): built once, not once per simulated rank
        s.slots, s._parts = [parts[0].slots], parts
    return s


def plan(stream, workers):
    """Every worker's first window of this rank."""
    return [stream._plan(0, Worker(w, max(workers, 1)), stream.segment).next() for w in range(max(workers, 1))]


def interrupted(stream, workers, rng):
    """The rank's state part-way through the epoch: each owned slot some way into its share."""
    part = stream.partitions()[0]
    sizes = part.sizes(0)
    n = max(workers, 1)
    counts = {}
    for w in range(n):
        mine = partition.owned(part.slots, stream.topo.rank, stream.topo.world, w, n)
        counts[w] = {s: int(rng.integers(0, max(int(sizes[s]), 1))) for s in mine}
    stream.segment.counts = [counts]
    batches = stream.segment.batches  # 7 made by each worker, fewer where its share is small: some stay to resume
    stream.segment.done = {w: max(0, min(7, batches // n + (w < batches % n) - 1)) for w in range(n)}
    return stream.state_dict()


def covered_once(part, merged, world, workers):
    """The re-deal hands each slot to exactly one (rank, worker), every pair gets at least
    one, and the pieces of the slots tile every shard."""
    order = redeal_order(part.sizes(0), merged)
    owners = np.zeros(part.slots, np.int64)
    n = max(workers, 1)
    for r in range(world):
        for w in range(n):
            mine = [order[j] for j in partition.owned(part.slots, r, world, w, n)]
            if not mine:
                return False
            owners[mine] += 1
    if not (owners == 1).all() or sorted(order) != list(range(part.slots)):
        return False
    samples = np.zeros(len(part.counts), np.int64)
    np.add.at(samples, part.piece_shard, part.piece_hi - part.piece_lo)
    return bool(np.array_equal(samples, part.counts))


def main(argv=None):
    args = parse_args(argv)
    src = big_source(args.shards, args.samples_per_shard)

    t = time.perf_counter()
    first = stream_at(src, 0, args.world, args.workers)
    plan(first, args.workers)
    plan_s = time.perf_counter() - t
    parts = first.partitions()

    rng = np.random.default_rng(1)
    states = [interrupted(stream_at(src, r, args.world, args.workers, parts), args.workers, rng)
              for r in range(args.world)]
    per_rank = max(len(json.dumps(s)) for s in states)
    blob = json.dumps({"ranks": states})

    resume_s, covered, left = 0.0, True, None
    merged = partition.gather([m for s in states for m in s["counts"][0].values()], parts[0].slots)
    for world in args.to_world:
        for rank in (0, world - 1):
            t = time.perf_counter()
            resumed = stream_at(src, rank, world, args.workers)
            resumed.load_state_dict(json.loads(blob))
            plan(resumed, args.workers)
            resume_s = max(resume_s, time.perf_counter() - t)
            left = resumed.segment.batches if left is None else min(left, resumed.segment.batches)
        covered &= covered_once(parts[0], merged, world, args.workers)
        if world * max(args.workers, 1) > parts[0].slots:
            print(f"scale_sim: note: {world} ranks x {max(args.workers, 1)} workers are more pairs than the "
                  f"{parts[0].slots} slots: the pairs without one borrow a slot (make_loader warns so), and "
                  f"covered_once, which needs every pair to own one, is false", file=sys.stderr)
    print(json.dumps({"plan_s": round(plan_s, 4), "resume_s": round(resume_s, 4), "state_bytes_per_rank": per_rank,
                      "state_bytes_gathered": len(blob), "covered_once": bool(covered), "batches_left": left,
                      "slots": parts[0].slots,
                      "shards": args.shards, "world": args.world, "workers": args.workers, "to_world": args.to_world}))


if __name__ == "__main__":
    main()
