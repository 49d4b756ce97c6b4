"""Beyond one machine: two torchrun "nodes" over HTTP, endless resampled streams, weight schedules."""
import collections
import json
import os
import subprocess
import sys

import pytest

from helpers import build_shards, completed, free_port, kill_tree, serve, train_in_process
from pipeline import stream
from pipeline.train.dist import Topology
from pipeline.train.metrics import read_keys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("shards")
    build_shards(out, "mnist", "train", 600, shape=(1, 28, 28), encoding="raw", maxcount=25)
    build_shards(out, "cifar10", "train", 300, shape=(3, 32, 32), encoding="raw", maxcount=25)
    build_shards(out, "mnist", "test", 100, shape=(1, 28, 28), encoding="raw", maxcount=25)
    return out


def env():
    return dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")


@pytest.mark.slow
def test_two_nodes_over_http_train_on_disjoint_samples(data, tmp_path):
    out = tmp_path / "run"
    port = free_port()
    with serve(data) as url:
        args = ["--train", f"mnist={url}", "--train", f"cifar10={url}", "--eval", f"mnist={url}",
                "--epochs", "2", "--batch-size", "16", "--workers", "2", "--width", "8", "--record-keys",
                "--out", str(out)]
        nodes = [subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
             "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=test", f"--node-rank={n}",
             "-m", "pipeline.train", *args],
            cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
            for n in (0, 1)]
        try:
            results = [(p.stdout, p.stderr) for p in (completed(p) for p in nodes)]
        finally:
            for p in nodes:
                if p.poll() is None:
                    kill_tree(p)
    assert [p.returncode for p in nodes] == [0, 0], results[0][1][-2000:] + results[1][1][-2000:]
    with open(out / "summary.json") as f:
        s = json.load(f)
    assert s["world_size"] == 2
    assert [e["batches"] for e in s["epochs"]] == [{"rank0": 28, "rank1": 28}] * 2  # 900 // (2 x 16)
    assert s["eval"]["mnist"]["count"] == 100
    keys = [[k for _, k in read_keys(out / f"keys-rank{r}.txt")] for r in (0, 1)]
    per_epoch = 28 * 16
    for e in range(2):  # 896 of 900 samples at equal weights: mnist's 600 once, cifar10's 300 read 1 or 2 times
        a, b = (k[e * per_epoch:(e + 1) * per_epoch] for k in keys)
        counts = collections.Counter(a + b)
        assert max(c for k, c in counts.items() if k.startswith("mnist")) == 1, "a sample read twice in one epoch"
        cifar = [counts.get(f"cifar10-train-{i:07d}", 0) for i in range(300)]
        assert min(cifar) == 1 and max(cifar) == 2, "a sample read twice before every sample of its source once"


def count(stream_, workers):
    batches, shares = 0, {}
    for b in stream.make_loader(stream_, workers):
        batches += 1
        for s in b["source"].tolist():
            shares[s] = shares.get(s, 0) + 1
    return batches, shares


@pytest.mark.parametrize("workers", [0, 2])
def test_resampled_stream_keeps_equal_batches_and_mixture(data, workers):
    sources = [stream.resolve("mnist", str(data), "train"), stream.resolve("cifar10", str(data), "train")]
    results = []
    for rank in (0, 1):
        s = stream.MixedStream(sources, {"mnist": 0.3, "cifar10": 0.7}, 50, Topology(rank, 2), resample=True,
                               epoch_samples=24000, shuffle_buffer=50)
        results.append(count(s, workers))
    assert [r[0] for r in results] == [240, 240]  # fixed epoch length, not a pass over the data
    for batches, shares in results:
        total = batches * 50
        assert abs(shares[0] / total - 0.3) < 0.02 and abs(shares[1] / total - 0.7) < 0.02


@pytest.mark.slow
def test_weight_schedule_moves_the_mixture_and_is_recorded(data, tmp_path):
    out = tmp_path / "run"
    p = train_in_process(["--train", f"mnist={data}", "--train", f"cifar10={data}",
                          "--weights", "mnist=0.9,cifar10=0.1", "--final-weights", "mnist=0.1,cifar10=0.9",
                          "--epochs", "3", "--epoch-samples", "1600",
                          "--batch-size", "32", "--workers", "0", "--width", "8", "--log-every", "1000",
                          "--out", str(out)])  # one process, no loader workers: main() here, as a subprocess would
    assert p.returncode == 0, p.stderr[-2000:]
    lines = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    by_epoch = {ln["epoch"]: ln for ln in lines if ln["kind"] == "train"}
    assert by_epoch[1]["weights"]["mnist"] == pytest.approx(0.9)  # epochs count from 1, as on the console
    assert by_epoch[2]["weights"]["mnist"] == pytest.approx(0.5)
    assert by_epoch[3]["weights"]["mnist"] == pytest.approx(0.1)
    assert by_epoch[1]["share"]["mnist"] > 0.8 and by_epoch[3]["share"]["mnist"] < 0.2
