"""Pictures of a run: report.png and a per-epoch table, read back from a run folder.

The folder is what `pipeline.train --out` writes: metrics.jsonl always, summary.json
once a run has ended. Everything is drawn from metrics.jsonl, so a run still going,
stopped or crashed (its last line torn) still gets a report; summary.json only adds
where each source's data came from (its origin and training manifest) and the data-wait
share. Eval lines also carry each test source's origin and manifest, so a run without a
summary says "origin unknown" only for sources it has not evaluated yet.

matplotlib is imported inside the drawing functions, never at import time: the
trainer imports nothing from here, and a training image need not carry it.
"""
import io
import json
import math
import os
import statistics

from pipeline.errors import ShardError, printable
from pipeline.figures import new_figure, plain
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


def _marker(points):
    """Dots where a line has too few points to be seen (a run shorter than a few --log-every)."""
    return "o" if len(points) < 10 else None


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


MARKS_MAX = 20  # stop/resume markers drawn; a hostile file's thousands would hide the curves


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


def draw_marks(axes, run):
    """A dotted vertical line at each stop and resume on the step panels, labelled on the first."""
    marks = stops_and_resumes(run)
    for i, (step, label) in enumerate(marks[:MARKS_MAX]):
        for ax in axes:
            ax.axvline(step, color="grey", linestyle=":", linewidth=1)
        last = i == MARKS_MAX - 1 and len(marks) > MARKS_MAX
        text = label + (f" (and {len(marks) - MARKS_MAX} more, not drawn)" if last else "")
        axes[0].text(step, 0.98, text, transform=axes[0].get_xaxis_transform(), rotation=90, ha="right", va="top",
                     fontsize=7, color="dimgrey")


def _cell(x, fmt):
    return "-" if x is None or math.isnan(x) else format(x, fmt)


def table(run):
    """The per-epoch table as text, columns aligned, for a terminal or a log, then where each
    source's data came from."""
    head = (["epoch"] + [f"loss {n}" for n in train_names(run)] + [f"acc {n}" for n in eval_names(run)]
            + ["samples/s"])
    body = [[str(r["epoch"])] + [_cell(v, ".4f") for v in r["loss"].values()]
            + [_cell(v, ".4f") for v in r["accuracy"].values()] + [_cell(r["samples_per_s"], ".1f")]
            for r in epoch_rows(run)]
    head = [printable(c) for c in head]
    widths = [max(len(row[i]) for row in [head] + body) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in [head] + body]
    notes = [ln for ln in (left_out_line(run),) if ln] + [f"run {label}" for _, label in stops_and_resumes(run)]
    return "\n".join(lines + [printable(ln) for ln in data_lines(run) + notes])


# ---------------------------------------------------------------- drawing


def _colours(names):
    from matplotlib import colormaps

    cmap = colormaps["tab10"]
    return {n: cmap(i % 10) for i, n in enumerate(names)}


def figure_title(run):
    summary = run["summary"] or {}
    names = _ordered([train_names(run), eval_names(run)])
    head = f"run {os.path.basename(os.path.abspath(run['dir']))}"
    if _number(summary.get("world_size")):
        head += f", {summary['world_size']} rank(s)"
    if not summary:
        head += ", no summary.json (still running, or stopped before the end)"
    elif summary.get("finished") is False:
        head += ", stopped before the end"
    return head + "\n" + "; ".join(described(run, n) for n in names)


def draw_loss(ax, run, colours):
    steps = [r["step"] for r in run["train"]]
    for name in train_names(run):
        ax.plot(steps, [loss_of(r, name) for r in run["train"]], color=colours[name], marker=_marker(steps),
                label=plain(described(run, name)))
    ax.set(title="training loss per source", xlabel="step", ylabel="mean loss since the last line")


def draw_accuracy(ax, run, colours):
    evals = last_evals(run)
    epochs = sorted(evals)
    for name in eval_names(run):
        ax.plot(epochs, [accuracy_of(evals[e], name) for e in epochs], marker="o", color=colours[name],
                label=plain(described(run, name)))
    ax.set(title="test accuracy per source", xlabel="epoch", ylabel="accuracy")
    if epochs:
        ax.set_xticks(epochs)
    else:
        ax.text(0.5, 0.5, "no eval lines (none yet, or no --eval sources)", ha="center", va="center", transform=ax.transAxes)


def draw_share(ax, run, colours):
    """A line's weights were in force over the steps since the line before (from step 0 for
    the first), hence the steps drawn back from each line."""
    steps = [r["step"] for r in run["train"]]
    names = train_names(run)
    weights = {name: [_finite(r.get("weights", {}).get(name)) for r in run["train"]] for name in names}
    for name in names:
        share = [_finite(r.get("share", {}).get(name)) for r in run["train"]]
        ax.plot(steps, share, color=colours[name], marker=_marker(steps), label=plain(f"{described(run, name)} share"))
    for group in equal_groups(weights):
        for i, name in enumerate(group):  # equal weights: dashes interleaved along one line, each colour seen
            w = weights[name]
            equal = f" (equal to {', '.join(n for n in group if n != name)})" if len(group) > 1 else ""
            ax.plot([0] + steps, w[:1] + w, color=colours[name], linestyle=(6 * i, (6, 6 * (len(group) - 1) or 6)),
                    drawstyle="steps-pre", label=plain(f"{name} weight{equal}"))
    # shares are fractions: the whole 0..1, so that sampling noise around 0.5 (0.48-0.52) looks as small as it is
    ax.set_ylim(0, 1)
    ax.set(title="realised mixture share (solid) and weights in force (dashed)", xlabel="step",
           ylabel="share of samples")


