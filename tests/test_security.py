"""Untrusted input: hostile manifests, lying servers, bad numbers, resumes with other settings.

A manifest is data, never code: no shard name ever runs a command or opens a file outside
the shard set. Bad input is one line and exit code 2, before anything is trained or wiped.
"""
import errno
import http.server
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from helpers import (HANG, Quiet, alive, build_shards, children, completed, drip, free_port, kill_tree, launch_trainer,
                     one_line_error, run_capture, serving, train_in_process)
from pipeline.train import checkpoint
from pipeline import files
from pipeline.data.manifests import manifest
from pipeline.data.store import remote
from pipeline.errors import FetchError, ShardError
from pipeline.data.streams.stream import MixedStream, resolve

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def data(mixed_shards):
    return mixed_shards  # built once per test run (conftest.py); read only here


def train(*args, nproc=0, timeout=HANG):
    """torchrun with `nproc` ranks; nproc=0 runs main() in this process (see helpers.train_in_process)."""
    if not nproc:
        return train_in_process(args)
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                f"--master_port={free_port()}"] if nproc else [sys.executable]
    return run_capture([*launcher, "-m", "pipeline.train", *map(str, args)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=timeout)


def small(data, out, *extra):
    return ["--train", f"mnist={data}/", "--train", f"cifar10={data}/", "--epochs", "1", "--batch-size", "16",
            "--workers", "0", "--width", "4", "--out", out, *extra]


def rewrite_manifest(src_dir, dst_dir, name, split, change):
    """A copy of a manifest (and hard links to its shards) with `change(manifest)` applied."""
    dst_dir.mkdir(exist_ok=True)
    m = json.loads((src_dir / f"{name}-{split}.json").read_text())
    for s in m["shards"]:
        if not (dst_dir / s["name"]).exists():
            os.link(src_dir / s["name"], dst_dir / s["name"])
    change(m)
    (dst_dir / f"{name}-{split}.json").write_text(json.dumps(m))
    return dst_dir / f"{name}-{split}.json"


# ---------------------------------------------------------------- 1. commands from a manifest


@pytest.mark.parametrize("evil", ["x.tar; touch {canary}", "$(touch {canary}).tar", "`touch {canary}`.tar",
                                  "x.tar && touch {canary}", "x.tar | touch {canary}", "x\ntouch {canary}"])
def test_a_piped_manifest_never_runs_its_shard_names(data, tmp_path, evil):
    canary = tmp_path / "canary"
    path = rewrite_manifest(data, tmp_path / "m", "mnist", "train",
                            lambda m: m["shards"][1].update(name=evil.format(canary=canary)))
    with pytest.raises(ShardError, match="not a plain relative name|scheme|commands"):
        resolve("mnist", f"pipe:cat {path}", "train")
    p = train("--train", f"mnist=pipe:cat {path}", "--out", tmp_path / "run")
    one_line_error(p, "mnist-train.json")
    assert not canary.exists(), "a shard name ran a command"


def test_a_local_manifest_cannot_name_a_command(data, tmp_path):
    canary = tmp_path / "canary"
    # object-store URLs (s3://, gs://, hf://) are shards a manifest may name; fsspec's other protocols are not
    for name in (f"pipe:touch {canary}", f"PIPE:touch {canary}", "file:///etc/passwd", "local:///etc/passwd",
                 "reference://x", "memory://x.tar"):
        path = rewrite_manifest(data, tmp_path / "m", "mnist", "train", lambda m: m["shards"][0].update(name=name))
        rel = os.path.relpath(path, ROOT)  # a bare relative path, as users type it
        p = train("--train", f"mnist={rel}", "--out", tmp_path / "run")
        one_line_error(p, "never commands or other schemes")
    assert not canary.exists()


def test_plain_names_are_quoted_into_the_pipe_command(data):
    src = resolve("mnist", f"pipe:cat {data}/mnist-train.json", "train")
    assert src.urls[0] == f"pipe:cat {data}/mnist-train-000000.tar"
    assert manifest.locate("pipe:cat /x/m.json", "a+b.tar") == "pipe:cat /x/a+b.tar"
    assert manifest.locate("pipe:aws s3 cp s3://b/p/m.json -", "sub/x.tar") == "pipe:aws s3 cp s3://b/p/sub/x.tar -"


# ---------------------------------------------------------------- 2. paths outside the shard set


@pytest.mark.parametrize("name", ["../other/x.tar", "../../../etc/passwd", "sub/../../x.tar", "./x.tar",
                                  ".hidden.tar", "a//b.tar", "a\\..\\b.tar", "", "sub/"])
def test_manifest_names_cannot_leave_its_folder(data, tmp_path, name):
    path = rewrite_manifest(data, tmp_path / "m", "mnist", "train", lambda m: m["shards"][0].update(name=name))
    with pytest.raises(ShardError, match="mnist-train.json"):
        resolve("mnist", str(path), "train")


def test_a_test_split_next_door_is_not_pulled_into_training(data, tmp_path):
    """The landed code opened ../other/x.tar: a manifest naming the test shards trained on them."""
    (tmp_path / "other").mkdir()
    os.link(data / "mnist-test-000000.tar", tmp_path / "other" / "mnist-test-000000.tar")
    rewrite_manifest(data, tmp_path / "m", "mnist", "train",
                     lambda m: m["shards"][0].update(name="../other/mnist-test-000000.tar"))
    p = train(*small(tmp_path / "m", tmp_path / "run")[:2], "--out", tmp_path / "run")
    one_line_error(p, "not a plain relative name")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_links_out_of_the_folder_are_refused_and_absolute_paths_only_in_local_manifests(data, tmp_path):
    folder = tmp_path / "m"
    rewrite_manifest(data, folder, "mnist", "train", lambda m: None)
    os.remove(folder / "mnist-train-000003.tar")
    os.symlink("/etc/passwd", folder / "mnist-train-000003.tar")
    with pytest.raises(ShardError, match="outside the manifest's folder"):
        resolve("mnist", str(folder), "train")
    absolute = rewrite_manifest(data, tmp_path / "abs", "mnist", "train",
                                lambda m: m["shards"][0].update(name=str(data / "mnist-train-000000.tar")))
    assert resolve("mnist", str(absolute), "train").urls[0] == str(data / "mnist-train-000000.tar")  # on purpose
    with pytest.raises(ShardError, match="absolute path in a remote manifest.*--out set to their folder.*--base-url"):
        manifest.locate("http://host/shards/mnist-train.json", "/etc/passwd")
    with pytest.raises(ShardError, match="absolute path in a remote manifest"):
        manifest.locate("pipe:cat /x/mnist-train.json", "/etc/passwd")


# ---------------------------------------------------------------- 3. labels the model has no row for


def test_eval_classes_must_match_training_classes(data, tmp_path):
    rewrite_manifest(data, tmp_path / "m", "mnist", "test", lambda m: m.update(classes=[str(i) for i in range(21)]))
    p = train(*small(data, tmp_path / "run"), "--eval", f"mnist={tmp_path / 'm'}/")
    one_line_error(p, "21 classes", "10")
    assert not (tmp_path / "run").exists(), "the run folder was touched before the check"


def test_a_decoded_label_outside_the_source_is_skipped_and_counted(tmp_path):
    from helpers import read_members, write_tar

    build_shards(tmp_path, "toy", "train", 20, maxcount=10)
    shard = tmp_path / "toy-train-000000.tar"
    write_tar(shard, [(n, b"20" if n.endswith(".cls") and i == 1 else body)
                      for i, (n, body) in enumerate(read_members(shard))])
    src = resolve("toy", str(tmp_path), "train")
    with pytest.warns(UserWarning, match="label 20 outside 0..9"):
        batches = list(MixedStream([src], {"toy": 1}, 5, epoch_samples=20).eval_stream(src))
    assert sum(b["skipped"] for b in batches) == 1 and sum(len(b["key"]) for b in batches) == 19
    assert max(int(b["label"].max()) for b in batches if len(b["label"])) < 10


# ---------------------------------------------------------------- 4. every manifest field checked


def _drop(key):
    return lambda m: m["shards"][0].pop(key)


MUTATIONS = {
    "std zero": (lambda m: m.update(std=[0.0]), "std"),
    "std negative": (lambda m: m.update(std=[-0.2]), "std"),
    "std NaN": (lambda m: m.update(std=[float("nan")]), "std"),
    "mean inf": (lambda m: m.update(mean=[float("inf")]), "mean"),
    "mean of 3 for 1 channel": (lambda m: m.update(mean=[0.1, 0.2, 0.3]), "mean"),
    "no samples": (_drop("samples"), "shards[0].samples"),
    "no name": (_drop("name"), "shards[0].name"),
    "samples as text": (lambda m: m["shards"][0].update(samples="20"), "shards[0].samples"),
    "samples zero": (lambda m: m["shards"][0].update(samples=0), "shards[0].samples"),
    "samples 1e12": (lambda m: m["shards"][0].update(samples=10 ** 12), "cannot fit"),
    "shards as a dict": (lambda m: m.update(shards={"a": 1}), "shards"),
    "shards empty": (lambda m: m.update(shards=[]), "shards"),
    "shape of 2": (lambda m: m.update(shape=[28, 28]), "shape"),
    "shape of 2 channels": (lambda m: m.update(shape=[2, 28, 28]), "shape"),
    "huge shape": (lambda m: m.update(shape=[1, 100000, 28]), "shape"),
    "classes empty": (lambda m: m.update(classes=[]), "classes"),
    "classes not text": (lambda m: m.update(classes=[1, 2]), "classes"),
    "unknown image kind": (lambda m: m.update(image_exts=["pyd"]), "image_exts"),
    "label from a pickle": (lambda m: m.update(label="pyd"), "label"),
    "bad sha256": (lambda m: m["shards"][0].update(sha256="zz"), "sha256"),
    "total wrong": (lambda m: m.update(total=5), "total"),
    "not a manifest": (lambda m: m.clear(), "format"),
    "std subnormal": (lambda m: m.update(std=[1e-320]), "std"),
    "a shard listed twice": (lambda m: m["shards"].__setitem__(1, dict(m["shards"][0])), "more than once"),
    "a name ending in a newline": (lambda m: m.update(dataset="mnist\n"), "dataset"),
    "label_names as text": (lambda m: m.update(label_names="yes"), "label_names"),
    "label names twice": (lambda m: m.update(label_names=True, classes=["a"] * 10), "classes"),
    "unlabelled negative": (lambda m: m["shards"][0].update(unlabelled=-1), "shards[0].unlabelled"),
    "image member of a pickle": (lambda m: m.update(image_exts=["rgb.pyd"]), "image_exts"),
    "image member with a path": (lambda m: m.update(image_exts=["../x.png"]), "image_exts"),
    "label from a folder, badly": (lambda m: m.update(label="dir:-1"), "label"),
}


@pytest.mark.parametrize("case", sorted(MUTATIONS))
def test_every_manifest_field_is_checked(data, tmp_path, case):
    change, field = MUTATIONS[case]
    path = rewrite_manifest(data, tmp_path / "m", "mnist", "train", change)
    with pytest.raises(ShardError) as e:
        resolve("mnist", str(path), "train")
    assert field in str(e.value) and "mnist-train.json" in str(e.value)


def test_a_shard_listed_twice_among_many_is_found_at_once(data):
    """The duplicate check counts names once: comparing each with all the others took 8 s
    for 20,000 shards here, and hours for a million."""
    m = json.loads((data / "mnist-train.json").read_text())
    m["shards"] = [dict(m["shards"][0], name=f"mnist-train-{i:06d}.tar") for i in range(50_000)]
    m["shards"].append(dict(m["shards"][-1]))
    m["total"] = sum(s["samples"] for s in m["shards"])
    t0 = time.process_time()  # CPU seconds: what other processes take of the cores does not count
    with pytest.raises(ShardError, match="'mnist-train-049999.tar' is listed more than once"):
        manifest.check(m, "mnist-train.json")
    assert time.process_time() - t0 < 10  # the quadratic scan took about 50 s for this many


def test_a_bad_manifest_is_one_line_from_the_trainer(data, tmp_path):
    path = rewrite_manifest(data, tmp_path / "m", "mnist", "train", lambda m: m.update(std=[0.0]))
    one_line_error(train("--train", f"mnist={path}", "--out", tmp_path / "run"), "std")


def test_a_shard_whose_count_differs_from_its_manifest_is_named_at_first_read(data, tmp_path):
    path = rewrite_manifest(data, tmp_path / "m", "mnist", "train", lambda m: (m["shards"][0].update(samples=25), m.update(total=205)))
    src = resolve("mnist", str(path), "train")
    with pytest.warns(UserWarning, match="mnist-train-000000.tar: 20 samples, the manifest says 25"):
        list(MixedStream([src], {"mnist": 1}, 10, epoch_samples=30).eval_stream(src))


# ---------------------------------------------------------------- 5. a server that drips


class Drip(Quiet, http.server.BaseHTTPRequestHandler):
    """Answers HEAD normally and GET with a byte every 0.2 s (for at most 60 s)."""

    def do_HEAD(self):
        self.send_response(200)
        self.send_header("Content-Length", str(self.server.sizes.get(self.path, 0)))
        self.end_headers()

    def do_GET(self):
        if self.path.endswith(".json"):
            body = self.server.files[self.path]
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(self.server.sizes[self.path]))
        self.end_headers()
        drip(self, b"\0", HANG)  # longer than the hang guard: a missed deadline is a hang, not a slow pass


