"""tools/bench_loader.py counts DataLoader workers' CPU time on kernels without
/proc/<pid>/task/*/children (CONFIG_PROC_CHILDREN unset), by scanning parent pids."""
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from bench import host, proc  # noqa: E402


def test_children_are_found_without_proc_children(monkeypatch):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        real_glob = proc.glob.glob
        monkeypatch.setattr(proc.glob, "glob",
                            lambda pattern: [] if pattern.endswith("/children") else real_glob(pattern))
        assert child.pid in proc.child_pids(os.getpid())
        assert child.pid in proc.tree_pids(os.getpid())
    finally:
        child.kill()
        child.wait()


def test_host_facts_name_what_moves_the_tutorial_loader():
    facts = host.host_facts()
    assert facts["torch_threads"] >= 1 and facts["affinity"] >= 1
    assert set(facts["env"]) >= {"OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"}
