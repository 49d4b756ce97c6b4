"""Limits from the job, not from the data: the I/O flags of both entry points (shared, checked
for overflow), the shard-size ceiling, what --overwrite may delete, one make_shards writer per
folder, brace patterns counted before they expand, and a manifest body past its cap.
Servers on 127.0.0.1 only; every subprocess bounded in time (and memory where it matters)."""
import http.server
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers import (Forker, HANG, Quiet, build_shards, drip, make_shards_in_process, run_capture, serving,
                     train_in_process)
from pipeline import cli
from pipeline.data.manifests import manifest
from pipeline.data.manifests import patterns
from pipeline.data.store import remote
from pipeline.train import options, outdir
from pipeline.writers import shards
from pipeline.writers import verify
from pipeline.errors import ShardError
from pipeline.writers.sources import SyntheticSource

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "make_shards.py"
ENV = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("shards")
    build_shards(out, "mnist", "train", 60, shape=(1, 28, 28), encoding="raw", maxcount=20)
    return out


def run(args, timeout=HANG, **kw):
    return run_capture([sys.executable, *map(str, args)], cwd=ROOT, env=ENV, capture_output=True, text=True,
                       timeout=timeout, **kw)


def one_line_error(p, prog, *needles):
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert "Traceback" not in p.stderr, p.stderr[-2000:]
    errors = [ln for ln in p.stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1 and errors[0].startswith(f"{prog}: error:"), p.stderr[-2000:]
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


@pytest.fixture(scope="module")
def tool():
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_shards_limits", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def parse_error(parse, argv, capsys):
    """The one stderr line of a command line that parse() refuses with exit code 2."""
    with pytest.raises(SystemExit) as e:
        parse(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.splitlines()) == 1, err
    return err


# ---------------------------------------------------------------- the I/O flags


BAD_IO = [
    (["--io-timeout", "1e308"], "--io-timeout"), (["--io-timeout", "inf"], "--io-timeout"),
    (["--io-timeout", "nan"], "--io-timeout"), (["--io-timeout", "-1"], "--io-timeout"),
    (["--min-rate", "1e-300"], "--min-rate"), (["--min-rate", "inf"], "--min-rate"), (["--min-rate", "nan"], "--min-rate"),
    (["--retries", "9" * 30], "--retries"), (["--retries", "-1"], "--retries"),
    (["--max-shard-bytes", "9" * 40], "--max-shard-bytes"), (["--max-shard-bytes", "1e400"], "--max-shard-bytes"),
    (["--max-shard-bytes", "0"], "--max-shard-bytes"), (["--max-shard-bytes", "-5"], "--max-shard-bytes"),
    (["--max-shard-bytes", "10X"], "--max-shard-bytes"), (["--max-shard-bytes", "1P"], "--max-shard-bytes"),
    (["--max-shard-bytes", "1000T", "--min-rate", "0.001"], "deadline"),
]


@pytest.mark.parametrize("bad, needle", BAD_IO + [
    (["--timeout", "9" * 30], "--timeout"), (["--timeout", "99999999999"], "--timeout"), (["--timeout", "0"], "--timeout"),
    (["--cache-size", "10G"], "--cache-dir"), (["--cache-dir", "c", "--cache-size", "0"], "--cache-size"),
    (["--cache-dir", "c", "--cache-size", "lots"], "--cache-size"), (["--workers", "100000"], "--workers"),
    (["--shuffle-window", "0"], "--shuffle-window"), (["--shuffle-window", "9" * 40], "--shuffle-window"),
    (["--shuffle-window", "1e400"], "--shuffle-window"), (["--shuffle-window", "-5"], "--shuffle-window"),
    (["--shuffle-window", "lots"], "--shuffle-window"), (["--on-error", "ignore"], "--on-error"),
    (["--strict", "--on-error", "skip"], "--strict"),
])
def test_the_trainer_refuses_overflowing_io_flags_in_one_line(capsys, bad, needle):
    err = parse_error(options.parse, ["--train", "a=x/", *bad], capsys)
    assert err.startswith("pipeline-train: error:") and needle in err, err


@pytest.mark.parametrize("k", ["0", "7", str(1 << 23)])
def test_slots_is_ignored_with_one_line(capsys, k):
    """--slots went with the canonical slots: any value is taken, said to be ignored in one line."""
    options.parse(["--train", "a=x/", "--slots", k])
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("pipeline-train: --slots is no longer used"), lines
    assert lines[0].endswith("ignored") and "error" not in lines[0], lines


@pytest.mark.parametrize("bad, needle", BAD_IO + [(["--workers", "100000"], "--workers")])
def test_make_shards_refuses_the_same_flags_alike(tool, capsys, bad, needle):
    err = parse_error(tool.parse_args, ["--index", "a:train=x/", *bad], capsys)
    assert err.startswith("make-shards: error:") and needle in err, err


def test_both_entry_points_share_one_definition_of_the_io_flags(tool, capsys):
    def flags(parse):
        with pytest.raises(SystemExit):
            parse(["--help"])
        text = " ".join(capsys.readouterr().out.split())
        return [text[text.rindex(f):][:120] for f in ("--io-timeout S", "--min-rate MB_PER_S", "--retries N",
                                                    "--max-shard-bytes BYTES")]
    assert flags(options.parse) == flags(tool.parse_args)


def test_good_io_flags_make_the_policy(tool):
    args = options.parse(["--train", "a=x/", "--io-timeout", "2.5", "--min-rate", "4", "--retries", "0",
                          "--max-shard-bytes", "64M", "--cache-dir", "c", "--cache-size", "1.5G"])
    assert remote.Policy(**cli.io_limits(args)) == remote.Policy(retries=0, timeout=2.5, min_rate=4e6,
                                                                 max_bytes=64 << 20)
    assert args.cache_size == int(1.5 * (1 << 30))
    json.dumps(vars(args))  # the config goes into summary.json and the checkpoint as it is
    assert remote.Policy(**cli.io_limits(tool.parse_args(["--index", "a:train=x/", "--retries", "7"]))).retries == 7
    assert cli.MAX_DELAY == remote.MAX_DELAY  # --help's "at most 60 s" is the data path's
    assert [cli.size(t) for t in ("1", "2K", "3m", "1GiB", "1gb", "0.5T")] == [1, 2048, 3 << 20, 1 << 30, 1 << 30, 1 << 39]


@pytest.mark.slow
def test_overflowing_flags_from_the_real_command_lines(data, tmp_path):
    p = run(["-m", "pipeline.train", "--train", f"mnist={data}/", "--io-timeout", "1e308", "--out", tmp_path / "run"])
    one_line_error(p, "pipeline-train", "--io-timeout")
    p = run(["-m", "torch.distributed.run", "--nproc_per_node=1", "-m", "pipeline.train", "--train", f"mnist={data}/",
             "--timeout", "9" * 25, "--out", tmp_path / "run"])
    assert p.returncode != 0 and "OverflowError" not in p.stderr  # torchrun adds its own report of the exit
    assert p.stderr.startswith("pipeline-train: error: --timeout must be a finite number from 1 to 604800"), p.stderr
    p = run([TOOL, "--index", f"x:train={data}", "--retries", "9" * 25, "--out", tmp_path / "idx"])
    one_line_error(p, "make-shards", "--retries")
    assert not (tmp_path / "run").exists() and not (tmp_path / "idx").exists()


class DripBody(Quiet, http.server.BaseHTTPRequestHandler):
    """Announces 100 MB and drips them, one byte every 0.2 s."""

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", str(100 << 20))
        self.end_headers()
        drip(self, b"x", 60)


def test_make_shards_index_obeys_the_io_flags(tmp_path):
    """--io-timeout 0.5 --min-rate 100 --retries 0 on a dripping server: the index fails at
    its 0.5 s + 100 MB / 100 MB/s deadline, not after the defaults' 130 s and three retries."""
    with serving(DripBody) as srv:
        t0 = time.time()
        p = make_shards_in_process(["--index", f"x:train={srv.url}x-{{0..1}}.tar", "--io-timeout", "0.5",
                                    "--min-rate", "100", "--retries", "0", "--workers", "1", "--quiet",
                                    "--out", tmp_path / "idx"])
        took = time.time() - t0
    one_line_error(p, "make-shards", "deadline", f"{srv.url}x-0.tar")
    assert took < 20, took


# ---------------------------------------------------------------- the shard-size ceiling


def overstate(src, dst, nbytes):
    """A copy of src's mnist-train manifest (hard links to its shards) whose first shard claims nbytes."""
    dst.mkdir()
    for f in os.listdir(src):
        if f.endswith(".tar"):
            os.link(src / f, dst / f)
    m = json.loads((src / "mnist-train.json").read_text())
    m["shards"][0]["bytes"] = nbytes
    (dst / "mnist-train.json").write_text(json.dumps(m))
    return dst


def test_a_manifest_claiming_more_than_the_ceiling_is_refused_before_any_read(data, tmp_path):
    lying = overstate(data, tmp_path / "lying", 10 ** 13)
    with pytest.raises(ShardError, match="more than --max-shard-bytes 1073741824"):
        manifest.resolve("mnist", str(lying), "train")
    m = json.loads((data / "mnist-train.json").read_text())
    biggest = max(s["bytes"] for s in m["shards"])
    with pytest.raises(ShardError, match=m["shards"][0]["name"]):
        manifest.resolve("mnist", str(data), "train", policy=remote.Policy(max_bytes=biggest - 1))
    assert manifest.resolve("mnist", str(data), "train", policy=remote.Policy(max_bytes=biggest)).total == 60
    p = train_in_process(["--train", f"mnist={lying}/", "--out", tmp_path / "run"])
    one_line_error(p, "pipeline-train", "--max-shard-bytes", "mnist-train-000000.tar")
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- --overwrite


def fake_args(out, **kw):
    return SimpleNamespace(out=str(out), resume=False, overwrite=True, **kw)


def test_overwrite_deletes_a_previous_run_and_says_what(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    names = ["checkpoint.pt", "eval.json", "keys-rank0.txt", "keys-rank1.txt", "metrics.jsonl", "report.png",
             "summary.json", "summary.json.tmp"]
    for n in names:
        (out / n).write_text("x")
    assert outdir.prepare_out(fake_args(out), SimpleNamespace(is_main=True)) is None
    said = capsys.readouterr().out
    assert said.startswith(f"--overwrite: deleting the previous run in {out}/: ") and all(n in said for n in names)
    assert out.is_dir() and os.listdir(out) == []


@pytest.mark.parametrize("foreign", ["mnist-train-000000.tar", "mnist-train.json", "notes.txt", "sub/", "link"])
def test_overwrite_refuses_a_folder_holding_anything_else(tmp_path, capsys, foreign):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text("{}\n")
    (out / "checkpoint.pt").write_text("x")
    if foreign.endswith("/"):
        (out / foreign).mkdir()
    elif foreign == "link":
        (tmp_path / "elsewhere").write_text("keep")
        os.symlink(tmp_path / "elsewhere", out / "summary.json")
    else:
        (out / foreign).write_text("keep")
    before = sorted(os.listdir(out))
    with pytest.raises(ValueError, match="nothing deleted"):
        outdir.prepare_out(fake_args(out), SimpleNamespace(is_main=True))
    assert sorted(os.listdir(out)) == before and capsys.readouterr().out == ""
    assert (tmp_path / "elsewhere").read_text() == "keep" if foreign == "link" else True


def test_overwrite_on_a_shard_folder_from_the_trainer_deletes_nothing(data, tmp_path):
    """--out pointed at the shards by mistake (it holds a metrics.jsonl too): one line, every
    shard and manifest stays."""
    out = tmp_path / "shards"
    out.mkdir()
    for f in os.listdir(data):
        os.link(data / f, out / f)
    (out / "metrics.jsonl").write_text('{"kind": "step"}\n')
    before = {f: (out / f).read_bytes() for f in os.listdir(out)}
    p = train_in_process(["--train", f"mnist={data}/", "--epochs", "1", "--batch-size", "16", "--workers", "0",
                          "--width", "4", "--out", out, "--overwrite"])
    one_line_error(p, "pipeline-train", "--overwrite", "nothing deleted", ".tar'")
    assert {f: (out / f).read_bytes() for f in os.listdir(out)} == before


# ---------------------------------------------------------------- one writer per folder


@pytest.mark.slow
def test_a_second_make_shards_on_one_out_is_refused_while_the_first_writes(tmp_path):
    out = tmp_path / "out"
    args = [TOOL, "--synthetic", "--datasets", "mnist", "--splits", "train", "--limit", "10000", "--maxcount", "100",
            "--workers", "1", "--quiet", "--out", out]
    first = subprocess.Popen([sys.executable, *map(str, args)], cwd=tmp_path, env=ENV, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        end = time.time() + HANG  # a hang guard
        while not (out / shards.LOCK).exists() and first.poll() is None and time.time() < end:
            time.sleep(0.01)
        assert first.poll() is None, "the first writer ended before the second started; make it write longer"
        second = run(args, timeout=HANG)
    finally:
        out1, err1 = first.communicate(timeout=HANG)
    assert first.returncode == 0, err1[-2000:]
    one_line_error(second, "make-shards", "another make-shards is writing this folder", f"pid {first.pid}")
    assert "wrote manifests and shards" in out1
    verify = run([TOOL, "--verify", "--out", out])
    assert verify.returncode == 0 and "verify" in verify.stdout and "OK" in verify.stdout, verify.stdout
    assert not (out / shards.LOCK).exists()
    assert json.loads((out / "mnist-train.json").read_text())["total"] == 10000


def test_a_second_build_in_one_folder_is_refused_while_the_first_holds_it(tmp_path):
    """In one process, two threads: the folder lock is per open file, so it holds between
    threads as between processes. The first build is held half-way through its shards; the
    second, on the same folder, is refused at once; the first then finishes and verifies."""
    out, halfway, go = str(tmp_path / "out"), threading.Event(), threading.Event()

    class Held(SyntheticSource):
        def image(self, i):
            if i == 7:
                halfway.set()
                go.wait(30)
            return super().image(i)

    results = []
    first = threading.Thread(target=lambda: results.append(
        shards.build(Held("mnist", "train", 40, (1, 8, 8), 0), out, maxcount=5, progress=False)))
    first.start()
    try:
        assert halfway.wait(30)
        with pytest.raises(ShardError, match="another make-shards is writing this folder"):
            shards.build(SyntheticSource("mnist", "train", 40, (1, 8, 8), 1), out, maxcount=5, progress=False)
        with pytest.raises(ShardError, match="another make-shards is writing this folder"):
            shards.merge_parts(out, "mnist", "train")
    finally:
        go.set()
        first.join(30)
    assert len(results) == 1 and results[0]["total"] == 40
    assert verify.verify(out) == [] and not os.path.exists(os.path.join(out, shards.LOCK))


def test_the_lock_is_free_again_after_a_failed_build(tmp_path):
    class Broken(SyntheticSource):
        def image(self, i):
            if i == 7:
                raise OSError(28, "No space left on device")
            return super().image(i)

    with pytest.raises(OSError, match="No space"):
        shards.build(Broken("mnist", "train", 20, (1, 8, 8), 0), str(tmp_path), maxcount=5, progress=False)
    assert not (tmp_path / shards.LOCK).exists()
    shards.build(SyntheticSource("mnist", "train", 20, (1, 8, 8), 0), str(tmp_path), maxcount=5, progress=False)
    assert verify.verify(str(tmp_path)) == []


# ---------------------------------------------------------------- brace patterns and manifest bodies

ENTRIES = f"""
import importlib.util, resource
import pipeline.train.loop as train_entry
spec = importlib.util.spec_from_file_location("ms", {str(TOOL)!r})
make_shards_entry = importlib.util.module_from_spec(spec)
spec.loader.exec_module(make_shards_entry)
"""
LIMITED = r"""
what, argv = sys.argv[1], sys.argv[2:]
entry = train_entry if what == "train" else make_shards_entry
vm = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + (400 << 20), vm + (400 << 20)))
sys.exit(entry.main(argv))
"""


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    """limited("train" or TOOL, *argv): that entry point's main(argv) in a process whose address
    space may grow 400 MB past its imports. Both entry points are imported once (helpers.Forker);
    each call runs in a child forked from there, which sets its own cap."""
    with Forker(ENTRIES, tmp_path_factory.mktemp("limited"), env=ENV, cwd=ROOT) as forker:
        yield lambda *args, timeout=HANG: forker.run(LIMITED, *args, timeout=timeout)


@pytest.mark.parametrize("pattern", ["x-{0..999999999}.tar", *(pytest.param(p, marks=pytest.mark.slow) for p in (
    "x-{0..9}{0..9}{0..9}{0..9}{0..9}{0..9}{0..9}.tar", "x-{A..A}{0..99999999}.tar", "x-{0.." + "9" * 5000 + "}.tar",
    "{" * 3000 + "x" + "}" * 3000 + ".tar", "x-{0..3.tar"))])
@pytest.mark.slow
def test_a_brace_pattern_of_millions_is_one_line_within_a_memory_limit(tmp_path, pattern, limited):
    """Refused from counting, before braceexpand builds a single range (which it does in
    memory, whole, before yielding the first name), in both entry points, under 400 MB."""
    p = limited("train", "--train", f"x={tmp_path}/{pattern}", "--out", tmp_path / "run")
    one_line_error(p, "pipeline-train", "brace" if "{0..3" not in pattern else "Unbalanced")
    p = limited(TOOL, "--index", f"x:train={tmp_path}/{pattern}", "--out", tmp_path / "idx")
    one_line_error(p, "make-shards", "brace" if "{0..3" not in pattern else "Unbalanced")


@pytest.mark.slow
def test_a_pattern_within_the_cap_still_expands_as_braceexpand_does(tmp_path):
    assert patterns.expand_pattern("a{0..2}/{x,y{1..2}}") == ["a0/x", "a0/y1", "a0/y2", "a1/x", "a1/y1", "a1/y2",
                                                              "a2/x", "a2/y1", "a2/y2"]
    assert len(patterns.expand_pattern("{0..999}{0..999}")) == patterns.MAX_PATTERN
    with pytest.raises(ShardError, match="more than 1,000,000"):
        patterns.expand_pattern("{0..999}{0..1000}")


class Huge(Quiet, http.server.BaseHTTPRequestHandler):
    """A '2 GB manifest': announces 2e9 bytes (or none, chunked) and sends zeros for as long as it may."""

    def do_GET(self):
        self.send_response(200)
        announced = self.path.startswith("/announced/")
        if announced:
            self.send_header("Content-Length", str(2 * 10 ** 9))
        self.end_headers()
        try:
            end = time.time() + 20
            while time.time() < end and not self.server.stopping:
                self.wfile.write(b"0" * (1 << 20))
        except OSError:
            pass


@pytest.mark.parametrize("kind", ["announced", "streamed"])
def test_a_2gb_manifest_body_is_one_line_naming_its_url(tmp_path, kind, limited):
    with serving(Huge) as srv:
        url = f"{srv.url}{kind}/mnist-train.json"
        t0 = time.process_time()  # CPU seconds (the server is a thread here): 2 GB read would take far more
        with pytest.raises(ShardError) as e:
            manifest.load(url, policy=remote.Policy(retries=0, timeout=5))
        assert time.process_time() - t0 < 10
        assert str(e.value).startswith(f"cannot read manifest {url}: ") and "67108864" in str(e.value), e.value
        p = limited("train", "--train", f"mnist={srv.url}{kind}/", "--retries", "0", "--out", tmp_path / "run")
    one_line_error(p, "pipeline-train", url, "67108864")


def test_a_gzip_shard_cannot_claim_more_samples_than_it_may_inflate_to(tmp_path):
    """A 2 KB .tar.gz listed with 10**15 samples made an epoch of 10**15 samples (the shard's 200
    read over and over, for ever): its count is bounded by what the reader inflates it to at most."""
    from pipeline.data.shards.read import INFLATE_RATIO, INFLATE_SLACK

    def m(samples, nbytes=2000):
        return {"format": manifest.FORMAT, "dataset": "x", "split": "train", "shape": [1, 4, 4], "classes": ["a"],
                "mean": [0.5], "std": [0.25], "image_exts": ["png"], "shards": [{"name": "x-000000.tar.gz", "samples": samples,
                                                           "bytes": nbytes}]}

    most = (2000 * INFLATE_RATIO + INFLATE_SLACK) // 1024
    assert manifest.check(m(most), "x.json")
    with pytest.raises(ShardError, match=r"shards\[0\].samples: 10+ samples cannot fit in 2000 bytes once inflated"):
        manifest.check(m(10 ** 15), "x.json")
    with pytest.raises(ShardError, match="cannot fit"):
        manifest.check(m(most + 1), "x.json")


def test_a_local_file_past_the_ceiling_is_refused_before_it_is_read(tmp_path):
    """A sparse file of a terabyte takes no disk: --index hashed it for the whole deadline (20
    minutes at the default flags). A local file past --max-shard-bytes is refused from its size."""
    path = tmp_path / "b.tar"
    with open(path, "wb") as f:
        f.truncate((2 << 20) + 1)
    read = []
    policy = remote.Policy(**cli.io_limits(options.parse(["--train", "a=x/", "--max-shard-bytes", "2M"])))
    with pytest.raises(ShardError, match=r"b.tar: 2097153 bytes, more than 2097152 bytes.*--max-shard-bytes"):
        remote.read_url(str(path), read.append, policy=policy)
    assert not read
    with open(path, "r+b") as f:
        f.truncate(2 << 20)
    remote.read_url(str(path), read.append, policy=policy)  # at the ceiling: read
    assert read


@pytest.mark.parametrize("foreign", ["mnist-train-000000.tar", "mnist-train.json", "notes.txt", "sub/"])
def test_overwrite_refuses_a_folder_of_other_files_with_no_run_in_it(tmp_path, capsys, foreign):
    """No run there yet, only shards, a manifest or notes: --overwrite refuses as it does beside a run."""
    out = tmp_path / "shards"
    out.mkdir()
    if foreign.endswith("/"):
        (out / foreign).mkdir()
    else:
        (out / foreign).write_text("keep")
    with pytest.raises(ValueError, match=f"holds '{foreign.rstrip('/')}'.*nothing deleted"):
        outdir.prepare_out(fake_args(out), SimpleNamespace(is_main=True))
    assert os.listdir(out) == [foreign.rstrip("/")] and capsys.readouterr().out == ""
    empty = tmp_path / "empty"
    empty.mkdir()
    assert outdir.prepare_out(fake_args(empty), SimpleNamespace(is_main=True)) is None  # an empty folder is fine
    assert outdir.prepare_out(fake_args(tmp_path / "new"), SimpleNamespace(is_main=True)) is None
    assert (tmp_path / "new").is_dir()


@pytest.mark.parametrize("why, kw", [("--out", {}), ("--resume-or-start without a checkpoint", {"resume_or_start": True})])
def test_a_run_starts_only_in_a_folder_it_can_later_overwrite(tmp_path, capsys, why, kw):
    """Started without --overwrite in a folder of shards, a run would leave a folder --overwrite
    can never clear: it is refused the same way, naming what was asked (not --overwrite)."""
    out = tmp_path / "shards"
    out.mkdir()
    (out / "mnist-train-000000.tar").write_text("keep")
    with pytest.raises(ValueError, match=f"^{why}: .*holds 'mnist-train-000000.tar'.*nothing deleted"):
        outdir.prepare_out(SimpleNamespace(out=str(out), resume=False, overwrite=False, **kw),
                          SimpleNamespace(is_main=True))
    assert os.listdir(out) == ["mnist-train-000000.tar"] and capsys.readouterr().out == ""