@pytest.fixture
def dripping(data):
    body = (data / "mnist-train.json").read_bytes()
    sizes = {f"/{s['name']}": s["bytes"] for s in json.loads(body)["shards"]}
    with serving(Drip, files={"/mnist-train.json": body}, sizes=sizes) as server:
        yield server.url


@pytest.mark.slow
def test_a_dripping_server_fails_at_its_deadline_instead_of_hanging(dripping):
    policy = remote.Policy(retries=1, delay=0.1, timeout=1.0, min_rate=1e6)
    src = resolve("mnist", dripping, "train", policy=policy)
    stream = MixedStream([src], {"mnist": 1}, 10, epoch_samples=20, policy=policy)
    t0 = time.time()
    with pytest.warns(UserWarning, match="retrying"), pytest.raises(FetchError, match="deadline"):
        list(stream)
    assert time.time() - t0 < 15  # two attempts of a ~1 s deadline each, plus one socket timeout


@pytest.mark.slow
def test_the_trainer_stops_with_one_line_on_a_dripping_server(dripping, tmp_path):
    p = train("--train", f"mnist={dripping}", "--batch-size", "10", "--workers", "1", "--width", "4",
              "--io-timeout", "1", "--retries", "1", "--out", tmp_path / "run", timeout=HANG)
    one_line_error(p, "deadline")  # the server drips for longer than HANG: without the deadline, a hang


