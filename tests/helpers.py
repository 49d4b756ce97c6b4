"""Test helpers for the stream tests: tiny synthetic shard sets, a local HTTP server,
hand-written tar shards, and a free port. Nothing here reads ../shared/data."""
import contextlib
import functools
import http.server
import io
import socket
import tarfile
import threading
import time

from pipeline.writers import shards
from pipeline.writers.sources import SyntheticSource

# A hang guard, in seconds, for a process or a wait a test starts: never a measure of speed. Work
# that scales with the machine's load (a Python starting, a job training) gets this long, so that
# `make test` beside other jobs on two busy cores fails only on a real hang; pytest's own timeout
# (pyproject.toml) is longer still, so that this guard's message, with the stacks, comes first.
HANG = 900


def build_shards(out, name, split, n, *, shape=(1, 28, 28), encoding="raw", maxcount=20, seed=0, workers=1):
    """Write n synthetic samples of `name`/`split` as shards plus manifest under `out`.

    Returns (manifest, source): the source gives each key's true image and label. workers=2
    for the learning tests' thousands of samples: each shard depends only on its indices,
    so the shards are the same, in half the time on two idle cores.
    """
    source = SyntheticSource(name, split, n, shape, seed)
    manifest = shards.build(source, str(out), encoding=encoding, maxcount=maxcount, seed=seed, workers=workers,
                            progress=False)
    return manifest, source



def two_small_sources(out):
    """Sources a (330 samples, 40 a shard) and b (200, 30 a shard) of 1x2x2 raw images in `out`:
    shards of unequal sizes, so an epoch of batches of 10 crosses shards mid-batch."""
    from pipeline.data.manifests.manifest import resolve

    for name, n, per in (("a", 330, 40), ("b", 200, 30)):
        build_shards(out, name, "train", n, shape=(1, 2, 2), maxcount=per)
    return [resolve(n, str(out), "train") for n in "ab"]

def sample_key(name, split, index):
    """The key make_shards gives sample `index` (see shards.write_shard)."""
    return f"{name}-{split}-{index:07d}"


def key_index(key):
    return int(key.rsplit("-", 1)[1])


def read_members(path):
    """[(member name, bytes)] of a tar file, read with Python's tarfile (not our parser)."""
    with tarfile.open(path) as tar:
        return [(m.name, tar.extractfile(m).read()) for m in tar.getmembers() if m.isfile()]


def shard_keys(path):
    """Sample keys of a shard in file order, read with tarfile."""
    keys = []
    for name, _ in read_members(path):
        key = name.split(".", 1)[0]
        if not keys or keys[-1] != key:
            keys.append(key)
    return keys


def write_tar(path, members, gz=False):
    """Write [(name, bytes)] as a plain USTAR tar file, the format make_shards writes (gzip-compressed with gz)."""
    with tarfile.open(path, "w:gz" if gz else "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            tar.addfile(info, io.BytesIO(data))


# ---------------------------------------------------------------- the stream tests' data and runs

HALF = {"mnist": 0.5, "cifar10": 0.5}

STREAM_SPECS = {  # the module fixture `data` (conftest): (name, split): (samples, shape, encoding, maxcount)
    ("mnist", "train"): (230, (1, 28, 28), "raw", 20),
    ("cifar10", "train"): (50, (3, 32, 32), "raw", 8),
    ("tiny", "train"): (12, (3, 32, 32), "raw", 6),
    ("mnist", "test"): (50, (1, 28, 28), "png", 20),
    ("cifar10", "test"): (30, (3, 32, 32), "png", 8),
    ("tiny", "test"): (7, (3, 32, 32), "png", 4),
}


def train_sources(folder, names=("mnist", "cifar10")):
    """The train splits of `names` under `folder`, resolved as the trainer resolves --train."""
    from pipeline.data.streams.stream import resolve

    return [resolve(n, folder, "train") for n in names]


def run_epoch(stream, workers=0):
    """Every batch of one epoch through make_loader, reduced to plain lists."""
    from types import SimpleNamespace

    from pipeline.data.handover.loader import make_loader

    out = []
    for b in make_loader(stream, workers):
        assert len(b["key"]) == len(b["label"]) == len(b["source"]) == b["image"].shape[0]
        out.append(SimpleNamespace(key=list(b["key"]), source=b["source"].tolist(), skipped=int(b["skipped"])))
    return out


def keys_of(batches):
    return [k for b in batches for k in b.key]


def read_pass(stream, most=None):
    """Keys of up to `most` batches of one pass of `stream` (all: None), as the loader reads them:
    the pass's plan taken once, each worker's batches in turn, each recorded as it arrives.
    Returns (keys, batches read, samples skipped)."""
    from pipeline.ordering.topology import Worker

    n = stream.workers
    made = [stream.batches(Worker(w, n)) for w in range(n)]
    active, keys, got, skipped = list(range(n)), [], 0, 0
    while active and (most is None or got < most):
        for w in list(active):
            if most is not None and got >= most:
                break
            batch = next(made[w], None)
            if batch is None:
                active.remove(w)
                continue
            stream.record(batch["state"])
            keys += batch["key"]
            assert batch.get("caption", batch["key"]) == batch["key"]  # fields corpus: each row's caption is its key
            skipped += batch["skipped"]
            got += 1
    return keys, got, skipped


# ---------------------------------------------------------------- shards of in-memory arrays (test_shards, test_read)

CLASSES = [str(i) for i in range(10)]


def array_source(n, shape=(1, 8, 8), name="toy", split="train", seed=0):
    """An ArraySource of n random uint8 images with random labels 0-9, the same for the same seed."""
    import numpy as np

    from pipeline.writers import sources

    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, size=(n, *shape), dtype=np.uint8)
    return sources.ArraySource(name, split, images, rng.integers(0, 10, n), CLASSES)


