"""tools/bench_order.py (issue 36) on a tiny ImageFolder: its pieces in this process, and the
whole command, training included, in its own."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from helpers import HANG, make_shards_in_process, run_capture, tool_module

CLASSES, PER_CLASS, TEST_PER_CLASS = 3, 15, 5
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def folder(tmp_path):
    """3 classes x 20 tiny JPEGs, each class its own brightness."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in range(CLASSES):
        os.makedirs(tmp_path / "img" / f"c{c}")
        for i in range(PER_CLASS + TEST_PER_CLASS):
            a = np.clip(rng.normal(c * 80 + 30, 15, (8, 8, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(a).save(tmp_path / "img" / f"c{c}" / f"{i:04d}.jpg")
    return tmp_path / "img"


def test_help_and_a_work_dir_in_use_are_one_line(tmp_path, capsys):
    bench = tool_module("bench_order")
    with pytest.raises(SystemExit) as e:
        bench.main(["--help"])
    assert e.value.code == 0 and "--cifar-folder" in capsys.readouterr().out
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "x").write_text("")
    with pytest.raises(SystemExit) as e:
        bench.main(["--cifar-folder", str(tmp_path), "--work-dir", str(tmp_path / "w")])
    assert e.value.code == 2 and "not an empty folder" in capsys.readouterr().err


@pytest.mark.slow  # make_shards indexes with a pool of processes
def test_the_pieces_write_index_and_count(folder, tmp_path, read_tar):
    bench = tool_module("bench_order")
    work = str(tmp_path / "w")
    args = bench.parse_args(["--cifar-folder", str(folder), "--work-dir", work, "--per-class", str(PER_CLASS),
                             "--test-per-class", str(TEST_PER_CLASS), "--maxcount", "10", "--batch-size", "8"])
    assert bench.write_sets(args, work) == (CLASSES * PER_CLASS, CLASSES * TEST_PER_CLASS, ["c0", "c1", "c2"])

    def labels(which):
        d = os.path.join(work, which)
        return [json.loads(s["json"])["label"] for f in sorted(os.listdir(d)) for _, s in read_tar(os.path.join(d, f))]

    ordered, shuffled = labels("ordered/train"), labels("shuffled/train")
    assert ordered == sorted(ordered) and shuffled != ordered and sorted(shuffled) == ordered
    assert labels("test") == [f"c{c}" for c in range(CLASSES) for _ in range(TEST_PER_CLASS)]
    for which in bench.SETS:
        p = make_shards_in_process(bench.index_args(work, which))
        assert p.returncode == 0, p.stderr
        with open(os.path.join(work, which, "cifar10-test.json")) as f:
            assert json.load(f)["total"] == CLASSES * TEST_PER_CLASS
    got = {w: bench.classes_per_batch(os.path.join(work, w), 8, 0, 1, 0) for w in bench.SETS}
    base = bench.uniform(CLASSES, PER_CLASS, 8, 0)
    assert all(v > base - 0.5 for v in got.values()), (got, base)


@pytest.mark.slow
def test_the_command_end_to_end(folder, tmp_path):
    p = run_capture([sys.executable, os.path.join(ROOT, "tools", "bench_order.py"), "--cifar-folder", str(folder),
                     "--work-dir", str(tmp_path / "w"), "--per-class", str(PER_CLASS), "--test-per-class",
                     str(TEST_PER_CLASS), "--epochs", "1", "--width", "4", "--batch-size", "8", "--maxcount", "10"],
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=HANG)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert set(out["accuracy"]) == {"ordered", "shuffled"} and all(0 <= a <= 1 for a in out["accuracy"].values())
    for which in ("ordered", "shuffled"):
        assert set(out["classes_per_batch"][which]) == {"w0", "w2", "ranks2_w1", "ranks2_w2"}
        assert all(1 <= v <= CLASSES for v in out["classes_per_batch"][which].values())
        assert os.path.isfile(tmp_path / "w" / "runs" / which / "summary.json")
    assert out["wall_s"] > 0