# ---------------------------------------------------------------- 6. resume with other settings


@pytest.fixture(scope="module")
def finished(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("resume") / "run"
    p = train(*small(data, out, "--epochs", "2", "--stop-after", "1"))
    assert p.returncode == 0, p.stderr[-2000:]
    return out


@pytest.mark.parametrize("change, needles", [
    (["--train", "cifar10={d}/", "--train", "mnist={d}/"], ["sources", "cifar10 10 classes 3x32x32"]),
    (["--weights", "mnist=0.9,cifar10=0.1"], ["weights", "--change-weights"]),
    (["--width", "8"], ["--width: checkpoint 4, now 8"]),
    (["--seed", "3"], ["seed"]),
    (["--train", "mnist={d}/"], ["sources"]),
])
@pytest.mark.slow
def test_resume_with_other_settings_is_one_line_naming_each_difference(data, finished, tmp_path, change, needles):
    out = tmp_path / "run"
    subprocess.run(["cp", "-r", str(finished), str(out)], check=True)
    args = small(data, out, "--epochs", "2", "--resume")
    if change[0] == "--train":
        args = [a for a in args if a not in ("--train", f"mnist={data}/", f"cifar10={data}/")]
        args = [c.format(d=data) for c in change] + args
    else:
        args += change
    one_line_error(train(*args), "--resume with other settings", *needles)


@pytest.mark.slow
def test_weights_may_change_on_purpose_and_are_recorded(data, finished, tmp_path):
    out = tmp_path / "run"
    subprocess.run(["cp", "-r", str(finished), str(out)], check=True)
    p = train(*small(data, out, "--epochs", "2", "--resume", "--change-weights", "--weights", "mnist=3,cifar10=1"))
    assert p.returncode == 0, p.stderr[-2000:]
    lines = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    changed = [ln for ln in lines if ln["kind"] == "weights_changed"]
    assert len(changed) == 1 and changed[0]["to"] == [0.75, 0.25] and changed[0]["from"] == [0.5, 0.5]


@pytest.mark.slow
def test_a_weights_change_records_the_weights_the_resumed_epoch_uses(data, finished, tmp_path):
    """--final-weights on resume: epoch 2 of 2 trains on the final weights, so the record names
    those (not the schedule's first), the same weights the epoch's train lines carry."""
    out = tmp_path / "run"
    subprocess.run(["cp", "-r", str(finished), str(out)], check=True)
    p = train(*small(data, out, "--epochs", "2", "--resume", "--change-weights", "--final-weights",
                     "mnist=3,cifar10=1", "--log-every", "1"))
    assert p.returncode == 0, p.stderr[-2000:]
    lines = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    changed = [ln for ln in lines if ln["kind"] == "weights_changed"]
    assert len(changed) == 1 and changed[0]["to"] == [0.75, 0.25] and changed[0]["from"] == [0.5, 0.5]
    assert changed[0]["from_epoch"] == 2
    used = [list(ln["weights"].values()) for ln in lines if ln["kind"] == "train" and ln["epoch"] == 2]
    assert used and all(w == changed[0]["to"] for w in used)


# ---------------------------------------------------------------- 7. full disks and torn lines


@pytest.mark.slow
def test_a_torn_metrics_line_is_cut_on_resume(data, finished, tmp_path):
    out = tmp_path / "run"
    subprocess.run(["cp", "-r", str(finished), str(out)], check=True)
    whole = (out / "metrics.jsonl").read_text()
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "epoch": 2, "st')  # what a full disk left
    p = train(*small(data, out, "--epochs", "2", "--resume"))
    assert p.returncode == 0, p.stderr[-2000:]
    text = (out / "metrics.jsonl").read_text()
    assert text.startswith(whole) and all(json.loads(ln) for ln in text.splitlines())


def test_a_failed_line_write_leaves_the_file_whole(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    files.append_line(str(path), '{"a": 1}')

    class Full:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            self.f.write(data[:5])  # part of it made it to disk
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *a):
            self.f.close()

    real_open = open
    monkeypatch.setattr(files, "open", lambda *a, **k: Full(real_open(*a, **k)), raising=False)
    with pytest.raises(OSError) as e:
        files.append_line(str(path), '{"b": 2}')
    monkeypatch.undo()
    assert path.read_text() == '{"a": 1}\n'
    assert str(e.value) == f"[Errno 28] No space left on device: '{path}'"  # which file (hostileK 6)


def test_a_key_log_over_a_file_size_limit_is_cut_back_whole_and_named(tmp_path):
    """A full disk mid-run said "[Errno 28] No space left on device" and nothing of the key log, and
    left half a line in it (hostileK 6): the lines are written whole or not at all, the file named."""
    import subprocess
    import sys

    code = ("import resource\nfrom pipeline.train.metrics import KeyLog\n"
            "log = KeyLog(%r, 0)\nlog.add(1, ['a' * 10] * 10)\nlog.flush()\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (300, 300))\n"
            "log.add(1, ['b' * 50] * 10)\ntry:\n    log.flush()\nexcept OSError as e:\n    print(e)\n"
            % str(tmp_path))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=root))
    log = tmp_path / "keys-rank0.txt"
    assert p.stdout.strip() == f"[Errno 27] File too large: '{log}'", p.stdout + p.stderr
    assert log.read_text().count("\n") == 10 and "b" not in log.read_text()


