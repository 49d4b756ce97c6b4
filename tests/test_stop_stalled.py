"""A stop signal while a read stalls, and after the run: a single process at --workers 0 reads
its next batch itself, and a SIGTERM there waited for the stalled read (40 s of a 40 s stall
that --io-timeout 60 allows, past torchrun's 30 s: hostileK 7); now it stops within seconds
with a checkpoint after the last step trained, and the resume reads what an uninterrupted run
reads. A signal after the run's end left a finished run dead by the signal (rc -15)."""
import contextlib
import functools
import http.server
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from helpers import HANG, Quiet, build_shards, completed, kill_tree, launch_train, next_line, serving, steps_logged
from pipeline.train.metrics import read_keys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STALL = 60.0  # s a stalled shard's answer waits, silent: inside --io-timeout 60, as hostileK's 40 s stall was
BOUND = 15.0  # s the stop may take after the signal: generous for a loaded machine, a quarter of the stall


class _Stalling(Quiet, http.server.SimpleHTTPRequestHandler):
    """Serves a folder; the shard requests after the first `server.first` (`server.stalls` of
    them) wait silently `server.stall` seconds (or until the server stops), then are answered: a
    server that hangs within the job's deadlines. `server.stalled` is set when one starts waiting."""

    def do_GET(self):
        if self.path.endswith(getattr(self.server, "shard", ".tar")):  # (`server.shard`: that shard's requests only)
            with self.server.lock:
                self.server.gets += 1
                late = self.server.first < self.server.gets <= self.server.first + self.server.stalls
            if late:
                self.server.stalled.set()
                t0 = time.monotonic()
                while time.monotonic() - t0 < self.server.stall and not self.server.stopping:
                    time.sleep(0.05)
                if self.server.stopping:  # the test is over; its client has gone
                    return
        super().do_GET()


def stalling(folder, first, **attrs):
    attrs = dict(dict(stall=STALL, stalls=10 ** 6), **attrs)
    return serving(functools.partial(_Stalling, directory=str(folder)), first=first, gets=0,
                   lock=threading.Lock(), stalled=threading.Event(), **attrs)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """4 mnist shards of 20 tiny samples: a pass is 10 batches of 8, and an epoch of 160 samples
    reads two passes, each with readers of its own, so the second pass fetches every shard again."""
    folder = tmp_path_factory.mktemp("stall") / "srv"
    build_shards(folder, "mnist", "train", 80, shape=(1, 8, 8), maxcount=20)
    return folder


PASS = 10  # batches in a pass


def args(url, out, *extra, workers=0):
    return ["--train", f"mnist={url}", "--epochs", "1", "--epoch-samples", str(2 * PASS * 8), "--batch-size", "8",
            "--workers", str(workers), "--width", "4", "--log-every", "1", "--record-keys", "--io-timeout", "60",
            "--out", str(out), *extra]


