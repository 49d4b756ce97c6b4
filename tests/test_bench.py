"""tools/bench_loader.py end to end on its own synthetic inputs.

One small subprocess run covers every part (A/B/C throughput at workers 0 and 2 for raw,
png and JPEG-WebDataset shards, peak memory at 1x and 10x, profile, read ceiling, JPEG
decoders); the tests check the JSON record's structure and one figure, C and C8 against
stock webdataset per CPU-second. A second, larger run, in this process, checks the other
figure that must hold on any machine: the stream does several times the tutorial's samples
per CPU-second. Both are ratios measured in one run, so a noisy machine slows both sides
alike. The record's run makes 300 inputs a source rather than 1200 and reads 256 a run, its
only limit a hang guard of many minutes (most of its time is the memory part's seven fresh
Pythons, which a loaded machine slows most); --tar-format and --stages run main() in this
process too.
"""
import functools
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import HANG, kill_tree, main_in_process, run_capture, tool_module

SLOW = pytest.mark.slow  # one benchmark run in a subprocess

TOOL = Path(__file__).resolve().parents[1] / "tools" / "bench_loader.py"
PEERS = tool_module("bench_peers")  # imports no peer library
sys.path.insert(0, str(TOOL.parent))  # the benchmark's parts, tools/bench/
from bench import cpu, host, micro  # noqa: E402


SMALL = ["--synthetic", "--synthetic-size", "300", "--samples", "256", "--batch-size", "64", "--repeats", "1"]


@pytest.fixture(scope="session")
def record(tmp_path_factory):
    """The record of one small run. Its inputs' temporary folder is made inside `work`, which
    is removed here whatever became of the run: one killed on a hang cannot remove it itself."""
    tmp = tmp_path_factory.mktemp("bench")
    out, work = tmp / "b.json", tmp / "work"
    try:
        proc = run_capture([sys.executable, str(TOOL), *SMALL, "--profile", "--work-dir", str(work), "--json", str(out)],
                           cwd=tmp)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert not list(work.glob("bench-loader-*"))  # the run removed its own
    finally:
        shutil.rmtree(work, ignore_errors=True)
    assert "x A" in proc.stdout and "peak memory" in proc.stdout
    assert not (tmp / "bench-out").exists()  # --synthetic keeps its inputs in a temporary folder
    return json.loads(out.read_text())