def test_a_checkpoint_that_cannot_be_written_keeps_the_previous_one(tmp_path, monkeypatch):
    path = str(tmp_path / "checkpoint.pt")
    checkpoint.save(path, {"version": checkpoint.VERSION, "n": 1})

    def full(obj, f, *a, **k):
        f.write(b"half a checkpoint")
        raise RuntimeError("[enforce fail at inline_container.cc:664] . PytorchStreamWriter failed writing file "
                           "data/0: file write failed")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(OSError, match="could not write the checkpoint .* the previous checkpoint is kept") as e:
        checkpoint.save(path, {"version": checkpoint.VERSION, "n": 2})
    assert "\n" not in str(e.value)
    monkeypatch.undo()
    assert not os.path.exists(path + ".tmp")
    assert checkpoint.load(path)["n"] == 1


def test_a_checkpoint_over_a_file_size_limit_says_so_and_that_none_was_kept(tmp_path):
    """Under `ulimit -f` torch said only "[enforce fail at inline_container.cc:672] . unexpected pos", and
    "the previous checkpoint is kept" where there was none (hostileK): the file's own error, and the truth."""
    import subprocess
    import sys

    code = ("import resource, torch\nfrom pipeline.train import checkpoint\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (100000, 100000))\n"
            "try:\n    checkpoint.save(%r, {'w': torch.zeros(100000)})\nexcept OSError as e:\n    print(e)\n"
            % str(tmp_path / "checkpoint.pt"))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=root))
    assert p.stdout.strip() == (f"could not write the checkpoint {tmp_path / 'checkpoint.pt'} ([Errno 27] File too "
                                f"large); there is no earlier checkpoint"), p.stdout + p.stderr
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------- 8. sizes that would eat memory


