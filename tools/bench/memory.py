"""Peak memory of one loader at 1x and 10x its corpus, each in a fresh process (bench_loader.py
--child), sampled from outside over the process tree."""
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict

from bench import ROOT
from bench.inputs import project_sources
from bench.methods import Setup, batches_a, batches_b, batches_c, tutorial_datasets
from bench.proc import proc_kib, tree_pids
from bench.report import log

ENTRY = os.path.join(ROOT, "tools", "bench_loader.py")  # the child runs the command itself, with --child


def peak_memory(setup, method, encoding, scale, workers):
    """Run one loader in a fresh process; the largest sum of VmRSS (and of Pss) over its tree."""
    spec = {"setup": asdict(setup), "method": method, "encoding": encoding, "scale": scale, "workers": workers}
    proc = subprocess.Popen([sys.executable, ENTRY, "--child", json.dumps(spec)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak_rss = peak_pss = 0
    while proc.poll() is None:
        rss = pss = 0
        for pid in tree_pids(proc.pid):
            rss += proc_kib(f"/proc/{pid}/status", "VmRSS:")
            pss += proc_kib(f"/proc/{pid}/smaps_rollup", "Pss:")
        peak_rss, peak_pss = max(peak_rss, rss), max(peak_pss, pss)
        time.sleep(0.05)
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"memory run {method} {encoding} x{scale} failed:\n{err[-3000:]}")
    result = json.loads(out.strip().splitlines()[-1])
    return {"peak_rss_mib": peak_rss / 1024, "peak_pss_mib": peak_pss / 1024, **result}


def child_main(spec):
    """Inside the fresh process: build the method's data at the given scale, stream, report."""
    setup = Setup(**spec["setup"])
    method, scale, workers = spec["method"], spec["scale"], spec["workers"]
    t0 = time.perf_counter()
    if method == "baseline":  # imports only: what every process tree starts from
        import torchvision  # noqa: F401
        import webdataset  # noqa: F401
        n = 0
    elif method == "A":
        n = sum(batches_a(tutorial_datasets(setup, copies=scale), setup, workers, 0))
    else:
        folder = setup.shards[spec["encoding"]] if scale == 1 else setup.corpus10x[spec["encoding"]]
        srcs = project_sources(folder)
        make = batches_b if method == "B" else batches_c
        n = sum(make(srcs, setup, workers, 0))
    print(json.dumps({"samples": n, "seconds": round(time.perf_counter() - t0, 2)}))
    return 0


def memory(setup, encoding, workers):
    entries = []
    base = peak_memory(setup, "baseline", None, 1, 0)
    log(f"  baseline (imports only): {base['peak_rss_mib']:.0f} MiB RSS")
    for method in ("A", "B", "C"):
        enc = None if method == "A" else encoding
        one, ten = (peak_memory(setup, method, enc, s, workers) for s in (1, 10))
        entry = {"method": method, "encoding": enc, "workers": workers, "scale_1x": one, "scale_10x": ten,
                 "ratio_10x_1x": ten["peak_rss_mib"] / one["peak_rss_mib"],
                 "ratio_10x_1x_pss": ten["peak_pss_mib"] / one["peak_pss_mib"] if one["peak_pss_mib"] else None}
        log(f"  {method}: 1x {one['peak_rss_mib']:.0f} MiB, 10x {ten['peak_rss_mib']:.0f} MiB RSS "
            f"(x{entry['ratio_10x_1x']:.2f})")
        entries.append(entry)
    return {"baseline": base, "entries": entries}
