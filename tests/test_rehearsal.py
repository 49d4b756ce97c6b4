"""tools/rehearsal.py at a small size: synthetic shards served by `python -m http.server` on
127.0.0.1, 2 ranks x 2 workers training from the HTTP URLs with a shard cache."""
import json
import sys
from pathlib import Path

import pytest

from helpers import HANG, run_capture

TOOL = Path(__file__).resolve().parents[1] / "tools" / "rehearsal.py"


@pytest.mark.slow
def test_rehearsal_reports_startup_speed_memory_and_cache(tmp_path):
    out = tmp_path / "r.json"
    p = run_capture([sys.executable, str(TOOL), "--samples", "12000", "--shards", "60", "--steps", "40",
                     "--work", str(tmp_path / "work"), "--workers", "2", "--json", str(out)],
                    capture_output=True, text=True, timeout=HANG)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["samples"] == 12000 and r["steps"] == 40 and r["world_size"] == 2 and "synthetic" in r["data"]
    assert 0 < r["startup_s"]["resolve_s"] < r["startup_s"]["first_batch_s"] < 120
    assert r["loader_samples_per_s"]["http"] > 0 and r["loader_samples_per_s"]["local"] > 0
    assert 0 < r["cache_mib"] <= r["shards_mib"] * 1.01  # what was fetched, each shard once
    assert r["rss_samples"] >= 3, r  # the thirds need samples in each
    for kind in ("rss", "pss"):
        assert r["peak_memory_mib"][kind]["last_over_first"] < 1.5, r["peak_memory_mib"]