def test_a_batch_larger_than_the_epoch_is_refused(data, tmp_path):
    one_line_error(train(*small(data, tmp_path / "run", "--batch-size", "100000000")), "less than one batch")
    assert not (tmp_path / "run").exists()


SCRIPT = r"""
import resource, sys, warnings
from pipeline.data.streams.stream import MixedStream, resolve
src = resolve("big", sys.argv[1], "train")
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
n = sum(len(b["key"]) for b in MixedStream([src], {"big": 1}, 4, epoch_samples=16, shuffle_buffer=16))
print(n, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


@pytest.mark.slow
def test_members_a_source_does_not_use_cost_no_memory(tmp_path):
    """8 samples, each with an unused 20 MB member (a 160 MB shard): the stream holds none of them."""
    from helpers import read_members, write_tar

    build_shards(tmp_path, "big", "train", 8, maxcount=8)
    shard = tmp_path / "big-train-000000.tar"
    members = []
    for name, body in read_members(shard):
        members.append((name, body))
        if name.endswith(".cls"):
            members.append((name.replace(".cls", ".npy"), os.urandom(20 << 20)))
    write_tar(shard, members)
    m = json.loads((tmp_path / "big-train.json").read_text())
    m["shards"][0]["bytes"] = os.path.getsize(shard)
    m["shards"][0].pop("sha256")
    (tmp_path / "big-train.json").write_text(json.dumps(m))
    p = run_capture([sys.executable, "-c", SCRIPT, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                    timeout=HANG, env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 0, p.stderr[-2000:]
    samples, grown_mb = map(int, p.stdout.split())
    assert samples == 16 and grown_mb < 60, grown_mb


# ---------------------------------------------------------------- weak spots: HEAD checks, launchers, numbers


# Each HTTP shard checked once per job, not once per rank: test_train's run over HTTP counts the HEADs.


@pytest.mark.slow
def test_ranks_end_when_their_launcher_is_killed(data, tmp_path):
    import signal

    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                             f"--master_port={free_port()}", "-m", "pipeline.train",
                             *small(data, out, "--epochs", "1000")], cwd=ROOT, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t0 = time.time()
    try:
        while not (out / "metrics.jsonl").exists():
            assert time.time() - t0 < HANG and proc.poll() is None  # a hang guard, not a speed test
            time.sleep(0.1)
        ranks = children(proc.pid)
        assert len(ranks) == 2
    except BaseException:
        kill_tree(proc)  # its ranks would train on for 1000 epochs
        raise
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher's group; each rank leads a group of its own
    proc.wait()
    deadline = time.time() + HANG  # a hang guard: they end on their own once they see the launcher gone
    while any(alive(r) for r in ranks) and time.time() < deadline:
        time.sleep(0.2)
    left = [r for r in ranks if alive(r)]
    for r in left:
        os.kill(r, signal.SIGKILL)
    assert not left, "ranks kept running without their launcher"


@pytest.mark.parametrize("bad, needle", [
    (["--lr", "nan"], "--lr"), (["--lr", "inf"], "--lr"), (["--lr", "0"], "--lr"), (["--width", "0"], "--width"),
    (["--width", "-4"], "--width"), (["--flip", "nosuchsource"], "--flip nosuchsource"),
    (["--weight-decay", "-1"], "--weight-decay"), (["--min-rate", "0"], "--min-rate"),
    (["--checkpoint-every", "0"], "--checkpoint-every"), (["--stop-after-steps", "-1"], "--stop-after-steps"),
    (["--sample-stage", "nocolon"], "--sample-stage"), (["--change-weights"], "--change-weights"),
])
def test_bad_numbers_are_one_line(data, tmp_path, bad, needle):
    one_line_error(train(*small(data, tmp_path / "run"), *bad), needle)


@pytest.mark.slow
def test_a_bad_number_never_wipes_the_previous_run(data, finished, tmp_path):
    out = tmp_path / "run"
    subprocess.run(["cp", "-r", str(finished), str(out)], check=True)
    before = sorted(os.listdir(out))
    one_line_error(train(*small(data, out, "--stop-after", "-2", "--overwrite")), "--stop-after")
    assert sorted(os.listdir(out)) == before


def test_a_manifest_of_another_data_set_is_named(data, tmp_path):
    with pytest.warns(UserWarning, match="the manifest describes data set 'mnist', not 'cifar10'"):
        resolve("cifar10", str(data / "mnist-train.json"), "train")


# ---------------------------------------------------------------- found by a hostile review


def test_a_negative_tar_size_is_damage_not_a_loop():
    """int() reads a sign: "-0000003000" as a size stepped the parser back to an earlier
    header, and a 3-member shard yielded samples forever."""
    import io
    import tarfile

    from pipeline.data.shards.read import iter_samples

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name in ("a.cls", "b.cls", "c.cls"):
            info = tarfile.TarInfo(name)
            info.size = 1
            tar.addfile(info, io.BytesIO(b"1"))
    raw = bytearray(buf.getvalue())
    raw[1024 + 124:1024 + 136] = b"-0000003000\0"  # the second member's size
    t0 = time.process_time()  # CPU seconds: what other processes take of the cores does not count
    with pytest.raises(ShardError, match="bad size field"):
        for _ in zip(range(100), iter_samples(io.BytesIO(bytes(raw)))):
            pass
    assert time.process_time() - t0 < 5


@pytest.mark.slow
def test_a_bad_seed_never_wipes_the_previous_run(data, finished, tmp_path):
    out = tmp_path / "run"
    subprocess.run(["cp", "-r", str(finished), str(out)], check=True)
    before = sorted(os.listdir(out))
    for seed in ("-1", str(2 ** 70)):
        one_line_error(train(*small(data, out, "--seed", seed, "--overwrite")), "--seed")
    assert sorted(os.listdir(out)) == before


def test_deeply_nested_or_huge_manifests_are_one_line(tmp_path):
    (tmp_path / "deep").mkdir()
    (tmp_path / "deep" / "mnist-train.json").write_text("[" * 100000 + "]" * 100000)
    one_line_error(train("--train", f"mnist={tmp_path / 'deep'}/", "--out", tmp_path / "run"), "not valid JSON")
    (tmp_path / "digits").mkdir()
    (tmp_path / "digits" / "mnist-train.json").write_text('{"total": ' + "9" * 5000 + "}")
    one_line_error(train("--train", f"mnist={tmp_path / 'digits'}/", "--out", tmp_path / "run"), "not valid JSON")
    with pytest.raises(ShardError, match="more than 1000 bytes"):  # a remote manifest is capped, not kept whole
        remote.fetch("pipe:head -c 5000 /dev/zero", limit=1000)


class DripHeaders(Quiet, http.server.BaseHTTPRequestHandler):
    """Sends its status line, then one header byte every 0.2 s (for at most 30 s)."""

    def do_HEAD(self):
        drip(self, b"X", 30, first=b"HTTP/1.1 200 OK\r\n")


@pytest.mark.slow
def test_a_head_check_that_drips_its_headers_ends_at_its_deadline():
    t0 = time.time()
    with serving(DripHeaders) as server:
        problems, _ = remote.head_check([server.url + "x.tar"],
                                        policy=remote.Policy(retries=1, delay=0.05, timeout=1.0))
    assert len(problems) == 1 and "deadline" in problems[0], problems
    assert time.time() - t0 < 10


STAGES = """
import numpy as np
raise_on_import = False

