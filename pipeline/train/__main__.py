"""`python -m pipeline.train ...` and `torchrun -m pipeline.train ...`.

The command line is parsed and checked before torch and the data path are imported, so
`--help` and a bad option answer at once."""
import sys

from pipeline.train import options

args = options.parse()
options.check_out(args)

from pipeline.train.loop import main  # noqa: E402  (torch: only for a command line that is good)

sys.exit(main(sys.argv[1:], args=args))
