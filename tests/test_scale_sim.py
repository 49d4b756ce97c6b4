"""tools/scale_sim.py: the interruption run forward with the real plans, each world resumed
from the one before it, the states' sizes within their bounds, and a re-deal broken on
purpose turns covered_once false."""
import json

import pytest

from helpers import tool_module
from pipeline.ordering import deal, state_format

ARGS = ["--shards", "300", "--samples-per-shard", "100", "--world", "6", "--workers", "2", "--to-world", "4",
        "--to-world", "9", "--stop", "3"]


def run(capsys, args=ARGS):
    state_format._made.cache_clear()  # segments made by another test's deal
    state_format.redeal.cache_clear()
    tool_module("scale_sim").main(args)
    return json.loads(capsys.readouterr().out)


def test_each_world_resumes_from_the_last_and_the_epoch_is_covered_once(capsys):
    r = run(capsys)
    assert r["covered_once"] is True and r["batches_left"] > 0
    assert [(h["world"], h["generation"]) for h in r["hops"]] == [(6, 0), (4, 1), (9, 2)]
    assert r["within_bounds"] is True


def test_the_state_is_o1_a_rank_and_o_world_gathered_after_three_re_deals(capsys):
    """8 workers a rank, four worlds: a rank's state stays under 1 KB and each rank adds at most
    64 bytes to the gathered state (its entry: rank, what it passed over, its check), the
    segment counted once; before, a rank's entry listed every worker's batches and
    positions, and re-dealt segments every span."""
    r = run(capsys, ["--shards", "1000", "--samples-per-shard", "100", "--world", "8", "--workers", "8",
                     "--to-world", "6", "--to-world", "10", "--to-world", "8", "--stop", "1"])
    assert r["covered_once"] is True and [h["generation"] for h in r["hops"]] == [0, 1, 2, 3]
    for h in r["hops"]:
        assert h["state_bytes_per_rank"] <= 1024 and h["state_bytes_gathered"] <= 64 * h["world"] + h["segment_bytes"]
    assert r["within_bounds"] is True


def _rest_reading_again(self, read, **kw):
    """A re-deal that forgets what the old pairs read: every position is dealt again."""
    return real_rest(self, [[0] * len(r) for r in read], **kw)


def _rest_dropping_a_span(self, read, **kw):
    seg = real_rest(self, read, **kw)
    return deal.Segment(seg.epoch, seg.generation, seg.world, seg.workers, seg.batch_size, seg.batches,
                        tuple(spans[1:] for spans in seg.spans), seg.seed, seg.passes)


real_rest = deal.Segment.rest


@pytest.mark.parametrize("broken", [_rest_reading_again, _rest_dropping_a_span])
def test_a_broken_re_deal_is_caught(capsys, monkeypatch, broken):
    monkeypatch.setattr(deal.Segment, "rest", broken)
    assert run(capsys)["covered_once"] is False


def test_bad_flags_are_one_line_before_numpy_loads(capsys):
    with pytest.raises(SystemExit) as e:
        tool_module("scale_sim").parse_args(["--shards", "1", "--world", "2"])
    assert e.value.code == 2 and "less than one batch of 256 per rank on 768 ranks" in capsys.readouterr().err