def start(argv, code=None):
    """The trainer in a process of its own (`code`: a `python -c` program that runs it instead)."""
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "pipeline.train"] if code is None else [sys.executable, "-c", code]
    return subprocess.Popen([*cmd, *map(str, argv)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def trained(out, world=1):
    """What a run trained on and logged: its key logs and metrics lines, without timings and the
    lines that say where it resumed."""
    lines = [json.loads(ln) for ln in open(os.path.join(out, "metrics.jsonl"))]
    for ln in lines:
        ln.pop("samples_per_s", None)
    keys = [read_keys(os.path.join(out, f"keys-rank{r}.txt")) for r in range(world)]
    return keys, [ln for ln in lines if ln["kind"] != "resumed"]


@pytest.fixture(scope="module")
def whole(served, tmp_path_factory):
    """workers -> what an uninterrupted run at that many workers trained and logged."""
    runs = {}

    def of(workers):
        if workers not in runs:
            out = tmp_path_factory.mktemp("whole") / "run"
            with stalling(served, first=10 ** 6) as server:  # never stalls
                p = completed(start(args(server.url, out, workers=workers)))
            assert p.returncode == 0, p.stderr[-3000:]
            runs[workers] = trained(out)
        return runs[workers]
    return of


def wait_for(proc, ready, what):
    """Poll until ready() (a hang guard, not a speed test)."""
    t0 = time.time()
    while not ready():
        if proc.poll() is not None or time.time() - t0 > HANG:
            p = completed(proc, 1)
            pytest.fail(f"{what} never came; the trainer ended with {p.returncode}: {p.stderr[-3000:]}")
        time.sleep(0.05)


def signalled(proc, sig):
    """(the completed run, seconds from `sig` to its exit): how long a stop took."""
    t0 = time.monotonic()
    proc.send_signal(sig)
    try:
        proc.wait(HANG)
    finally:
        took = time.monotonic() - t0
    return completed(proc), took


def waiting(server, out, still=1.0):
    """A test of: a read stalls, a pass was trained, and no step was logged for `still` seconds
    (on a loaded machine a slow step may pass for a wait: the stop is then a step's, as fast)."""
    last = {"steps": None, "since": time.monotonic()}

    def ready():
        steps = steps_logged(out)
        if steps != last["steps"]:
            last.update(steps=steps, since=time.monotonic())
        return server.stalled.is_set() and PASS in steps and time.monotonic() - last["since"] > still
    return ready


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_while_a_read_stalls_stops_within_seconds_and_the_resume_matches(served, whole, tmp_path, sig):
    workers = 0  # the trainer reads its batches itself, inside the stalled read
    out = tmp_path / "run"
    with stalling(served, first=4) as server:  # the second pass's reads stall
        proc = start(args(server.url, out, workers=workers))
        # the first pass trained, a read stalls, and no step came for a second: the trainer waits for a batch
        wait_for(proc, waiting(server, out), "the stall")
        p, took = signalled(proc, sig)
    assert p.returncode == 128 + sig, p.stderr[-3000:]
    print(f"{sig.name} during a {STALL:g} s stall: stopped in {took:.2f} s")  # pytest -s shows it (docs/training.md)
    assert took < BOUND, f"the stop took {took:.1f} s of a {STALL:g} s stall: {p.stdout[-1500:]}"
    stops = re.findall(r"stopped at epoch 1, step (\d+); checkpoint saved", p.stdout)
    assert stops == [str(PASS)], p.stdout[-3000:]  # after the last step trained: the stalled batch is not
    with stalling(served, first=10 ** 6) as server:
        p = completed(start(args(server.url, out, "--resume", workers=workers)))
    assert p.returncode == 0 and f"resumed from epoch 1, step {stops[0]}" in p.stdout, p.stderr[-3000:]
    assert trained(out) == whole(workers)


@pytest.mark.slow
def test_a_single_process_waiting_for_its_workers_stalled_reads_stops_within_seconds(served, whole, tmp_path):
    """At 2 workers the trainer waits for workers whose reads stall, from the first batch on: the
    stop is before step 1, and the resume reads the whole epoch as an uninterrupted run does.
    (The workers, stuck in their reads, are given 5 s to stop before they are killed.)"""
    out = tmp_path / "run"
    with stalling(served, first=0) as server:
        proc = start(args(server.url, out, workers=2))
        wait_for(proc, lambda: server.stalled.is_set(), "the stall")
        # the run began (its settings line): a signal before it ends the job with --out untouched
        line, _ = next_line(proc, b"", HANG, "trainer")
        assert line and line.startswith("training "), line
        time.sleep(1)  # the trainer's start done, and the wait for the first batch begun (else: a step's stop)
        p, took = signalled(proc, signal.SIGTERM)
    assert p.returncode == 128 + signal.SIGTERM, p.stderr[-3000:]
    print(f"2 workers, SIGTERM during a {STALL:g} s stall: stopped in {took:.2f} s")
    assert took < BOUND + 5, f"the stop took {took:.1f} s of a {STALL:g} s stall: {p.stdout[-1500:]}"
    assert "stopped at epoch 1, step 0; checkpoint saved" in p.stdout, p.stdout[-3000:]
    with stalling(served, first=10 ** 6) as server:
        p = completed(start(args(server.url, out, "--resume", workers=2)))
    assert p.returncode == 0 and "resumed from epoch 1, step 0" in p.stdout, p.stderr[-3000:]
    assert trained(out) == whole(2)


PIPE_STALL = 120  # s a pipe: command's shard read sleeps
STALLCAT = """#!/bin/sh
# cat $1; a shard's read stalls first (the stall is a second process in the command's group)
case "$1" in *.tar) touch "{dir}/stalled"; "{dir}/nap-{mark}" {stall};; esac
exec cat "$1"
"""


def marked(mark):
    """The pids of the processes whose command line holds `mark` (a /proc scan)."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if mark.encode() in f.read():
                    found.append(int(entry))
        except OSError:  # gone meanwhile
            pass
    return found


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="the /proc scan is Linux's")
def test_a_stop_at_2_workers_ends_their_stalled_pipe_commands(served, tmp_path):
    """A pipe: command runs in a process group of its own, which the worker's reader kills as it
    closes; a worker stuck in a stalled read is SIGKILLed at the trainer's end instead, and its
    commands lived on (hostileO s5c): a caller reading the trainer's output waited for them (58 s).
    Now they end with the worker, and the caller's communicate() returns with the trainer."""
    mark = f"p1stall{os.getpid()}x{time.monotonic_ns()}"
    script = tmp_path / f"stallcat-{mark}"
    script.write_text(STALLCAT.format(dir=tmp_path, mark=mark, stall=PIPE_STALL))
    script.chmod(0o755)
    os.symlink(shutil.which("sleep"), tmp_path / f"nap-{mark}")
    proc = start(args(f"pipe:{script} {served}/mnist-train.json", tmp_path / "run", workers=2))
    try:
        wait_for(proc, (tmp_path / "stalled").exists, "the stall")
        line, _ = next_line(proc, b"", HANG, "trainer")
        assert line and line.startswith("training "), line
        time.sleep(1)  # the trainer's start done, and the wait for the first batch begun
        assert marked(f"nap-{mark}"), "the stall is not a command of its own"
        proc.send_signal(signal.SIGTERM)
        proc.wait(HANG)
        t0 = time.monotonic()
        try:  # what a caller capturing the output does: it returns once no process holds the pipes
            _, err = proc.communicate(timeout=PIPE_STALL / 4)
        except subprocess.TimeoutExpired:
            err = None
        waited = time.monotonic() - t0
        left = marked(mark)
        print(f"2 workers, pipe: commands stalled: output closed {waited:.2f} s after the trainer ended")
    finally:
        for pid in marked(mark):  # whatever is left, not to outlive the test
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            completed(proc, 1)
    assert proc.returncode == 128 + signal.SIGTERM, (err or "")[-3000:]
    assert not left, f"the pipe: commands outlived the trainer: {left}"
    assert err is not None, f"the output stayed open {waited:.1f} s after the trainer ended"


CONSUMER = r"""
import sys
from pipeline.data.handover.loader import make_loader
from pipeline.data.streams.stream import MixedStream, resolve
stream = MixedStream([resolve("mnist", sys.argv[1], "train")], {"mnist": 1.0}, 8, epoch_samples=80,
                     normalize=False)
for batch in make_loader(stream, 2):
    pass
"""


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="the /proc scan is Linux's")
def test_workers_of_a_killed_consumer_end_their_stalled_pipe_commands(served, tmp_path):
    """A consumer SIGKILLed (a second signal, the OOM killer, torchrun's grace over) cannot end
    its workers; each notices within a second that it is gone and exits, and now ends its pipe:
    commands (sessions of their own) as it goes."""
    mark = f"p1stall{os.getpid()}x{time.monotonic_ns()}"
    script = tmp_path / f"stallcat-{mark}"
    script.write_text(STALLCAT.format(dir=tmp_path, mark=mark, stall=PIPE_STALL))
    script.chmod(0o755)
    os.symlink(shutil.which("sleep"), tmp_path / f"nap-{mark}")
    proc = start([f"pipe:{script} {served}/mnist-train.json"], code=CONSUMER)
    try:
        wait_for(proc, (tmp_path / "stalled").exists, "the stall")
        time.sleep(1)  # both workers' reads begun
        assert marked(f"nap-{mark}"), "the stall is not a command of its own"
        proc.kill()
        proc.wait()
        t0 = time.monotonic()
        while marked(mark) and time.monotonic() - t0 < PIPE_STALL / 4:  # a hang guard, not a speed test
            time.sleep(0.1)
        left = marked(mark)
    finally:
        for pid in marked(mark):  # whatever is left, not to outlive the test
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        kill_tree(proc)
    assert not left, f"the pipe: commands outlived the consumer's workers: {left}"


def _raised(call):
    try:
        call()
    except Exception as e:
        return e


def _stat(pid):
    """(ppid, pgid) of a process, from /proc (None, None once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None, None
    return int(fields[1]), int(fields[2])


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="the /proc scan is Linux's")
def test_a_worker_killed_for_its_loaders_timeout_ends_its_stalled_pipe_commands(served, tmp_path):
    """make_loader's timeout kills a worker that sent nothing for that long; its pipe: commands
    (sessions of their own) end with it."""
    from pipeline.data.handover.loader import make_loader
    from pipeline.data.streams.stream import MixedStream, resolve

    mark = f"p1stall{os.getpid()}x{time.monotonic_ns()}"
    script = tmp_path / f"stallcat-{mark}"
    script.write_text(STALLCAT.format(dir=tmp_path, mark=mark, stall=PIPE_STALL))
    script.chmod(0o755)
    os.symlink(shutil.which("sleep"), tmp_path / f"nap-{mark}")
    stream = MixedStream([resolve("mnist", f"pipe:{script} {served}/mnist-train.json", "train")], {"mnist": 1.0},
                         8, epoch_samples=80, normalize=False)
    loader = make_loader(stream, 2, timeout=6)
    got = {}
    reader = threading.Thread(target=lambda: got.update(error=_raised(lambda: next(iter(loader)))), daemon=True)
    reader.start()
    try:
        t0 = time.monotonic()
        while len(marked(f"nap-{mark}")) < 2 and time.monotonic() - t0 < HANG:  # both workers' reads stall
            time.sleep(0.05)
        groups = {_stat(pid)[1]: _stat(_stat(pid)[1])[0] for pid in marked(f"nap-{mark}")}  # group -> its worker
        reader.join(HANG)
        assert isinstance(got.get("error"), TimeoutError), got
        killed = int(re.search(r"\(pid (\d+)\) sent nothing", str(got["error"]))[1])
        assert killed in groups.values(), (killed, groups)
        left = [pid for pid in marked(mark) if groups.get(_stat(pid)[1]) == killed]
    finally:
        del loader
        for pid in marked(mark):  # whatever is left, not to outlive the test
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert not left, f"the pipe: commands outlived the worker killed for the timeout: {left}"


SHORT = 10.0  # s: the stall a 2-rank stop waits out


@pytest.mark.slow
def test_two_ranks_wait_for_a_stalled_read_and_stop_together(served, tmp_path):
    """One rank's read stalls; the other rank is in the step's gradient all-reduce, waiting for
    it. The signal (to torchrun, which forwards it to both) cannot drop that rank's batch: the
    other would be left in the all-reduce. Both stop together once the read ends, a step or two
    later, and the resume reads what an uninterrupted run reads."""
    whole, out = tmp_path / "whole", tmp_path / "run"
    # 4 passes of 5 steps a rank; each rank reads a part of every shard, fetching its first two
    # passes' at its start, the next two at its third: the third request for shard 0, one rank's,
    # stalls after step 10, and the other rank's is answered
    more = ["--epoch-samples", str(4 * PASS * 8), "--timeout", "120"]
    with stalling(served, first=10 ** 6) as server:
        p = completed(launch_train(args(server.url, whole, *more), 2))
    assert p.returncode == 0, p.stderr[-3000:]
    with stalling(served, first=2, stalls=1, shard="mnist-train-000000.tar", stall=SHORT) as server:
        proc = launch_train(args(server.url, out, *more), 2)
        wait_for(proc, waiting(server, out), "the stall")
        proc.send_signal(signal.SIGTERM)
        p = completed(proc, 4 * SHORT + 60)  # a hang guard: ranks left in a collective would wait --timeout
    said = p.stdout + p.stderr
    stops = re.findall(r"stopped at epoch 1, step (\d+); checkpoint saved", said)
    assert len(stops) == 1 and PASS <= int(stops[0]) < 2 * PASS, said[-3000:]
    with stalling(served, first=10 ** 6) as server:
        p = completed(launch_train(args(server.url, out, *more, "--resume"), 2))
    assert p.returncode == 0 and f"resumed from epoch 1, step {stops[0]}" in p.stdout + p.stderr, p.stderr[-3000:]
    assert trained(out, 2) == trained(whole, 2)


LATE = r"""
import os, sys, time
sys.argv = ["pipeline-train", *sys.argv[1:]]
from pipeline.train import stop

def late(then=lambda: None):
    print("exiting", flush=True)  # the run is over and saved; the process has not ended yet
    time.sleep(2)
    then()

if os.environ["PHASE"] == "ending":  # main() ends the loader's workers after its stop handlers are put away
    ends = stop.end_children
    stop.end_children = lambda: late(ends)
else:  # Python's teardown, after every atexit hook: the default actions are back
    class Last:
        def __del__(self):
            late()
    last = Last()
from pipeline.train.__main__ import command
command()
"""


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["ending", "teardown"])
def test_a_signal_after_the_run_ended_leaves_its_exit_code(served, tmp_path, monkeypatch, phase):
    """The stop handlers were put back before the process ended, and Python puts the default
    action back as it tears itself down: a SIGTERM just after "done" (torchrun's, a
    scheduler's) ended a finished, saved run with rc -15."""
    monkeypatch.setenv("PHASE", phase)
    with stalling(served, first=10 ** 6) as server:
        proc = start(args(server.url, tmp_path / "run"), code=LATE)
        said = ""
        while "exiting\n" not in said:
            line = proc.stdout.readline()
            assert line, completed(proc).stderr[-3000:]
            said += line
        proc.send_signal(signal.SIGTERM)
        p = completed(proc)
    assert "done: " in said and p.returncode == 0, (p.returncode, p.stderr[-3000:])


@pytest.mark.slow
def test_a_stop_signal_while_the_manifest_read_stalls_ends_the_start_up_at_once(served, tmp_path):
    """The manifest's request stalls at start-up; a SIGTERM was only noted there and the retries
    went on (4 min at --io-timeout 60; hostileO). A single process now stops at once, before the
    run began: 143, --out untouched."""
    out = tmp_path / "run"
    with stalling(served, first=0, shard=".json") as server:
        proc = start(args(server.url, out))
        wait_for(proc, lambda: server.stalled.is_set(), "the manifest's stall")
        time.sleep(1.0)
        p, took = signalled(proc, signal.SIGTERM)
    assert p.returncode == 128 + signal.SIGTERM, p.stderr[-3000:]
    print(f"SIGTERM during a stalled manifest read: stopped in {took:.2f} s")
    assert took < BOUND, f"the stop took {took:.1f} s of a {STALL:g} s stall: {p.stderr[-1500:]}"
    assert f"stopped by SIGTERM before the run began; {out}/ is left as it was" in p.stderr, p.stderr[-3000:]
    assert not out.exists()


@pytest.fixture(scope="module")
def tested(tmp_path_factory):
    """A test set of 16 tiny mnist samples, served apart from the training shards (its reads stall)."""
    folder = tmp_path_factory.mktemp("stall") / "test"
    build_shards(folder, "mnist", "test", 16, shape=(1, 8, 8), maxcount=8)
    return folder


def evals_logged(out):
    lines = [json.loads(ln) for ln in open(os.path.join(out, "metrics.jsonl"))]
    return [ln["epoch"] for ln in lines if ln["kind"] == "eval"]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_stop_during_a_stalled_evaluation_and_the_resume_evaluates_the_saved_epoch(served, tested, tmp_path, sig):
    """Epoch 1 saved, its evaluation's reads stall: a SIGTERM waited for them (61 s), and after a
    kill the resume went on to epoch 2 with no accuracy for epoch 1 and no word (hostileO). A
    single process now stops at once (143, the epoch saved), and the resume evaluates epoch 1
    first, saying why."""
    out = tmp_path / "run"
    more = ["--epochs", "2", "--epoch-samples", str(PASS * 8)]
    with stalling(served, first=10 ** 6) as train, stalling(tested, first=0) as test:
        proc = start(args(train.url, out, *more, "--eval", f"mnist={test.url}"))
        wait_for(proc, lambda: test.stalled.is_set(), "the evaluation's stall")
        time.sleep(1.0)
        p, took = signalled(proc, sig)
        assert p.returncode == (-sig if sig == signal.SIGKILL else 128 + sig), p.stderr[-3000:]
        assert took < BOUND, f"the stop took {took:.1f} s of a {STALL:g} s stall: {p.stdout[-1500:]}"
        if sig != signal.SIGKILL:
            print(f"{sig.name} during a stalled evaluation: stopped in {took:.2f} s")
            assert "checkpoint saved" in p.stdout, p.stdout[-3000:]
        assert evals_logged(out) == []
        test.first = 10 ** 6  # no more stalls
        p = completed(start(args(train.url, out, *more, "--eval", f"mnist={test.url}", "--resume")))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "epoch 1's evaluation is missing (it failed or was stopped after the epoch was saved)" in p.stderr
    assert "epoch 1/2: mnist" in p.stdout and "epoch 2/2: mnist" in p.stdout, p.stdout[-3000:]
    assert evals_logged(out) == [1, 2]


def test_a_stop_signal_inside_an_atomic_write_leaves_no_half_made_file(tmp_path, monkeypatch):
    """Start-up is interruptible in a single process, and an index made on first use is written
    there: a stop signal (Interrupted, a BaseException) inside the write leaves the old file and
    no .tmp beside it, as an OSError does."""
    from pipeline import files
    from pipeline.train.stop import Interrupted

    path = tmp_path / "shards.json"
    path.write_text("old")

    def signalled(fd):
        raise Interrupted(signal.SIGTERM)
    monkeypatch.setattr(files.os, "fsync", signalled)
    with pytest.raises(Interrupted):
        files.write_json_atomic(str(path), {"new": 1})
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["shards.json"]