def build_source(src, out, **kw):
    """shards.build(src) into `out`, 5 samples a shard unless `maxcount` says otherwise; returns the manifest."""
    kw.setdefault("maxcount", 5)
    return shards.build(src, str(out), progress=False, **kw)


def project_samples(path, stream=None, **kw):
    """[(key, {ext: bytes})] as pipeline.read reads them, from `path` or an open stream."""
    from pipeline.data.shards import read

    with (stream or open(path, "rb")) as f:
        return [(s.pop("__key__"), {k: v for k, v in s.items() if k != "__url__"})
                for s in read.iter_samples(f, **kw)]


# ---------------------------------------------------------------- PNGs (test_png, test_decode)

def pixels(shape, seed=0):
    import numpy as np

    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def pil_png(a, **kw):
    """uint8 CHW array `a` as PIL writes it as a PNG (`kw` to PIL's save)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(a[0] if a.shape[0] == 1 else a.transpose(1, 2, 0)).save(buf, format="PNG", **kw)
    return buf.getvalue()


def handmade_png(a, filter_type):
    """A PNG whose every row carries `filter_type`, with that filter applied (None or Sub)."""
    import struct
    import zlib

    import numpy as np

    from pipeline.data.decoding import png

    c, h, w = a.shape
    rows = a.transpose(1, 2, 0).reshape(h, w * c).astype(np.int16)
    if filter_type == 1:  # Sub: difference from the pixel one to the left
        rows = rows - np.concatenate([np.zeros((h, c), np.int16), rows[:, :-c]], axis=1)
    body = np.concatenate([np.full((h, 1), filter_type), rows % 256], axis=1).astype(np.uint8)
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 0 if c == 1 else 2, 0, 0, 0)
    return png.SIGNATURE + png._chunk(b"IHDR", ihdr) + png._chunk(b"IDAT", zlib.compress(body.tobytes())) \
        + png._chunk(b"IEND", b"")


# ---------------------------------------------------------------- commands

def one_line_error(p, *needles):
    """The one `error:` line of a command that exited 2 without a traceback; each needle in it."""
    assert p.returncode == 2, p.stderr[-2000:]
    assert "Traceback" not in p.stderr, p.stderr[-2000:]
    errors = [ln for ln in p.stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1, p.stderr[-2000:]
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


def launch_train(args, nproc=2, extra_launcher=(), pythonpath=(), fresh=False, fork_ranks=True):
    """`python -m torch.distributed.run ... -m pipeline.train ARGS` in a session of its own,
    forked from a Python that imported torch once (see Launchers). With fork_ranks, torchrun
    forks each rank from that launcher (`--run-path --start-method=fork /abs/tests/forked_rank.py`),
    which runs the trainer as `-m pipeline.train` would, without paying ~3.4 CPU-s a rank to
    import torch and the trainer again; else the ranks are fresh Pythons, as on a cluster.
    fresh=True starts the launcher itself as a new Python with fresh ranks, for a test that
    needs its command line (the trainer reads it back to print the resume command).
    test_preempt, test_scale, test_stream, test_readback, test_security and test_limits start
    `torchrun -m pipeline.train` as users do, so that path is tested as it runs."""
    import os
    import subprocess
    import sys

    root, env = _launch_env(pythonpath)
    entry = ["--run-path", "--start-method=fork", os.path.join(root, "tests", "forked_rank.py")] \
        if fork_ranks and not fresh else ["-m", "pipeline.train"]
    argv = [f"--nproc_per_node={nproc}", f"--master_port={free_port()}", *extra_launcher, *entry, *map(str, args)]
    if not fresh:
        return launchers().start(argv, env, root)
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *argv], cwd=root, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def launch_trainer(args, pythonpath=()):
    """`python -m pipeline.train ARGS`, one process without torchrun, forked as the launchers
    are (see Launchers) from a Python that imported torch and the trainer once: for a test
    that needs the trainer in a process of its own (its DataLoader workers' stderr seen)."""
    root, env = _launch_env(pythonpath)
    return launchers().start(list(map(str, args)), env, root, module="pipeline.train")


def _launch_env(pythonpath):
    """(the repository root, the environment) a launched job runs in: the root and `pythonpath`
    on PYTHONPATH, one torch thread, and PYTHONFAULTHANDLER, so that on a hang finish() can
    send SIGABRT and every process prints its stacks."""
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return root, dict(os.environ, PYTHONPATH=os.pathsep.join([root, *map(str, pythonpath)]), OMP_NUM_THREADS="1",
                      PYTHONFAULTHANDLER="1")


CHILD = """
import os, sys, traceback


def _run_and_exit(run):
    # in a forked child: run(), then end with the status `python -m`/`-c` would give
    status = 0
    try:
        run()
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
"""

LAUNCHER = CHILD + """
import faulthandler, json, runpy, select
import torch.distributed.run  # what every launch would import again
import torch._dynamo, pipeline.train.loop  # what every rank forked from a launcher would import again (DDP imports dynamo)
faulthandler.enable()
children = set()
while True:
    if select.select([0], [], [], 0.05 if children else None)[0]:
        request = sys.stdin.readline()
        if not request:
            break
        module, argv, env, cwd, out, err = json.loads(request)
        pid = os.fork()
        if pid == 0:  # as `python -m MODULE ARGV` with start_new_session=True would run
            os.setsid()
            os.chdir(cwd)
            os.environ.clear()
            os.environ.update(env)
            for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                                    (2, err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
                os.dup2(os.open(path, flags), fd)
            sys.stdin = open(0, closefd=False)
            sys.path[:0] = [cwd, *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
            sys.argv = [module, *argv]
            if module == "torch.distributed.run":  # as `python -m` finds it: not imported yet (no runpy warning)
                del sys.modules[module]
            _run_and_exit(lambda: runpy.run_module(module, run_name="__main__", alter_sys=True))
        children.add(pid)
        print("pid", pid, flush=True)
    for pid in list(children):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            children.discard(pid)
            print("exit", pid, os.waitstatus_to_exitcode(status), flush=True)
"""


class Launchers:
    """Forks torchrun launchers (or trainers) from one Python per test process that imported
    torch, torch._dynamo and the trainer once.

    `python -m torch.distributed.run` paid ~2.5 CPU-s to import torch before it started a
    rank, some 30 times a test run on two cores, and each rank ~3.4 CPU-s more. The fork runs
    the same module as __main__ with the same argv, environment, folder and session; the
    test holds a Launched, which answers as the subprocess.Popen it replaces does."""

    def __init__(self):
        self.proc, self.exits, self.pending, self.folder, self.calls = None, {}, b"", None, 0

    def start(self, argv, env, cwd, module="torch.distributed.run"):
        import json
        import os
        import subprocess
        import sys
        import tempfile

        if self.proc is None or self.proc.poll() is not None:
            # in the run's temporary folder (conftest sets it), which pytest removes with old runs
            # even where this process dies before close()
            self.folder = tempfile.mkdtemp(prefix="launchers-", dir=LAUNCH_FOLDER)
            self.proc = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE,
                                         env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True)
            self.pending = b""
        self.calls += 1
        out, err = (os.path.join(self.folder, f"{self.calls}.{s}") for s in ("out", "err"))
        self.proc.stdin.write((json.dumps([module, argv, env, str(cwd), out, err]) + "\n").encode())
        self.proc.stdin.flush()
        while True:
            got = self.report(HANG)
            assert got is not None, f"the process that forks the launchers did not answer in {HANG} s: a hang"
            if got[0] == "pid":
                return Launched(self, got[1], ["torchrun" if module == "torch.distributed.run" else module, *argv],
                                out, err)

    def report(self, timeout):
        """The next line, [word, pid, code...], with an exit noted; None if none came within `timeout` s."""
        got = self.line(timeout)
        if got is not None and got[0] == "exit":
            self.exits[got[1]] = got[2]
        return got

    def line(self, timeout):
        """The launcher's next line as [word, pid, code...]; None if none came within `timeout` s."""
        line, self.pending = next_line(self.proc, self.pending, timeout, "launchers")
        if line is None:
            return None
        word, *numbers = line.split()
        return [word, *map(int, numbers)]

    def exit_code(self, pid, timeout):
        """pid's exit code once it has ended, reading what the forking process reports for up to `timeout` s."""
        import time

        deadline = time.monotonic() + timeout
        while pid not in self.exits:
            if self.report(max(0.0, deadline - time.monotonic())) is None:
                return None
        return self.exits.pop(pid)  # a pid the kernel hands out again is another launcher's

    def close(self):
        import shutil

        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(30)
        if self.folder:
            shutil.rmtree(self.folder, ignore_errors=True)


