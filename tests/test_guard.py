"""The trainer's start-up guards (pipeline.train.guard, dist.set_threads): one trainer per --out,
an earlier run's files never replaced by --resume-or-start, train/eval overlap and split
mix-ups warned, torch's threads set for the process's share of the cores."""
import json
import os
import re
import shutil
import signal
import time
import warnings

import pytest
import torch

from helpers import build_shards, completed, finish, launch_train, launch_trainer, launchers, steps_logged, \
    train_in_process
from pipeline.files import locked
from pipeline.data.streams.stream import resolve
from pipeline.train import dist, guard

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--batch-size", "8", "--workers", "0", "--width", "4", "--log-every", "1"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    base = tmp_path_factory.mktemp("guard") / "d"
    build_shards(base, "mnist", "train", 60, maxcount=20)
    build_shards(base, "mnist", "test", 20, maxcount=10, seed=1)
    return base


def refused(p, *needles):
    errors = [ln for ln in p.stderr.splitlines() if "error:" in ln]
    assert p.returncode == 2 and len(errors) == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


def snapshot(folder):
    return {n: ((folder / n).read_bytes(), (folder / n).stat().st_mtime_ns) for n in sorted(os.listdir(folder))}


# ---------------------------------------------------------------- one trainer per --out


def test_a_second_trainer_on_a_live_runs_out_is_one_line_and_touches_nothing(shards, tmp_path):
    """The hostile trial: a second run with --overwrite replaced the files of a live (paused)
    run in the same folder, and both finished writing into it."""
    out = tmp_path / "run"
    first = launch_trainer(["--train", f"mnist={shards}/", "--epochs", "1000", *SMALL, "--out", out])
    try:
        deadline = time.monotonic() + 120
        while not steps_logged(out):
            assert first.poll() is None, first.communicate()
            assert time.monotonic() < deadline, "the first trainer logged no step in 120 s"
            time.sleep(0.2)
        os.kill(first.pid, signal.SIGSTOP)
        before = snapshot(out)
        assert guard.LOCK in before
        for extra in (["--overwrite"], [], ["--resume"]):
            p = train_in_process(["--train", f"mnist={shards}/", "--epochs", "1", *SMALL, "--out", out, *extra])
            refused(p, f"--out {out}", f"pid {first.pid}", "nothing touched")
            assert snapshot(out) == before
        os.kill(first.pid, signal.SIGCONT)
        first.send_signal(signal.SIGTERM)  # a clean stop releases the lock, and its file goes
        code, err = finish(first)
        assert code == 143, err[-2000:]
        assert guard.LOCK not in os.listdir(out)
    finally:
        if first.poll() is None:
            os.kill(first.pid, signal.SIGCONT)
            first.kill()
    p = train_in_process(["--train", f"mnist={shards}/", "--epochs", "1", *SMALL, "--out", out, "--overwrite"])
    assert p.returncode == 0, p.stderr[-2000:]
    assert guard.LOCK not in os.listdir(out)


def test_under_torchrun_every_rank_ends_on_the_lock_in_one_line(shards, tmp_path):
    """Rank 0 alone takes the lock; the others learn its verdict and end with the same line,
    rather than die in a collective waiting for rank 0 (a gloo 'Connection closed' traceback)."""
    out = tmp_path / "run"
    out.mkdir()
    with locked(str(out / guard.LOCK)):  # held by this process, as a live trainer would
        p = completed(launch_train(["--train", f"mnist={shards}/", "--epochs", "1", *SMALL, "--out", out]))
    lines = [ln for ln in p.stderr.splitlines() if "pipeline-train: error:" in ln]
    assert p.returncode != 0 and len(lines) == 2, p.stderr[-3000:]
    assert all(f"pid {os.getpid()}" in ln and "nothing touched" in ln for ln in lines), lines
    assert "Connection closed" not in p.stderr and "[rank1]: Traceback" not in p.stderr, p.stderr[-3000:]
    assert os.listdir(out) == []


