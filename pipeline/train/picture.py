"""The picture of a run (report.png): four panels against steps and epochs, the stops and
resumes marked, a confusion matrix per source evaluated per class.

matplotlib is imported inside the drawing functions, never at import time: the
trainer imports nothing from here, and a training image need not carry it.
"""
import math
import os

from pipeline.figures import new_figure, plain
from pipeline.train.rundata import (ReportError, _number, _ordered, accuracy_of, described, eval_names, last_evals,
                                    left_out_line, loss_of, stops_and_resumes, train_names, value, world_words)


def _marker(points):
    """Dots where a line has too few points to be seen (a run shorter than a few --log-every)."""
    return "o" if len(points) < 10 else None

MARKS_MAX = 20  # stop/resume markers drawn; a hostile file's thousands would hide the curves

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


def _colours(names):
    from matplotlib import colormaps

    cmap = colormaps["tab10"]
    return {n: cmap(i % 10) for i, n in enumerate(names)}


def figure_title(run):
    summary = run["summary"] or {}
    names = _ordered([train_names(run), eval_names(run)])
    head = f"run {os.path.basename(os.path.abspath(run['dir']))}"
    ranks = world_words(run)
    if ranks:
        head += f", {ranks}"
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
    weights = {name: [value(r.get("weights", {}).get(name), "weight") for r in run["train"]] for name in names}
    for name in names:
        share = [value(r.get("share", {}).get(name), "share") for r in run["train"]]
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
    ax.plot(steps, [value(r.get("samples_per_s"), "samples/s") for r in run["train"]], color="black",
            marker=_marker(steps))
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
    for a prediction of another source's class (the model has one head over every source's
    classes, so a digit can be taken for a cat), said under the panel."""
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
           xlabel="predicted (other: a class of another source)", ylabel="true class")


def build_figure(run):
    """The figure of a run: four panels (training loss, test accuracy, mixture share against
    weights, samples/s), stops and resumes marked on the step panels, then a row of one
    confusion matrix per source evaluated per class (MNIST and CIFAR10: six panels in all),
    and a line saying which values no axis could hold and so were not drawn."""
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
        fig.text(0.5, 0.005, plain(note, limit=300), ha="center", va="bottom", fontsize=9, color="darkred")
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
