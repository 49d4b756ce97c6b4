"""The trainer under torchrun reading shards from an S3-compatible server on 127.0.0.1 (moto's
server mode, tests/conftest.py's s3_server), through the client code users run:

- 2 ranks from s3:// read the same keys in the same order and end with the same losses and
  evaluation as from the same shards on local disk;
- the store stopped mid-epoch: retries, then one line naming the URL; the store back, `--resume`
  finishes the epoch exactly as the uninterrupted run did, no key twice;
- no credential is ever printed or written: the AWS secret, a `user:SECRET@` URL's password and
  the HTTP auth header's value are grepped for in every output of the trainer and of make_shards.
"""
import contextlib
import functools
import http.server
import json
import logging
import os
import sys
import time

import pytest

from conftest import S3_SECRET
from helpers import HANG, Quiet, build_shards, completed, free_port, launch_train, run_capture, serving
from pipeline.data.store import writing
from pipeline.train.metrics import read_keys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLES = 480  # 24 shards of 20: the outage test stops the store with most of them still unread
WORLD = 2


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    folder = tmp_path_factory.mktemp("store-shards")
    build_shards(folder, "mnist", "train", SAMPLES, maxcount=20)
    build_shards(folder, "mnist", "test", 40, maxcount=20)
    return folder


def upload(folder, base):
    for name in sorted(os.listdir(folder)):
        writing.put(os.path.join(folder, name), f"{base}/{name}")


@pytest.fixture(scope="module")
def png_shards(tmp_path_factory):
    """Shards of png images, which --index reads (the raw ones above need their manifest)."""
    folder = tmp_path_factory.mktemp("png-shards")
    build_shards(folder, "mnist", "train", 40, encoding="png", maxcount=10)
    for name in os.listdir(folder):
        if name.endswith(".json"):
            os.remove(folder / name)
    return folder


@pytest.fixture(scope="module")
def bucket(s3_server, shards, png_shards):
    """The shards under s3://BUCKET/shards, the png ones under s3://BUCKET/png, on the session's server."""
    import boto3

    name = f"store-training-{os.getpid()}"
    boto3.client("s3").create_bucket(Bucket=name)
    upload(shards, f"s3://{name}/shards")
    upload(png_shards, f"s3://{name}/png")
    return name


def args_for(src, out, *extra):
    return ["--train", f"mnist={src}", "--eval", f"mnist={src}", "--epochs", "1", "--batch-size", "8",
            "--workers", "1", "--width", "4", "--log-every", "4", "--shuffle-buffer", "30", "--record-keys",
            "--checkpoint-every", "3", "--out", str(out), *extra]


def key_logs(out):
    return {r: read_keys(out / f"keys-rank{r}.txt") for r in range(WORLD)}


def losses(out):
    """metrics.jsonl's training and evaluation lines without their timings."""
    lines = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    kept = [ln for ln in lines if any("loss" in k or "acc" in k for k in ln)]
    for ln in kept:
        for k in [k for k in ln if "per_s" in k or k.endswith("_s") or "time" in k]:
            del ln[k]
    return kept


def position(out):
    import torch

    try:
        state = torch.load(out / "checkpoint.pt", weights_only=True)
    except (OSError, RuntimeError, EOFError):
        return None
    return json.loads(state["position"])


def run_ok(args, timeout=HANG):
    p = completed(launch_train(args, WORLD), timeout)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    return p


@pytest.fixture(scope="module")
def s3_run(bucket, tmp_path_factory):
    """One uninterrupted 2-rank run from s3:// (its folder, what it printed): the reference of
    the local comparison and of the outage test, and an output grepped for the secret."""
    out = tmp_path_factory.mktemp("s3-run") / "run"
    p = run_ok(args_for(f"s3://{bucket}/shards/", out))
    return out, p.stdout + p.stderr


@pytest.mark.slow
def test_two_ranks_from_s3_read_and_learn_what_they_read_locally(shards, s3_run, tmp_path):
    s3_out, printed = s3_run
    local = tmp_path / "local"
    run_ok(args_for(f"{shards}/", local))
    assert key_logs(s3_out) == key_logs(local)
    assert all(len(keys) == SAMPLES // WORLD for keys in key_logs(local).values())
    assert losses(s3_out) == losses(local) and any("loss" in k for ln in losses(local) for k in ln)
    s, w = (json.loads((d / "summary.json").read_text()) for d in (s3_out, local))
    assert s["eval"]["mnist"].pop("manifest") == f"{s['config']['train']['mnist']}mnist-test.json"
    w["eval"]["mnist"].pop("manifest")
    assert s["eval"] == w["eval"] and s["epochs_done"] == w["epochs_done"] == 1
    assert s["config"]["train"]["mnist"].startswith("s3://")


class Store:
    """A moto server of this test's own on a fixed port, stopped and started again while the
    session's server stays up. moto keeps buckets in the memory of the process that serves
    them, which is this one for both servers: a stop loses nothing, but `restock` uploads the
    shards again all the same, as a user would after a store lost them."""

    def __init__(self):
        self.port, self.server = free_port(), None

    @property
    def endpoint(self):
        return f"http://127.0.0.1:{self.port}"

    def start(self):
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()

    def stop(self):
        if self.server is not None:
            self.server.stop()
            self.server = None

    def restock(self, bucket, folder):
        import boto3

        client = boto3.client("s3", endpoint_url=self.endpoint)
        with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou, client.exceptions.BucketAlreadyExists):
            client.create_bucket(Bucket=bucket)
        for name in sorted(os.listdir(folder)):
            client.upload_file(os.path.join(folder, name), bucket, f"shards/{name}")


