"""Batch memory from the job (pipeline.data.budget): what a batch, the loader's queue, the float
copy and the shuffle windows take is computed from the batch size, the manifests' shapes and
the workers, and a job over --max-batch-memory is refused in one line before it reads."""
import json
import os
import shutil

import pytest

from helpers import Forker, HANG, build_shards, train_in_process
from pipeline.data import budget

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    base = tmp_path_factory.mktemp("budget")
    build_shards(base / "d", "mnist", "train", 60, maxcount=20)
    return base / "d"


def with_shape(shards, folder, shape):
    """A copy of the shards whose manifest declares another image shape (the shards are 1x28x28)."""
    shutil.copytree(shards, folder)
    path = folder / "mnist-train.json"
    m = json.loads(path.read_text())
    m["shape"] = shape
    path.write_text(json.dumps(m))
    return folder


def test_the_sums_follow_the_loader():
    # 8 x 3 x 4096 x 4096 bytes a batch; 8 workers x (4 + 2) ring buffers; the trainer's uint8 + float32 copies
    parts = budget.needed(8, [(1, 4096, 4096)], 8, prefetch_factor=4)
    batch = 8 * 3 * 4096 * 4096
    assert parts["batch"] == batch and parts["ring"] == 48 * batch and parts["trainer"] == 5 * batch
    assert parts["total"] == 53 * batch > 20e9  # the 20.7 GB the trainer grew to
    # the largest H and W over the sources, 3 channels; no workers: no ring; windows per source and worker
    parts = budget.needed(2, [(1, 28, 28), (3, 32, 16)], 0, window_bytes=1000, eval_sources=2)
    assert parts["batch"] == 2 * 3 * 32 * 28 and parts["ring"] == parts["eval_ring"] == 0
    assert parts["windows"] == 2 * 1000
    parts = budget.needed(2, [(1, 28, 28), (3, 32, 16)], 3, window_bytes=1000, eval_sources=2)
    assert parts["windows"] == 2 * 3 * 1000 and parts["eval_ring"] == 2 * 2 * 6 * parts["batch"]


def test_over_the_cap_is_one_line_naming_numbers_and_flags():
    with pytest.raises(ValueError) as e:
        budget.check_budget(8, {"mnist": (1, 4096, 4096)}, 8, 1 << 30)
    line = str(e.value)
    assert "\n" not in line
    for needle in ("--batch-size 8", "3x4096x4096", "[1, 4096, 4096]", "384.0 MiB a batch", "8 worker(s)",
                   "19.9 GiB", "--max-batch-memory 1.0 GiB", "--workers"):
        assert needle in line, line
    assert budget.check_budget(8, {"mnist": (1, 28, 28)}, 8, 1 << 30)["total"] < 1 << 30


def test_the_default_cap_is_half_the_memory_over_the_local_ranks(monkeypatch):
    pages = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 1 << 22}  # 16 GiB
    monkeypatch.setattr(os, "sysconf", pages.__getitem__)
    assert budget.default_cap({}) == 8 << 30
    assert budget.default_cap({"LOCAL_WORLD_SIZE": "4"}) == 2 << 30
    assert budget.default_cap({"LOCAL_WORLD_SIZE": "x"}) == 8 << 30


def refused(p):
    errors = [ln for ln in p.stderr.splitlines() if "error:" in ln]
    assert p.returncode == 2 and len(errors) == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    return errors[0]


def test_a_manifest_shape_of_4096_is_refused_before_a_read(shards, tmp_path):
    """The hostile trial's case: 28x28 shards, the manifest's shape edited to [1, 4096, 4096],
    --batch-size 8 (the trainer grew to 20.7 GB and was killed)."""
    big = with_shape(shards, tmp_path / "big", [1, 4096, 4096])
    p = train_in_process(["--train", f"mnist={big}/", "--batch-size", "8", "--workers", "2", "--width", "4",
                          "--max-batch-memory", "2G", "--out", tmp_path / "o"])
    line = refused(p)
    assert "3x4096x4096" in line and "--batch-size" in line and "--workers" in line and "--max-batch-memory 2.0 GiB" \
        in line, line
    assert not (tmp_path / "o").exists()


def test_a_huge_batch_size_is_refused(shards, tmp_path):
    p = train_in_process(["--train", f"mnist={shards}/", "--batch-size", "200000", "--epoch-samples", "400000",
                          "--workers", "2", "--width", "4", "--max-batch-memory", "1G", "--out", tmp_path / "o"])
    assert "--batch-size 200000 of 3x28x28" in refused(p)


ENTRY = "import resource\nimport pipeline.train.loop as loop\n"
CAPPED = r"""
vm = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), vm + (1 << 30)))
sys.exit(loop.main(sys.argv[1:]))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmSize from /proc")
def test_the_default_cap_refuses_the_case_under_a_memory_cap(shards, tmp_path):
    """The trainer's default cap, in a child whose address space may grow 1 GiB: refused in one line
    (on any machine with less than 8 workers x 6 x 384 MiB x 2 = 37 GiB of memory per rank)."""
    big = with_shape(shards, tmp_path / "big", [1, 4096, 4096])
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    phys = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if phys // 2 >= 53 * 8 * 3 * 4096 * 4096:
        pytest.skip("this machine's default cap admits the case")
    with Forker(ENTRY, tmp_path, env=env, cwd=ROOT) as forker:
        p = forker.run(CAPPED, "--train", f"mnist={big}/", "--batch-size", "8", "--width", "4",
                       "--out", tmp_path / "o", timeout=HANG)
    assert "--max-batch-memory" in refused(p)
