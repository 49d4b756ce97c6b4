"""A run folder read back: its metrics lines, its summary, and the numbers per epoch that the
report's table and picture are made of.

The folder is what `pipeline.train --out` writes: metrics.jsonl always, summary.json
once a run has ended. Everything is read from metrics.jsonl, so a run still going,
stopped or crashed (its last line torn) still gets a report; summary.json only adds
where each source's data came from (its origin and training manifest) and the data-wait
share. Eval lines also carry each test source's origin and manifest, so a run without a
summary says "origin unknown" only for sources it has not evaluated yet.
"""
import bisect
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
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    return isinstance(x, int) or math.isfinite(x)  # an int is finite (isfinite overflows past 1e308)


def _count(x):
    """A whole number from 0 to 2**53 (past that a float step is no longer exact): an epoch, a step,
    a world size. A hostile line's epoch of 1e300 made matplotlib's epoch ticks fail."""
    return _number(x) and x == int(x) and 0 <= x <= 2 ** 53


FAR = 1e300  # past this an axis and its margins overflow a float: matplotlib cannot draw the panel
RANGES = {"loss": (0, FAR), "accuracy": (0, 1), "share": (0, 1), "weight": (0, FAR), "samples/s": (0, FAR)}


def value(x, what):
    """x as a float when it is a number a `what` (a key of RANGES) can be, else NaN: not drawn,
    not tabled, and counted by left_out. A cross-entropy loss is never negative and an accuracy
    never above 1; an axis from -1e308 to 1e308, or one to 1.7e308, is not drawn at all
    (matplotlib's ticks end in `arange: cannot compute length`, its layout in a singular
    matrix), so one such value must not cost the picture of the rest."""
    low, high = RANGES[what]
    return float(x) if _number(x) and low <= x <= high else math.nan


def _train_ok(r):
    return (_count(r.get("step")) and _count(r.get("epoch")) and isinstance(r.get("loss"), dict)
            and isinstance(r.get("share", {}), dict) and isinstance(r.get("weights", {}), dict))


def _eval_ok(r):
    return _count(r.get("epoch")) and isinstance(r.get("eval"), dict) and all(
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
             and _count(r.get("step"))]
    evals = [r for r in records if r.get("kind") == "eval" and _eval_ok(r)]
    dropped = sum(1 for r in records if r.get("kind") in ("train", "eval")) - len(train) - len(evals)
    return {"dir": run_dir, "train": train, "eval": evals, "marks": marks, "dropped": dropped,
            "summary": read_summary(os.path.join(run_dir, "summary.json"))}


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
    if _number(share) and share == 0:
        return math.nan
    return value(loss, "loss")


def accuracy_of(record, name):
    """Test accuracy of `name` in an eval line, or NaN when it evaluated no samples."""
    v = record["eval"].get(name)
    if not isinstance(v, dict) or v.get("count") == 0:
        return math.nan
    return value(v.get("accuracy"), "accuracy")


def last_evals(run):
    """{epoch: eval line}, the last one per epoch (a resumed run may evaluate an epoch again)."""
    return {int(r["epoch"]): r for r in run["eval"]}


def epoch_rows(run):
    """One row per epoch: each source's mean training loss over the epoch's samples, test
    accuracy per source, median samples/s, and the samples skipped as damaged (the sum of
    its lines' `skipped`, which count every rank's; None where no line says)."""
    evals, rows, names, evaluated = last_evals(run), [], train_names(run), eval_names(run)
    by_epoch = {}
    for r, n in zip(run["train"], line_samples(run)):  # one pass: a scan per epoch made 20,000 epochs take minutes
        by_epoch.setdefault(int(r["epoch"]), []).append((r, n))
    for epoch in sorted(set(by_epoch) | set(evals)):
        lines = by_epoch.get(epoch, [])
        loss = {name: epoch_loss(lines, name) for name in names}
        ev = evals.get(epoch)
        acc = {name: accuracy_of(ev, name) if ev else math.nan for name in evaluated}
        rates = [x for x in (value(r.get("samples_per_s"), "samples/s") for r, _ in lines) if not math.isnan(x)]
        counts = [r["skipped"] for r, _ in lines if _count(r.get("skipped"))]
        rows.append({"epoch": epoch, "loss": loss, "accuracy": acc,
                     "samples_per_s": statistics.median(rates) if rates else math.nan,
                     "skipped": int(sum(counts)) if counts else None})
    return rows


def epoch_loss(lines, name):
    """The mean loss of `name` over an epoch's samples: each line's mean weighted by how many of
    the source's samples it covers ([(line, its samples of all sources)], see line_samples).
    The last line's alone said little: it may cover one step of the epoch."""
    total = weight = 0.0
    for r, n in lines:
        loss, share = loss_of(r, name), r.get("share", {}).get(name)
        w = n * (value(share, "share") if share is not None else 1.0)
        if not math.isnan(loss) and not math.isnan(w):
            total, weight = total + loss * w, weight + w
    if weight == 0:  # lines without steps between them (a hostile file): their plain mean
        seen = [x for x in (loss_of(r, name) for r, _ in lines) if not math.isnan(x)]
        return sum(seen) / len(seen) if seen else math.nan
    return total / weight


