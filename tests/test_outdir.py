"""The run folder's life cycle (pipeline.train.outdir, and the lines around it in loop.py):
the advice after a failure works when followed literally, a finished run is left as it was,
a torchrun restart takes over only a run its own job started, checkpoints reach the disk
before their rename, a deleted key log is named."""
import errno
import os
import re
import shlex

import pytest

from helpers import HANG, build_shards, finish, launch_train, train_in_process
from pipeline.train import checkpoint, outdir

SMALL = ["--batch-size", "8", "--workers", "0", "--width", "4", "--log-every", "1"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    base = tmp_path_factory.mktemp("outdir") / "d"
    build_shards(base, "mnist", "train", 60, maxcount=20)
    build_shards(base, "mnist", "test", 20, maxcount=10, seed=1)
    return base


def args_for(shards, out, *extra):
    return ["--train", f"mnist={shards}/", "--eval", f"mnist={shards}/", "--epochs", "2", *SMALL, "--out", out,
            "--record-keys", *extra]


def snapshot(folder):
    return {n: ((folder / n).read_bytes(), (folder / n).stat().st_mtime_ns) for n in sorted(os.listdir(folder))}


def advice(p, lead):
    """The trainer's own arguments in the advice line starting `lead`."""
    lines = [ln for ln in p.stderr.splitlines() if lead in ln]
    assert len(lines) == 1, p.stderr[-2000:]
    words = shlex.split(lines[0].split(lead, 1)[1])
    return words[words.index("pipeline.train") + 1:]


# ---------------------------------------------------------------- a failure before the first checkpoint


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, "No space left on device"),
                                   FileNotFoundError(errno.ENOENT, "No such file or directory")],
                         ids=["disk", "missing"])
def test_the_advice_after_a_failure_before_the_first_checkpoint_starts_the_run_again(shards, tmp_path, monkeypatch,
                                                                                     error):
    """hostileK 5: a failure before the first checkpoint (here its save: the epoch's training and
    evaluation lines are written) printed advice that was refused, or none; followed literally,
    the advice now starts the run over and says which files it deleted."""
    out = tmp_path / "run"

    def fail(path, state):
        raise error

    monkeypatch.setattr(checkpoint, "save", fail)
    p = train_in_process(args_for(shards, out))
    assert p.returncode == 2 and not (out / "checkpoint.pt").exists(), p.stderr[-2000:]
    again = advice(p, f"no checkpoint yet in {out}/; start again with: ")
    assert again[-1] == "--resume-or-start", again
    monkeypatch.undo()

    plain = train_in_process(args_for(shards, out))  # the obvious rerun points at the same advice, not --resume
    assert plain.returncode == 2 and "saved no checkpoint.pt; pass --resume-or-start" in plain.stderr, plain.stderr
    p = train_in_process(again)
    assert p.returncode == 0, p.stderr[-2000:]
    assert f"--resume-or-start without a checkpoint: deleting the previous run in {out}/: " \
           f"keys-rank0.txt, metrics.jsonl" in p.stdout, p.stdout[-2000:]
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert sum('"kind": "eval"' in ln for ln in lines) == 2  # one run's lines, not two runs' mixed


def test_resume_or_start_still_refuses_a_run_that_went_past_a_checkpoint(shards, tmp_path):
    """Only a folder of a run that never saved a checkpoint is started over: a later epoch's
    line, or a summary, means a checkpoint was there and is gone: refused, nothing touched."""
    for name, files in {"epoch2": {"metrics.jsonl": '{"kind": "train", "epoch": 2, "step": 9}\n'},
                        "summary": {"metrics.jsonl": '{"kind": "train", "epoch": 1, "step": 1}\n',
                                    "summary.json": "{}\n"}}.items():
        out = tmp_path / name
        out.mkdir()
        for n, text in files.items():
            (out / n).write_text(text)
        assert not outdir.never_saved(out)
        before = snapshot(out)
        p = train_in_process(args_for(shards, out, "--resume-or-start"))
        assert p.returncode == 2 and "no checkpoint.pt to continue from" in p.stderr, p.stderr[-2000:]
        assert snapshot(out) == before


# ---------------------------------------------------------------- a finished run


def test_resuming_a_finished_run_leaves_its_files_as_they_are(shards, tmp_path):
    """hostileK 9: each --resume of a finished run appended a "resumed" line to metrics.jsonl."""
    out = tmp_path / "run"
    assert train_in_process(args_for(shards, out, "--epochs", "1")).returncode == 0
    before = snapshot(out)
    for flag in ("--resume", "--resume-or-start"):
        p = train_in_process(args_for(shards, out, "--epochs", "1", flag))
        assert p.returncode == 0 and "nothing to do" in p.stdout, p.stderr[-2000:]
        assert snapshot(out) == before, flag


