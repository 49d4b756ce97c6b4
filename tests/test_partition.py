"""The canonical partition: K slots dealt like webdataset's splitters, positions reached
directly, counts range-checked, and the same slots re-dealt on another world."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds

from pipeline.data import partition
from pipeline.data.partition import Partition, default_slots, owned

TOOL = Path(__file__).resolve().parents[1] / "tools" / "scale_sim.py"


def wds_owned(slots, rank, world, worker, workers, monkeypatch):
    """What webdataset's own splitters give this (rank, worker) of range(slots)."""
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("WORKER", str(worker))
    monkeypatch.setenv("NUM_WORKERS", str(workers))
    return list(wds.split_by_worker(wds.split_by_node(list(range(slots)))))


@pytest.mark.parametrize("workers", range(5))
def test_the_deal_agrees_with_webdataset_and_covers_each_slot_once(workers, monkeypatch):
    for world in range(1, 65):
        slots = default_slots(world, workers, shards=50)
        seen = []
        for r in range(world):
            for w in range(max(workers, 1)):
                mine = owned(slots, r, world, w, workers)
                if world in (1, 2, 7, 64) or r == world - 1:  # webdataset's islices are slow to set up per call
                    assert mine == wds_owned(slots, r, world, w, max(workers, 1), monkeypatch), (world, workers, r, w)
                assert mine, f"rank {r} worker {w} of {world} x {workers} owns no slot"
                seen += mine
        assert sorted(seen) == list(range(slots)), (world, workers)


def test_default_slots_cover_the_world_and_grow_with_it():
    assert default_slots(4, 2, shards=1000) == 96          # 12 per pair while shards allow
    assert default_slots(4, 2, shards=2) == 8              # at least one per pair
    assert default_slots(4, 0, shards=1000) == 48          # 0 workers is one reader per rank
    assert default_slots(1024, 8, 100_000) >= 1280 * 8      # a larger world still has a slot per pair


@pytest.mark.parametrize("shards,slots", [(40, 8), (3, 8), (1, 5), (10, 10)])
def test_pieces_tile_every_shard_once(shards, slots):
    counts = np.arange(1, shards + 1) * 7
    part = Partition(counts, slots, seed=3, source=1)
    seen = {}
    for s in range(slots):
        for shard, lo, hi in part.pieces(5, s):
            seen.setdefault(int(shard), []).append((int(lo), int(hi)))
    for shard, ranges in seen.items():
        ranges.sort()
        assert ranges[0][0] == 0 and ranges[-1][1] == counts[shard]
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert sorted(seen) == list(range(shards))
    assert part.sizes(5).sum() == counts.sum()
    assert [part.size(5, s) for s in range(slots)] == list(part.sizes(5))


def test_small_sources_reach_every_slot_when_parts_allow():
    part = Partition([100, 100], 8, seed=0, source=0)  # 2 shards x 4 parts = 8 pieces
    assert all(part.size(0, s) > 0 for s in range(8))


def test_orders_are_pure_functions_of_seed_epoch_source():
    a, b = Partition([5] * 30, 6, seed=1, source=0), Partition([5] * 30, 6, seed=1, source=0)
    assert np.array_equal(a.deal(2), b.deal(2))
    assert not np.array_equal(a.deal(2), a.deal(3))
    assert not np.array_equal(a.deal(2), Partition([5] * 30, 6, seed=2, source=0).deal(2))
    assert not np.array_equal(a.deal(2), Partition([5] * 30, 6, seed=1, source=1).deal(2))


def test_locate_reaches_any_position_directly_and_later_passes_reorder():
    part = Partition([3, 4, 5, 6, 7, 8], 2, seed=0, source=0)
    size = part.size(0, 1)
    rows = part.pieces(0, 1)
    walk = [part.locate(0, 1, p) for p in range(size)]
    # the first pass reads the slot's pieces in their dealt order, every sample once
    assert walk == [(0, k, i) for k, (_, lo, hi) in enumerate(rows) for i in range(hi - lo)]
    second = [part.locate(0, 1, size + p) for p in range(size)]
    assert {(k, i) for _, k, i in second} == {(k, i) for _, k, i in walk} and {t for t, _, _ in second} == {1}
    assert part.locate(0, 1, 10 * size + 3) == Partition([3, 4, 5, 6, 7, 8], 2, seed=0, source=0).locate(
        0, 1, 10 * size + 3)


def test_a_resampled_slot_reaches_any_position_with_one_draw(monkeypatch):
    """--resample windows each stand for the same span of positions, so any position is one
    generator draw away: reading on costs a draw a window, and a hostile count near 2**53
    costs no more than the first (summing earlier windows took 500,500 draws for 1,000)."""
    part = Partition([3, 4, 5, 6, 7, 8], 2, seed=0, source=0)
    calls = []
    real = partition.generator
    monkeypatch.setattr(partition, "generator", lambda *key: (key[0] == partition.RESAMPLE and calls.append(key))
                        or real(*key))
    walk, at = [], 0
    for _ in range(1000):
        _, start, size, key = part.resampled(1, 0, at, 2)
        walk.append((start, size, key))
        at = start + size
    assert len(calls) == 1000 and all(a[0] + a[1] == b[0] for a, b in zip(walk, walk[1:]))
    calls.clear()
    _, start, size, _ = part.resampled(1, 0, 2 ** 52, 2)
    assert len(calls) == 1 and start <= 2 ** 52 < start + size
    assert part.resampled(1, 0, walk[700][0] + 1, 2)[1:] == walk[700]