@pytest.mark.slow
def test_a_store_stopped_mid_epoch_fails_in_one_line_and_resume_finishes_the_epoch(shards, bucket, s3_run, tmp_path,
                                                                                    monkeypatch):
    store = Store()
    store.start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", store.endpoint)  # the launched job's store; the session's stays up
    out = tmp_path / "run"
    # a rank left waiting in a collective would wait out --timeout: longer than the hang guard, so a hang
    args = args_for(f"s3://{bucket}/shards/", out, "--retries", "1", "--io-timeout", "2", "--timeout", str(2 * HANG))
    try:
        store.restock(bucket, shards)
        proc = launch_train(args, WORLD)
        t0 = time.time()
        while not ((position(out) or {}).get("step", 0) >= 3):  # a checkpoint inside the epoch (30 steps)
            assert proc.poll() is None and time.time() - t0 < HANG, "no mid-epoch checkpoint"  # a hang guard
            time.sleep(0.02)
        store.stop()
        p = completed(proc)
    finally:
        store.stop()
    printed = p.stdout + p.stderr
    assert p.returncode != 0, printed[-3000:]  # torchrun reports a failed rank as 1; the rank itself exits 2
    errors = [ln for ln in p.stderr.splitlines() if "pipeline-train: error:" in ln]
    assert 1 <= len(errors) <= WORLD, printed[-3000:]  # one line from the rank that failed (or from each)
    assert all(f"s3://{bucket}/shards/mnist-" in e and "failed after 2 attempts" in e for e in errors), errors
    assert "retrying" in p.stderr, printed[-3000:]
    said = [ln for ln in p.stderr.splitlines() if ln.startswith(f"pipeline-train: the last checkpoint stays in {out}/; "
                                                                 f"resume with: ")]
    assert 1 <= len(said) <= WORLD and all(ln.endswith(" --resume") for ln in said), printed[-3000:]
    stopped_at = position(out)
    steps = SAMPLES // (WORLD * 8)
    # the worker fetches the epoch's shards ahead, so the store's loss may first meet the evaluation: the
    # epoch's checkpoint (written before its evaluation) is then the last; else a mid-epoch one
    assert (stopped_at["mid"] and stopped_at["epoch"] == 0 and 3 <= stopped_at["step"] < steps) or \
        (not stopped_at["mid"] and stopped_at["epoch"] == 1 and stopped_at["step"] == steps), stopped_at

    store.start()
    try:
        store.restock(bucket, shards)
        resumed = run_ok([*args, "--resume"])
    finally:
        store.stop()
    whole, _ = s3_run
    keys = [k for r in range(WORLD) for k in key_logs(out)[r]]
    assert len(keys) == len(set(keys)) == SAMPLES, "a key read twice, or one left out, over the epoch"
    assert key_logs(out) == key_logs(whole)  # exactly the uninterrupted run's keys, in its order
    assert losses(out) == losses(whole)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from"]["step"] == stopped_at["step"] and summary["epochs_done"] == 1
    for text in (printed, resumed.stdout + resumed.stderr):
        assert S3_SECRET not in text
    assert_secret_nowhere(out, S3_SECRET)


# ---------------------------------------------------------------- credentials never printed


def assert_secret_nowhere(folder, secret, *texts):
    """`secret` in none of `texts` (what commands printed) and in no file under `folder`
    (metrics.jsonl, summary.json, checkpoint.pt's bytes, key logs, manifests...)."""
    for text in texts:
        assert secret not in text, text[-2000:]
    found = [path for path in folder.rglob("*") if path.is_file() and secret.encode() in path.read_bytes()]
    assert not found, found
    assert folder.is_dir()


HTTP_SECRET = "http-pa55word-never-printed"
HEADER_SECRET = "header-t0ken-never-printed"


