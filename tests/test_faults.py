"""Failures a multi-process job meets: corrupt shards, HTTP outages, killed ranks, Ctrl-C.

Each case runs real processes with a bounded timeout: a hang fails the test. The errors found
before training (one line each) run main() in this process (tests/test_train.py proves the
command line's wiring).
"""
import functools
import http.server
import json
import os
import signal
import threading
import time

import pytest
import torch

from helpers import HANG, build_shards, children, descendants, finish, free_port, launch_train, serve, train_in_process

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("shards")
    build_shards(out, "mnist", "train", 400, shape=(1, 28, 28), encoding="raw", maxcount=20)
    build_shards(out, "cifar10", "train", 400, shape=(3, 32, 32), encoding="png", maxcount=20)
    build_shards(out, "mnist", "test", 100, shape=(1, 28, 28), encoding="raw", maxcount=20)
    return out


def args_for(base, out, *extra):
    base = str(base).rstrip("/") + "/"
    return ["--train", f"mnist={base}", "--train", f"cifar10={base}", "--batch-size", "16", "--workers", "1",
            "--width", "8", "--epochs", "2", "--log-every", "10", "--out", str(out), *extra]


def launch(args, nproc=2, extra_launcher=(), fork_ranks=True):
    """torchrun with ranks forked from the launcher (helpers.launch_train). The tests of process
    lifetimes (a killed rank restarted, Ctrl-C) take fresh ranks, which live as on a cluster:
    torch.multiprocessing sends a forked rank SIGINT when its launcher dies, and a restart
    forks the launcher again rather than starting a new Python."""
    return launch_train(args, nproc, extra_launcher, pythonpath=[os.path.join(ROOT, "tests")], fork_ranks=fork_ranks)


def summary(out):
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f)


def wait_for(path, proc, timeout=HANG):
    t0 = time.time()
    while not os.path.exists(path):
        assert proc.poll() is None, f"exited early: {proc.communicate()[1][-2000:]}"
        assert time.time() - t0 < timeout, f"{path} never appeared"
        time.sleep(0.05)


def linked_copy(data, dst, leave_out):
    """`dst` holding hard links to every file of `data` but `leave_out`."""
    dst.mkdir()
    for f in os.listdir(data):
        if f != leave_out:
            os.link(data / f, dst / f)
    return dst


def corrupt_copy(data, tmp_path):
    """A copy of the shards with one mnist shard cut in the middle of a member."""
    dst = linked_copy(data, tmp_path / "corrupt", "mnist-train-000003.tar")
    src = (data / "mnist-train-000003.tar").read_bytes()
    (dst / "mnist-train-000003.tar").write_bytes(src[:len(src) // 2 + 700])
    return dst


def test_corrupt_shard_stops_the_run_under_strict(data, tmp_path):
    bad = corrupt_copy(data, tmp_path)
    rc, err = finish(launch(args_for(bad, tmp_path / "run", "--strict")))
    assert rc != 0
    assert "mnist-train-000003.tar" in err and "truncated" in err


class Server:
    """An http.server on a fixed port that can be stopped and started again."""

    def __init__(self, folder):
        self.folder, self.port, self.httpd = str(folder), free_port(), None

    def start(self):
        handler = functools.partial(_Quiet, directory=self.folder)
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), handler)
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}/"


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def test_a_corrupt_shard_is_skipped_and_an_http_outage_retried_in_one_run(data, tmp_path):
    """Two faults a run survives, in one torchrun job: mnist from a local copy with a shard
    cut short (skipped, named, counted), cifar10 over HTTP from a server stopped mid-run."""
    bad = corrupt_copy(data, tmp_path)
    server = Server(data)
    server.start()
    out = tmp_path / "run"
    args = [f"mnist={bad}/" if a == f"mnist={server.url}" else a for a in args_for(server.url, out, "--epochs", "3")]
    proc = launch(args)
    try:
        wait_for(out / "checkpoint.pt", proc)  # epoch 1 done: the stream is mid-run
        server.stop()
        time.sleep(2.5)
        server.start()
        rc, err = finish(proc)
    finally:
        server.stop()
    assert rc == 0, err[-2000:]
    assert "retrying" in err
    assert "mnist-train-000003.tar" in err  # the warning names the shard
    s = summary(out)
    assert s["epochs_done"] == 3 and s["config"]["train"]["mnist"] == f"{bad}/"
    assert s["skipped_samples"] > 0
    assert len(set(s["epochs"][0]["batches"].values())) == 1
    with open(out / "metrics.jsonl") as f:
        assert sum(json.loads(ln).get("skipped", 0) for ln in f) == s["skipped_samples"]


