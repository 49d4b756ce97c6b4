"""A scale rehearsal on paper: stop a thousand-GPU epoch, resume it on other worlds, again and again.

    python tools/scale_sim.py                    # 100,000 shards, 1,024 x 8 -> 768 -> 1,280 -> 1,024
    python tools/scale_sim.py --shards 2000 --world 16 --workers 2 --to-world 12 --to-world 20

A source of --shards shards is made in memory (no files) and the trainer's own stream
(pipeline.data.streams.stream.MixedStream) is built for every rank of --world ranks x --workers
workers. The interruption is run forward with the real plans: each rank's workers take
`--stop` batches each of their own choices (`deal.Choices`), and their runs' positions
are walked window by window (`stages.RunPlan`) to the position that many samples
reach; the stream records it as a consumed batch and writes its `state_dict`. The
states are gathered as the trainer gathers them (the segment once, each rank's own
entry), and every rank of the next --to-world resumes from them with `load_state_dict`,
is interrupted the same way and writes its own: each world re-deals what the one before
it left. Coverage is checked from what the streams hold: the positions each world read
before its stop, and the runs of the last world's pairs (all it will read), must be
apart and cover the epoch but for less than one global batch of the last world.

Prints one JSON line: plan_s (one rank's segment and its workers' first windows),
resume_s (the slowest resume of a rank, parsing the gathered state included), per world
that wrote states its generation and the bytes of a rank's state (the largest), of the
gathered state and of its segment, and whether they keep within the bounds (a rank's
state at most 1 KB, the gathered state at most 64 B a rank plus the segment),
covered_once and batches_left (the fewest batches a rank of the last world makes).
"""
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from pipeline.cli import Parser  # noqa: E402

BATCH = 256
RANK_BYTES, ENTRY_BYTES = 1024, 64  # the bounds: a rank's state; each rank's share of the gathered state


def parse_args(argv=None):
    """The command line, checked; it needs neither numpy nor torch, so --help and a bad
    flag answer before they load (the `__main__` block parses first)."""
    ap = Parser(prog="scale_sim", description=__doc__.splitlines()[0])
    ap.add_argument("--shards", type=int, default=100_000)
    ap.add_argument("--world", type=int, default=1024)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--to-world", type=int, action="append",
                    help="the worlds that resume, in turn, each from the one before (default: 768, 1280, 1024)")
    ap.add_argument("--samples-per-shard", type=int, default=1000)
    ap.add_argument("--stop", type=int, default=7, help="batches each old worker made before the stop (default: 7)")
    args = ap.parse_args(argv)
    args.to_world = args.to_world or [768, 1280, 1024]
    for flag, values, low in (("--shards", [args.shards], 1), ("--world", [args.world], 1),
                              ("--workers", [args.workers], 0), ("--to-world", args.to_world, 1),
                              ("--samples-per-shard", [args.samples_per_shard], 1), ("--stop", [args.stop], 0)):
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

from pipeline.ordering import deal, state_format  # noqa: E402
from pipeline.data.decoding.decode import Target  # noqa: E402
from pipeline.data.manifests.manifest import Source  # noqa: E402
from pipeline.data.streams.plans import RunPlan  # noqa: E402
from pipeline.data.streams.stream import MixedStream  # noqa: E402
from pipeline.ordering.topology import Topology  # noqa: E402


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
        run = RunPlan(stream.source_order(0, seg.epoch), stream.sources[0].urls, seg.runs(pair)[0],
                      reserve=seg.reserves(pair, plan.targets)[0])  # a run short of its quota goes on there
        while taken and run.state((w_ := run.next()).size - w_.skip) < taken:
            pass
        stream.record({"plan": plan.id, "worker": w, "batches": done, "positions": [taken]})
    return stream.state_dict()


def gathered(states):
    """Every rank's state as the trainer's checkpoint holds it (Run.state): the segment once,
    each rank's own entry."""
    return dict(states[0], ranks=[s["ranks"][0] for s in states])


def read_by(seg, state):
    """The spans of positions the pairs of `seg` read, by a gathered state of it: each pair's run
    is a range of places in the segment's spans (pairs in order), read from its start."""
    done, passed = state["done"], {}
    for r in state["ranks"]:
        for w, v in r["passed"]:
            passed[r["rank"] + w * seg.world] = v
    starts = np.concatenate([[0], np.cumsum(seg.quotas()[:, 0])])
    read = {rank + w * seg.world: n[0] for rank in range(seg.world)
            for w, n in state_format.positions(seg, done, passed, rank).items()}
    return deal.cut_all(seg.spans[0], [(int(starts[p]), int(starts[p]) + min(read[p], int(seg.quotas()[p, 0])))
                                       for p in range(seg.pairs)])


def covered_once(spans, total, global_batch):
    """No position in two runs, and all of the epoch but less than one global batch."""
    spans = sorted(spans)
    apart = all(b[0] >= a[0] + a[1] for a, b in zip(spans, spans[1:]))
    unread = total - sum(n for _, n in spans)
    return apart and 0 <= unread < global_batch


def main(argv=None):
    args = parse_args(argv)
    src = big_source(args.shards, args.samples_per_shard)

    t = time.perf_counter()
    first_windows(stream_at(src, 0, args.world, args.workers))
    plan_s = time.perf_counter() - t

    text, reads, hops, resume_s, same = None, [], [], 0.0, True
    for world in (args.world, *args.to_world):
        states, seg = [], None
        for rank in range(world):
            t = time.perf_counter()
            s = stream_at(src, rank, world, args.workers)
            if text is not None:
                s.load_state_dict(json.loads(text))
                first_windows(s)
                resume_s = max(resume_s, time.perf_counter() - t)
            seg = seg or s.current()
            same &= s.current() == seg  # every rank of a world deals itself the same segment
            states.append(json.loads(json.dumps(interrupted(s, args.stop))))
        state = gathered(states)
        text = json.dumps(state)
        segment = len(json.dumps({k: v for k, v in state.items() if k != "ranks"}))
        per_rank = max(len(json.dumps(x)) for x in states)
        hops.append({"world": world, "generation": seg.generation, "state_bytes_per_rank": per_rank,
                     "state_bytes_gathered": len(text), "segment_bytes": segment,
                     "within_bounds": per_rank <= RANK_BYTES and len(text) <= ENTRY_BYTES * world + segment})
        reads.append(read_by(seg, state))
    whole = deal.cut(seg.spans[0], 0, int(seg.quotas()[:, 0].sum()))  # all the last world's pairs read
    covered = same and covered_once([x for r in reads[:-1] for x in r] + whole, int(state["targets"][0]),
                                    seg.world * BATCH)
    print(json.dumps({"plan_s": round(plan_s, 4), "resume_s": round(resume_s, 4), "hops": hops,
                      "state_bytes_per_rank": max(h["state_bytes_per_rank"] for h in hops),
                      "state_bytes_gathered": max(h["state_bytes_gathered"] for h in hops),
                      "within_bounds": all(h["within_bounds"] for h in hops), "covered_once": bool(covered),
                      "batches_left": seg.batches, "shards": args.shards, "workers": args.workers}))


if __name__ == "__main__":
    main()
