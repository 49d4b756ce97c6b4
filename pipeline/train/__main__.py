"""`python -m pipeline.train ...` and `torchrun -m pipeline.train ...`.

The command line is parsed and checked before torch and the data path are imported, so
`--help` and a bad option answer at once."""
import sys
import warnings

from pipeline.train import options

args = options.parse()
options.check_out(args)

from pipeline.train.loop import main  # noqa: E402  (torch: only for a good command line)
from pipeline.train.console import one_line_warning  # noqa: E402
from pipeline.train.dist import set_threads  # noqa: E402

set_threads()  # this process's share of the cores (main() called from Python leaves its caller's setting)

warnings.formatwarning = one_line_warning  # the command's warnings read as its other lines; workers fork with it
sys.exit(main(sys.argv[1:], args=args))
