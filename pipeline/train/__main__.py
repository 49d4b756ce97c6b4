"""`python -m pipeline.train ...` and `torchrun -m pipeline.train ...`."""
import sys

from pipeline.train.loop import main

sys.exit(main())
