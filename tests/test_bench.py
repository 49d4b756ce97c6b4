"""tools/bench_loader.py end to end on its own tiny synthetic inputs.

One subprocess run covers every part (A/B/C throughput at workers 0 and 2, peak memory at
1x and 10x, profile and read ceiling); the test checks the exit code and the JSON record's
structure, not the figures, which mean nothing at this size.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # one benchmark run in a subprocess: ~45 s

TOOL = Path(__file__).resolve().parents[1] / "tools" / "bench_loader.py"


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    out = tmp / "b.json"
    proc = subprocess.run([sys.executable, str(TOOL), "--synthetic", "--samples", "512", "--batch-size", "128",
                           "--repeats", "1", "--profile", "--json", str(out)],
                          cwd=tmp, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "x A" in proc.stdout and "peak memory" in proc.stdout
    assert not (tmp / "bench-out").exists()  # --synthetic keeps its inputs in a temporary folder
    return json.loads(out.read_text())


def test_throughput_entries(record):
    entries = {(e["method"], e["encoding"], e["workers"]): e for e in record["throughput"]}
    for w in (0, 2):
        assert ("A", None, w) in entries
        for enc in ("raw", "png"):
            b, c = entries[("B", enc, w)], entries[("C", enc, w)]
            for e in (b, c):
                assert e["samples_per_s"]["median"] > 0 and e["samples_per_cpu_s"]["median"] > 0
                assert len(e["runs"]) == 1 and e["runs"][0]["samples"] == 512
                for metric in ("samples_per_s", "samples_per_cpu_s"):
                    r = e["ratios"]["vs_A"][metric]
                    assert 0 < r["min"] <= r["median"] <= r["max"]
            assert c["ratios"]["vs_B"]["samples_per_cpu_s"]["median"] > 0
    for w in (0, 2):
        assert entries[("A", None, w)]["ratios"] == {}
        assert entries[("A", None, w)]["samples_per_s"]["median"] > 0
    # the workers' CPU (reaped by us or by a forkserver) must be counted
    assert entries[("C", "raw", 2)]["runs"][0]["cpu_workers_s"] > 0
    assert entries[("C", "raw", 0)]["runs"][0]["cpu_workers_s"] == 0


def test_memory_entries(record):
    mem = record["memory"]
    assert mem["baseline"]["peak_rss_mib"] > 0
    assert [e["method"] for e in mem["entries"]] == ["A", "B", "C"]
    for e in mem["entries"]:
        assert e["ratio_10x_1x"] > 0
        for scale in ("scale_1x", "scale_10x"):
            assert e[scale]["peak_rss_mib"] >= mem["baseline"]["peak_rss_mib"] * 0.5
            assert e[scale]["samples"] == 512


def test_profile_and_ceiling(record):
    assert record["profile"]["top"] and record["profile"]["samples"] == 512
    assert {c["encoding"] for c in record["read_ceiling"]} == {"raw", "png"}
    assert all(c["samples_per_s"]["median"] > 0 for c in record["read_ceiling"])


def test_tar_format(tmp_path):
    out = tmp_path / "t.json"
    proc = subprocess.run([sys.executable, str(TOOL), "--synthetic", "--tar-format", "--json", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["format"].split()[0]: r for r in json.loads(out.read_text())["tar_format"]}
    assert set(rows) == {"pax", "ustar"}
    assert rows["ustar"]["bytes"] < rows["pax"]["bytes"]  # no PAX header per member
    for r in rows.values():
        assert r["webdataset_samples_per_s"]["median"] > 0 and r["pipeline_read_samples_per_s"]["median"] > 0