class Launched:
    """A forked launcher, answering as subprocess.Popen(..., stdout=PIPE, stderr=PIPE, text=True)
    does for what the tests use: pid, args, returncode, poll, wait, communicate, send_signal, kill."""

    def __init__(self, launchers, pid, args, out, err):
        self.launchers, self.pid, self.args, self.out, self.err, self.returncode = launchers, pid, args, out, err, None

    def poll(self):
        return self.wait(0) if self.returncode is None else self.returncode

    def wait(self, timeout=None):
        import subprocess

        if self.returncode is None:
            self.returncode = self.launchers.exit_code(self.pid, 10 ** 6 if timeout is None else timeout)
            if self.returncode is None and timeout:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def communicate(self, timeout=None):
        self.wait(timeout)
        return read_text(self.out), read_text(self.err)

    def send_signal(self, sig):
        """As Popen: nothing once the launcher has ended (its pid, reaped at once, may be reused)."""
        import os

        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # ended since the poll
                pass

    def kill(self):
        import signal

        self.send_signal(signal.SIGKILL)


LAUNCH_FOLDER = None  # where Launchers keeps the launchers' output: the test run's temporary folder (conftest)


@functools.lru_cache(maxsize=None)
def launchers():
    import atexit

    forker = Launchers()
    atexit.register(forker.close)
    return forker