def test_http_server_gone_for_good_stops_every_rank_with_one_error(data, tmp_path):
    server = Server(data)
    server.start()
    out = tmp_path / "run"
    # a rank left waiting for the others in a collective would wait out --timeout: longer than the hang guard
    proc = launch(args_for(server.url, out, "--epochs", "50", "--timeout", 2 * HANG))
    wait_for(out / "checkpoint.pt", proc)
    server.stop()
    rc, err = finish(proc, timeout=HANG)
    assert rc != 0
    assert "failed after 4 attempts" in err


def test_unreachable_server_fails_fast(tmp_path):
    t0 = time.time()
    p = train_in_process(args_for(f"http://127.0.0.1:{free_port()}", tmp_path / "run"))
    assert p.returncode == 2 and "cannot read manifest" in p.stderr and "Traceback" not in p.stderr
    assert time.time() - t0 < 60


def test_missing_http_shard_is_reported_before_training(data, tmp_path):
    folder = linked_copy(data, tmp_path / "served", "cifar10-train-000005.tar")
    with serve(folder) as url:
        p = train_in_process(args_for(url, tmp_path / "run"))
    assert p.returncode == 2, p.stderr
    assert "cifar10-train-000005.tar" in p.stderr and "404" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("rdzv", ["static", "fixed-rdzv-id"])
def test_killed_rank_restarts_from_checkpoint_and_finishes(data, tmp_path, rdzv):
    """Before `dist.restart_store`, the restarted attempt read the killed rank's gloo address
    from torchrun's store and failed with "Connection refused" in most runs. With a fixed
    --rdzv-id the restart still takes its own run over (outdir.same_job: the same launcher)."""
    out = tmp_path / "run"
    fixed = ["--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{free_port()}", "--rdzv-id=exp100"]
    proc = launch(args_for(data, out, "--epochs", "3", "--epoch-samples", "2000"),
                  extra_launcher=["--max-restarts=1", *(fixed if rdzv == "fixed-rdzv-id" else [])], fork_ranks=False)
    wait_for(out / "checkpoint.pt", proc)
    victims = children(proc.pid)
    assert victims, "no trainer processes found"
    os.kill(victims[-1], signal.SIGKILL)
    rc, err = finish(proc, timeout=HANG)
    assert rc == 0, err[-2000:]
    s = summary(out)
    assert s["restarts"] == 1 and s["resumed_from"]["epoch"] >= 2
    assert s["epochs_done"] == 3 and all(len(set(e["batches"].values())) == 1 for e in s["epochs"])
    torch.load(out / "checkpoint.pt", weights_only=True)


def test_ctrl_c_on_the_launcher_ends_every_process(data, tmp_path):
    out = tmp_path / "run"
    proc = launch(args_for(data, out, "--epochs", "50"), fork_ranks=False)
    wait_for(out / "checkpoint.pt", proc)
    tree = descendants(proc.pid)  # the ranks and their DataLoader workers
    proc.send_signal(signal.SIGINT)
    finish(proc, timeout=HANG)  # a hang guard; how soon they end is no test on a loaded machine
    time.sleep(1)
    assert [p for p in tree if os.path.exists(f"/proc/{p}") and "Z" not in open(f"/proc/{p}/stat").read().split()[2]] \
        == [], "processes left running"
    assert not [f for f in os.listdir(out) if f.endswith(".tmp")]
    torch.load(out / "checkpoint.pt", weights_only=True)


