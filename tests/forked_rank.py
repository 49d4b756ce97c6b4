"""A rank as `python -u -m pipeline.train ARGS` runs it, forked by torchrun from a launcher
that imported torch and the trainer once (helpers.launch_train: `torchrun --run-path
--start-method=fork /abs/path/tests/forked_rank.py ARGS`, the path absolute as --run-path
asks): each fresh rank paid about 3.4 CPU-s for those imports.

torchrun waits for a function rank's return value, so an exit with code 0 returns; any
other code ends the process with it, as it ends a fresh rank."""
import io
import runpy
import sys

# what `python -u` sets up: unbuffered output (the launcher put the folder and PYTHONPATH on sys.path)
sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True, errors="backslashreplace")
try:
    runpy.run_module("pipeline.train", run_name="__main__", alter_sys=True)
except SystemExit as e:
    if e.code not in (0, None):
        raise