def test_a_lock_left_by_a_killed_trainer_is_no_obstacle(shards, tmp_path):
    """A SIGKILL leaves the lock's file (the kernel drops the lock itself): the next run takes it."""
    out = tmp_path / "run"
    out.mkdir()
    (out / guard.LOCK).write_text("12345\n")
    p = train_in_process(["--train", f"mnist={shards}/", "--epochs", "1", *SMALL, "--out", out])
    assert p.returncode == 0, p.stderr[-2000:]
    assert sorted(os.listdir(out)) == ["checkpoint.pt", "metrics.jsonl", "summary.json"]


def test_a_refused_run_leaves_no_folder_behind(shards, tmp_path):
    p = train_in_process(["--train", f"mnist={shards}/", "--epochs", "1", *SMALL, "--max-batch-memory", "1K",
                          "--out", tmp_path / "new"])
    refused(p, "--max-batch-memory")
    assert not (tmp_path / "new").exists()


# ---------------------------------------------------------------- --resume-or-start over an earlier run


def test_resume_or_start_never_replaces_an_earlier_runs_files(shards, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"kind": "train", "step": 5}\n')
    (out / "keys-rank0.txt").write_text("1\tkey\n")
    before = snapshot(out)
    p = train_in_process(["--train", f"mnist={shards}/", "--epochs", "1", *SMALL, "--out", out, "--resume-or-start"])
    refused(p, "--resume-or-start", "keys-rank0.txt, metrics.jsonl", "no checkpoint.pt", "--overwrite")
    assert snapshot(out) == before and "deleting" not in p.stdout


def test_resume_or_start_on_an_empty_folder_starts(shards, tmp_path):
    p = train_in_process(["--train", f"mnist={shards}/", "--epochs", "1", *SMALL, "--out", tmp_path / "run",
                          "--resume-or-start"])
    assert p.returncode == 0, p.stderr[-2000:]


# ---------------------------------------------------------------- overlap and splits


def renamed(shards, folder, split):
    """The training shards copied under another split's names (same bytes, same sha256)."""
    folder.mkdir()
    m = json.loads((shards / "mnist-train.json").read_text())
    for s in m["shards"]:
        new = s["name"].replace("-train-", f"-{split}-")
        shutil.copy(shards / s["name"], folder / new)
        s["name"] = new
    m["split"] = split
    (folder / f"mnist-{split}.json").write_text(json.dumps(m))
    return folder / f"mnist-{split}.json"


def messages(record):
    return [str(w.message) for w in record]


def data_lines(record):
    return [m for m in messages(record) if "test accuracy" in m or "held-out" in m]


def test_the_trainer_warns_in_one_line_when_eval_is_the_training_manifest(shards, tmp_path):
    """The hostile trial's case: --eval given the training manifest ran to "test accuracy" with two
    warnings for one mistake; one line names both sources, what they share and the split."""
    with pytest.warns(UserWarning) as record:
        p = train_in_process(["--train", f"mnist={shards}/", "--eval", f"mnist={shards}/mnist-train.json",
                              "--epochs", "1", *SMALL, "--out", tmp_path / "run"])
    assert p.returncode == 0, p.stderr[-2000:]
    said = data_lines(record)
    assert len(said) == 1, said
    assert said[0].startswith(f"--eval mnist ({shards}/mnist-train.json) shares 3 shard(s) with --train mnist "
                              f"({shards}/mnist-train.json; the same file or sha256)"), said
    assert "records split 'train'" in said[0] and "measured on data the model trains on" in said[0], said


def test_the_trainer_warns_in_one_line_when_train_is_the_test_manifest(shards, tmp_path):
    with pytest.warns(UserWarning) as record:
        p = train_in_process(["--train", f"mnist={shards}/mnist-test.json", "--eval", f"mnist={shards}/",
                              "--epochs", "1", *SMALL, "--out", tmp_path / "run"])
    assert p.returncode == 0, p.stderr[-2000:]
    said = data_lines(record)
    assert len(said) == 1 and "shares 2 shard(s) with --train mnist" in said[0], said
    assert f"{shards}/mnist-test.json, which records split 'test'" in said[0], said
    assert said[0].endswith("(give --train mnist the source's training manifest)"), said