def equal_groups(series):
    """The names grouped by identical series (in first-seen order): the lines that would hide each other."""
    groups = {}
    for name, values in series.items():
        groups.setdefault(tuple("nan" if isinstance(v, float) and math.isnan(v) else v for v in values),
                          []).append(name)
    return list(groups.values())


def draw_speed(ax, run):
    steps = [r["step"] for r in run["train"]]
    ax.plot(steps, [_finite(r.get("samples_per_s")) for r in run["train"]], color="black", marker=_marker(steps))
    ax.set(title="throughput", xlabel="step", ylabel="samples/s (all ranks)")
    wait = (run["summary"] or {}).get("data_wait_share")
    note = f"waiting for data: {wait:.1%} of the time" if _number(wait) else "data-wait share: no summary.json"
    ax.text(0.02, 0.04, note, transform=ax.transAxes, fontsize=9,
            bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "none"})


CONFUSION_MAX = 20  # classes per source (the trainer's PER_CLASS_MAX); a hostile line's larger one is not drawn


def confusions(run):
    """{source: (class names, rows of counts)} from the last eval line, for sources evaluated
    per class; the last column counts predictions of another source's class."""
    evals = last_evals(run)
    if not evals:
        return {}
    out = {}
    for name, v in evals[max(evals)]["eval"].items():
        rows, per_class = v.get("confusion"), v.get("per_class")
        if not (isinstance(rows, list) and isinstance(per_class, dict) and 0 < len(rows) == len(per_class) <=
                CONFUSION_MAX and all(isinstance(r, list) and len(r) == len(rows) + 1 and all(
                    _number(x) and x >= 0 for x in r) for r in rows)):
            continue
        out[name] = ([str(c) for c in per_class], rows)
    return out


def draw_confusion(ax, name, classes, rows):
    """Rows: the true class; columns: the predicted one (each row sums to 1), then 'other'
    for a prediction of another source's class."""
    shares = [[x / max(sum(r), 1) for x in r] for r in rows]
    ax.imshow(shares, cmap="Blues", vmin=0, vmax=1, interpolation="nearest")
    labels = [plain(c, limit=16) for c in classes]
    ax.set_xticks(range(len(classes) + 1))
    ax.set_xticklabels(labels + ["other"], rotation=90, fontsize=7)
    ax.set_yticks(range(len(classes)))
    ax.set_yticklabels(labels, fontsize=7)
    total = sum(sum(r) for r in rows)
    correct = sum(r[i] for i, r in enumerate(rows))
    ax.set(title=plain(f"{name}: confusion, accuracy {correct / max(total, 1):.3f}", limit=60),
           xlabel="predicted", ylabel="true class")


def build_figure(run):
    """The figure of a run: four panels (training loss, test accuracy, mixture share against
    weights, samples/s), stops and resumes marked on the step panels, then a row of one
    confusion matrix per source evaluated per class (MNIST and CIFAR10: six panels in all),
    and a line saying which values were not finite numbers and so not drawn."""
    matrices = confusions(run)
    n = len(matrices)
    fig = new_figure(max(14, 3.5 * n), 9 + (4.5 if n else 0))
    grid = fig.add_gridspec(3 if n else 2, 2 * max(n, 1), height_ratios=[1, 1, 1.1] if n else [1, 1])
    half = max(n, 1)
    a, b = fig.add_subplot(grid[0, :half]), fig.add_subplot(grid[0, half:])
    c, d = fig.add_subplot(grid[1, :half]), fig.add_subplot(grid[1, half:])
    for i, (name, (classes, rows)) in enumerate(matrices.items()):
        draw_confusion(fig.add_subplot(grid[2, 2 * i:2 * i + 2]), name, classes, rows)
    colours = _colours(_ordered([train_names(run), eval_names(run)]))
    draw_loss(a, run, colours)
    draw_accuracy(b, run, colours)
    draw_share(c, run, colours)
    draw_speed(d, run)
    draw_marks([a, c, d], run)
    for ax in (a, b, c):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(plain(figure_title(run), limit=1000))
    note = left_out_line(run)
    fig.tight_layout(rect=(0, 0.03, 1, 1) if note else None)
    if note:
        fig.text(0.5, 0.005, plain(note), ha="center", va="bottom", fontsize=9, color="darkred")
    return fig


def save(fig, out):
    """Write the figure in the format its name asks for (PNG when the name has no extension)."""
    ext = os.path.splitext(out)[1].lstrip(".").lower() or "png"
    if ext not in fig.canvas.get_supported_filetypes():
        raise ReportError(f"{out}: cannot write .{ext} pictures; name a .png file")
    try:
        fig.savefig(out, format=ext)
    except OSError as e:
        raise ReportError(f"{out}: {e}") from None
    return out


def report(run_dir, out=None):
    """Draw report.png (or `out`) for a run folder; returns (path written, the epoch table)."""
    run = load_run(run_dir)
    path = save(build_figure(run), out or os.path.join(run_dir, "report.png"))
    return path, table(run)
