"""A scale rehearsal on paper: plan, save and resume one rank's stream at a thousand GPUs.

    python tools/scale_sim.py                                  # 100,000 shards, 1,024 x 8 -> 768 and 1,280
    python tools/scale_sim.py --shards 2000 --world 16 --workers 2 --to-world 12 --to-world 20

A manifest of --shards shards is made in memory (no files), the canonical partition
(pipeline.data.partition) is fixed for --world ranks x --workers workers, one rank plans
its epoch (its slots, the deal, where each slot starts) and saves its state; every rank's
state is gathered, and one rank of each --to-world resumes from it. Prints one JSON line:
plan_s, resume_s (the slowest resume), state_bytes_per_rank (the largest), state_bytes_gathered,
covered_once (on every new world the slots cover every sample exactly once).

What it rehearses is the partition itself: the trainer's stream (pipeline.data.stream) does
not yet keep its state as the partition's per-slot counts, so these are the figures the
stream will have once it does, not today's resume cost.
"""
import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from pipeline.data import partition  # noqa: E402


def rank_state(part, epoch, rank, world, workers, counts, batches):
    """One rank's stream state: its owned slots' consumed counts and the mixture's position."""
    mine = partition.owned(part.slots, rank, world)
    return {"slots": part.slots, "epoch": epoch, "batches": batches,
            "counts": {str(s): int(counts[s]) for s in mine}}


def plan(part, epoch, rank, world, workers, counts=None):
    """Where each slot of each of this rank's workers starts: (pass, piece, offset) per slot."""
    out = []
    for w in range(max(workers, 1)):
        for s in partition.owned(part.slots, rank, world, w, workers):
            out.append(part.locate(epoch, s, 0 if counts is None else counts[s]))
    return out


def covered_once(part, epoch, world, workers):
    """Every slot owned by exactly one (rank, worker), and the slots' pieces tile every shard."""
    owners = np.zeros(part.slots, np.int64)
    for r in range(world):
        for w in range(max(workers, 1)):
            owners[partition.owned(part.slots, r, world, w, workers)] += 1
    if not (owners == 1).all():
        return False
    deal = part.deal(epoch)
    if not np.array_equal(np.sort(deal), np.arange(len(part.piece_shard))):
        return False
    samples = np.zeros(len(part.counts), np.int64)
    np.add.at(samples, part.piece_shard, part.piece_hi - part.piece_lo)
    return bool(np.array_equal(samples, part.counts))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", type=int, default=100_000)
    ap.add_argument("--world", type=int, default=1024)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--to-world", type=int, action="append", help="default: 768 and 1280")
    ap.add_argument("--samples-per-shard", type=int, default=1000)
    args = ap.parse_args(argv)
    to_worlds = args.to_world or [768, 1280]
    for flag, values, low in (("--shards", [args.shards], 1), ("--world", [args.world], 1),
                              ("--workers", [args.workers], 0), ("--to-world", to_worlds, 1),
                              ("--samples-per-shard", [args.samples_per_shard], 1)):
        for v in values:
            if not low <= v <= 10 ** 7:
                ap.error(f"{flag} {v}: between {low} and 10000000")
    counts = np.full(args.shards, args.samples_per_shard, np.int64)
    seed, epoch, source = 0, 0, 0
    slots = partition.default_slots(args.world, args.workers, args.shards)

    t = time.perf_counter()
    part = partition.Partition(counts, slots, seed=seed, source=source)
    plan(part, epoch, 0, args.world, args.workers)
    plan_s = time.perf_counter() - t

    # an interruption part-way: every slot has consumed some of its share
    sizes = part.sizes(epoch)
    consumed = np.random.default_rng(1).integers(0, np.maximum(sizes, 1))
    states = [rank_state(part, epoch, r, args.world, args.workers, consumed, 7) for r in range(args.world)]
    per_rank = max(len(json.dumps(s)) for s in states)
    blob = json.dumps({"ranks": states})

    resume_s, covered = 0.0, True
    for world in to_worlds:
        for rank in (0, world - 1):
            t = time.perf_counter()
            loaded = json.loads(blob)["ranks"]
            merged = partition.gather([s["counts"] for s in loaded], loaded[0]["slots"])
            fresh = partition.Partition(counts, loaded[0]["slots"], seed=seed, source=source)
            plan(fresh, loaded[0]["epoch"], rank, world, args.workers, merged)
            resume_s = max(resume_s, time.perf_counter() - t)
        covered &= covered_once(part, epoch, world, args.workers) and len(merged) == slots
    print(json.dumps({"plan_s": round(plan_s, 4), "resume_s": round(resume_s, 4), "state_bytes_per_rank": per_rank,
                      "state_bytes_gathered": len(blob), "covered_once": bool(covered), "slots": slots,
                      "shards": args.shards, "world": args.world, "workers": args.workers, "to_world": to_worlds}))


if __name__ == "__main__":
    main()
