"""summary.json and the run's last line: what was trained on, how far it got, what it
measured, where the time went.

Apart from the training so that the one file a reader (and tools/report.py) opens first
is assembled in one place.
"""
import os
import resource
import shlex
import sys
import time

from pipeline.errors import redact, redacted
from pipeline.files import write_json_atomic
from pipeline.train import stop
from pipeline.train.evaluate import origin_label, per_class_lines
from pipeline.train.run import where
from pipeline.train.schedule import BASE_BATCH


def peak_rss_mb():
    """Peak RSS of this process and of its largest finished child (loader workers)."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return round((own + kids) / 1024, 1)


def write_summary(run, evals, t_start, resumed_from, finished, sources):
    args, topo = run.args, run.topo
    wait, busy = run.history.get("wait", 0.0), run.history.get("busy", 0.0)
    if run.in_epoch:  # stopped inside an epoch: its share of waiting counts too
        wait, busy = wait + run.tally["wait"], busy + run.tally["busy"]
    summary = {
        "data": {s.name: {"origin": origin_label(s), "synthetic": s.synthetic, "manifest": redact(s.manifest),
                          "train_samples": s.total} for s in sources},
        "accuracy": {k: v["accuracy"] for k, v in evals.items()},
        "per_class_accuracy": {k: v["per_class"] for k, v in evals.items() if "per_class" in v},
        "eval": evals,
        "epochs_done": len(run.history["epochs"]),
        "steps_done": run.step,
        "finished": finished,
        "epochs": run.history["epochs"],
        "skipped_samples": sum(e["skipped"] for e in run.history["epochs"]),
        "nonfinite_steps": run.nonfinite,
        "wall_time_s": round(time.time() - t_start, 2),
        "data_wait_share": round(wait / max(wait + busy, 1e-9), 4),
        "startup": run.startup,
        "peak_rss_mb_rank0": peak_rss_mb(),
        "restarts": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
        "resumed_from": resumed_from,
        "stopped_by": run.stopping.name if run.stopping else None,
        "world_size": topo.world,
        "global_batch": run.global_batch,
        "peak_lr": args.lr * run.global_batch / BASE_BATCH,
        "device": str(run.device),
        "config": redacted(vars(args)),
    }
    if topo.is_main and run.stopping:
        write_json_atomic(os.path.join(args.out, "summary.json"), summary)
        print(f"stopped at {where(run)}; checkpoint saved in {args.out}/; resume with: "
              f"{stop.resume_command(run.stopper.argv)}", flush=True)
    elif topo.is_main:
        write_json_atomic(os.path.join(args.out, "summary.json"), summary)
        acc = ", ".join(f"{k} {v['accuracy']:.4f} ({v['data']})" for k, v in evals.items()) or \
            ("no evaluation in this invocation" if run.evals else "no --eval sources")
        state = "done" if finished else \
            f"stopped at step {run.step}, epoch {run.epoch + (1 if run.in_epoch else 0)} of {args.epochs} " \
            f"(continue with --resume)"
        tested = f"test accuracy {acc}" if evals else acc
        skipped = summary["skipped_samples"]
        left = f"; {skipped:,} training samples skipped (damaged: see metrics.jsonl)" if skipped else ""
        print(f"{state}: {summary['wall_time_s']:.1f} s of training ({time.perf_counter() - run.t0:.1f} s in all)"
              f"{left}; {tested}\n" +
              "".join(line + "\n" for line in per_class_lines(evals)) +
              f"metrics.jsonl, summary.json and checkpoint.pt are in {args.out}/; "
              f"pictures: {report_command(args.out)}", flush=True)
    return summary


def report_command(out, clone=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                   installed=None):
    """The command that draws this run's pictures: the installed `pipeline-report` where pip put it
    beside this Python (`installed`: whether it did; default: look), else tools/report.py in a
    clone (`clone`: where the package sits), else the installed module."""
    if installed is None:
        installed = os.path.isfile(os.path.join(os.path.dirname(sys.executable), "pipeline-report"))
    if installed:
        return f"pipeline-report {shlex.quote(str(out))}"
    in_clone = os.path.isfile(os.path.join(clone, "tools", "report.py"))
    tool = "tools/report.py" if in_clone else "-m pipeline.train.report"
    return f"{shlex.quote(sys.executable)} {tool} {shlex.quote(str(out))}"
