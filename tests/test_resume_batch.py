"""The trainer's resume on other settings (issue 46): another batch size or world, --global-batch,
new --epochs or --weights, each said in one line; and the checkpoint's sample counts tied to
its stream state, so an edited `position.seen` or key count is refused.
"""
import collections
import json
import os
import shutil
from types import SimpleNamespace

import pytest
import torch

from helpers import finish, launch_train
from pipeline.train import loop as train, options
from pipeline.train.schedule import learning_rate
from pipeline.train.metrics import read_keys


@pytest.fixture(scope="module")
def data(mixed_shards):
    return mixed_shards  # mnist and cifar10, 200 training samples each (conftest.py); read only here


def small(data, out, *extra):
    return ["--train", f"mnist={data}/", "--train", f"cifar10={data}/", "--epochs", "2", "--epoch-samples", "160",
            "--workers", "0", "--width", "4", "--log-every", "1", "--record-keys", "--out", str(out), *extra]


def run_main(argv, capsys):
    try:
        code = train.main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def lines(out, kind="train"):
    return [json.loads(ln) for ln in open(os.path.join(out, "metrics.jsonl")) if f'"kind": "{kind}"' in ln]


def keys(out, epoch, ranks=1):
    return [k for r in range(ranks) for e, k in read_keys(os.path.join(out, f"keys-rank{r}.txt")) if e == epoch]


def edit(path, change):
    state = torch.load(path, weights_only=True)
    change(state)
    torch.save(state, path)


# ---------------------------------------------------------------- the run's counts tied to the stream's


def test_samples_seen_and_key_counts_are_tied_to_the_stream_state(data, tmp_path, capsys):
    """A run checkpointed at step 5 went on to step 10 and was killed: its key log holds 160 lines,
    its checkpoint 80. A checkpoint edited to say 160 seen and 160 keys kept the log's later
    80 keys, which the resume then reads again (80 twice in the record, exit 0, before);
    the seen count must be what the run's tallies and the stream's batches add up to."""
    out = tmp_path / "run"
    assert run_main(small(data, out, "--batch-size", "16", "--stop-after-steps", "5"), capsys)[0] == 0
    shutil.copy(out / "checkpoint.pt", tmp_path / "at5.pt")
    assert run_main(small(data, out, "--batch-size", "16", "--resume", "--stop-after-steps", "5"), capsys)[0] == 0
    assert len(keys(out, 1)) == 160
    shutil.copy(tmp_path / "at5.pt", out / "checkpoint.pt")  # killed after step 10: the last checkpoint is step 5's

    def forged(state):
        pos = json.loads(state["position"])
        state["position"] = json.dumps(dict(pos, seen=160))
        state["key_counts"] = json.dumps([160])
    edit(out / "checkpoint.pt", forged)
    code, _, err = run_main(small(data, out, "--batch-size", "16", "--resume"), capsys)
    assert code == 2 and "position.seen: 160, but the run's epochs and tallies hold 80 samples" in err, err[-2000:]
    assert err.count("error:") == 1 and "Traceback" not in err


# ---------------------------------------------------------------- another batch size, --global-batch


def test_global_batch_and_batch_size_exclude_each_other(data, tmp_path, capsys):
    code, _, err = run_main(small(data, tmp_path / "run", "--batch-size", "16", "--global-batch", "32"), capsys)
    assert code == 2 and "--batch-size 16 (per rank) and --global-batch 32 (over all ranks) exclude each other" in err
    args = SimpleNamespace(global_batch=130, batch_size=None)
    with pytest.raises(ValueError, match="--global-batch 130 does not divide over 4 ranks; give a multiple of 4 "
                                         r"\(128 or 132\)"):
        options.per_rank_batch(args, 4)
    args.global_batch = 128
    assert options.per_rank_batch(args, 4) == 32 == args.batch_size
    assert options.parse(small(data, tmp_path / "r")).batch_size == 256  # neither given: the default


