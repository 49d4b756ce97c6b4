"""The stream's DataLoader face in the usual loops (examples/dataloader_loop.py, lightning_stream.py,
accelerate_stream.py), each stopped inside its first epoch and resumed: every sample of every epoch
read once. Lightning and accelerate are not dependencies: their tests run where they are installed."""
import collections
import os
import sys

import pytest

from helpers import HANG, run_capture, write_captioned

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def stopped_and_resumed(tmp_path, example, *extra):
    """Runs the example with --stop-after 3, then again to the end (2 epochs of 6 batches of 8);
    returns {epoch: Counter of keys}."""
    write_captioned(tmp_path / "set", 48, per_shard=12)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    for more in (["--stop-after", "3"], []):
        r = run_capture([sys.executable, os.path.join(ROOT, "examples", example), str(tmp_path / "set"), *extra,
                         "--keys", str(tmp_path / "keys.txt"), "--workers", "1", *more], cwd=tmp_path,
                        capture_output=True, text=True, timeout=HANG, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
    seen = collections.defaultdict(collections.Counter)
    for line in (tmp_path / "keys.txt").read_text().splitlines():
        epoch, key = line.split("\t")
        seen[int(epoch)][key] += 1
    return seen


def every_sample_once(seen):
    return sorted(seen) == [0, 1] and all(len(c) == 48 and set(c.values()) == {1} for c in seen.values())


def test_a_plain_loop_stopped_mid_epoch_reads_every_sample_once(tmp_path):
    assert every_sample_once(stopped_and_resumed(tmp_path, "dataloader_loop.py", "--state",
                                                 str(tmp_path / "state.json")))


def test_lightning_resumes_the_stream_from_its_checkpoint(tmp_path):
    pytest.importorskip("lightning")
    assert every_sample_once(stopped_and_resumed(tmp_path, "lightning_stream.py", "--out", str(tmp_path / "run")))


def test_accelerate_resumes_the_stream_from_its_saved_state(tmp_path):
    pytest.importorskip("accelerate")
    assert every_sample_once(stopped_and_resumed(tmp_path, "accelerate_stream.py", "--out", str(tmp_path / "run")))