def test_the_same_bytes_under_other_names_in_eval_are_warned(shards, tmp_path):
    test = renamed(shards, tmp_path / "copy", "test")
    with pytest.warns(UserWarning, match=r"--eval mnist .* shares 3 shard\(s\) with --train mnist .*the same "
                                         r"file or sha256") as record:
        guard.warn_data([resolve("mnist", str(shards / "mnist-train.json"), "train")],
                        [resolve("mnist", str(test), "test")])
    assert len(record) == 1, messages(record)
    with warnings_none():
        guard.warn_data([resolve("mnist", f"{shards}/", "train")], [resolve("mnist", f"{shards}/", "test")])


def test_a_copy_of_the_training_set_without_sha256_is_warned_by_its_listing(shards, tmp_path):
    """Two other folders, the same shard names, sizes and counts, no sha256 to compare, the eval
    copy's split field edited to 'test': the same listing digest (what a checkpoint's fingerprint
    holds) tells them apart from another set, in one line."""
    def copy(folder, split):
        shutil.copytree(shards, folder)
        m = json.loads((shards / "mnist-train.json").read_text())
        for s in m["shards"]:
            s.pop("sha256", None)
        (folder / f"mnist-{split}.json").write_text(json.dumps(dict(m, split=split)))
        return folder / f"mnist-{split}.json"

    train, test = copy(tmp_path / "a", "train"), copy(tmp_path / "b", "test")
    with pytest.warns(UserWarning) as record:
        guard.warn_data([resolve("mnist", str(train), "train")], [resolve("mnist", str(test), "test")])
    said = data_lines(record)
    assert len(said) == 1 and said[0].startswith(f"--eval mnist ({test}) lists the same shards as --train mnist "
                                                 f"({train}: the same names, sizes and sha256)"), said


def test_equal_sha256_under_two_names_in_one_training_source_is_warned_once(shards, tmp_path):
    folder = tmp_path / "twins"
    shutil.copytree(shards, folder)
    m = json.loads((folder / "mnist-train.json").read_text())
    twin = dict(m["shards"][0], name="mnist-train-000099.tar")
    shutil.copy(folder / m["shards"][0]["name"], folder / twin["name"])
    m["shards"].append(twin)
    m["total"] += twin["samples"]
    (folder / "mnist-train.json").write_text(json.dumps(m))
    with pytest.warns(UserWarning, match="1 shard.* same bytes as another.*read twice an epoch") as record:
        guard.warn_data([resolve("mnist", f"{folder}/", "train")], [])
    assert len(record) == 1 and "mnist-train-000099.tar" in str(record[0].message)


def test_two_training_sources_sharing_shards_are_warned_once(shards, tmp_path):
    """Two --train sources over the same shards trained with no word (hostileH): each sample twice an
    epoch under two names. Shared by file or by sha256 (a copy elsewhere); sources apart: no line."""
    folder = tmp_path / "copy"
    shutil.copytree(shards, folder)
    build_shards(tmp_path / "apart", "mnist", "train", 40, maxcount=20, seed=5)

    def shared_lines(other):
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            guard.warn_data([resolve("mnist", str(shards / "mnist-train.json"), "train"),
                             resolve("mnist", other, "train")], [])
        return [m for m in messages(record) if "shares" in m]

    for other in (str(shards / "mnist-train.json"), f"{folder}/"):
        said = shared_lines(other)
        assert len(said) == 1 and re.match(r"--train mnist shares 3 shard\(s\) with --train mnist \(the same file or "
                                           r"sha256\), e\.g\. .*: their samples are read twice an epoch", said[0]), said
    assert shared_lines(f"{tmp_path / 'apart'}/") == []
    linked = tmp_path / "linked"  # hard links, and a manifest without sha256: the same files all the same
    linked.mkdir()
    m = json.loads((shards / "mnist-train.json").read_text())
    for shard in m["shards"]:
        os.link(shards / shard["name"], linked / shard["name"])
        shard.pop("sha256", None)
    (linked / "mnist-train.json").write_text(json.dumps(m))
    assert len(shared_lines(str(linked / "mnist-train.json"))) == 1


