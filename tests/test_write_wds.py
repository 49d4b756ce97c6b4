"""tools/write_wds.py on odd ImageFolder trees: special files, folders where images belong,
class names classes.txt cannot hold, and an OUT inside ROOT, each one line, never a hang."""
import os
import sys
import tarfile
from pathlib import Path

from helpers import HANG, main_in_process, run_capture, tool_module

TOOL = Path(__file__).resolve().parents[1] / "tools" / "write_wds.py"


def tree(root, classes=("a", "b"), n=2):
    for c in classes:
        (root / c).mkdir(parents=True)
        for i in range(n):
            (root / c / f"{i}.jpg").write_bytes(b"not decoded here %d" % i)  # write_wds copies bytes as they are
    return root


def run(*args):
    return main_in_process(tool_module("write_wds").main, "write_wds.py", args)


def members(folder):
    names = []
    for f in sorted(os.listdir(folder)):
        with tarfile.open(folder / f) as t:
            names += t.getnames()
    return names


def test_a_fifo_among_the_images_is_skipped_in_one_line_not_waited_on(tmp_path):
    root = tree(tmp_path / "root")
    os.mkfifo(root / "a" / "x.jpg")
    p = run_capture([sys.executable, str(TOOL), root, tmp_path / "out", "--holdout", "0"], capture_output=True,
                    text=True, timeout=HANG)
    assert p.returncode == 0, p.stderr
    assert p.stderr.splitlines() == [f"write_wds: skipping {root}/a/x.jpg: a FIFO, not an image file"]
    assert "train: 4 samples" in p.stdout


def test_a_folder_inside_a_class_folder_is_skipped_in_one_line(tmp_path):
    root = tree(tmp_path / "root")
    (root / "b" / "nested").mkdir()
    p = run(root, tmp_path / "out", "--holdout", "1")
    assert p.returncode == 0, p.stderr
    assert p.stderr.splitlines() == [f"write_wds: skipping {root}/b/nested: a directory, not an image file"]
    assert len(members(tmp_path / "out" / "train")) + len(members(tmp_path / "out" / "test")) == 8  # 4 samples x 2


def test_a_class_name_with_a_newline_is_refused_in_one_line(tmp_path):
    root = tree(tmp_path / "root", classes=("a", "b\nc"))
    p = run(root, tmp_path / "out")
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.splitlines() == [f"write_wds: error: class folder 'b\\nc' in {root}: its name holds a newline "
                                     f"or another control character, which classes.txt (one name a line) cannot "
                                     f"hold; rename the folder"]
    assert not (tmp_path / "out").exists()


def test_out_equal_to_or_inside_root_is_refused_in_one_line(tmp_path):
    root = tree(tmp_path / "root")
    for out in (root, root / "wds", root / "a" / ".." / "b" / "x"):
        p = run(root, out)
        assert p.returncode == 2 and len(p.stderr.splitlines()) == 1, p.stderr
        assert "is ROOT" in p.stderr and "inside it" in p.stderr
    assert sorted(os.listdir(root)) == ["a", "b"] and sorted(os.listdir(root / "b")) == ["0.jpg", "1.jpg"]
