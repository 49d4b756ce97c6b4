"""Helpers shared by the shard tests: read shards with Python's tarfile (independent of
pipeline.shards' own reader) and decode a sample the way a consumer would."""
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
def read_tar():
    return tar_samples


@pytest.fixture
def decode_image():
    return decode


@pytest.fixture(scope="session")
def mixed_shards(tmp_path_factory):
    """mnist train 200 + cifar10 train 200 + mnist test 40, raw, 20 per shard: built once per
    test run and shared by the files that only read it (test_security, test_readback).
    Tests that change shards copy or hard-link them into their own tmp_path first."""
    from helpers import build_shards

    out = tmp_path_factory.mktemp("mixed-shards")
    build_shards(out, "mnist", "train", 200, shape=(1, 28, 28), encoding="raw", maxcount=20)
    build_shards(out, "cifar10", "train", 200, shape=(3, 32, 32), encoding="raw", maxcount=20)
    build_shards(out, "mnist", "test", 40, shape=(1, 28, 28), encoding="raw", maxcount=20)
    return out


# The fixtures that run a torchrun job or the benchmark for several tests (test_train's ddp_run,
# test_resume's whole and stopped, test_bench's record) are session-scoped though each serves one
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
