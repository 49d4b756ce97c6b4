"""Draw the pictures of a training run in RUN_DIR/report.png and a per-epoch table on stdout.
The picture: four panels (training loss, test accuracy, mixture share against weights,
samples/s) with dotted lines where the run stopped and resumed, then one confusion matrix per
source evaluated per class (MNIST and CIFAR10: six panels in all). Values that are not finite
numbers (an Infinity or NaN loss) are left out and counted in a line under the picture.

    python tools/report.py runs/demo
    python tools/report.py runs/demo --out /tmp/demo.png

Works on a run still going or stopped early (from metrics.jsonl alone; summary.json,
when there, adds where each source's data came from and the data-wait share).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pipeline.cli import Parser, printable  # noqa: E402
from pipeline.train.report import ReportError, report  # noqa: E402


def parse_args(argv):
    p = Parser(prog="report", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", metavar="RUN_DIR", help="a folder written by python -m pipeline.train --out")
    p.add_argument("--out", metavar="FILE", help="where to write the picture (default: RUN_DIR/report.png)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    try:
        path, table = report(args.run_dir, args.out)
    except ReportError as e:
        print(f"report: error: {printable(e)}", file=sys.stderr)  # it may quote a name from the run
        return 2
    print(table)
    print(f"picture: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
