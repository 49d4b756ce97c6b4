"""tools/scale_sim.py: the interruption run forward with the real plans, every resumed rank
checked from its own state, and a re-deal broken on purpose turns covered_once false."""
import json

import pytest

from helpers import tool_module
from pipeline.data import deal

ARGS = ["--shards", "300", "--samples-per-shard", "100", "--world", "6", "--workers", "2", "--to-world", "4",
        "--to-world", "9", "--stop", "3"]


def run(capsys, args=ARGS):
    tool_module("scale_sim").main(args)
    return json.loads(capsys.readouterr().out)


def test_every_resumed_rank_covers_the_epoch_once(capsys):
    r = run(capsys)
    assert r["covered_once"] is True and r["ranks_checked"] == 13 and r["batches_left"] > 0
    assert r["state_bytes_per_rank"] < 4096


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


def test_a_sample_of_the_ranks_is_checked_at_scale(capsys):
    r = run(capsys, ARGS + ["--ranks-checked", "3"])
    assert r["covered_once"] is True and r["ranks_checked"] == 6


def test_bad_flags_are_one_line_before_numpy_loads(capsys):
    with pytest.raises(SystemExit) as e:
        tool_module("scale_sim").parse_args(["--shards", "1", "--world", "2"])
    assert e.value.code == 2 and "less than one batch of 256 per rank on 768 ranks" in capsys.readouterr().err