# ---------------------------------------------------------------- checkpoint and key log


def test_a_checkpoint_is_on_disk_before_its_rename(tmp_path, monkeypatch):
    """hostileK 10: the rename without an fsync could leave an empty checkpoint.pt after a power cut."""
    synced, real_fsync, real_replace = [], os.fsync, os.replace

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    def replace(src, dst):
        assert str(src) in synced, f"{src} renamed before an fsync"
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    checkpoint.save(str(tmp_path / "checkpoint.pt"), {"a": 1})
    assert (tmp_path / "checkpoint.pt").exists() and synced == [str(tmp_path / "checkpoint.pt.tmp")]


def test_a_deleted_key_log_is_named_on_resume(shards, tmp_path):
    """hostileK 10: a resume over a key log deleted since the checkpoint went on without a word."""
    out = tmp_path / "run"
    assert train_in_process(args_for(shards, out, "--stop-after-steps", "3")).returncode == 0
    os.remove(out / "keys-rank0.txt")
    with pytest.warns(UserWarning, match=r"keys-rank0.txt: not there, though the checkpoint counts 24 key line"):
        p = train_in_process(args_for(shards, out, "--resume"))
    assert p.returncode == 0, p.stderr[-2000:]


# ---------------------------------------------------------------- torchrun restarts


def test_job_ids_tell_jobs_apart():
    assert outdir.job_id({}) is None
    for run in ("5e78d7f0", "none"):  # --standalone's uuid or --rdzv-id; static rendezvous
        job = outdir.job_id({"TORCHELASTIC_RUN_ID": run})  # and the launcher process, always (hostileN 1)
        assert job.startswith(f"{run}@") and f":{os.getppid()}:" in job and not job.endswith(":?")
    same = outdir.same_job
    assert same("exp100@h1:42:7", "exp100@h1:42:7")  # a restart by the same launcher
    assert not same("exp100@h1:42:7", "exp100@h1:43:9")  # a fixed --rdzv-id copied into another job
    assert same("exp100@h1:42:7", "exp100@h2:51:8")  # an elastic restart put rank 0 on another node
    assert not same("none@h1:42:7", "none@h2:51:8")  # static: each node keeps its place over restarts
    assert not same("exp100@h1:42:7", "exp101@h1:42:7") and not same("exp100", "exp100@h1:42:7")
    assert not same(None, "exp100@h1:42:7") and not same("exp100@h1:42:7", None)


@pytest.mark.slow
@pytest.mark.parametrize("launcher", [["--standalone"], [], "fixed"], ids=["standalone", "static", "fixed-rdzv-id"])
def test_a_restart_does_not_take_over_another_jobs_run(shards, tmp_path, launcher):
    """hostileK 1: a job refused on an --out holding another run was restarted by torchrun
    (--max-restarts) and the restart resumed that run with the new job's options. A restart
    takes over only a run its own job started or resumed; a refusal stays a refusal. hostileN 1:
    also where both jobs share a fixed --rdzv-id (copied from an example), the run id torchrun
    gives both."""
    from helpers import free_port

    if launcher == "fixed":
        launcher = ["--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{free_port()}", "--rdzv-id=exp100"]
    out = tmp_path / "run"
    args = ["--train", f"mnist={shards}/", "--epochs", "2", *SMALL, "--out", out]
    job1 = launch_train([*args, "--stop-after-steps", "2"], 2, extra_launcher=launcher, fork_ranks=False)
    rc, err = finish(job1, timeout=HANG)  # another job, the same launcher: under "static" the same run id 'none'
    assert rc == 0 and (out / outdir.JOB).exists(), err[-3000:]
    before = snapshot(out)
    proc = launch_train([*args, "--lr", "0.05"], 2, extra_launcher=[*launcher, "--max-restarts=1"],
                        fork_ranks=False)
    rc, err = finish(proc, timeout=HANG)
    assert rc != 0, err[-3000:]
    refusals = [ln for ln in err.splitlines() if "holds a previous run; pass --resume" in ln]
    assert len(refusals) == 4 and "resumed from" not in err, err[-3000:]  # 2 ranks, 2 attempts
    assert snapshot(out) == before


# ---------------------------------------------------------------- --out checked before any indexing