@SLOW
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_killed_run_leaves_its_inputs_where_its_caller_removes_them(tmp_path, sig):
    """A record run killed by its test's timeout left its bench-loader-* inputs (20 MB) in the
    system's temporary folder: given --work-dir, they are made inside it (the caller's to
    remove, as the record fixture does), never in the system's."""
    work, system = tmp_path / "work", tmp_path / "system-tmp"
    system.mkdir()
    proc = subprocess.Popen([sys.executable, str(TOOL), *SMALL, "--work-dir", str(work), "--json", str(tmp_path / "b.json")],
                            cwd=tmp_path, env=dict(os.environ, TMPDIR=str(system)), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        t0 = time.time()
        while not list(work.glob("bench-loader-*/shards-*")) + list(system.glob("bench-loader-*/shards-*")):
            assert proc.poll() is None and time.time() - t0 < HANG, "no inputs built"  # a hang guard
            time.sleep(0.05)
        os.kill(proc.pid, sig)
        assert proc.wait(HANG) == -sig
    finally:
        kill_tree(proc)  # and whatever of its session is left (a pool of builders)
    assert not list(system.glob("bench-loader-*")) and [f.name[:13] for f in work.iterdir()] == ["bench-loader-"]


@SLOW
@pytest.mark.xdist_group("bench-record")  # shares the module's fixture run
def test_throughput_entries(record):
    entries = {(e["method"], e["encoding"], e["workers"]): e for e in record["throughput"]}
    for w in (0, 2):
        assert ("A", None, w) in entries
        for enc in ("raw", "png", "jpg"):
            b, c = entries[("B", enc, w)], entries[("C", enc, w)]
            for e in (b, c):
                assert e["samples_per_s"]["median"] > 0 and e["samples_per_cpu_s"]["median"] > 0
                assert len(e["runs"]) == 1 and e["runs"][0]["samples"] == 256
                for metric in ("samples_per_s", "samples_per_cpu_s"):
                    r = e["ratios"]["vs_A"][metric]
                    assert 0 < r["min"] <= r["median"] <= r["max"]
            assert c["ratios"]["vs_B"]["samples_per_cpu_s"]["median"] > 0
    for method in ("C", "C8"):  # the one ratio checked here (on an idle machine: docs/benchmarks.md, test margins)
        ratio = entries[(method, "raw", 0)]["ratios"]["vs_B"]["samples_per_cpu_s"]["median"]
        assert ratio >= 3, f"{method} is only {ratio:.2f}x stock webdataset per core"
    for w in (0, 2):
        assert entries[("A", None, w)]["ratios"] == {}
        assert entries[("A", None, w)]["samples_per_s"]["median"] > 0
    for e in record["throughput"]:  # each run says how much of its CPUs' time was stolen, where Linux tells
        for r in e["runs"]:
            assert r["steal_share"] is None or (0 <= r["steal_share"] <= 1 and r["busy_ticks"] + r["steal_ticks"] > 0)
    if cpu.host_ticks() is not None:  # this host's /proc/stat tells it
        assert any(r["steal_share"] is not None for e in record["throughput"] for r in e["runs"])
    assert isinstance(record["host"]["cpu"], dict)
    # the workers' CPU (reaped by us or by a forkserver) must be counted
    assert entries[("C", "raw", 2)]["runs"][0]["cpu_workers_s"] > 0
    assert entries[("C", "raw", 0)]["runs"][0]["cpu_workers_s"] == 0


@SLOW
@pytest.mark.xdist_group("bench-record")  # shares the module's fixture run
def test_memory_entries(record):
    mem = record["memory"]
    assert mem["baseline"]["peak_rss_mib"] > 0
    assert [e["method"] for e in mem["entries"]] == ["A", "B", "C"]
    for e in mem["entries"]:
        assert e["ratio_10x_1x"] > 0
        for scale in ("scale_1x", "scale_10x"):
            assert e[scale]["peak_rss_mib"] >= mem["baseline"]["peak_rss_mib"] * 0.5
            assert e[scale]["samples"] == 256


@SLOW
@pytest.mark.xdist_group("bench-record")  # shares the module's fixture run
def test_profile_ceiling_and_jpeg_path(record):
    assert record["profile"]["top"] and record["profile"]["samples"] == 256
    assert record["profile"]["method"] == "C" and record["profile_c8"]["method"] == "C8"
    assert record["profile_c8"]["top"] and record["profile_c8"]["samples"] == 256
    c8 = [r["tottime_s"] for r in record["profile_c8"]["top"] if r["function"].endswith("(normalize)")]
    assert not any(c8)  # C8 batches stay uint8: normalize never runs
    assert {c["encoding"] for c in record["read_ceiling"]} == {"raw", "png", "jpg"}
    assert all(c["samples_per_s"]["median"] > 0 for c in record["read_ceiling"])
    assert all(0 < e["ceiling_share"] < 1 for e in record["throughput"] if e["method"] != "A")
    for e in (e for e in record["throughput"] if e["method"] != "A"):  # samples per CPU-second against the ceiling
        enc = e["encoding"] or "raw"  # the peers (where installed) hold the raw shards' pixels
        ceiling = next(c for c in record["read_ceiling"] if c["encoding"] == enc)["samples_per_s"]["median"]
        assert e["ceiling_share_cpu"] == pytest.approx(e["samples_per_cpu_s"]["median"] / ceiling)
    rows = {(r["set"], r["what"]): r for r in record["jpeg"]}  # the JPEG path beside each bare decoder
    for name in ("small", "large"):
        assert {(name, w) for w in ("torchvision", "stream, 0 workers, whole run", "stream, 2 workers, whole run",
                                                  "stream, 0 workers, after 1st batch", "stream, 2 workers, after 1st batch")} <= set(rows)
    assert all(r["samples_per_cpu_s"]["median"] > 0 and r["of_best"] > 0 for r in rows.values())
    assert max(r["of_best"] for r in rows.values() if not r["what"].startswith("stream")) == 1


@SLOW
def test_stream_beats_the_tutorial_per_core(tmp_path, monkeypatch):
    """In one process (this one: main() as the command runs it), raw shards: the stream's float
    and uint8 batches both at least 3x the tutorial's samples per CPU-second (what they read on
    an idle machine: docs/benchmarks.md, test margins). Against stock webdataset:
    test_throughput_entries."""
    out = tmp_path / "ratio.json"
    monkeypatch.chdir(tmp_path)
    proc = main_in_process(tool_module("bench_loader").main, "bench_loader.py", [
        "--synthetic", "--synthetic-size", "2048", "--samples", "4096", "--methods", "A", "C", "C8",
        "--encoding", "raw", "--workers", "0", "--repeats", "3", "--skip-memory", "--json", out, "--work-dir", tmp_path])
    assert proc.returncode == 0, proc.stderr[-3000:]
    entries = {e["method"]: e for e in json.loads(out.read_text())["throughput"]}
    assert set(entries) == {"A", "C", "C8"}
    for method in ("C", "C8"):
        ratio = entries[method]["ratios"]["vs_A"]["samples_per_cpu_s"]["median"]
        assert ratio >= 3, f"{method} is only {ratio:.2f}x the tutorial per core"


@SLOW
def test_tar_format(tmp_path):
    out = tmp_path / "t.json"
    proc = main_in_process(tool_module("bench_loader").main, "bench_loader.py",
                           ["--synthetic", "--synthetic-size", "600", "--tar-format", "--json", out, "--work-dir",
                            tmp_path / "work"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["format"].split()[0]: r for r in json.loads(out.read_text())["tar_format"]}
    assert set(rows) == {"pax", "ustar"}
    assert rows["ustar"]["bytes"] < rows["pax"]["bytes"]  # no PAX header per member
    for r in rows.values():
        assert r["webdataset_samples_per_s"]["median"] > 0 and r["pipeline_read_samples_per_s"]["median"] > 0


@SLOW
def test_stage_costs(tmp_path, monkeypatch):
    """--stages in this process, over 20,000 samples rather than 200,000: the record's shape,
    not its figures, is what is checked here."""
    out = tmp_path / "s.json"
    tool = tool_module("bench_loader")
    monkeypatch.setattr(micro, "stage_costs", functools.partial(micro.stage_costs, n=20_000))
    monkeypatch.setattr(micro, "thread_switch", functools.partial(micro.thread_switch, normalizes=5, steps=1))
    proc = main_in_process(tool.main, "bench_loader.py", ["--stages", "--repeats", "2", "--json", out])
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    rows = {r["stage"]: r for r in record["stages"]}
    assert set(rows) == {"shuffle", "mix"}
    for r in rows.values():
        assert r["webdataset_us_per_sample"]["median"] > 0 and r["pipeline_us_per_sample"]["median"] > 0
    switch = {r["what"]: r for r in record["thread_switch"]}
    assert set(switch) == {"normalize, numpy", "normalize, torch one thread", "CPU step", "CPU step after a switch"}
    assert all(r["cpu"]["median"] > 0 for r in switch.values())


def test_host_facts_from_proc_text():
    """Steal is the eighth number of a cpuN line of /proc/stat, counted only for the CPUs given
    and against their busy time (user, nice, system, irq, softirq), so an idle CPU does not
    dilute it; what cannot be read or told gives None, never an error or a made-up 0%."""
    stat = ("cpu  30 1 5 900 1 3 2 14 3 0\n"
            "cpu0 10 1 5 100 1 3 2 4 3 0\n"  # busy 10+1+5+3+2 = 21 (idle, iowait and guest left out), stolen 4
            "\n"
            "cpu1 20 0 0 800 0 0 0 10 0 0\n"
            "intr 1 2 3\n")
    assert cpu.host_ticks(stat, cpus={0}) == {0: (4, 21)}
    assert cpu.host_ticks(stat, cpus={0, 1}) == {0: (4, 21), 1: (10, 20)}
    assert cpu.host_ticks(stat, cpus={7}) is None  # none of the CPUs given
    for bad in ("cpu0 10 1 5 80\n",  # an old kernel without the steal column: no reading, not 0
                "cpu0 x y\n", "cpu0 1 1 1 1 1 1 1 -1\n", "cpu0 1 1 1 1 1 1 1 1\ncpu00 1 1 1 1 1 1 1 1\n"):
        assert cpu.host_ticks(bad, cpus={0}) is None, bad
    before, after = {0: (4, 21), 1: (10, 20)}, {0: (9, 36), 1: (10, 30), 2: (50, 50)}
    assert cpu.steal_ticks(before, after) == (5, 25)  # over the CPUs both readings saw
    assert cpu.steal_fields(before, after) == {"steal_share": 5 / 30, "steal_ticks": 5, "busy_ticks": 25}
    for a, b in ((before, {0: (2, 40), 1: (20, 30)}),  # cpu0's steal went back, hidden by cpu1's rise
                 (before, {0: (4, 20), 1: (10, 20)}),  # busy went back
                 (before, {2: (1, 1)}), (None, before)):
        assert cpu.steal_ticks(a, b) is None
        assert cpu.steal_fields(a, b)["steal_share"] is None
    assert cpu.steal_fields(before, before) == {"steal_share": None, "steal_ticks": 0, "busy_ticks": 0}  # no tick
    info = ("processor\t: 0\r\nvendor_id\t: AuthenticAMD\r\nmodel name\t: Some CPU 9000\r\nstepping\t: 1\r\n"
            "cpu MHz\t\t: 2596.1\r\n\r\nprocessor\t: 1\r\nmodel name\t: Other\r\ncache size\t: 1 KB\r\n")
    first = {"vendor_id": "AuthenticAMD", "model name": "Some CPU 9000", "stepping": "1", "max kHz": "3500000"}
    assert host.cpu_identity(info, max_khz="3500000\n") == {"cpu": first}  # the first processor's, no clock
    arm = "processor\t: 0\nBogoMIPS\t: 50.00\nCPU implementer\t: 0x41\nCPU part\t: 0xd0c\n"
    for khz in ("fast", "-1"):
        assert host.cpu_identity(arm, max_khz=khz) == {"cpu": {"CPU implementer": "0x41", "CPU part": "0xd0c"}}


def absent(monkeypatch):
    """The peer libraries made to look uninstalled, whatever this venv holds (the project's own lacks them)."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name in ("litdata", "streaming") else real(name, *a, **k))


@SLOW
@pytest.mark.xdist_group("bench-record")  # shares the module's fixture run
def test_record_names_the_peers_run_or_skipped(record):
    """In a venv without the [bench] extra every peer is skipped with its line; with it, each ran
    and its batches passed the check (a failed check fails the run)."""
    for peer in PEERS.PEERS:
        if PEERS.missing(peer):
            assert f"{PEERS.missing(peer)}; skipped" in record["config"]["peers_skipped"]
            assert not any(e["method"] == peer for e in record["throughput"])
        else:
            assert {e["workers"] for e in record["throughput"] if e["method"] == peer} == {0, 2}


def test_peers_skipped_cleanly_when_absent(monkeypatch):
    absent(monkeypatch)
    tool = tool_module("bench_loader")
    args = tool.parse_args(["--synthetic"])
    assert args.methods == ["A", "B", "C", "C8"]
    assert args.skipped == ["LitData: litdata is not installed (pip install -e '.[bench]'); skipped",
                            "Mosaic: mosaicml-streaming is not installed (pip install -e '.[bench]'); skipped"]
    proc = main_in_process(tool.main, "bench_loader.py", ["--synthetic", "--methods", "C", "Mosaic"])
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "bench_loader: error: Mosaic: mosaicml-streaming is not installed (pip install -e '.[bench]') (see --help)"]


def test_a_module_of_a_peers_name_from_elsewhere_is_not_the_peer(tmp_path, monkeypatch):
    """A folder named streaming on the path made find_spec say Mosaic was there, and reading its
    version then ended the benchmark in a traceback (PackageNotFoundError)."""
    import importlib.metadata

    if list(importlib.metadata.distributions(name="mosaicml-streaming")):
        pytest.skip("mosaicml-streaming is installed here: the stray module would not be asked about")
    (tmp_path / "streaming").mkdir()
    (tmp_path / "streaming" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert PEERS.missing("Mosaic") == ("Mosaic: a module streaming is importable but mosaicml-streaming is not "
                                       "installed (pip install -e '.[bench]')")
    tool = tool_module("bench_loader")
    proc = main_in_process(tool.main, "bench_loader.py", ["--synthetic", "--methods", "C", "Mosaic"])
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


@SLOW
@pytest.mark.parametrize("flags", [["--synthetic-size", "100"], ["--synthetic-size", "300", "--world", "2"]])
def test_too_few_samples_for_a_is_one_line(tmp_path, flags):
    """A reads each data set once: 4 batches of 64 from 100 samples (or 150 a rank) ended in
    the RuntimeError "run delivered 200 samples, expected 256" after the shards were built."""
    tool = tool_module("bench_loader")
    proc = main_in_process(tool.main, "bench_loader.py", [
        "--synthetic", *flags, "--samples", "512", "--batch-size", "128", "--encoding", "raw", "--methods", "C",
        "--workers", "0", "--repeats", "1", "--skip-memory", "--json", tmp_path / "b.json", "--work-dir", tmp_path / "w"])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[-1].startswith("bench_loader: error: mnist holds ")
    assert "A needs 256 (4 batches of 64)" in proc.stderr and not (tmp_path / "b.json").exists()


def test_synthetic_samples_default_to_what_its_data_sets_hold():
    tool = tool_module("bench_loader")
    assert tool.parse_args(["--synthetic"]).samples == 2048  # 1,200 a data set, batches of 256: 8 timed + 1 spare
    assert tool.parse_args(["--synthetic", "--synthetic-size", "100000"]).samples == 60000
    assert tool.parse_args(["--synthetic", "--samples", "512"]).samples == 512


def test_peers_need_the_raw_shards_and_one_rank(monkeypatch):
    tool = tool_module("bench_loader")
    monkeypatch.setattr(tool.bench_peers, "missing", lambda peer: None)  # as if installed
    args = tool.parse_args(["--synthetic", "--encoding", "png"])
    assert args.methods == ["A", "B", "C", "C8"] and all("add raw to --encoding" in line for line in args.skipped)
    proc = main_in_process(tool.main, "bench_loader.py", ["--synthetic", "--methods", "LitData", "--world", "2"])
    assert proc.returncode == 2 and "single rank only" in proc.stderr


def peer_batch(source, index, label=None, shape=None, dtype=torch.float32):
    source = np.asarray(source)
    label = np.where(source == 0, 3, 15) if label is None else np.asarray(label)
    return {"image": torch.zeros(shape or (len(source), 3, 32, 32), dtype=dtype), "label": torch.from_numpy(label),
            "source": torch.from_numpy(source), "index": torch.as_tensor(index)}


def peer_run(batches, batch_size=64):
    check = PEERS.Check(batch_size, (32, 32), [10, 10])
    for b in batches:
        check.add(b)
    check.done()


def halves(n_batches, batch_size=64, first=0.5):
    """Batches with `first` of the samples from source 0, every (source, index) once."""
    k = int(batch_size * first)
    return [peer_batch([0] * k + [1] * (batch_size - k), [*range(i * k, (i + 1) * k),
                                                          *range(i * (batch_size - k), (i + 1) * (batch_size - k))])
            for i in range(n_batches)]


def test_peer_check_passes_the_job():
    peer_run(halves(10))


@pytest.mark.parametrize("fault, message", [
    ("repeat", "delivered twice"), ("share", "share"), ("shape", "float32 (64, 3, 32, 32) expected"),
    ("dtype", "float32 (64, 3, 32, 32) expected"), ("label", "label 12 of source 0 outside 0..9"),
    ("cifar label", "label 5 of source 1 outside 10..19"), ("source", "source 2 outside 0..1")])
def test_peer_check_fails_a_wrong_run(fault, message):
    batches = halves(10)
    b = batches[3]
    if fault == "repeat":
        batches.append(batches[0])
    elif fault == "share":
        batches = halves(10, first=0.625)  # 0.125 off, with 0.089 allowed for 640 samples
    elif fault == "shape":
        b["image"] = torch.zeros(64, 1, 28, 28)
    elif fault == "dtype":
        b["image"] = b["image"].to(torch.uint8)
    elif fault == "label":
        b["label"][0] = 12
    elif fault == "cifar label":
        b["label"][-1] = 5
    elif fault == "source":
        b["source"][0] = 2
    with pytest.raises(PEERS.CheckError, match=re.escape(message)):
        peer_run(batches)