def line_samples(run):
    """Per train line, the samples it covers in units of the batch size: its steps since the
    line before, each counted with the world size it ran on (a resume on another world
    changes the samples a step takes; a line may span the resume). Where the first world is
    not known, the next known one stands for it."""
    segments = worlds(run)
    known = [w for _, w in segments if w] or [1]
    starts, sizes = [start for start, _ in segments], [w or known[0] for _, w in segments]
    out, before = [], 0
    for r in run["train"]:  # the lines' spans (before, step] do not overlap: each segment is walked about once
        step = int(r["step"])
        n, i = 0, max(bisect.bisect_left(starts, before + 1) - 1, 0)
        while i < len(starts) and starts[i] < step:
            end = starts[i + 1] if i + 1 < len(starts) else step
            n += max(0, min(step, end) - max(before, starts[i])) * sizes[i]  # steps (start, end] ran on sizes[i]
            i += 1
        out.append(n)
        before = max(before, step)
    return out


def worlds(run):
    """[(step after which it began, world size or None where not known)]: the stretches of the
    run on one world size, from the 'resumed' lines (each names its world). The first world
    comes from summary.json: the ranks that finished an epoch before the first resume, else
    the ranks whose part of the first resume's epoch was carried over (before_resume), else
    the only world when the run never resumed."""
    resumes = sorted({int(r["step"]): int(r["world"]) for r in run["marks"]  # a resume that failed and was
                      if r["kind"] == "resumed" and _count(r.get("world")) and r["world"] >= 1}.items())  # tried again
    summary = run["summary"] or {}
    if not resumes:
        w = summary.get("world_size")
        return [(0, int(w) if _count(w) and w >= 1 else None)]
    first = resumes[0][0]
    ends = {}
    for r in run["train"]:
        ends[int(r["epoch"])] = max(ends.get(int(r["epoch"]), 0), int(r["step"]))
    epochs = summary.get("epochs") if isinstance(summary.get("epochs"), list) else []
    history = {int(e["epoch"]): e for e in epochs if isinstance(e, dict) and _count(e.get("epoch"))}
    ranks = lambda d: len(d) if isinstance(d, dict) and d else None  # noqa: E731
    before = [e for e, end in ends.items() if end <= first and e in history]
    if before:
        w0 = ranks(history[max(before)].get("batches"))
    else:
        after = min((e for e, end in ends.items() if end > first), default=None)  # the first resume's epoch
        entry = history.get(after)
        resumes_in_it = sum(1 for s, _ in resumes if s < ends[after]) if entry else 0
        w0 = ranks(entry.get("before_resume")) if entry and resumes_in_it == 1 else None
        if entry and resumes_in_it == 1 and "before_resume" not in entry and \
                ranks(entry.get("batches")) == resumes[0][1]:
            w0 = resumes[0][1]  # resumed on the same world and workers: nothing carried over
    return [(0, w0)] + resumes


def world_words(run):
    """'2 ranks', '2 then 3 ranks', or '3 ranks from step 16' when the first is not known."""
    segments, said = worlds(run), []
    for start, w in segments:
        if not said or said[-1][1] != w:
            said.append((start, w))
    known = [(start, w) for start, w in said if w]
    if not known:
        return None
    text = " then ".join(str(w) for _, w in known) + (" rank" if known[-1][1] == 1 and len(known) == 1 else " ranks")
    return text if said[0][1] else f"{text} from step {known[0][0]}"


def left_out(run):
    """{what: how many values} the lines hold that are not numbers a `what` can be (Infinity,
    NaN, a string, a negative loss, an accuracy above 1): they are not drawn, and the picture
    and the table say so."""
    counts = {}

    def count(what, values):
        bad = sum(1 for x in values if x is not None and math.isnan(value(x, what)))
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
    """'left out of the picture: 2 loss value(s) ...', or None when everything could be drawn."""
    counts = left_out(run)
    said = []
    if counts:
        said.append(", ".join(f"{n} {what}" for what, n in counts.items()) + " value(s) that no axis holds (Infinity, "
                    "NaN, below 0, past 1e300; an accuracy or share past 1)")
    if run.get("dropped"):
        said.append(f"{run['dropped']} train or eval line(s) without a whole epoch and step")
    return f"left out of the picture: {'; '.join(said)}" if said else None


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
    if isinstance(resumed, dict) and _count(resumed.get("step")):
        words.setdefault(int(resumed["step"]), []).append("resumed")
    return [(step, " and ".join(dict.fromkeys(w)) + f" at step {step}") for step, w in sorted(words.items())]