def test_a_test_manifest_given_to_train_is_warned(shards):
    with pytest.warns(UserWarning, match="--train mnist: .*mnist-test.json records split 'test'") as record:
        guard.warn_data([resolve("mnist", str(shards / "mnist-test.json"), "train")], [])
    assert len(record) == 1
    with pytest.warns(UserWarning, match="--train mnist: .*mnist-test.json records split 'test'") as record:
        guard.warn_data([resolve("mnist", str(shards / "mnist-test.json"), "train")],
                        [resolve("mnist", str(shards / "mnist-train.json"), "test")])  # no overlap: the split's line
    assert len(data_lines(record)) == 2, messages(record)


class warnings_none:
    def __enter__(self):
        import warnings

        self.catch = warnings.catch_warnings()
        self.catch.__enter__()
        warnings.simplefilter("error")

    def __exit__(self, *exc):
        self.catch.__exit__(*exc)


# ---------------------------------------------------------------- torch threads


@pytest.fixture
def threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_threads_are_the_processs_share_of_its_cores(threads):
    cores = len(os.sched_getaffinity(0))
    assert dist.set_threads({}) == cores
    assert dist.set_threads({"LOCAL_WORLD_SIZE": "2"}) == max(1, cores // 2)
    assert dist.set_threads({"LOCAL_WORLD_SIZE": str(cores * 4)}) == 1
    torch.set_num_threads(1)
    assert dist.set_threads({"OMP_NUM_THREADS": "1"}) == 1  # set by the user: kept


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core: every share is one thread")
def test_python_m_pipeline_train_sets_its_threads(shards, tmp_path):
    """`python -m pipeline.train` (forked from a Python whose torch has 1 thread) without
    OMP_NUM_THREADS: as many threads as cores it may run on; with it: the user's number."""
    cores = len(os.sched_getaffinity(0))
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "LOCAL_WORLD_SIZE")}
    base["PYTHONPATH"] = ROOT
    for env, expected in ((base, cores), (dict(base, OMP_NUM_THREADS="1"), 1)):
        out = tmp_path / f"run{expected}"
        proc = launchers().start(["--train", f"mnist={shards}/", "--epochs", "1", *SMALL, "--out", str(out)],
                                 env, ROOT, module="pipeline.train")
        code, err = finish(proc)
        assert code == 0, err[-2000:]
        assert json.loads((out / "summary.json").read_text())["startup"]["torch_threads"] == expected


@pytest.mark.parametrize("loader_timeout, workers, warned", [(5, 1, True), (600, 1, False), (0, 1, False),
                                                             (5, 0, False)])
def test_a_loader_timeout_shorter_than_a_shards_read_is_warned(tmp_path, capsys, loader_timeout, workers, warned):
    """--io-timeout 20 let a 12 s stall through and --loader-timeout 5 ended the run (hostileK): a
    loader timeout under the longest read the I/O flags allow a shard is said at the start."""
    import argparse

    from pipeline import cli
    from pipeline.data.store import remote

    build_shards(tmp_path / "d", "mnist", "train", 20, shape=(1, 8, 8))
    src = resolve("mnist", str(tmp_path / "d"), "train")
    args = argparse.Namespace(loader_timeout=loader_timeout, workers=workers, io_timeout=20.0, min_rate=1.0,
                              retries=3, max_shard_bytes=1 << 30)
    guard.warn_loader_timeout(args, remote.Policy(**cli.io_limits(args)), [src])
    err = capsys.readouterr().err
    largest = max(src.sizes)
    assert err == (f"pipeline-train: warning: --loader-timeout 5 s is shorter than a shard's read may take "
                   f"({20 + largest / 1e6:.1f} s for the largest, {largest:,} bytes, under --io-timeout 20 s and --min-rate 1 MB/s): a slow read "
                   f"within its deadline would end the run; raise --loader-timeout\n" if warned else "")


@pytest.mark.slow
def test_the_trainer_says_a_short_loader_timeout_at_its_start(tmp_path):
    build_shards(tmp_path / "d", "mnist", "train", 40, shape=(1, 8, 8))
    p = train_in_process(["--train", f"mnist={tmp_path / 'd'}", "--epochs", "1", "--batch-size", "8", "--workers",
                          "1", "--width", "4", "--loader-timeout", "25", "--out", tmp_path / "run"])
    assert p.returncode == 0, p.stderr[-2000:]
    assert "pipeline-train: warning: --loader-timeout 25 s is shorter than a shard's read may take (30.1 s" in p.stderr
