"""Batch memory from the job (pipeline.data.handover.budget): what a batch, the loader's queue, the float
copy and the shuffle windows take is computed from the batch size, the manifests' shapes and
the workers, and a job over --max-batch-memory is refused in one line before it reads."""
import json
import os
import shutil

import pytest

from helpers import Forker, HANG, build_shards, train_in_process
from pipeline.data.handover import budget

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    base = tmp_path_factory.mktemp("budget")
    build_shards(base / "d", "mnist", "train", 60, maxcount=20)
    return base / "d"


@pytest.fixture(scope="module")
def png_shards(tmp_path_factory):
    """PNG shards, as make_shards writes them: decoded whatever the manifest's shape (raw ones are refused)."""
    base = tmp_path_factory.mktemp("budget-png")
    build_shards(base / "d", "mnist", "train", 60, maxcount=20, encoding="png")
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
    # 8 x 3 x 4096 x 4096 bytes a batch; 8 workers x (4 + 2) ring slots; the trainer's float32 copy;
    # each worker decodes a batch (decoded, joined as RGBX, padded: 4 batches) and resizes an image (3 images of the
    # target, and the source image at RGBA, here at most MAX_PIXELS)
    parts = budget.needed(8, [(1, 4096, 4096)], 8, prefetch_factor=4)
    batch = 8 * 3 * 4096 * 4096
    assert parts["batch"] == batch and parts["ring"] == 48 * batch and parts["trainer"] == 4 * batch
    assert parts["decode"] == 8 * (4 * batch + 3 * batch // 8 + 4 * 4096 * 4096) and parts["step"] == 0
    assert parts["total"] == 52 * batch + parts["decode"] > 20e9  # the 20.7 GB the trainer grew to
    # the largest H and W over the sources, 3 channels; no workers: the loader's own ring of 6 slots, and
    # one for each evaluation loader, the trainer decodes;
    # windows per source and worker; the model's step as the caller gives it
    parts = budget.needed(2, [(1, 28, 28), (3, 32, 16)], 0, window_bytes=1000, eval_sources=2, step_bytes=7)
    assert parts["batch"] == 2 * 3 * 32 * 28 and parts["ring"] == 6 * parts["batch"]
    assert parts["eval_ring"] == 2 * 6 * parts["batch"]
    source = 4 * 256 * 32 * 28  # an image of bounds.MAX_DECODE_RATIO times the target's pixels, RGBA
    assert parts["windows"] == 2 * 1000 and parts["decode"] == 4 * parts["batch"] + 3 * 3 * 32 * 28 + source
    assert parts["step"] == 7 and parts["total"] == 26 * parts["batch"] + 3 * 3 * 32 * 28 + source + 2000 + 7
    parts = budget.needed(2, [(1, 28, 28), (3, 32, 16)], 3, window_bytes=1000, eval_sources=2)
    assert parts["windows"] == 2 * 3 * 1000 and parts["eval_ring"] == 2 * 2 * 6 * parts["batch"]
    assert parts["decode"] == (3 + 2 * 2) * (4 * parts["batch"] + 3 * 3 * 32 * 28 + source)  # the eval loaders' too


def test_over_the_cap_is_one_line_naming_numbers_and_flags():
    with pytest.raises(ValueError) as e:
        budget.check_budget(8, {"mnist": (1, 4096, 4096)}, 8, 1 << 30)
    line = str(e.value)
    assert "\n" not in line
    for needle in ("--batch-size 8", "3x4096x4096", "[1, 4096, 4096]", "384.0 MiB a batch", "8 worker(s)",
                   "queued, decoding and the float copy a rank needs 33.1 GiB", "--max-batch-memory 1.0 GiB",
                   "lower --batch-size or --workers, or raise"):
        assert needle in line, line
    assert budget.check_budget(8, {"mnist": (1, 28, 28)}, 8, 1 << 30)["total"] < 1 << 30


def test_only_the_flags_that_lower_the_sum_are_named():
    """A batch of 1 cannot be lowered, nor no workers; the model's step names --width, first when it is
    the larger part; with nothing to lower, the cap and the manifest's shape are what is left."""
    def line(*a, **kw):
        with pytest.raises(ValueError) as e:
            budget.check_budget(*a, **kw)
        assert "\n" not in str(e.value)
        return str(e.value)

    assert "lower --width or --batch-size, or raise" in line(8, {"m": (1, 4096, 4096)}, 0, 1 << 30, step_bytes=40 << 30,
                                                             width=64)
    said = line(1, {"m": (1, 4096, 4096)}, 0, 1 << 30, step_bytes=40 << 30, width=64)
    assert "the model's step at --width 64 on the CPU (40.0 GiB)" in said and "lower --width, or raise" in said, said
    assert "--batch-size" not in said.split("a batch;")[1]
    said = line(1, {"m": (1, 4096, 4096)}, 0, 1 << 20)
    assert said.endswith("raise --max-batch-memory, or give the source a manifest of a smaller shape"), said
    assert "lower" not in said and "--workers" not in said


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


def rss_watched(args, limit, timeout=600):
    """`python -m pipeline.train ARGS` in a subprocess whose RSS is read every 50 ms: killed, and
    the test failed, once it passes `limit` bytes. (returncode, stderr, the most RSS seen)."""
    import subprocess
    import sys
    import time

    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    p = subprocess.Popen([sys.executable, "-m", "pipeline.train", *map(str, args)], cwd=ROOT, env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    most, deadline = 0, time.monotonic() + timeout  # a hang guard, not a measure of speed
    try:
        while p.poll() is None:
            try:
                with open(f"/proc/{p.pid}/status") as f:
                    most = max(most, int(f.read().split("VmRSS:")[1].split()[0]) * 1024)
            except (OSError, IndexError):  # exiting: no VmRSS any more
                pass
            assert most <= limit, f"the trainer grew to {budget.human(most)} ({args})"
            assert time.monotonic() < deadline, f"the trainer ran {timeout} s ({args})"
            time.sleep(0.05)
    finally:
        if p.poll() is None:
            p.kill()
        stderr = p.communicate()[1]
    return p.returncode, stderr, most


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmRSS from /proc")
@pytest.mark.parametrize("extra", [["--batch-size", "1"], ["--batch-size", "8"], ["--batch-size", "1", "--width", "4"]])
def test_a_manifest_shape_of_4096_is_refused_at_any_batch_size_under_an_rss_watch(png_shards, tmp_path, extra):
    """The hostile trial's case: 28x28 shards, the manifest's shape edited to [1, 4096, 4096],
    `--epoch-samples 32 --workers 0` at batch 1 and 8 passed the estimate and grew past 4 GB:
    what the decode, the batch, its float copy and the model's step on the CPU take is counted,
    so the job ends in one line, RSS sampled, before it reads (a 3 GiB cap, the default of a
    6 GiB machine, so the test means the same on any machine)."""
    big = with_shape(png_shards, tmp_path / "big", [1, 4096, 4096])
    rc, stderr, most = rss_watched(["--train", f"mnist={big}/", *extra, "--epoch-samples", "32", "--workers", "0",
                                    "--epochs", "1", "--max-batch-memory", "3G", "--out", tmp_path / "o"],
                                   limit=3 << 29)  # 1.5 GiB: torch and the model alone are about 0.8
    errors = [ln for ln in stderr.splitlines() if "error:" in ln]
    assert rc == 2 and len(errors) == 1 and "Traceback" not in stderr, stderr[-2000:]
    line = errors[0]
    assert "[1, 4096, 4096]" in line and "--max-batch-memory 3.0 GiB" in line and "--width" in line, line
    assert ("--batch-size" in line.split("lower ")[1]) == (extra[1] != "1"), line  # a batch of 1 cannot be lowered
    assert not (tmp_path / "o").exists()