@pytest.mark.parametrize("saved", [True, False], ids=["checkpoint", "no-checkpoint"])
def test_a_previous_run_in_out_is_refused_before_new_shards_are_indexed(tmp_path, saved):
    """newuser5 1: on shards with no manifest the trainer indexed the whole set on first use, then
    refused the --out holding a previous run; the refusal comes first and nothing is indexed."""
    from helpers import write_shardwriter
    from pipeline.writers import autoindex

    write_shardwriter(tmp_path / "set", 40)
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"kind": "train", "epoch": 2}\n')
    if saved:
        (out / "checkpoint.pt").write_bytes(b"x")
    before = snapshot(out)
    p = train_in_process(["--train", f"web={tmp_path / 'set'}", *SMALL, "--out", str(out)])
    assert p.returncode == 2 and "holds a previous run" in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "set" / autoindex.INDEX_FOLDER).exists() and "indexed" not in p.stderr
    assert snapshot(out) == before


def test_eval_only_without_a_checkpoint_is_refused_before_shards_are_indexed(tmp_path, monkeypatch):
    """hostileN 3: --eval-only on an --out with no checkpoint indexed the training set on first
    use, printed the busy-cores note, and only then said there was no checkpoint."""
    from helpers import write_shardwriter
    from pipeline.train import dist
    from pipeline.writers import autoindex

    monkeypatch.setattr(dist, "busy_line", lambda *a, **k: "BUSY")  # as on a loaded machine
    write_shardwriter(tmp_path / "set", 40)
    out = tmp_path / "run"
    p = train_in_process(["--train", f"web={tmp_path / 'set'}", "--eval", f"web={tmp_path / 'set'}", *SMALL,
                          "--out", str(out), "--eval-only"])
    assert p.returncode == 2 and f"--eval-only: no checkpoint at {out}/checkpoint.pt" in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "set" / autoindex.INDEX_FOLDER).exists() and "indexed" not in p.stderr
    assert "BUSY" not in p.stderr and not out.exists()


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_stop_signal_before_the_run_began_leaves_the_previous_run(shards, tmp_path, monkeypatch, sig):
    """hostileN 2: Ctrl-C while --overwrite's job indexed its shards on first use was noted and
    acted on only after a step: the finished run was deleted for a 1-step one. A stop signal
    that comes before the run changed --out ends the job there (128 + N), --out as it was."""
    import signal

    from pipeline.train import guard

    out = tmp_path / "run"
    assert train_in_process(args_for(shards, out, "--epochs", "1")).returncode == 0
    before = snapshot(out)
    memory = guard.check_memory

    def signalled(*a, **k):  # while the job gets ready, after its shards are indexed
        os.kill(os.getpid(), getattr(signal, sig))
        return memory(*a, **k)

    monkeypatch.setattr(guard, "check_memory", signalled)
    p = train_in_process(args_for(shards, out, "--overwrite"))
    assert p.returncode == 128 + getattr(signal, sig), p.stderr[-2000:]
    assert f"stopped by {sig} before the run began; {out}/ is left as it was" in p.stderr
    assert "deleting" not in p.stdout and snapshot(out) == before


SIGNAL_RANK1 = """
import os, signal
if os.environ.get("RANK") == "1":  # a rank of the job, not its launcher: SIGINT to itself as it gets ready
    from pipeline.train import guard
    memory = guard.check_memory
    def signalled(*a, **k):
        os.kill(os.getpid(), signal.SIGINT)
        return memory(*a, **k)
    guard.check_memory = signalled
"""


@pytest.mark.slow
def test_a_stop_signal_on_one_rank_before_the_run_began_stops_every_rank(shards, tmp_path):
    """hostileN 2 on 2 ranks: rank 1 alone is signalled before the run began; both ranks end with
    130 and rank 0 deletes nothing."""
    out = tmp_path / "run"
    assert train_in_process(args_for(shards, out, "--epochs", "1")).returncode == 0
    before = snapshot(out)
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SIGNAL_RANK1)
    proc = launch_train(args_for(shards, out, "--overwrite"), 2, pythonpath=[hook], fork_ranks=False)
    rc, err = finish(proc, timeout=HANG)
    assert rc != 0 and err.count("before the run began") == 1, err[-3000:]  # said by rank 0, never signalled
    codes = re.findall(r"rank\s*: (\d) \(local_rank[^\n]*\n\s*exitcode\s*: (-?\d+)", err)  # torchrun's report
    assert ("0", "130") in codes, err[-3000:]  # (rank 1 may be ended by torchrun's SIGTERM once rank 0 is out)
    assert snapshot(out) == before


def test_overwrite_refused_by_a_later_check_leaves_the_previous_run(shards, tmp_path):
    """check_out runs first but deletes nothing: --overwrite clears the previous run only once the
    other checks (here an epoch shorter than one batch) have passed."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"kind": "train", "epoch": 2}\n')
    before = snapshot(out)
    p = train_in_process(args_for(shards, out, "--overwrite", "--epoch-samples", "4"))
    assert p.returncode == 2 and "less than one batch" in p.stderr, p.stderr[-2000:]
    assert snapshot(out) == before
