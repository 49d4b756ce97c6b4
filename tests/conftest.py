"""Fixtures shared by the test modules (plain functions live in helpers.py): read shards with
Python's tarfile (independent of pipeline.shards' own reader) and decode a sample the way a
consumer would, the shard sets several modules read, and the runs several modules compare."""
import io
import os
import tarfile

# One torch thread in every test process and every process a test starts: the tensors are tiny,
# and make test runs two test processes on two cores, where more threads only contend.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import pytest


def tar_samples(path):
    """[(key, {ext: bytes})] in file order, grouped at the first dot of each member name."""
    out = []
    with tarfile.open(path) as tar:
        for m in tar.getmembers():
            key, _, ext = m.name.partition(".")
            if not out or out[-1][0] != key:
                out.append((key, {}))
            assert ext not in out[-1][1], f"{path}: member {m.name} repeated"
            out[-1][1][ext] = tar.extractfile(m).read()
    return out


def decode(data, encoding, shape):
    """Image bytes -> uint8 CHW array: PIL for png, frombuffer + manifest shape for raw."""
    if encoding == "raw":
        return np.frombuffer(data, dtype=np.uint8).reshape(shape)
    from PIL import Image

    a = np.asarray(Image.open(io.BytesIO(data)))
    return a[None] if a.ndim == 2 else a.transpose(2, 0, 1)


@pytest.fixture
def without_simplejpeg(monkeypatch):
    """simplejpeg not installed (`import simplejpeg` fails): JPEGs go torchvision's and PIL's way."""
    import sys

    from pipeline.data.decoding import turbo

    monkeypatch.setitem(sys.modules, "simplejpeg", None)
    turbo._module.cache_clear()
    yield
    monkeypatch.undo()
    turbo._module.cache_clear()


@pytest.fixture
def read_tar():
    return tar_samples


@pytest.fixture
def decode_image():
    return decode


