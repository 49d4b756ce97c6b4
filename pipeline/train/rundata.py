"""A run folder read back: its metrics lines, its summary, and the numbers per epoch that the
report's table and picture are made of.

The folder is what `pipeline.train --out` writes: metrics.jsonl always, summary.json
once a run has ended. Everything is read from metrics.jsonl, so a run still going,
stopped or crashed (its last line torn) still gets a report; summary.json only adds
where each source's data came from (its origin and training manifest) and the data-wait
share. Eval lines also carry each test source's origin and manifest, so a run without a
summary says "origin unknown" only for sources it has not evaluated yet.
"""
import io
import json
import math
import os
import statistics

from pipeline.errors import ShardError
from pipeline.figures import plain
from pipeline.files import open_regular

UNKNOWN = "origin unknown"


class ReportError(Exception):
    """A run folder that cannot be reported on; the message is the whole explanation."""


# ---------------------------------------------------------------- reading a run folder


def read_records(path):
    """The JSON objects of a .jsonl file, skipping lines that do not parse: a crash can tear
    the last line, and one bad line should not cost the picture of the rest."""
    out = []
    with io.TextIOWrapper(open_regular(path), encoding="utf-8", errors="replace") as f:  # a FIFO would block
        for line in f:
            try:
                record = json.loads(line)
            except (ValueError, RecursionError):  # torn, or hostile: 100,000-deep nesting
                continue
            if isinstance(record, dict):
                out.append(record)
    return out



def _number(x):
    """A finite number: a hostile line's Infinity or NaN epoch is no epoch."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _train_ok(r):
    return (_number(r.get("step")) and _number(r.get("epoch")) and isinstance(r.get("loss"), dict)
            and isinstance(r.get("share", {}), dict) and isinstance(r.get("weights", {}), dict))


def _eval_ok(r):
    return _number(r.get("epoch")) and isinstance(r.get("eval"), dict) and all(
        isinstance(v, dict) for v in r["eval"].values())


def read_summary(path):
    """summary.json, or None when there is none or it cannot be read: the report then
    stands on metrics.jsonl alone rather than failing."""
    try:
        with open_regular(path) as f:  # a FIFO named summary.json is refused, not waited on
            summary = json.loads(f.read())
    except (OSError, ValueError, RecursionError, ShardError):
        return None
    return summary if isinstance(summary, dict) else None


def load_run(run_dir):
    """The run's train lines, eval lines and summary (None if absent). Raises ReportError."""
    if not os.path.isdir(run_dir):
        raise ReportError(f"{run_dir}: no such run folder")
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        raise ReportError(f"{run_dir}: no metrics.jsonl (is this a folder written by pipeline.train --out?)")
    try:
        records = read_records(path)
    except (OSError, ShardError) as e:
        raise ReportError(f"{path}: {e}") from None
    train = [r for r in records if r.get("kind") == "train" and _train_ok(r)]
    if not train:
        raise ReportError(f"{path}: no training lines yet (the run has not logged its first --log-every steps)")
    marks = [r for r in records if r.get("kind") in ("stopped", "resumed", "weights_changed", "data_changed")
             and _number(r.get("step"))]
    return {"dir": run_dir, "train": train, "eval": [r for r in records if r.get("kind") == "eval" and _eval_ok(r)],
            "marks": marks, "summary": read_summary(os.path.join(run_dir, "summary.json"))}


def _ordered(keys_lists):
    seen = {}
    for keys in keys_lists:
        for k in keys:
            seen.setdefault(str(k), None)
    return list(seen)


def train_names(run):
    return _ordered(r["loss"] for r in run["train"])


def eval_names(run):
    return _ordered(r["eval"] for r in run["eval"])


def origins(run):
    """{source: where its data came from}: summary.json where it names the source, else what
    its eval lines say (they carry the origin too, so a run without a summary can still tell)."""
    out = {}
    for r in run["eval"]:
        for name, v in r["eval"].items():
            if isinstance(v.get("data"), str):
                out[name] = v["data"]
    data = (run["summary"] or {}).get("data")
    if isinstance(data, dict):
        for name, v in data.items():
            if isinstance(v, dict) and isinstance(v.get("origin"), str):
                out[name] = v["origin"]
    return out


def manifests(run):
    """{source: {"train": manifest, "test": manifest}}, each where the run recorded it (summary.json
    for training, the last eval line for testing): the files the numbers came from."""
    out = {}
    for r in run["eval"]:
        for name, v in r["eval"].items():
            if isinstance(v.get("manifest"), str):
                out.setdefault(name, {})["test"] = v["manifest"]
    data = (run["summary"] or {}).get("data")
    if isinstance(data, dict):
        for name, v in data.items():
            if isinstance(v, dict) and isinstance(v.get("manifest"), str):
                out.setdefault(name, {})["train"] = v["manifest"]
    return out