def boom(sample):
    raise KeyError("no such field")

def relabel(sample):
    sample["label"] = 10 ** 6
    return sample

def not_a_dict(sample):
    return 5
"""


@pytest.mark.slow
@pytest.mark.parametrize("stage, needle", [("stage_broken:f", "RuntimeError: broken on import"),
                                           ("my_stages:boom", "raised KeyError"),
                                           ("my_stages:relabel", "returned label 1000000"),
                                           ("my_stages:not_a_dict", "returned int, not the sample dict")])
def test_a_users_stage_that_fails_is_one_line(data, tmp_path, stage, needle):
    """A process of its own, not main() in this process: the stage fails in a DataLoader worker,
    whose own stderr (a traceback, a second error line) captured in process would not be seen."""
    (tmp_path / "my_stages.py").write_text(STAGES)
    (tmp_path / "stage_broken.py").write_text("raise RuntimeError('broken on import')\n")
    p = completed(launch_trainer([*small(data, tmp_path / "run", "--workers", "1"), "--sample-stage", stage],
                                 pythonpath=[tmp_path]))
    one_line_error(p, needle)


def test_redirects_lead_to_http_only(tmp_path):
    class Redirect(Quiet, http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(302)
            self.send_header("Location", "ftp://127.0.0.1/x.tar")
            self.end_headers()

    with serving(Redirect) as server, \
            pytest.raises(FetchError, match="redirect to 'ftp://127.0.0.1/x.tar' refused"):
        remote.fetch(server.url + "x.tar")