def test_unloadable_checkpoint_is_one_line_error(data, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoint.pt").write_bytes(b"not a checkpoint")
    p = train_in_process(args_for(data, out, "--resume"))
    assert p.returncode == 2 and "not a loadable checkpoint" in p.stderr and "Traceback" not in p.stderr


def test_remote_shard_with_wrong_sha256_is_reported_and_skipped(data, tmp_path):
    from pipeline.data.streams import stream
    from pipeline.writers.shards import ShardError

    folder = linked_copy(data, tmp_path / "served", "mnist-train-000002.tar")
    blob = bytearray((data / "mnist-train-000002.tar").read_bytes())
    blob[-1] ^= 1  # a flipped bit in the end-of-archive padding: still a readable tar
    (folder / "mnist-train-000002.tar").write_bytes(bytes(blob))
    with serve(folder) as url:
        src = stream.resolve("mnist", url, "train")
        mixed = stream.MixedStream([src], {"mnist": 1}, 20, epoch_samples=400, shuffle_buffer=10)
        with pytest.warns(UserWarning, match="mnist-train-000002.tar: sha256 differs"):
            skipped = sum(b["skipped"] for b in mixed)
        # the shard's 20 samples, once: the run, 20 samples short of its batches, goes on into its
        # reserve (the next pass here, the epoch being the whole pass), whose first windows are other
        # shards' (it read its own start again before, and the damaged shard a second time: 40)
        assert skipped == 20
        strict = stream.MixedStream([src], {"mnist": 1}, 20, epoch_samples=400, shuffle_buffer=10, strict=True)
        with pytest.raises(ShardError, match="sha256"):
            list(strict)


def stop_worker_mid_run(tmp_path, data, sig, *extra):
    """A one-process trainer (--workers 1) whose loader worker gets `sig` once the first
    checkpoint is written: (exit code, stderr), under the hang guard."""
    from helpers import launch_trainer

    out = tmp_path / "run"
    proc = launch_trainer(args_for(data, out, "--epochs", "50", "--checkpoint-every", "5", *extra))
    try:
        wait_for(out / "checkpoint.pt", proc)
        workers = children(proc.pid)
        assert workers, "no loader worker found"
        for pid in workers:
            os.kill(pid, sig)
        rc, err = finish(proc, timeout=HANG)
    finally:
        for pid in workers if "workers" in locals() else ():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return rc, err, out


def test_a_stuck_loader_worker_ends_the_run_in_one_line_with_the_resume_command(data, tmp_path):
    """A worker stopped (as one in uninterruptible I/O) left `python -m pipeline.train` waiting
    for ever with no line: --loader-timeout ends it, naming the worker and the resume command."""
    rc, err, out = stop_worker_mid_run(tmp_path, data, signal.SIGSTOP, "--loader-timeout", "3")
    assert rc == 2 and "Traceback" not in err, err[-3000:]
    errors = [ln for ln in err.splitlines() if "error:" in ln]
    assert len(errors) == 1 and "loader worker 0" in errors[0] and "sent nothing for 3 s" in errors[0], err[-3000:]
    assert "next pass" not in err, errors[0]  # the trainer makes none: the loader's promise is not its
    assert f"resume with: " in err and "--resume" in err.split("resume with: ")[1], err[-3000:]


def test_a_killed_loader_worker_ends_the_run_in_one_line_with_what_to_do(data, tmp_path):
    """A worker killed (as the OOM killer does) ended the trainer with a traceback whose last
    line promised a next pass the trainer never makes."""
    rc, err, out = stop_worker_mid_run(tmp_path, data, signal.SIGKILL)
    assert rc == 2 and "Traceback" not in err, err[-3000:]
    errors = [ln for ln in err.splitlines() if "error:" in ln]
    assert len(errors) == 1 and "loader worker 0" in errors[0] and "SIGKILL" in errors[0], err[-3000:]
    assert "next pass" not in err and "lower --workers or --batch-size" in errors[0]
    assert "resume with: " in err, err[-3000:]


def test_the_loader_timeout_is_checked_in_one_line(tmp_path):
    for bad in ("nan", "-1", "inf", "1e9"):
        p = train_in_process(args_for(tmp_path, tmp_path / "run", "--loader-timeout", bad))
        assert p.returncode == 2 and "--loader-timeout" in p.stderr and "Traceback" not in p.stderr, p.stderr