def test_a_resume_on_another_batch_size_re_deals_the_epoch_and_says_the_rate_moves(data, tmp_path, capsys):
    """Stopped inside epoch 1 at batch 16, resumed at batch 8 (refused before: --batch-size was in
    the resume fingerprint): the rest of the epoch re-dealt, no sample twice, fewer unread than
    a batch, and one line saying the learning rate moves, from what to what and why."""
    out = tmp_path / "run"
    assert run_main(small(data, out, "--batch-size", "16", "--stop-after-steps", "3"), capsys)[0] == 0
    code, said, err = run_main(small(data, out, "--batch-size", "8", "--resume", "--stop-after", "1"), capsys)
    assert code == 0, err[-2000:]
    moved = [ln for ln in said.splitlines() if ln.startswith("resume: the learning rate")]
    assert len(moved) == 1 and "at step 3 moves from" in moved[0], said
    assert "the global batch is 1 x 8 = 8 samples, the checkpoint's 1 x 16 = 16" in moved[0]
    assert "--global-batch 16 keeps it" in moved[0]
    read = keys(out, 1)
    assert len(read) == len(set(read)) and 0 <= 160 - len(read) < 8
    position = json.loads(torch.load(out / "checkpoint.pt", weights_only=True)["position"])
    assert position == {"epoch": 1, "mid": False, "step": 3 + (160 - 48) // 8, "seen": 160}
    code, said, err = run_main(small(data, out, "--global-batch", "8", "--resume", "--stop-after", "1"), capsys)
    assert code == 0 and "resume: the learning rate" not in said, err[-2000:]  # the same global batch: no line


def test_more_epochs_keep_the_interrupted_epochs_mixture_and_apply_from_the_next(data, tmp_path, capsys):
    """--epochs 3 -> 5 with --final-weights moves epoch 2's interpolated mixture: the interrupted
    epoch goes on with the mixture it started with (refused before: 'weights changed inside
    an epoch'), the next epoch takes the new one, and a line says so."""
    out = tmp_path / "run"
    first = small(data, out, "--batch-size", "16", "--final-weights", "mnist=0.2,cifar10=0.8", "--stop-after-steps",
                  "13")
    first[first.index("--epochs") + 1] = "3"
    assert run_main(first, capsys)[0] == 0
    before = [ln["weights"] for ln in lines(out) if ln["epoch"] == 2]
    again = small(data, out, "--batch-size", "16", "--final-weights", "mnist=0.2,cifar10=0.8", "--resume",
                  "--stop-after", "2")
    again[again.index("--epochs") + 1] = "5"
    code, said, err = run_main(again, capsys)
    assert code == 0, err[-2000:]
    kept = [ln for ln in said.splitlines() if ln.startswith("resume: epoch 2 keeps the mixture it started with")]
    assert len(kept) == 1 and "--epochs 3 -> 5 apply from epoch 3" in kept[0], said
    assert "--epochs 3 -> 5 stretches the schedule" in said
    epoch2 = lines(out)
    mix = {ln["epoch"]: ln["weights"] for ln in epoch2}
    assert before and mix[2] == pytest.approx(before[0], abs=1e-9)  # the mixture of epoch 2 as it began
    args = options.parse(again)
    assert mix[3] == pytest.approx(options.weights_at(args, 2))  # epoch 3 on the new --epochs
    read = keys(out, 2)
    assert len(read) == len(set(read)) == 160


def test_a_weights_change_inside_an_epoch_records_the_next_epochs_weights(data, tmp_path, capsys):
    """--change-weights --final-weights on a checkpoint inside epoch 2 of 3: epoch 2 keeps its
    mixture, so the weights_changed record names epoch 3 and the weights its train lines carry."""
    out = tmp_path / "run"
    first = small(data, out, "--batch-size", "16", "--stop-after-steps", "13")
    first[first.index("--epochs") + 1] = "3"
    assert run_main(first, capsys)[0] == 0
    again = small(data, out, "--batch-size", "16", "--resume", "--change-weights", "--final-weights",
                  "mnist=3,cifar10=1")
    again[again.index("--epochs") + 1] = "3"
    code, said, err = run_main(again, capsys)
    assert code == 0, err[-2000:]
    changed = lines(out, "weights_changed")
    assert len(changed) == 1 and changed[0]["from_epoch"] == 3 and changed[0]["epoch"] == 2, changed
    assert changed[0]["from"] == [0.5, 0.5] and changed[0]["to"] == [0.75, 0.25]
    mix = {ln["epoch"]: list(ln["weights"].values()) for ln in lines(out)}
    assert mix[2] == [0.5, 0.5] and mix[3] == changed[0]["to"]


@pytest.mark.slow  # starts loader workers
def test_a_checkpoint_of_a_set_with_damaged_samples_resumes_on_3_workers(tmp_path, capsys):
    """10 of 40 samples without their image, 3 workers, stopped at step 8: the replacements a worker
    read for them passed over more positions than the run counted skipped (30 to 10), which the
    resume's check took for a damaged checkpoint. The epoch counts each damaged position once."""
    from helpers import png_set_then_damage

    manifest, _ = png_set_then_damage(tmp_path)
    out = tmp_path / "run"
    argv = ["--train", f"web={manifest}", "--epochs", "1", "--batch-size", "4", "--epoch-samples",
            "40", "--workers", "3", "--width", "4", "--on-error", "skip", "--out", out]
    assert run_main(argv + ["--stop-after-steps", "8"], capsys)[0] == 0
    code, said, err = run_main(argv + ["--resume"], capsys)
    assert code == 0, err[-2000:]
    assert json.loads((out / "summary.json").read_text())["skipped_samples"] == 10


# ---------------------------------------------------------------- under torchrun


@pytest.mark.slow
def test_a_resume_from_2_x_64_to_4_x_32_with_global_batch_128(one_source, tmp_path):
    """The acceptance case: torchrun on 2 ranks with --global-batch 128 (64 each), stopped after
    3 steps, resumed on 4 (32 each): the learning rate of every step is the uninterrupted
    schedule's, no sample is read twice, and fewer than one global batch goes unread."""
    out = tmp_path / "run"
    args = ["--train", f"mnist={one_source}/", "--global-batch", "128", "--epochs", "1", "--width", "4",
            "--workers", "0", "--log-every", "1", "--record-keys", "--out", str(out)]
    code, err = finish(launch_train([*args, "--stop-after-steps", "3"], 2), 240)
    assert code == 0, err[-3000:]
    proc = launch_train([*args, "--resume"], 4)
    code, err = finish(proc, 240)
    assert code == 0, err[-3000:]
    steps = lines(out)
    assert [ln["step"] for ln in steps] == list(range(1, 10))  # 1,200 // 128 steps
    schedule = SimpleNamespace(lr=0.1)
    for ln in steps:
        assert ln["lr"] == pytest.approx(learning_rate(schedule, 128, (ln["step"] - 1) * 128, 1200), rel=1e-6)
    resumed = [json.loads(ln) for ln in open(out / "metrics.jsonl") if '"resumed"' in ln]
    assert [(r["step"], r["world"]) for r in resumed] == [(3, 4)]
    read = keys(out, 1, 4)
    assert max(collections.Counter(read).values()) == 1, "a sample read twice"
    assert 0 <= 1200 - len(read) < 128
    summary = json.loads((out / "summary.json").read_text())
    assert summary["epochs"][0]["batches"] == {f"rank{r}": (1200 - 3 * 128) // 128 for r in range(4)}