def data_lines(run):
    """Under the table, per source: its origin and the manifests it was trained and tested on."""
    where, said = manifests(run), origins(run)
    lines = []
    for name in _ordered([train_names(run), eval_names(run)]):
        files = where.get(name, {})
        parts = [f"{split} {plain(files[split], limit=300)}" for split in ("train", "test") if split in files]
        lines.append(f"  {name}: {said.get(name, UNKNOWN)}; " + ("; ".join(parts) or "manifests not recorded"))
    return ["data:"] + lines


def described(run, name):
    """'cifar10 (synthetic look-alike data)': a curve is never shown without saying what data it is."""
    return f"{name} ({origins(run).get(name, UNKNOWN)})"


# ---------------------------------------------------------------- numbers


def loss_of(record, name):
    """The line's mean loss of `name`, or NaN when the line holds none of its samples:
    the trainer writes 0.0 for a source that got no samples (weight 0), which is no loss."""
    loss, share = record["loss"].get(name), record.get("share", {}).get(name)
    if not _number(loss) or (_number(share) and share == 0):
        return math.nan
    return float(loss)


def accuracy_of(record, name):
    """Test accuracy of `name` in an eval line, or NaN when it evaluated no samples."""
    v = record["eval"].get(name)
    if not isinstance(v, dict) or not _number(v.get("accuracy")) or v.get("count") == 0:
        return math.nan
    return float(v["accuracy"])


def last_evals(run):
    """{epoch: eval line}, the last one per epoch (a resumed run may evaluate an epoch again)."""
    return {int(r["epoch"]): r for r in run["eval"]}


def epoch_rows(run):
    """One row per epoch: last train loss per source, test accuracy per source, median samples/s."""
    evals, rows, names, evaluated = last_evals(run), [], train_names(run), eval_names(run)
    by_epoch = {}
    for r in run["train"]:  # one pass: a scan per epoch made 20,000 epochs take minutes
        by_epoch.setdefault(int(r["epoch"]), []).append(r)
    for epoch in sorted(set(by_epoch) | set(evals)):
        lines = by_epoch.get(epoch, [])
        loss = {}
        for name in names:
            seen = [x for x in (loss_of(r, name) for r in lines) if not math.isnan(x)]
            loss[name] = seen[-1] if seen else math.nan
        ev = evals.get(epoch)
        acc = {name: accuracy_of(ev, name) if ev else math.nan for name in evaluated}
        rates = [float(r["samples_per_s"]) for r in lines if _number(r.get("samples_per_s"))]
        rows.append({"epoch": epoch, "loss": loss, "accuracy": acc,
                     "samples_per_s": statistics.median(rates) if rates else math.nan})
    return rows


def _finite(x):
    """A value to draw: a finite number, else NaN (matplotlib leaves NaN out; Infinity would
    stretch an axis to nothing, and a string fails the drawing)."""
    return float(x) if _number(x) else math.nan


def left_out(run):
    """{what: how many values} the lines hold that are not finite numbers (Infinity, NaN, a
    string): they are not drawn, and the picture and the table say so."""
    counts = {}

    def count(what, values):
        bad = sum(1 for x in values if x is not None and not _number(x))
        if bad:
            counts[what] = counts.get(what, 0) + bad

    for r in run["train"]:
        count("loss", r["loss"].values())
        count("samples/s", [r.get("samples_per_s")])
        count("share", r.get("share", {}).values())
        count("weight", r.get("weights", {}).values())
    for r in run["eval"]:
        count("accuracy", [v.get("accuracy") for v in r["eval"].values()])
    return counts


def left_out_line(run):
    """'left out: 2 loss values ...', or None when every value is a finite number."""
    counts = left_out(run)
    if not counts:
        return None
    said = ", ".join(f"{n} {what} value(s)" for what, n in counts.items())
    return f"left out of the picture: {said} that are not finite numbers (Infinity or NaN)"



def stops_and_resumes(run):
    """[(step, label)] in step order: where the run stopped (a 'stopped' line, with its signal)
    and where it resumed (a 'resumed' line, summary.json's resumed_from; a weights_changed or
    data_changed line, which only a resume writes). A resume drops the 'stopped' line at its checkpoint
    from metrics.jsonl, so an earlier stop shows as the resume that followed it."""
    words = {}
    for r in run["marks"]:
        if r["kind"] == "stopped":
            sig = r.get("signal")
            word = "stopped" + (f" ({plain(sig, limit=20)})" if isinstance(sig, str) else "")
        else:
            word = "resumed"
        words.setdefault(int(r["step"]), []).append(word)
    resumed = (run["summary"] or {}).get("resumed_from")
    if isinstance(resumed, dict) and _number(resumed.get("step")):
        words.setdefault(int(resumed["step"]), []).append("resumed")
    return [(step, " and ".join(dict.fromkeys(w)) + f" at step {step}") for step, w in sorted(words.items())]
