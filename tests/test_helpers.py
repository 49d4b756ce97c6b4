"""The test suite's own guards on the processes it starts (tests/helpers.py, conftest.py): a
test that stops waiting takes its process's whole tree with it, and whatever those processes
write to a temporary folder lands in the test run's, not the system's."""
import os
import subprocess
import sys
import time

import pytest

from helpers import HANG, alive, completed, descendants, run_capture


@pytest.mark.slow  # two Pythons
def test_a_test_that_stops_waiting_takes_the_process_tree_with_it():
    """subprocess.run(timeout=...) killed the child alone: its children ran on (a benchmark's
    memory runs, torchrun's ranks), holding the pipes. completed() kills the whole tree on
    any way out of the wait: pytest's own timeout or ^C, here a KeyboardInterrupt."""
    code = ("import subprocess, sys, time\n"
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
            "time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    t0 = time.time()
    while len(descendants(proc.pid)) < 1:
        assert time.time() - t0 < HANG and proc.poll() is None  # a hang guard
        time.sleep(0.05)
    tree = [proc.pid, *descendants(proc.pid)]

    def interrupted(timeout=None):
        raise KeyboardInterrupt

    proc.communicate = interrupted
    with pytest.raises(KeyboardInterrupt):
        completed(proc)
    t0 = time.time()
    while any(alive(p) for p in tree) and time.time() - t0 < HANG:
        time.sleep(0.05)
    assert not [p for p in tree if alive(p)]


def test_the_processes_tests_start_keep_their_temporary_files_in_the_test_run(tmp_path_factory):
    """A child killed before its own clean-up left its temporary folder in /tmp (a killed
    benchmark's 20 MB of inputs); TMPDIR points every child into the run's folder, which pytest
    removes with old runs."""
    p = run_capture([sys.executable, "-c", "import tempfile; print(tempfile.gettempdir())"])
    assert p.stdout.strip() == os.path.join(str(tmp_path_factory.getbasetemp()), "tmp")
