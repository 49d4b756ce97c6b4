"""The trainer's step loop waits for the device only where its step log is read: every
--log-every steps, at a checkpoint and at an epoch's last step (issue: the trainer reached 58%
of the model's own speed because every step waited). The calls that would make it wait are
counted by tests/sync_count.py; putting back a per-step read (a `.tolist()` of the non-finite
check, an all-reduce of the stop votes) turns these tests red."""
import json
import os
import subprocess
import sys

import pytest

import sync_count
from helpers import finish, free_port
from pipeline.train import loop as train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def data(mixed_shards):
    return mixed_shards


def args(data, out, *extra):
    return ["--train", f"mnist={data}/", "--train", f"cifar10={data}/", "--epochs", "2", "--epoch-samples", "320",
            "--batch-size", "16", "--width", "4", "--log-every", "4", "--out", str(out), *extra]


def allowed(seen, log_every, epoch_steps, epochs):
    """The steps at which the loop may wait: log steps and each epoch's last."""
    return {s for s, _ in seen} - {s for s in range(0, epoch_steps * epochs + 1, log_every)} \
        - {epoch_steps * e for e in range(1, epochs + 1)}


@pytest.mark.parametrize("workers", ["0", "2"])
def test_one_process_reads_the_device_only_at_log_steps(data, tmp_path, monkeypatch, workers):
    syncs = sync_count.install(patch=monkeypatch.setattr)
    assert train.main(args(data, tmp_path / "run", "--workers", workers)) == 0
    steps = {s for s, _ in syncs.seen}
    assert not allowed(syncs.seen, 4, 20, 2), syncs.seen  # 320 / 16 = 20 steps an epoch
    assert {4, 8, 20, 40} <= steps and ("tolist" in {c for _, c in syncs.seen})  # the counting itself works


def test_a_checkpoint_reads_the_device_too_and_only_then(data, tmp_path, monkeypatch):
    syncs = sync_count.install(patch=monkeypatch.setattr)
    assert train.main(args(data, tmp_path / "run", "--workers", "0", "--checkpoint-every", "6", "--log-every",
                           "100")) == 0
    assert {s for s, _ in syncs.seen} == {6, 12, 18, 20, 24, 30, 36, 40}, syncs.seen  # steps counted over the run


@pytest.mark.slow
def test_two_ranks_under_torchrun_wait_only_at_log_steps(data, tmp_path):
    """gloo, 2 ranks: no collective of ours and no read between log steps on either rank, and
    the per-step skip decision still agrees (a NaN test of its own is in test_readback)."""
    prefix = tmp_path / "syncs"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                             f"--master_port={free_port()}", os.path.join(ROOT, "tests", "sync_count.py"), str(prefix),
                             *args(data, tmp_path / "run", "--workers", "1", "--epoch-samples", "640")],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    code, err = finish(proc, timeout=600)
    assert code == 0, err[-3000:]
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"syncs-rank{rank}.json").read_text())
        assert not allowed(seen, 4, 20, 2), seen  # 640 / (2 x 16) = 20 steps an epoch on each rank
        assert "all_reduce" in {c for _, c in seen}


def test_the_loaders_workers_start_before_the_model_is_built(data, tmp_path, monkeypatch):
    """The first batch sooner: the training loader's workers fork (and begin the first pass) while
    the model is built, before CUDA would start in the trainer."""
    import multiprocessing

    from pipeline.train import run as run_module

    seen = []
    real = run_module.build_model

    def build_model(*a, **kw):
        seen.append(len(multiprocessing.active_children()))
        return real(*a, **kw)

    monkeypatch.setattr(run_module, "build_model", build_model)
    assert train.main(args(data, tmp_path / "run", "--workers", "2", "--epochs", "1")) == 0
    assert seen == [2]


@pytest.mark.parametrize("log_every", ["1000", "4"])
def test_a_stop_signal_ends_the_run_after_its_step_whatever_log_every(data, tmp_path, monkeypatch, log_every):
    """The votes are read every step, a step late on several ranks and at once on one, without
    waiting for the device: a SIGTERM during step 3 stops the run after step 3 with a checkpoint,
    not at the next metrics line or the epoch's end (it was step 20 with --log-every 1000)."""
    import os
    import signal

    from pipeline.train import run as run_module

    real = run_module.Run.step_once

    def step_once(self, *a, **kw):
        out = real(self, *a, **kw)
        if self.step == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    monkeypatch.setattr(run_module.Run, "step_once", step_once)
    out = tmp_path / "run"
    assert train.main(args(data, out, "--workers", "0", "--log-every", log_every)) == 143
    lines = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [ln["step"] for ln in lines if ln["kind"] == "stopped"] == [3]
    assert (out / "checkpoint.pt").exists()
