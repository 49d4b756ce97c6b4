"""What the trainer prints as it runs (pipeline.train.console): a fatal error's line is the
last one, after the epoch's bar, and the run's settings are one line of its log."""
import json
import sys

import pytest

from helpers import build_shards, train_in_process

# a --sample-stage that refuses every sample: the run ends with an input error inside its first epoch
REFUSE = '''
from pipeline.errors import InputError


def refuse(sample):
    raise InputError("this stage refuses every sample")
'''


def failing_evaluation(run, evals_from):
    """pipeline.train.loop.evaluate as a test shard answering 503 makes it."""
    raise OSError("mnist-test-000000.tar: HTTP 503")


@pytest.fixture
def tiny(tmp_path):
    build_shards(tmp_path / "data", "mnist", "train", 40, shape=(1, 8, 8))
    return tmp_path / "data" / "mnist-train.json"


def args(tiny, out, *more):
    return ["--train", f"mnist={tiny}", "--epochs", "1", "--batch-size", "4", "--workers", "0", "--width", "4",
            "--out", out, *more]


@pytest.mark.slow
def test_an_error_inside_an_epoch_is_the_last_line_after_the_bar(tiny, tmp_path, monkeypatch):
    """The epoch's bar was left open when an error ended the run: closed once the exception's
    frames went, after the error line, it drew itself again below it (a new user's log)."""
    (tmp_path / "n1_refusing_stage.py").write_text(REFUSE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "n1_refusing_stage", raising=False)
    p = train_in_process(args(tiny, tmp_path / "run", "--sample-stage", "n1_refusing_stage:refuse"))
    lines = p.stderr.splitlines()
    assert p.returncode == 2 and any(ln.startswith("epoch 1/1: ") for ln in lines), p.stderr  # the bar was up
    assert lines[-1].startswith("pipeline-train: error: sample stage n1_refusing_stage:refuse raised InputError: "
                                "this stage refuses every sample"), p.stderr


@pytest.mark.slow
@pytest.mark.parametrize("flag", [[], ["--channels-last"]])
def test_the_runs_settings_line_says_channels_last(tiny, tmp_path, flag):
    """--channels-last showed nowhere on the console: a log could not tell which layout a run trained in."""
    p = train_in_process(args(tiny, tmp_path / "run", *flag))
    said = [ln for ln in p.stdout.splitlines() if ln.startswith("training ")]
    assert p.returncode == 0 and said == [f"training cnn (width 4) on cpu: batch 4 a rank x 1 rank = 4 samples a "
                                          f"step, 0 loader workers a rank, channels-last {'on' if flag else 'off'}"], \
        p.stdout + p.stderr[-2000:]


@pytest.mark.slow
def test_the_epoch_line_says_how_often_each_source_is_read(tiny, tmp_path):
    """Equal weights over sources of 40 and 12 samples read the small one twice an epoch, which only
    metrics.jsonl showed (newuser4): the line under the settings says it, with the epoch's size."""
    build_shards(tmp_path / "data", "small", "train", 12, shape=(1, 8, 8))
    p = train_in_process(args(tiny, tmp_path / "run", "--train", f"small={tmp_path / 'data' / 'small-train.json'}"))
    lines = p.stdout.splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.startswith("training "))
    assert p.returncode == 0 and lines[at + 1] == ("1 epoch of 52 samples (13 steps an epoch), peak lr 0.00156 (--lr 0.1 x 4 samples a "
                                                   "step / 256); mix mnist 0.50 (26 "
                                                   "samples of its 40), small 0.50 (26 samples of its 12, read 2.2 "
                                                   "times)"), p.stdout + p.stderr[-2000:]


