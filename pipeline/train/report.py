"""The report of a run: the per-epoch table, report.png (pipeline.train.picture), and the
`pipeline-report` command (tools/report.py), all read back from a run folder
(pipeline.train.rundata).
"""
import argparse
import math
import os
import sys

from pipeline.cli import Parser
from pipeline.errors import printable
from pipeline.train.picture import build_figure, save
from pipeline.train.rundata import ReportError, data_lines, epoch_rows, eval_names, left_out_line, load_run, \
    stops_and_resumes, train_names

DESCRIPTION = """Draw the pictures of a training run in RUN_DIR/report.png and a per-epoch table on stdout.
The picture: four panels (training loss, test accuracy, mixture share against weights,
samples/s) with dotted lines where the run stopped and resumed, then one confusion matrix per
source evaluated per class (MNIST and CIFAR10: six panels in all); its title names the world
sizes the run ran on (2 then 3 ranks after a resume on 3). Values no axis can hold (an Infinity
or NaN loss, a negative one, an accuracy above 1) are left out and counted under the picture.
The table: per epoch, each source's mean training loss over the epoch's samples, its test
accuracy, the median samples/s and the samples skipped as damaged (all ranks').

    python tools/report.py runs/demo
    python tools/report.py runs/demo --out /tmp/demo.png

Works on a run still going or stopped early (from metrics.jsonl alone; summary.json,
when there, adds where each source's data came from and the data-wait share).
"""

__all__ = ["ReportError", "build_figure", "epoch_rows", "load_run", "main", "report", "table"]


def _cell(x, fmt):
    return "-" if x is None or math.isnan(x) else format(x, fmt)


def table(run):
    """The per-epoch table as text, columns aligned, for a terminal or a log, then where each
    source's data came from."""
    rows = epoch_rows(run)
    skips = any(r["skipped"] is not None for r in rows)  # a run from before the count: no column
    head = (["epoch"] + [f"loss {n}" for n in train_names(run)] + [f"acc {n}" for n in eval_names(run)]
            + ["samples/s"] + ["skipped"] * skips)
    body = [[str(r["epoch"])] + [_cell(v, ".4f") for v in r["loss"].values()]
            + [_cell(v, ".4f") for v in r["accuracy"].values()] + [_cell(r["samples_per_s"], ".1f")]
            + ["-" if r["skipped"] is None else str(r["skipped"])] * skips
            for r in rows]
    head = [printable(c) for c in head]
    widths = [max(len(row[i]) for row in [head] + body) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in [head] + body]
    notes = [ln for ln in (left_out_line(run),) if ln] + [f"run {label}" for _, label in stops_and_resumes(run)]
    columns = COLUMNS + ("; acc NAME: the test accuracy after the epoch" if eval_names(run) else "") + \
        "; samples/s: training samples a second" + ("; skipped: training samples skipped (damaged)" if skips else "")
    return "\n".join(lines + [columns] + [printable(ln) for ln in data_lines(run) + notes])


COLUMNS = "loss NAME: the mean training loss over the epoch's samples of NAME"  # read as a test loss (newuser4)


def report(run_dir, out=None):
    """Draw report.png (or `out`) for a run folder; returns (path written, the epoch table)."""
    run = load_run(run_dir)
    path = save(build_figure(run), out or os.path.join(run_dir, "report.png"))
    return path, table(run)


def parse_args(argv):
    p = Parser(prog="report", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", metavar="RUN_DIR", help="a folder written by python -m pipeline.train --out")
    p.add_argument("--out", metavar="FILE", help="where to write the picture (default: RUN_DIR/report.png)")
    return p.parse_args(argv)


def main(argv=None):
    """tools/report.py and the `pipeline-report` command; returns the exit code."""
    args = parse_args(argv)
    try:
        path, text = report(args.run_dir, args.out)
    except ReportError as e:
        print(f"pipeline-report: error: {printable(e)}", file=sys.stderr)  # it may quote a name from the run
        return 2
    print(text)
    print(f"picture: {path}")
    return 0


if __name__ == "__main__":  # python -m pipeline.train.report: where pip installed the package without tools/
    sys.exit(main())
