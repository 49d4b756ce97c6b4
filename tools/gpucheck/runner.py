"""Running the steps and reporting them: each step its own PASS or FAIL line with its figures,
a step stopped at its share of the time, and the report as a Markdown table for
docs/benchmarks.md."""
import faulthandler
import os
import signal
import time
import traceback
import warnings
from contextlib import contextmanager

import torch


class Failed(Exception):
    """A step that ran but whose figures are wrong; the figures still go in the report."""

    def __init__(self, message, figures=None):
        super().__init__(message)
        self.figures = figures or {}


def cuda_device_count():
    """Visible CUDA devices, 0 without a driver (a CUDA build of torch warns then: kept quiet,
    the caller says it in one line)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.cuda.device_count() if torch.cuda.is_available() else 0


def machine(nproc):
    props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    nccl = torch.cuda.nccl.version() if hasattr(torch.cuda, "nccl") else None
    return {"gpus": [f"{p.name} ({p.total_memory / 2**30:.0f} GiB)" for p in props], "nproc": nproc,
            "cpu_cores": os.cpu_count(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(), "nccl": ".".join(map(str, nccl)) if nccl else None}


@contextmanager
def time_limit(seconds):
    """Raise TimeoutError in a step that hangs in Python (e.g. waiting on a worker); a hang
    inside a CUDA or NCCL call cannot be interrupted, so the process ends 30 s later."""
    def expired(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    faulthandler.dump_traceback_later(seconds + 30, exit=True)
    try:
        yield
    finally:
        signal.alarm(0)
        faulthandler.cancel_dump_traceback_later()
        signal.signal(signal.SIGALRM, old)


def run_step(report, name, fn, limit):
    """Run one step, record and print PASS/FAIL with its figures; never raises an Exception."""
    print(f"-- {name}", flush=True)
    t = time.perf_counter()
    try:
        with time_limit(limit):
            figures, error = fn(), None
    except Exception as e:  # reported; the next steps still run
        figures, error = getattr(e, "figures", {}), str(e) if isinstance(e, Failed) else f"{type(e).__name__}: {e}"
        if not isinstance(e, Failed):
            traceback.print_exc()
    seconds = round(time.perf_counter() - t, 1)
    report["steps"][name] = dict(figures, ok=error is None, seconds=seconds, **({"error": error} if error else {}))
    text = "; ".join(filter(None, [figures.get("summary"), error]))
    print(f"{'PASS' if error is None else 'FAIL'} {name} ({seconds} s): {text}", flush=True)


def summary_lines(report):
    """The report as a machine line and a Markdown table, to paste into docs/benchmarks.md."""
    m, first = report["machine"], report["steps"].get("shards", {})
    gpus = m["gpus"]
    kind = f"{len(gpus)} x {gpus[0]}" if len(set(gpus)) == 1 else ", ".join(gpus)
    data = "synthetic" if first.get("synthetic") else "real" if first.get("ok") else "none"
    lines = [f"GPU check: {kind}, {m['nproc']} rank(s), {m['cpu_cores']} CPU cores, torch {m['torch']}, "
             f"CUDA {m['cuda']}, cuDNN {m['cudnn']}, NCCL {m['nccl']}; {data} data", "",
             "| step | result | seconds | figures |", "| --- | --- | ---: | --- |"]
    for name, s in report["steps"].items():
        text = s.get("summary") if s["ok"] else "; ".join(filter(None, [s["error"].splitlines()[0], s.get("summary")]))
        lines.append(f"| {name} | {'PASS' if s['ok'] else 'FAIL'} | {s['seconds']} | {text.replace('|', '/')} |")
    lines.append(f"\noverall: {'PASS' if report['passed'] else 'FAIL'}")
    return lines