@pytest.mark.parametrize("bad", [{"9": 1}, {"-1": 1}, {"x": 1}, {"1": -1}, {"1": 2 ** 60}, {"1": True},
                                 {"1": "3"}, {"1": 1.5}, {" 1": 1}, [1, 2]])
def test_hostile_counts_are_one_line_errors(bad):
    with pytest.raises(ValueError):
        partition.check_counts(bad, 4)


def test_gather_refuses_a_slot_claimed_twice():
    assert partition.gather([{"0": 1, "2": 3}, {"1": 0}], 3) == {0: 1, 2: 3, 1: 0}
    with pytest.raises(ValueError, match="more than one"):
        partition.gather([{"0": 1}, {"0": 2}], 3)


def test_generator_keys_must_be_integers():
    assert partition.generator(1, 2).integers(1 << 30) == partition.generator(1, 2).integers(1 << 30)
    for key in [(-1,), (1.5,), ("1",), (True,)]:
        with pytest.raises(ValueError):
            partition.generator(*key)


def test_generator_draws_what_its_keyed_philox_always_drew():
    """Checkpoints hold positions, not draws: every order a stream ever took must come back
    from its key, so the generator stays Philox keyed by SeedSequence(key).generate_state(2)."""
    for key in [(0,), (0, 0), (3, 0, 1, 7), (5, 1 << 40, 2, 0, 9), ((1 << 32) - 1, 1 << 32, 1 << 64, (1 << 63) + 5),
                (np.int64(7), 1 << 100)]:
        words = np.random.SeedSequence(list(map(int, key))).generate_state(2, np.uint64)
        want = np.random.Generator(np.random.Philox(key=words))
        got = partition.generator(*key)
        assert np.array_equal(got.permutation(1000), want.permutation(1000))
        assert np.array_equal(got.random(257), want.random(257))
        seed = np.random.SeedSequence(list(map(int, key))).generate_state(1, np.uint64)[0]
        assert partition.seed_of(key) == int(seed) >> 1


def test_elastic_redeal_goes_on_from_each_slots_count_and_reads_nothing_twice():
    """4 ranks x 2 workers -> 3 x 1 -> 6 x 3 -> 4 x 2: each hop re-deals the same slots, every
    slot goes on from its count, and over the whole epoch no sample is read twice."""
    counts = [11] * 20
    slots = default_slots(4, 2, len(counts))
    part = Partition(counts, slots, seed=0, source=0)
    sizes = part.sizes(0)
    done = {s: 0 for s in range(slots)}
    read = []
    for world, workers in [(4, 2), (3, 1), (6, 3), (4, 2)]:
        for r in range(world):
            for w in range(max(workers, 1)):
                for s in owned(slots, r, world, w, workers):
                    step = min(3, int(sizes[s]) - done[s])
                    for p in range(done[s], done[s] + step):
                        _, k, i = part.locate(0, s, p)
                        shard, lo, _ = part.pieces(0, s)[k]
                        read.append((int(shard), int(lo) + i))
                    done[s] += step
        # the state carried to the next world is the counts alone
        done = partition.gather([{str(s): done[s] for s in owned(slots, r, world)} for r in range(world)], slots)
    assert len(read) == len(set(read))


@pytest.mark.slow
def test_scale_sim_prints_one_json_line_with_the_slots_covered_once():
    p = subprocess.run([sys.executable, str(TOOL), "--shards", "3000", "--world", "32", "--workers", "4",
                        "--to-world", "24", "--to-world", "40"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = p.stdout.strip().splitlines()
    assert len(lines) == 1
    r = json.loads(lines[0])
    assert r["covered_once"] is True
    assert r["state_bytes_per_rank"] < 4096 and r["plan_s"] >= 0 and r["resume_s"] >= 0  # times: a benchmark figure, not a test
    assert r["state_bytes_gathered"] >= 32 * 2 and r["batches_left"] > 0


def test_scale_sim_runs_where_a_worker_has_fewer_than_its_simulated_batches(capsys):
    """10 shards on 16 ranks x 8 workers: 2 batches a rank, fewer than the 7 a worker had
    made in the simulated interruption, which the resume then refused. The stop stays inside
    the epoch: the resumed ranks have batches left."""
    from helpers import tool_module

    tool_module("scale_sim").main(["--shards", "10", "--world", "16", "--to-world", "12"])
    r = json.loads(capsys.readouterr().out)
    assert r["covered_once"] is True and r["batches_left"] > 0, r
    with pytest.raises(SystemExit) as e:  # checked before numpy and torch load: one line
        tool_module("scale_sim").parse_args(["--shards", "1", "--world", "2"])
    assert e.value.code == 2 and "less than one batch of 256 per rank on 768 ranks" in capsys.readouterr().err


@pytest.mark.parametrize("rank, world, worker, workers", [(5, 4, 0, 0), (-1, 4, 0, 0), (0, 0, 0, 0), (0, 1, 3, 2),
                                                          (0, 1, 0, -2)])
def test_owned_refuses_ranks_and_workers_out_of_range(rank, world, worker, workers):
    with pytest.raises(ValueError, match="out of range"):
        partition.owned(10, rank, world, worker, workers)