@pytest.fixture(scope="session")
def mixed_shards(tmp_path_factory):
    """mnist train 200 + cifar10 train 200 + mnist test 40, raw, 20 per shard: built once per
    test run (helpers.shared_shards) and shared by the files that only read it (test_security,
    test_readback).
    Tests that change shards copy or hard-link them into their own tmp_path first."""
    from helpers import shared_shards

    return shared_shards(tmp_path_factory, "mixed-shards", [("mnist", "train", 200, "raw"),
                                                           ("cifar10", "train", 200, "raw"),
                                                           ("mnist", "test", 40, "raw")], maxcount=20)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The stream tests' shards (helpers.STREAM_SPECS), built once a module, as a namespace:
    .dir, .synth[name, split] (each key's true image and label), .manifests[name, split].
    test_stream, test_loader and test_manifest read them; modules with data of their own
    (test_train, test_security, ...) define a `data` fixture of their own, which overrides this one."""
    from types import SimpleNamespace

    from helpers import STREAM_SPECS, build_shards

    folder = tmp_path_factory.mktemp("shards")
    synth, manifests = {}, {}
    for (name, split), (n, shape, enc, maxcount) in STREAM_SPECS.items():
        manifests[name, split], synth[name, split] = build_shards(folder, name, split, n, shape=shape,
                                                                  encoding=enc, maxcount=maxcount)
    return SimpleNamespace(dir=str(folder), synth=synth, manifests=manifests)


@pytest.fixture(scope="module")
def even(tmp_path_factory):
    """Shards that divide evenly over 4 slots: mnist 16 x 10, cifar10 8 x 10 (test_stream, test_loader)."""
    from helpers import build_shards

    folder = tmp_path_factory.mktemp("even")
    build_shards(folder, "mnist", "train", 160, maxcount=10)
    build_shards(folder, "cifar10", "train", 80, shape=(3, 32, 32), maxcount=10)
    return str(folder)


@pytest.fixture(scope="session", autouse=True)
def launch_folder(tmp_path_factory):
    """The forked launchers' output goes under this test run's temporary folder (helpers.Launchers),
    and so does every temporary file of the processes the tests start (TMPDIR, which they inherit):
    a child killed before its own clean-up (a hang's SIGKILL) leaves its files where pytest removes
    them with old runs, not in /tmp."""
    import helpers

    helpers.LAUNCH_FOLDER = str(tmp_path_factory.getbasetemp())
    tmp = tmp_path_factory.getbasetemp() / "tmp"
    tmp.mkdir(exist_ok=True)
    os.environ["TMPDIR"] = str(tmp)


@pytest.fixture(scope="session")
def mid_epoch_shards(tmp_path_factory):
    """mnist 400 raw + cifar10 400 png, 20 per shard, and 60 mnist test: the data of the
    stop-and-resume tests (test_resume, test_preempt), which compare with one uninterrupted run."""
    from helpers import shared_shards

    return shared_shards(tmp_path_factory, "mid-epoch-shards", [("mnist", "train", 400, "raw"),
                                                               ("cifar10", "train", 400, "png"),
                                                               ("mnist", "test", 60, "raw")], maxcount=20)


@pytest.fixture(scope="session")
def one_source(tmp_path_factory):
    """One source of 1,200 mnist samples in 100-sample shards: the resume-on-another-world and
    resume-on-another-batch-size runs (test_resume, test_resume_batch)."""
    from helpers import shared_shards

    return shared_shards(tmp_path_factory, "one-source", [("mnist", "train", 1200, "raw")], maxcount=100)


@pytest.fixture(scope="session")
def uninterrupted_run(mid_epoch_shards, tmp_path_factory):
    """The run that SIGKILL (test_resume) and SIGTERM (test_preempt) interrupt, from start to
    end: one torchrun job for both, whose tests share the xdist group "mid-epoch-runs".
    --checkpoint-every writes checkpoints and nothing that the comparisons read."""
    from helpers import finish, launch_train, mid_epoch_args

    out = tmp_path_factory.mktemp("whole") / "run"
    code, err = finish(launch_train(mid_epoch_args(mid_epoch_shards, out, "--checkpoint-every", "3"), 2))
    assert code == 0, err[-3000:]
    return out


@pytest.fixture(scope="session")
def sigterm_stopped(mid_epoch_shards, tmp_path_factory):
    """A 2-rank run without --checkpoint-every, stopped by SIGTERM to its launcher once epoch 1
    has logged a step: (its folder, a copy of it as the stop left it, what the launcher printed).
    test_preempt resumes it on 2 ranks, test_resume on 3 and on 1, each after putting the copy
    back; their tests share the xdist group "mid-epoch-runs". The launcher is a fresh Python:
    the resume command the trainer prints is read from the launcher's command line."""
    import shutil
    import signal
    import time

    from helpers import HANG, completed, launch_train, mid_epoch_args, steps_logged

    top = tmp_path_factory.mktemp("sigterm")
    out = top / "run"
    proc = launch_train(mid_epoch_args(mid_epoch_shards, out), 2, fresh=True)
    t0 = time.time()
    while not steps_logged(out):
        if proc.poll() is not None or time.time() - t0 > HANG:  # a hang guard, not a speed test
            p = completed(proc, 1)  # a hang: the processes' stacks and a failure; else what the launcher said
            pytest.fail(f"no training step logged; the launcher ended with {p.returncode}: {p.stderr[-3000:]}")
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # to the launcher only, which forwards it to both ranks
    p = completed(proc)
    stdout, stderr = p.stdout, p.stderr
    shutil.copytree(out, top / "as-stopped")
    return out, top / "as-stopped", stdout + stderr


# The fixtures that run a torchrun job or the benchmark for several tests (test_train's ddp_run,
# uninterrupted_run, sigterm_stopped, test_bench's record) are session-scoped though each serves one
# file: an xdist worker may run another file's test between two of them, which would tear a
# module fixture down and run its job again.

# The longest jobs (a minute or so each on 2 cores), started first so that make test's two test
# processes finish together instead of one running the longest job alone at the end.
# None of them shares a module fixture with tests left behind, so no fixture is built twice.
LONGEST_FIRST = ("test_the_defaults_learn_at_small_and_large_global_batches", "test_throughput_entries",
                 "test_memory_entries", "test_profile_ceiling_and_decoders", "test_record_names_the_peers_run_or_skipped",
                 "test_rehearsal_reports_startup_speed_memory_and_cache")


@pytest.hookimpl(tryfirst=True)  # before -m "not slow" deselects
def pytest_collection_modifyitems(items):
    for item in items:  # DataLoader workers are processes: such cases run in make test, their 0-worker twin in both
        workers = getattr(item, "callspec", None) and item.callspec.params.get("workers")
        if isinstance(workers, int) and workers > 0:
            item.add_marker(pytest.mark.slow)

    def rank(item):
        name = getattr(item, "originalname", item.name)
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)
    items.sort(key=rank)  # a stable sort: the rest keep the collection order


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-compatible server (moto's server mode) on 127.0.0.1 for the whole test run,
    reached the way users reach MinIO or R2: AWS_ENDPOINT_URL and a key pair in the
    environment (inherited by the processes the tests start). Yields its endpoint; tests
    make their own buckets (`s3_bucket`)."""
    import logging

    from moto.server import ThreadedMotoServer

    from helpers import free_port

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "testing-key-id",
           "AWS_SECRET_ACCESS_KEY": S3_SECRET, "AWS_DEFAULT_REGION": "us-east-1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield env["AWS_ENDPOINT_URL"]
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


S3_SECRET = "s3cret-never-printed-0123456789"  # tests grep every output for it


def as_aws_endpoint(monkeypatch, url):
    """A fake S3 server at `url` made the AWS endpoint, with the tests' key pair and region."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", url.rstrip("/"))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing-key-id")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", S3_SECRET)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")


@pytest.fixture
def s3_bucket(s3_server, request):
    """A new, empty bucket on the test server: its name."""
    import re

    import boto3

    name = "t-" + re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:50].strip("-") + f"-{os.getpid()}"
    boto3.client("s3").create_bucket(Bucket=name)
    return name
