"""A stop signal while a read stalls, and after the run: a single process at --workers 0 reads
its next batch itself, and a SIGTERM there waited for the stalled read (40 s of a 40 s stall
that --io-timeout 60 allows, past torchrun's 30 s: hostileK 7); now it stops within seconds
with a checkpoint after the last step trained, and the resume reads what an uninterrupted run
reads. A signal after the run's end left a finished run dead by the signal (rc -15)."""
import functools
import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from helpers import HANG, Quiet, build_shards, completed, serving, steps_logged
from pipeline.train.metrics import read_keys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STALL = 60.0  # s a stalled shard's answer waits, silent: inside --io-timeout 60, as hostileK's 40 s stall was
BOUND = 15.0  # s the stop may take after the signal: generous for a loaded machine, a quarter of the stall


class _Stalling(Quiet, http.server.SimpleHTTPRequestHandler):
    """Serves a folder; every shard request after the first `server.first` waits silently
    `server.stall` seconds (or until the server stops), then is answered: a server that hangs
    within the job's deadlines. `server.stalled` is set when a request starts waiting."""

    def do_GET(self):
        if self.path.endswith(".tar"):
            with self.server.lock:
                self.server.gets += 1
                late = self.server.gets > self.server.first
            if late:
                self.server.stalled.set()
                t0 = time.monotonic()
                while time.monotonic() - t0 < self.server.stall and not self.server.stopping:
                    time.sleep(0.05)
        super().do_GET()


def stalling(folder, first):
    return serving(functools.partial(_Stalling, directory=str(folder)), first=first, gets=0, stall=STALL,
                   lock=threading.Lock(), stalled=threading.Event())


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """4 mnist shards of 20 tiny samples: a pass is 10 batches of 8, and an epoch of 160 samples
    reads two passes, each with readers of its own, so the second pass fetches every shard again."""
    folder = tmp_path_factory.mktemp("stall") / "srv"
    build_shards(folder, "mnist", "train", 80, shape=(1, 8, 8), maxcount=20)
    return folder


PASS = 10  # batches in a pass


def args(url, out, *extra):
    return ["--train", f"mnist={url}", "--epochs", "1", "--epoch-samples", str(2 * PASS * 8), "--batch-size", "8",
            "--workers", "0", "--width", "4", "--log-every", "1", "--record-keys", "--io-timeout", "60",
            "--out", str(out), *extra]


def start(argv, code=None):
    """The trainer in a process of its own (`code`: a `python -c` program that runs it instead)."""
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "pipeline.train"] if code is None else [sys.executable, "-c", code]
    return subprocess.Popen([*cmd, *map(str, argv)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def trained(out):
    """What a run trained on and logged: its key log and metrics lines, without timings and the
    lines that say where it stopped and resumed."""
    lines = [json.loads(ln) for ln in open(os.path.join(out, "metrics.jsonl"))]
    for ln in lines:
        ln.pop("samples_per_s", None)
    return read_keys(os.path.join(out, "keys-rank0.txt")), [ln for ln in lines if ln["kind"] != "resumed"]


def wait_for(proc, ready, what):
    """Poll until ready() (a hang guard, not a speed test)."""
    t0 = time.time()
    while not ready():
        if proc.poll() is not None or time.time() - t0 > HANG:
            p = completed(proc, 1)
            pytest.fail(f"{what} never came; the trainer ended with {p.returncode}: {p.stderr[-3000:]}")
        time.sleep(0.05)


@pytest.mark.slow
def test_sigterm_while_a_read_stalls_at_workers_0_stops_within_seconds_and_the_resume_matches(served, tmp_path):
    whole, out = tmp_path / "whole", tmp_path / "run"
    with stalling(served, first=10 ** 6) as server:  # never stalls
        p = completed(start(args(server.url, whole)))
    assert p.returncode == 0, p.stderr[-3000:]
    with stalling(served, first=4) as server:  # the second pass's reads stall
        proc = start(args(server.url, out))
        # the first pass trained and logged, and the next batch's read stalls
        wait_for(proc, lambda: server.stalled.is_set() and PASS in steps_logged(out), "the stall")
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(HANG)
        finally:
            took = time.monotonic() - t0
        p = completed(proc)
    assert p.returncode == 128 + signal.SIGTERM, p.stderr[-3000:]
    assert took < BOUND, f"the stop took {took:.1f} s of a {STALL:g} s stall"
    assert f"stopped at epoch 1, step {PASS}; checkpoint saved" in p.stdout, p.stdout[-3000:]
    with stalling(served, first=10 ** 6) as server:
        p = completed(start(args(server.url, out, "--resume")))
    assert p.returncode == 0 and f"resumed from epoch 1, step {PASS}" in p.stdout, p.stderr[-3000:]
    assert trained(out) == trained(whole)


ATEXIT = r"""
import atexit, sys, time
sys.argv = ["pipeline-train", *sys.argv[1:]]
atexit.register(lambda: (print("exiting", flush=True), time.sleep(2)))  # the end of a process, made long
from pipeline.train.__main__ import command
command()
"""


@pytest.mark.slow
def test_a_signal_after_the_run_ended_leaves_its_exit_code(served, tmp_path):
    """The stop handlers were put back before the process ended: a SIGTERM just after "done"
    (torchrun's, a scheduler's) ended a finished, saved run with rc -15."""
    with stalling(served, first=10 ** 6) as server:
        proc = start(args(server.url, tmp_path / "run"), code=ATEXIT)
        pending = ""
        while "exiting\n" not in pending:  # the run is over and saved; the process has not ended yet
            line = proc.stdout.readline()
            assert line, completed(proc).stderr[-3000:]
            pending += line
        proc.send_signal(signal.SIGTERM)
        p = completed(proc)
    assert "done: " in pending and p.returncode == 0, (p.returncode, p.stderr[-3000:])