def built_once(tmp_path_factory, name, build):
    """build(folder)'s value, with `folder` filled once per test run by whichever xdist worker
    asks first; the others wait on a lock, then read the folder and the pickled value.

    A session fixture runs once per test process, and under make test's two processes both
    paid for read-only data that one of them could build. The folder is read-only for the
    tests (copy or hard-link before changing anything)."""
    import fcntl
    import os
    import pickle
    import shutil

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # pytest-N/, this run's: each worker has pytest-N/popen-gwK/
    folder, done = root / f"once-{name}", root / f"once-{name}.pickle"
    with open(root / f"once-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            value = build(folder)
            with open(f"{done}.tmp", "wb") as f:
                pickle.dump(value, f)
            os.replace(f"{done}.tmp", done)
    with open(done, "rb") as f:
        return pickle.load(f)


SHAPES = {"mnist": (1, 28, 28), "cifar10": (3, 32, 32)}


def shared_shards(tmp_path_factory, key, sets, maxcount):
    """Shard sets [(name, split, samples, encoding)] in one folder, built once per test run
    (built_once): read-only data that several test files, and both test processes, read."""
    def build(out):
        for name, split, n, encoding in sets:
            build_shards(out, name, split, n, shape=SHAPES[name], encoding=encoding, maxcount=maxcount)
        return out
    return built_once(tmp_path_factory, key, build)


def mid_epoch_args(data, out, *extra):
    """The trainer's arguments in the stop-and-resume tests: 2 epochs of 40 steps a rank at 2 ranks."""
    return ["--train", f"mnist={data}/", "--train", f"cifar10={data}/", "--eval", f"mnist={data}/", "--epochs", "2",
            "--epoch-samples", "640", "--batch-size", "8", "--workers", "2", "--width", "4", "--log-every", "4",
            "--shuffle-buffer", "30", "--record-keys", "--out", str(out), *extra]


def steps_logged(out):
    """The steps of the training lines in OUT/metrics.jsonl so far ([] before the first)."""
    import json
    import os

    try:
        return [json.loads(ln)["step"] for ln in open(os.path.join(out, "metrics.jsonl")) if '"train"' in ln]
    except (OSError, ValueError):
        return []


def put_back(out, copy):
    """OUT as it was when COPY was made: a test resumes a shared stopped run in its own folder."""
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(copy, out)


def next_line(proc, pending, timeout, what):
    """(the next line `proc` writes, without its newline, or None if none came within `timeout` s;
    what is left of the bytes read). Read unbuffered from its stdout: select sees only the pipe,
    not a buffer. `what` it forks, for the message if it died."""
    import os
    import select

    fd = proc.stdout.fileno()
    while b"\n" not in pending:
        if not select.select([fd], [], [], timeout)[0]:
            return None, pending
        chunk = os.read(fd, 4096)
        assert chunk, f"the process that forks the {what} died"
        pending += chunk
    line, pending = pending.split(b"\n", 1)
    return line.decode(), pending


def read_text(path):
    """A child's captured output, undecodable bytes replaced."""
    with open(path, errors="replace") as f:
        return f.read()


def finish(proc, timeout=HANG):
    """(exit code, stderr) of a launched job; kills its whole session and fails the test on a hang."""
    p = completed(proc, timeout)
    return p.returncode, p.stderr


def run_capture(cmd, timeout=HANG, capture_output=True, text=True, **kw):
    """subprocess.run(cmd, capture_output=True, text=True) in a session of its own, through
    completed(): a hang shows every process's stacks and fails the test; a test that fails
    while it waits (pytest's own timeout, ^C) takes the whole session down with it, where
    subprocess.run killed the child alone and left its children running, holding the pipes."""
    import subprocess

    kw.setdefault("stdout", subprocess.PIPE)
    kw.setdefault("stderr", subprocess.PIPE)
    return completed(subprocess.Popen(cmd, text=text, start_new_session=True, **kw), timeout)


def completed(proc, timeout=HANG):
    """The CompletedProcess of a launched job (a session of its own); on a hang, every process's
    stacks, then a failed test; on any other way out of the wait, the session killed."""
    import os
    import signal
    import subprocess

    import pytest

    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException as e:
        if not isinstance(e, subprocess.TimeoutExpired):
            kill_tree(proc)
            raise
        import time
        # faulthandler (PYTHONFAULTHANDLER=1) prints each process's stacks on SIGABRT; torchrun puts
        # every rank in a process group of its own, so the ranks and their DataLoader workers are
        # signalled one by one, the launcher's group last
        for pid in descendants(proc.pid)[::-1]:
            _signal(os.kill, pid, signal.SIGABRT)
        time.sleep(2)
        _signal(os.killpg, proc.pid, signal.SIGABRT)  # the launcher may have ended with its ranks
        time.sleep(3)
        _signal(os.killpg, proc.pid, signal.SIGKILL)
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # a process outside the session still holds the pipes
            err = ""
        pytest.fail(f"still running after {timeout} s: a hang; the processes' stacks:\n{(err or '')[-12000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def kill_tree(proc):
    """SIGKILL to a process a test started (a session of its own), its descendants (torchrun's
    ranks lead groups of their own) and its group, then reap it: for a test that fails while
    its process runs."""
    import os
    import signal

    for pid in [*descendants(proc.pid)[::-1], proc.pid]:
        _signal(os.kill, pid, signal.SIGKILL)
    _signal(os.killpg, proc.pid, signal.SIGKILL)
    proc.wait()


def _signal(send, pid, sig):
    """send(pid, sig) (os.kill or os.killpg), where the process may have ended already."""
    try:
        send(pid, sig)
    except ProcessLookupError:
        pass


def parents():
    """{pid: parent pid} of every process, from field 4 of each /proc/N/stat (after the
    parenthesised name, which may hold spaces)."""
    import os

    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    out[int(name)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    return out


def children(pid):
    """Direct child pids of a process."""
    return [c for c, parent in parents().items() if parent == pid]


def descendants(pid):
    """Every live descendant of pid, parents before children."""
    tree, out, todo = parents(), [], [pid]
    while todo:
        p = todo.pop(0)
        kids = [c for c, parent in tree.items() if parent == p]
        out += kids
        todo += kids
    return out


def alive(pid):
    """Whether pid runs (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def no_aws_credentials(monkeypatch, tmp_path):
    """An environment where botocore's credential chain finds nothing (no variables, files or
    instance metadata)."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                 "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Quiet:
    """A request handler mixin that keeps the test output free of access logs."""

    def log_message(self, *args):
        pass


class _QuietHandler(Quiet, http.server.SimpleHTTPRequestHandler):
    pass


@contextlib.contextmanager
def serving(handler, **attrs):
    """Run an http.server `handler` on 127.0.0.1 in a thread; yields the server, with its
    base URL (ending in '/') as `.url` and `attrs` set on it for the handler to read.
    `.stopping` turns True before the shutdown, so that a handler that stalls on purpose ends."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads, server.stopping = True, False
    for name, value in attrs.items():
        setattr(server, name, value)
    server.url = f"http://127.0.0.1:{server.server_address[1]}/"
    # shutdown() waits for serve_forever to poll: 0.5 s a server by default, 0.02 here
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.stopping = True
        server.shutdown()
        server.server_close()
        thread.join(5)


@contextlib.contextmanager
def serve(folder):
    """Serve `folder` over HTTP on 127.0.0.1 in a thread; yields the base URL (with '/')."""
    with serving(functools.partial(_QuietHandler, directory=str(folder))) as server:
        yield server.url


def drip(handler, byte, seconds, first=b""):
    """Write `first`, then `byte` every 0.2 s for at most `seconds`, until the server stops
    or the client hangs up: a server slower than any deadline, never silent long enough
    for a socket timeout."""
    t0 = time.time()
    try:
        handler.wfile.write(first)
        while time.time() - t0 < seconds and not handler.server.stopping:
            handler.wfile.write(byte)
            handler.wfile.flush()
            time.sleep(0.2)
    except OSError:
        pass


# ---------------------------------------------------------------- other writers' WebDatasets


def foreign_image(label, size, seed, mode="RGB", colour=7):
    """A learnable synthetic image: class `label` sets which quadrant is bright, noise on top;
    `colour` (a mask of R=1, G=2, B=4) which channels brighten, so that data sets with their
    own colour can be told apart by one model's shared head."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    h, w = size
    a = rng.integers(0, 90, (h, w, 3), dtype=np.uint8)
    qy, qx = divmod(label % 4, 2)
    channels = [c for c in range(3) if colour >> c & 1]
    a[qy * h // 2:(qy + 1) * h // 2, qx * w // 2:(qx + 1) * w // 2, channels] += 150
    img = Image.fromarray(a)
    return img.convert(mode) if mode != "RGB" else img


def encode_pil(img, fmt, **kw):
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def write_shardwriter(folder, n, *, classes=4, per_shard=20, seed=0):
    """`wds.ShardWriter` shards (a PAX header per member): JPEGs of mixed sizes and modes,
    keys with directories in them (`train/c2/000123`), labels in .cls. Returns the keys."""
    import os

    import webdataset as wds

    os.makedirs(folder, exist_ok=True)
    keys = []
    with wds.ShardWriter(os.path.join(str(folder), "wds-%06d.tar"), maxcount=per_shard, verbose=0) as sink:
        for i in range(n):
            label = i % classes
            size = [(32, 32), (40, 56), (64, 48)][i % 3]
            img = foreign_image(label, size, seed * 100003 + i, "L" if i % 7 == 0 else "RGB")
            key = f"train/c{label}/{i:06d}"
            sink.write({"__key__": key, "jpg": encode_pil(img, "JPEG", quality=90), "cls": str(label).encode()})
            keys.append(key)
    return keys


def write_foreign(folder, n, per_shard, name, sample, write=write_tar):
    """n samples, per_shard a shard, as FOLDER/name.format(shard number), each written by
    write(path, [(member name, bytes)]); sample(i) gives (key, its members). Returns the keys."""
    import os

    os.makedirs(folder, exist_ok=True)
    keys = []
    for start in range(0, n, per_shard):
        members = []
        for i in range(start, min(n, start + per_shard)):
            key, more = sample(i)
            keys.append(key)
            members += more
        write(os.path.join(str(folder), name.format(start // per_shard)), members)
    return keys


def gnu_tar(path, members):
    """GNU `tar` of [(relative name, bytes)], written as files first (folders made as needed)."""
    import os
    import shutil
    import subprocess
    import tempfile

    src = tempfile.mkdtemp(dir=os.path.dirname(str(path)))
    try:
        for rel, data in members:
            os.makedirs(os.path.dirname(os.path.join(src, rel)), exist_ok=True)
            with open(os.path.join(src, rel), "wb") as f:
                f.write(data)
        subprocess.run(["tar", "--format=gnu", "-cf", str(path), "-C", src, *(rel for rel, _ in members)], check=True)
    finally:
        shutil.rmtree(src)


def write_gnu_tar(folder, n, *, classes=4, per_shard=25, seed=1):
    """GNU `tar` over a folder of name.png + name.cls (long names included). Returns the keys."""
    def sample(i):
        label = i % classes
        name = f"sample_{i:05d}" + ("_with_a_rather_long_file_name" * 3 if i % 5 == 0 else "")
        return name, [(name + ".png", encode_pil(foreign_image(label, (32, 32), seed * 100003 + i, colour=6), "PNG")),
                      (name + ".cls", f"{label}\n".encode())]
    return write_foreign(folder, n, per_shard, "gnu-{:04d}.tar", sample, gnu_tar)


def write_img2dataset(folder, n, *, classes=4, per_shard=20, seed=2, gz=False):
    """img2dataset's layout: 000012345.jpg, .json (label in a field), .txt caption; plain
    USTAR written by tarfile, optionally gzip-compressed. Returns the keys."""
    import json

    def sample(i):
        label = i % classes
        key = f"{i // per_shard:05d}{i:04d}"
        return key, [(f"{key}.jpg", encode_pil(foreign_image(label, (48, 48), seed * 100003 + i), "JPEG", quality=90)),
                     (f"{key}.json", json.dumps({"key": key, "label": label, "width": 48}).encode()),
                     (f"{key}.txt", f"a picture of class {label}".encode())]
    return write_foreign(folder, n, per_shard, "{:05d}.tar" + (".gz" if gz else ""), sample,
                         functools.partial(write_tar, gz=gz))


NAMES = ("airplane", "cat", "dog", "ship")  # class i's name: the sorted order is the label order
SYNSETS = ("n01440764", "n01443537", "n01484850", "n01491361")
FOLDERS = ("001.ak47", "002.american-flag", "003.backpack", "257.clutter")  # caltech-style, dots included


def write_named_shardwriter(folder, n, *, nested=False, per_shard=20, seed=3, prefix=""):
    """`wds.ShardWriter` with class names in .json ({"label": "cat"}, or {"meta": {"label": "cat"}}
    when nested), JPEGs, and at the start of every shard a `__meta__.json` sample and a
    `__meta__/info.json` member, as some writers add. Returns the keys."""
    import json
    import os

    import webdataset as wds

    os.makedirs(folder, exist_ok=True)
    keys = []
    with wds.ShardWriter(os.path.join(str(folder), "named-%06d.tar"), maxcount=per_shard + 2, verbose=0) as sink:
        for i in range(n):
            if i % per_shard == 0:
                sink.write({"__key__": "__meta__", "json": json.dumps({"classes": list(NAMES)}).encode()})
                sink.write({"__key__": "__meta__/info", "json": b'{"writer": "a test"}'})
            label = i % 4
            field = {"meta": {"label": NAMES[label]}} if nested else {"label": NAMES[label], "id": i}
            key = f"{prefix}{i:06d}"
            img = foreign_image(label, (32, 32), seed * 100003 + i, colour=2 if nested else 1)
            sink.write({"__key__": key, "jpg": encode_pil(img, "JPEG", quality=90), "json": json.dumps(field).encode()})
            keys.append(key)
    with open(os.path.join(str(folder), "named-000000.tar"), "rb") as f:
        head = f.read(8192)
        assert b"__meta__.json" in head and b"__meta__/info.json" in head
    return keys


def write_synset_tar(folder, n, *, per_shard=20, seed=4, end_blocks=True):
    """PNG + .cls holding ImageNet synset ids (`n01440764`), plain USTAR; without end_blocks the
    tars stop after their last member, as a writer that never closed them leaves them. Returns the keys."""
    import os

    def sample(i):
        label = i % 4
        key = f"{SYNSETS[label]}_{i:05d}"
        return key, [(f"{key}.png", encode_pil(foreign_image(label, (32, 32), seed * 100003 + i, colour=4), "PNG")),
                     (f"{key}.cls", SYNSETS[label].encode())]

    def write(path, members):
        write_tar(path, members)
        if not end_blocks:
            with tarfile.open(path) as tar:
                last = tar.getmembers()[-1]
            os.truncate(path, last.offset_data + (last.size + 511) // 512 * 512)
    return write_foreign(folder, n, per_shard, "syn-{:04d}.tar", sample, write)


def write_imagefolder_tar(folder, n, *, split="train", per_shard=20, seed=5):
    """GNU `tar` over an ImageFolder tree `SPLIT/257.clutter/257_0002.jpg`: the label is the key's
    last folder. Returns the keys."""
    def sample(i):
        label = i % 4
        rel = f"{split}/{FOLDERS[label]}/{FOLDERS[label][:3]}_{i:04d}.jpg"
        return rel[:-4], [(rel, encode_pil(foreign_image(label, (36, 36), seed * 100003 + i, colour=3), "JPEG",
                                           quality=90))]
    return write_foreign(folder, n, per_shard, "tree-{:04d}.tar", sample, gnu_tar)


def write_multi_member(folder, n, *, per_shard=20, seed=6):
    """Samples of `rgb.png` + `depth.npy` + `.json` (the class name in "label"): two image members,
    one chosen with --image-key rgb.png. Returns the keys."""
    import json

    import numpy as np

    def sample(i):
        label = i % 4
        key = f"scene/{i:06d}"
        depth = io.BytesIO()
        np.save(depth, np.zeros((32, 32), np.uint8))  # grey and blank: a run that learns read rgb.png
        rgb = foreign_image(label, (32, 32), seed * 100003 + i, colour=5)
        return key, [(f"{key}.rgb.png", encode_pil(rgb, "PNG")), (f"{key}.depth.npy", depth.getvalue()),
                     (f"{key}.json", json.dumps({"label": NAMES[label]}).encode())]
    return write_foreign(folder, n, per_shard, "multi-{:04d}.tar", sample)


def train_in_process(args):
    """`python -m pipeline.train ARGS` run inside this test process, as a CompletedProcess.

    A subprocess pays seconds to import torch again for every command line; a single
    process runs without a process group (see dist.distributed), so calling main()
    here checks the same code. tests/test_train.py keeps one subprocess test that
    proves `python -m pipeline.train` is wired to main(). An unexpected exception
    propagates and fails the test, as a traceback would.

    One torch thread, as OMP_NUM_THREADS=1 gives the subprocess runs: the models are tiny,
    and two threads spinning for two cores that other processes share took a 3-epoch run
    from 14 s to 42 s.
    """
    import torch

    from pipeline.train import loop

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return main_in_process(loop.main, "pipeline.train", args)
    finally:
        torch.set_num_threads(threads)


def main_in_process(main, name, args):
    """main(ARGS) with stdout and stderr captured, as the CompletedProcess of command `name`:
    a SystemExit (argparse, a check) gives its code, as the shell would see it."""
    import contextlib
    import subprocess

    args = [str(a) for a in args]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(args)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return subprocess.CompletedProcess([name, *args], code or 0, out.getvalue(), err.getvalue())


@functools.lru_cache(maxsize=None)
def tool_module(name):
    """tools/NAME.py imported once per test run (the tools are scripts, not a package)."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"{name}_in_process", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def make_shards_in_process(args):
    """`tools/make_shards.py ARGS` run inside this test process, as a CompletedProcess: the same
    main() without a fresh interpreter importing torchvision. tests/test_make_shards.py keeps
    the subprocess tests that prove the script's wiring."""
    return main_in_process(tool_module("make_shards").main, "make_shards.py", args)


FORKER = CHILD.replace("{", "{{").replace("}", "}}") + """
import json
{preamble}
for _request in sys.stdin:
    _code, _args, _out, _err = json.loads(_request)
    _pid = os.fork()
    if _pid == 0:
        os.setpgid(0, 0)
        for _fd, _path in ((1, _out), (2, _err)):
            os.dup2(os.open(_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), _fd)
        sys.argv = ["-c", *_args]
        _run_and_exit(lambda: exec(compile(_code, "<forked>", "exec"), globals()))
    print(_pid, flush=True)
    print(os.waitstatus_to_exitcode(os.waitpid(_pid, 0)[1]), flush=True)
"""


class Forker:
    """`python -c PREAMBLE+CODE ARGS` for many CODEs, paying for PREAMBLE's imports once.

    A fresh Python per command paid seconds to import torch again; here one Python runs
    the preamble, then forks a child per call that runs CODE alone (its own process group,
    its own limits if CODE sets them, stdout and stderr to files), so a child that dies or
    hangs takes nothing else with it. Answers as subprocess.run(capture_output=True) would.
    """

    def __init__(self, preamble, folder, env=None, cwd=None):
        self.preamble, self.folder, self.env, self.cwd = preamble, str(folder), env, cwd
        self.proc, self.calls, self.pending = None, 0, b""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(30)

    def run(self, code, *args, timeout=HANG):
        """CompletedProcess of CODE with sys.argv[1:] = ARGS; TimeoutExpired (the child killed) after `timeout` s."""
        import json
        import os
        import signal
        import subprocess
        import sys

        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen([sys.executable, "-c", FORKER.format(preamble=self.preamble)],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=self.env,
                                         cwd=self.cwd)
            self.pending = b""
        self.calls += 1
        out, err = (os.path.join(self.folder, f"forked-{self.calls}.{s}") for s in ("out", "err"))
        args = [str(a) for a in args]
        self.proc.stdin.write(json.dumps([code, args, out, err]) + "\n")
        self.proc.stdin.flush()
        pid = None
        try:
            pid = self._line(timeout)
            status = self._line(timeout, pid)
        except BaseException:  # a hang (the child and the forker already killed), or the test stopped waiting
            if pid:
                _signal(os.killpg, pid, signal.SIGKILL)
            self.proc.kill()
            self.proc.wait()
            raise
        return subprocess.CompletedProcess(["forked", *args], status, read_text(out), read_text(err))

    def _line(self, timeout, child=None):
        """The forking process's next line as an int; on a timeout the child and the forker are killed."""
        import os
        import signal
        import subprocess

        line, self.pending = next_line(self.proc, self.pending, timeout, "runs")
        if line is None:
            if child:
                os.killpg(child, signal.SIGKILL)
            self.proc.kill()
            self.proc.wait()
            raise subprocess.TimeoutExpired("forked", timeout)
        return int(line)


def figure_texts(fig):
    """Every string drawn on a figure (titles, labels, legends, notes), to check what a picture says."""
    from matplotlib.text import Text

    return [t.get_text() for t in fig.findobj(Text) if t.get_text()]


CORPUS_FIELDS = "image:image=png,fit=native,size=4x4,channels=1 caption:text=txt label:int=cls"


def fields_corpus(out, sizes):
    """Sources of (name, samples, per shard) whose keys are make_shards' and whose captions are
    their keys, read through a schema with a caption and a random resized crop + flip stage
    (tests/test_coverage.py and tests/test_lifecycle.py read them)."""
    import dataclasses

    import numpy as np
    from PIL import Image

    from pipeline.data.fields import augment, schema
    from pipeline.data.manifests.manifest import resolve
    from pipeline.writers import index

    fields = schema.parse_fields(CORPUS_FIELDS)
    for name, n, per in sizes:
        def sample(i, name=name):
            key = f"{name}-train-{i:07d}"
            png = encode_pil(Image.fromarray(np.full((3, 4), i % 251, np.uint8)), "PNG")
            return key, [(key + ".png", png), (key + ".txt", key.encode()), (key + ".cls", str(i % 10).encode())]
        write_foreign(out / name, n, per, name + "-{:04d}.tar", sample)
        index.index(name, "train", str(out / name), str(out), fields=fields, progress=False)
    stages = [augment.RandomResizedCrop("image", 2), augment.Flip("image")]
    return [dataclasses.replace(resolve(name, str(out), "train"), schema=schema.Schema(fields.columns, stages))
            for name, _, _ in sizes]


# ---------------------------------------------------------------- images and sets several test modules share


def encoded(a, fmt, **kw):
    """uint8 CHW -> bytes in a PIL format."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(a[0] if a.shape[0] == 1 else a.transpose(1, 2, 0)).save(buf, format=fmt, **kw)
    return buf.getvalue()


def smooth(c, h, w, seed=0):
    """uint8 CHW gradients (lossy formats keep them), shifted by `seed`."""
    import numpy as np

    yy, xx = np.mgrid[:h, :w]
    return np.stack([(xx * 200 // w + yy * 40 // h + 30 * k + seed) % 256 for k in range(c)]).astype(np.uint8)


def exif_rotated(a, orientation):
    from PIL import Image

    exif = Image.Exif()
    exif[0x0112] = orientation
    return encoded(a, "JPEG", quality=95, exif=exif.tobytes())


def jpeg_cases(shape):
    """JPEGs of every kind decode_batch meets: the target's size in its own mode and the other,
    stored sideways, larger (DCT-scaled with simplejpeg), CMYK, a cut scan, not a JPEG, too elongated."""
    from PIL import Image

    c, h, w = shape
    cmyk = io.BytesIO()
    Image.fromarray(smooth(3, h, w, 5).transpose(1, 2, 0)).convert("CMYK").save(cmyk, format="JPEG", quality=95)
    good = encoded(smooth(c, h, w, 1), "JPEG", quality=95)
    sos = good.find(b"\xff\xda")
    return [encoded(smooth(c, h, w, 2), "JPEG", quality=95), encoded(smooth(4 - c, h, w, 3), "JPEG", quality=95),
            exif_rotated(smooth(c, w, h, 4), 6), encoded(smooth(c, 3 * h + 4, 3 * w + 5, 6), "JPEG", quality=95),
            cmyk.getvalue(), good[:sos + 4 + int.from_bytes(good[sos + 2:sos + 4], "big") + 10],
            b"\xff\xd8 not a jpeg", encoded(smooth(c, 4, 400), "JPEG"), good]


def write_captioned(folder, n, *, per_shard=20, cls=lambda i: str(i % 4), side=16, start=0):
    """img2dataset's shape written by wds.ShardWriter: .jpg, .txt caption, .json of numbers (and
    its own key), .cls from `cls(i)`. Returns the shard paths."""
    import json
    import os

    import webdataset as wds

    os.makedirs(folder, exist_ok=True)
    with wds.ShardWriter(os.path.join(str(folder), "wds-%06d.tar"), maxcount=per_shard, verbose=0,
                         start_shard=start) as sink:
        for i in range(n):
            sink.write({"__key__": f"{i:06d}", "jpg": encode_pil(foreign_image(i % 4, (side, side), i), "JPEG"),
                        "txt": f"a small photo, number {i}, of class {i % 4}".encode(), "cls": cls(i).encode(),
                        "json": json.dumps({"key": f"{i:06d}", "width": side, "height": side,
                                            "similarity": 0.25 + i / 1000}).encode()})
    return sorted(os.path.join(str(folder), f) for f in os.listdir(folder) if f.endswith(".tar"))


def png_set_then_damage(folder):
    """40 png samples of 2 classes indexed in `folder` as web-train.json, then every fourth one's
    image taken out of the shard (the index still counts it): (manifest path, damaged indices)."""
    def shard(damaged):
        write_tar(folder / "web-000000.tar", [m for i in range(40) for m in (
            [] if damaged and i % 4 == 0 else [(f"s{i:02d}.png", encode_pil(foreign_image(i % 2, (16, 16), i), "PNG"))])
            + [(f"s{i:02d}.cls", str(i % 2).encode())]])

    shard(False)
    done = make_shards_in_process(["--quiet", "--index", f"web:train={folder}/web-000000.tar", "--out", folder])
    assert done.returncode == 0, done.stderr
    shard(True)
    return f"{folder}/web-train.json", set(range(0, 40, 4))


def jpegs_beside_mnist(top):
    """A wds.ShardWriter set of JPEGs of three sizes (one of them the index's 40x56), some grey, and
    beside it the raw grey MNIST-shaped source of build_shards (padded and repeated onto the 40x56
    canvas): their resolved sources."""
    from pipeline.data.streams.stream import resolve

    write_shardwriter(top / "web" / "train", 72, per_shard=12)
    p = make_shards_in_process(["--quiet", "--index", f"web:train={top}/web/train", "--out", str(top / "m")])
    assert p.returncode == 0, p.stderr
    build_shards(top / "m", "mnist", "train", 60, maxcount=12)
    return [resolve("web", str(top / "m"), "train"), resolve("mnist", str(top / "m"), "train")]


def write_many_sizes(folder, sizes, n=40):
    """A WebDataset of one shard in `folder` (a Path, made here): n PNGs of `sizes` sizes (8x9 up), a .cls beside each
    (what the size warnings of make-shards --index and the first use are tested on)."""
    import numpy as np
    from PIL import Image

    members = []
    for i in range(n):
        side = 8 + i % sizes
        image = Image.fromarray(np.full((side, side + 1, 3), i, np.uint8))
        members += [(f"s{i:03d}.png", encode_pil(image, "PNG")), (f"s{i:03d}.cls", b"%d" % (i % 2))]
    folder.mkdir()
    write_tar(folder / "train-000000.tar", members)