@pytest.mark.slow
def test_an_evaluation_that_fails_keeps_the_epochs_checkpoint_and_the_resume_is_exact(tiny, tmp_path, monkeypatch):
    """The end-of-epoch checkpoint was written after the evaluation, so a test shard failing
    (hostileK: a 503) threw the whole epoch away. Saved first, the epoch is kept: --resume goes on
    with the next epoch and reads what an uninterrupted run reads."""
    from pipeline.train import loop

    build_shards(tmp_path / "data", "mnist", "test", 8, shape=(1, 8, 8))
    common = ["--train", f"mnist={tiny}", "--eval", f"mnist={tmp_path / 'data' / 'mnist-test.json'}", "--epochs", "2",
              "--batch-size", "4", "--workers", "0", "--width", "4", "--record-keys"]
    whole = train_in_process([*common, "--out", tmp_path / "whole"])
    assert whole.returncode == 0, whole.stderr[-2000:]
    real = loop.evaluate

    monkeypatch.setattr(loop, "evaluate", failing_evaluation)
    p = train_in_process([*common, "--out", tmp_path / "cut"])
    assert p.returncode != 0 and "HTTP 503" in p.stderr
    assert "pipeline-train: note: epoch 1 is saved, its evaluation failed: --resume evaluates it" in p.stderr
    assert (tmp_path / "cut" / "checkpoint.pt").exists()
    monkeypatch.setattr(loop, "evaluate", real)
    p = train_in_process([*common, "--out", tmp_path / "cut", "--resume"])
    assert p.returncode == 0, p.stderr[-2000:]
    assert (tmp_path / "cut" / "keys-rank0.txt").read_text() == (tmp_path / "whole" / "keys-rank0.txt").read_text()
    assert "epoch 1's evaluation is missing" in p.stderr and "epoch 1/2: mnist" in p.stdout  # as the note said
    lines = [json.loads(ln) for ln in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert [ln["epoch"] for ln in lines if ln.get("kind") == "eval"] == [1, 2]


@pytest.mark.slow
def test_the_last_line_gives_the_training_time_the_whole_time_and_the_skipped(tiny, tmp_path):
    """'done in 0 s' for a 9 s run (newuser4: the time of the epochs alone), and 109 skipped training
    samples nowhere on the console (hostileK): the last line says both times and the skipped."""
    import re

    shard = tmp_path / "data" / "mnist-train-000000.tar"
    shard.write_bytes(bytes(len(shard.read_bytes())))  # zeros: the shard's samples are skipped
    p = train_in_process(args(tiny, tmp_path / "run", "--epochs", "2"))
    done = [ln for ln in p.stdout.splitlines() if ln.startswith("done")]
    assert p.returncode == 0 and len(done) == 1, p.stdout + p.stderr[-2000:]
    assert re.fullmatch(r"done: \d+\.\d s of training \(\d+\.\d s in all\); \d+ training samples skipped \(damaged: "
                        r"see metrics\.jsonl\); no --eval sources", done[0]), done[0]


@pytest.mark.slow
def test_a_resume_after_the_last_evaluation_failed_evaluates_and_writes_the_summary(tiny, tmp_path, monkeypatch):
    """The last epoch saved, its evaluation failed: --resume, as the failure's line says, answered
    "nothing to do" and left the run without its summary or its last accuracy (hostileL)."""
    import json

    from pipeline.train import loop

    build_shards(tmp_path / "data", "mnist", "test", 8, shape=(1, 8, 8))
    common = ["--train", f"mnist={tiny}", "--eval", f"mnist={tmp_path / 'data' / 'mnist-test.json'}", "--epochs", "1",
              "--batch-size", "4", "--workers", "0", "--width", "4", "--out", tmp_path / "run"]
    real = loop.evaluate
    monkeypatch.setattr(loop, "evaluate", failing_evaluation)
    p = train_in_process(common)
    assert p.returncode != 0 and "epoch 1 is saved, its evaluation failed: --resume evaluates it" in p.stderr
    assert not (tmp_path / "run" / "summary.json").exists()
    monkeypatch.setattr(loop, "evaluate", real)
    p = train_in_process([*common, "--resume"])
    assert p.returncode == 0 and "nothing to do" not in p.stdout, p.stdout + p.stderr[-2000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["finished"] and 0 <= summary["accuracy"]["mnist"] <= 1
    lines = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [ln["epoch"] for ln in lines if ln.get("kind") == "eval"] == [1]
    p = train_in_process([*common, "--resume"])  # finished now: nothing more to do, nothing written
    assert p.returncode == 0 and "nothing to do" in p.stdout


@pytest.mark.slow
def test_the_mix_line_says_where_final_weights_take_the_mix(tiny, tmp_path):
    """With --final-weights the line gave the first epoch's mix alone (hostileL)."""
    build_shards(tmp_path / "data", "small", "train", 12, shape=(1, 8, 8))
    p = train_in_process(args(tiny, tmp_path / "run", "--train", f"small={tmp_path / 'data' / 'small-train.json'}",
                              "--weights", "mnist=0.8,small=0.2", "--final-weights", "mnist=0.1,small=0.9",
                              "--epochs", "3", "--epoch-samples", "20"))
    said = [ln for ln in p.stdout.splitlines() if ln.startswith("3 epochs of 20 samples")]
    assert p.returncode == 0 and len(said) == 1, p.stdout + p.stderr[-2000:]
    assert said[0].endswith("; moving to mnist 0.10, small 0.90 by epoch 3"), said[0]
