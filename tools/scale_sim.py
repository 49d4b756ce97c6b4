"""A scale rehearsal on paper: stop a thousand-GPU epoch, resume it on other worlds, check coverage.

    python tools/scale_sim.py                                  # 100,000 shards, 1,024 x 8 -> 768 and 1,280
    python tools/scale_sim.py --shards 2000 --world 16 --workers 2 --to-world 12 --to-world 20

A source of --shards shards is made in memory (no files) and the trainer's own stream
(pipeline.data.stream.MixedStream) is built for every rank of --world ranks x --workers
workers. The interruption is run forward with the real plans: each rank's workers take
`--stop` batches each of their own choices (`deal.Choices`), and their runs' positions
are walked window by window (`stages.RunPlan`) to the position that many samples
reach; the stream records it as a consumed batch and writes its `state_dict`. Every
rank of each --to-world then resumes from the gathered states with `load_state_dict`
(or a random --ranks-checked of them), and coverage is checked from what those
resumed streams hold: the positions each of their pairs will read (their segment's
runs) must be disjoint from each other and from what the old world read, and together
with it cover the epoch but for less than one global batch.

Prints one JSON line: plan_s (one rank's segment and its workers' first windows),
resume_s (the slowest resume, parsing the gathered state included),
state_bytes_per_rank (the largest), state_bytes_gathered, covered_once, batches_left
(the fewest a resumed rank still makes), ranks_checked.
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
    ap.add_argument("--stop", type=int, default=7, help="batches each old worker made before the stop (default: 7)")
    ap.add_argument("--ranks-checked", type=int, default=64,
                    help="resumed ranks of each new world whose pairs are checked, at random (default: 64; "
                         "every rank when the world is no larger)")
    args = ap.parse_args(argv)
    args.to_world = args.to_world or [768, 1280]
    for flag, values, low in (("--shards", [args.shards], 1), ("--world", [args.world], 1),
                              ("--workers", [args.workers], 0), ("--to-world", args.to_world, 1),
                              ("--samples-per-shard", [args.samples_per_shard], 1), ("--stop", [args.stop], 0),
                              ("--ranks-checked", [args.ranks_checked], 1)):
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

from pipeline.data import deal  # noqa: E402
from pipeline.data.decode import Target  # noqa: E402
from pipeline.data.manifest import Source  # noqa: E402
from pipeline.data.stages import RunPlan  # noqa: E402
from pipeline.data.stream import MixedStream  # noqa: E402
from pipeline.data.topology import Topology  # noqa: E402


def big_source(shards, per_shard):
    urls = [f"pipe:cat /corpus/big-{i:06d}.tar" for i in range(shards)]
    return Source("big", urls, [per_shard] * shards, Target((3, 32, 32)), [str(c) for c in range(10)],
                  [0.5] * 3, [0.25] * 3)


def stream_at(src, rank, world, workers):
    s = MixedStream([src], {"big": 1}, BATCH, Topology(rank, world))
    s.set_workers(max(workers, 1))
    return s


def first_windows(stream):
    """Every worker's first window of this rank: what each computes before its first read."""
    seg = stream.current()
    runs = [seg.runs(pair)[0] for pair in pairs_of(seg, stream.topo.rank)]
    return [RunPlan(stream.source_order(0, seg.epoch), stream.sources[0].urls, run).next() for run in runs if run]


def pairs_of(seg, rank):
    return [rank + w * seg.world for w in range(seg.workers)]


def interrupted(stream, stop):
    """The rank's state after each of its workers made `stop` batches (fewer where its
    share is smaller): each run walked window by window, with the real plan, to the
    position its taken samples reach, and recorded as the loader records a batch."""
    plan = stream.plan()
    seg = plan.segment
    for w, pair in enumerate(pairs_of(seg, stream.topo.rank)):
        done = min(stop, seg.worker_batches(w))
        taken = int(seg.choices(pair).taken(done * BATCH)[0])
        run = RunPlan(stream.source_order(0, seg.epoch), stream.sources[0].urls, seg.runs(pair)[0])
        while taken and run.state((w_ := run.next()).size - w_.skip) < taken:
            pass
        stream.record({"plan": plan.id, "worker": w, "batches": done, "positions": [taken]})
    return stream.state_dict()


def read_before(src, states, workers):
    """The positions the old world read: each old pair's run up to its recorded position,
    from the old segment as a stream loading those states on the old world holds it."""
    old = stream_at(src, 0, states[0]["segment"]["world"], workers)
    old.load_state_dict(states)
    seg = old.current()
    return [span for s in states for r in s["ranks"] for w in range(seg.workers)
            for span in deal.cut(seg.runs(r["rank"] + w * seg.world)[0], 0, r["positions"][str(w)][0])]


def covered_once(before, after, total, global_batch, every):
    """No position in two runs (read before, or to be read by a checked pair after), and,
    where every new rank was checked, all of the epoch but less than one global batch."""
    spans = sorted(before + after)
    apart = all(b[0] >= a[0] + a[1] for a, b in zip(spans, spans[1:]))
    unread = total - sum(n for _, n in spans)
    return apart and (not every or 0 <= unread < global_batch)


def main(argv=None):
    args = parse_args(argv)
    src = big_source(args.shards, args.samples_per_shard)

    t = time.perf_counter()
    first_windows(stream_at(src, 0, args.world, args.workers))
    plan_s = time.perf_counter() - t

    states = [json.loads(json.dumps(interrupted(stream_at(src, r, args.world, args.workers), args.stop)))
              for r in range(args.world)]
    per_rank = max(len(json.dumps(s)) for s in states)
    blob = json.dumps(states)
    before = read_before(src, states, args.workers)
    total = int(states[0]["targets"][0])

    rng = np.random.default_rng(1)
    resume_s, covered, left, checked = 0.0, True, None, 0
    for world in args.to_world:
        ranks = range(world) if world <= args.ranks_checked else sorted(
            rng.choice(world, args.ranks_checked, replace=False).tolist())
        after = []
        for rank in ranks:
            t = time.perf_counter()
            resumed = stream_at(src, rank, world, args.workers)
            resumed.load_state_dict(json.loads(blob))
            first_windows(resumed)
            resume_s = max(resume_s, time.perf_counter() - t)
            seg = resumed.current()  # the resumed stream's own segment: what its pairs will read
            left = seg.batches if left is None else min(left, seg.batches)
            after += [span for pair in pairs_of(seg, rank) for span in seg.runs(pair)[0]]
            checked += 1
        covered &= covered_once(before, after, total, world * BATCH, len(ranks) == world)
    print(json.dumps({"plan_s": round(plan_s, 4), "resume_s": round(resume_s, 4), "state_bytes_per_rank": per_rank,
                      "state_bytes_gathered": len(blob), "covered_once": bool(covered), "batches_left": left,
                      "ranks_checked": checked, "shards": args.shards, "world": args.world, "workers": args.workers,
                      "to_world": args.to_world}))


if __name__ == "__main__":
    main()