class Guarded(Quiet, http.server.SimpleHTTPRequestHandler):
    """Serves a folder to requests whose Authorization header is one of server.accepted; 401 otherwise."""

    def do_GET(self):
        self._guard(super().do_GET)

    def do_HEAD(self):
        self._guard(super().do_HEAD)

    def _guard(self, serve):
        if self.headers.get("Authorization") not in self.server.accepted:
            self.send_response(401)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        serve()


def make_shards(*args):
    return run_capture([sys.executable, os.path.join(ROOT, "tools", "make_shards.py"), *map(str, args)],
                       capture_output=True, text=True, cwd=ROOT, timeout=HANG)


@pytest.mark.slow
def test_the_aws_secret_is_printed_or_written_nowhere(bucket, s3_run, tmp_path):
    """AWS_SECRET_ACCESS_KEY is in the environment of every process here: not in what the
    trainer and make_shards --index (on the bucket, and on a prefix that is not there) print,
    nor in any file they leave (metrics, summary, checkpoint bytes, key logs, the manifest)."""
    assert os.environ["AWS_SECRET_ACCESS_KEY"] == S3_SECRET
    run, printed = s3_run
    assert_secret_nowhere(run, S3_SECRET, printed)
    index = tmp_path / "index"
    p = make_shards("--index", f"mnist:train=s3://{bucket}/png/", "--out", index)
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads((index / "mnist-train.json").read_text())["shards"][0]["name"].startswith(f"s3://{bucket}/png/")
    bad = make_shards("--index", f"mnist:train=s3://{bucket}/nothing-here/", "--out", tmp_path / "bad-index")
    assert bad.returncode == 2 and "nothing-here" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr[-2000:]
    assert_secret_nowhere(tmp_path, S3_SECRET, p.stdout, p.stderr, bad.stdout, bad.stderr)


@contextlib.contextmanager
def guarded_servers(shards, png_shards):
    """The raw and the png shards served to requests with the password or the header (401 without)."""
    import base64

    accepted = {"Basic " + base64.b64encode(f"reader:{HTTP_SECRET}".encode()).decode(), f"Bearer {HEADER_SECRET}"}
    with serving(functools.partial(Guarded, directory=str(shards)), accepted=accepted) as server, \
            serving(functools.partial(Guarded, directory=str(png_shards)), accepted=accepted) as png_server:
        yield server.url, png_server.url


def http_runs(src, png_src, folder):
    """A 2-rank run from `src`, make_shards --index of `png_src`, and a run whose manifest is
    missing (its error line): everything they printed."""
    outputs = []
    p = completed(launch_train([*args_for(src, folder / "run"), "--epoch-samples", "160"], WORLD))
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    outputs += [p.stdout, p.stderr]
    p = make_shards("--index", f"mnist:train={png_src}mnist-train-{{000000..000003}}.tar", "--out", folder / "index")
    assert p.returncode == 0, p.stderr[-2000:]
    outputs += [p.stdout, p.stderr]
    p = completed(launch_train(args_for(src + "missing/", folder / "fails"), WORLD))
    assert p.returncode != 0 and "missing/mnist-train.json" in p.stderr, p.stderr[-2000:]
    return outputs + [p.stdout, p.stderr]


@pytest.mark.slow
def test_the_http_header_variable_is_printed_or_written_nowhere(shards, png_shards, tmp_path, monkeypatch):
    monkeypatch.setenv("PIPELINE_HTTP_AUTHORIZATION", f"Bearer {HEADER_SECRET}")
    with guarded_servers(shards, png_shards) as (url, png_url):
        outputs = http_runs(url, png_url, tmp_path)
    assert_secret_nowhere(tmp_path, HEADER_SECRET, *outputs)


@pytest.mark.slow
def test_a_url_password_is_printed_or_written_nowhere(shards, png_shards, tmp_path, monkeypatch):
    """Nowhere but where the user asked for it: an --index manifest of user:password URLs names
    its shards by those URLs (they are how the shards are read; docs/stores.md says to use the
    header variable instead), while its origin and every run file, log and checkpoint redact it."""
    monkeypatch.delenv("PIPELINE_HTTP_AUTHORIZATION", raising=False)
    with guarded_servers(shards, png_shards) as (url, png_url):
        def with_password(u):
            return u.replace("http://", f"http://reader:{HTTP_SECRET}@")
        outputs = http_runs(with_password(url), with_password(png_url), tmp_path)
    manifest = json.loads((tmp_path / "index" / "mnist-train.json").read_text())
    assert HTTP_SECRET not in json.dumps(manifest["origin"]) and "reader:***@" in manifest["origin"]["spec"]
    assert all(HTTP_SECRET in s["name"] for s in manifest["shards"])
    (tmp_path / "index" / "mnist-train.json").unlink()
    assert_secret_nowhere(tmp_path, HTTP_SECRET, *outputs)
