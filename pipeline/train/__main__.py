"""`python -m pipeline.train ...`, `torchrun -m pipeline.train ...` and the `pipeline-train`
command that `pip install` puts on the PATH.

The command line is parsed and checked before torch and the data path are imported, so
`--help` and a bad option answer at once."""
import sys
import warnings

from pipeline.train import options, stop


def command():
    args = options.parse()
    options.check_out(args)
    if not args.eval_only:  # registered before torch's and multiprocessing's hooks, so it runs after them
        stop.ignore_at_exit(stop.parse_signals(args.stop_signals))

    from pipeline.train.loop import main  # torch: only for a good command line
    from pipeline.train.console import one_line_warning
    from pipeline.train.dist import set_threads

    set_threads()  # this process's share of the cores (main() called from Python leaves its caller's setting)

    warnings.formatwarning = one_line_warning  # the command's warnings read as its other lines; workers fork with it
    sys.exit(main(sys.argv[1:], args=args, process=True))


if __name__ == "__main__":
    command()
