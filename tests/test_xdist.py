"""make test's two processes keep the tests that share a job's fixture together: with pytest 9.2,
xdist's loadgroup stops grouping without a word (pytest-xdist#1386), and every shared torchrun
and benchmark fixture would run once per process."""
import os
import sys
import textwrap

import pytest

from helpers import HANG, run_capture

GROUPED = '''
import os, time
import pytest

def where(name):
    time.sleep(0.2)  # long enough that both processes take tests
    with open(os.path.join(os.environ["WHERE"], name), "w") as f:
        f.write(os.environ["PYTEST_XDIST_WORKER"])

@pytest.mark.xdist_group("shared")
def test_a():
    where("a")

@pytest.mark.xdist_group("shared")
def test_b():
    where("b")

@pytest.mark.xdist_group("shared")
def test_c():
    where("c")

def test_d():
    where("d")

def test_e():
    where("e")
'''


@pytest.mark.slow
def test_tests_of_one_xdist_group_run_in_one_process(tmp_path):
    pytest.importorskip("xdist")
    (tmp_path / "test_grouped.py").write_text(textwrap.dedent(GROUPED))
    env = dict(os.environ, WHERE=str(tmp_path))
    p = run_capture([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider",
                     "test_grouped.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=HANG)
    assert p.returncode == 0, p.stdout + p.stderr
    ran = {name: (tmp_path / name).read_text() for name in "abcde"}
    assert ran["a"] == ran["b"] == ran["c"], f"the group was split over processes: {ran}"
