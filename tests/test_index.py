"""Other writers' WebDatasets: indexed in place with make_shards --index, then streamed and
trained on next to this project's own shards.

Three foreign layouts, written in the tests: wds.ShardWriter (PAX headers, JPEGs of mixed
sizes and modes, keys with directories), GNU tar over a folder (PNG + .cls, long names),
and img2dataset's (.jpg + .json label + .txt caption, plain and gzip-compressed).
"""
import hashlib
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from helpers import build_shards, free_port, write_gnu_tar, write_img2dataset, write_shardwriter
from pipeline.index import expand
from pipeline.stream import MixedStream, make_loader, resolve

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "make_shards.py")
SIZES = {"train": 240, "test": 60}


def make_shards(*args):
    return subprocess.run([sys.executable, TOOL, "--quiet", *map(str, args)], capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def foreign(tmp_path_factory):
    """Each foreign layout, train and test splits, indexed into one manifest folder."""
    top = tmp_path_factory.mktemp("foreign")
    keys = {}
    for split, n in SIZES.items():
        seed = 10 if split == "test" else 0
        keys["sw", split] = write_shardwriter(top / f"sw-{split}", n, seed=seed)
        keys["gnu", split] = write_gnu_tar(top / f"gnu-{split}", n, seed=seed + 1)
        keys["i2d", split] = write_img2dataset(top / f"i2d-{split}", n, seed=seed + 2, gz=split == "test")
    out = top / "manifests"
    for split in SIZES:
        p = make_shards("--index", f"sw:{split}={top}/sw-{split}", "--index", f"gnu:{split}={top}/gnu-{split}",
                        "--out", out)
        assert p.returncode == 0, p.stderr
        pattern = f"{top}/i2d-{split}/{{00000..{SIZES[split] // 20 - 1:05d}}}.tar" + (".gz" if split == "test" else "")
        p = make_shards("--index", f"i2d:{split}={pattern}", "--label-key", "json:label", "--out", out)
        assert p.returncode == 0, p.stderr
    build_shards(out, "mnist", "train", 400, shape=(1, 28, 28), encoding="png", maxcount=40)
    build_shards(out, "mnist", "test", 100, shape=(1, 28, 28), encoding="png", maxcount=40)
    return SimpleNamespace(top=top, out=out, keys=keys)


def manifest_of(foreign, name, split="train"):
    return json.loads((foreign.out / f"{name}-{split}.json").read_text())


def test_index_records_what_the_shards_hold(foreign):
    sw, gnu, i2d = (manifest_of(foreign, n) for n in ("sw", "gnu", "i2d"))
    for m, exts, label in ((sw, ["jpg"], "cls"), (gnu, ["png"], "cls"), (i2d, ["jpg"], "json:label")):
        assert m["origin"]["kind"] == "index" and m["total"] == SIZES["train"]
        assert m["image_exts"] == exts and m["label"] == label and m["classes"] == ["0", "1", "2", "3"]
        assert all(0 < x < 1 for x in m["mean"] + m["std"])
        for s in m["shards"]:
            path = s["name"]
            assert os.path.isabs(path)  # the manifest lives in another folder: absolute paths
            data = open(path, "rb").read()
            assert s["bytes"] == len(data) and s["sha256"] == hashlib.sha256(data).hexdigest()
    assert sw["shape"][0] == 3 and gnu["shape"] == [3, 32, 32] and i2d["shape"] == [3, 48, 48]


def test_index_beside_the_shards_uses_relative_names(foreign, tmp_path):
    folder = tmp_path / "gnu"
    write_gnu_tar(folder, 50)
    p = make_shards("--index", f"gnu:train={folder}", "--out", folder)
    assert p.returncode == 0, p.stderr
    m = json.loads((folder / "gnu-train.json").read_text())
    assert [s["name"] for s in m["shards"]] == ["gnu-0000.tar", "gnu-0001.tar"]
    assert resolve("gnu", str(folder), "train").total == 50


@pytest.mark.parametrize("workers", [0, 2])
def test_every_foreign_sample_streams_once_per_pass(foreign, workers):
    """Eval streams read every sample of every foreign layout exactly once, decoded to the
    source's shape, with the labels the writers gave them."""
    names = ("sw", "gnu", "i2d", "mnist")
    train = [resolve(n, str(foreign.out), "train") for n in names]
    stream = MixedStream(train, dict.fromkeys(names, 1), 16)
    for name in ("sw", "gnu", "i2d"):
        test = resolve(name, str(foreign.out), "test")
        keys = []
        for b in make_loader(stream.eval_stream(test), workers):
            assert b["image"].shape[1:] == (3, *stream.layout.hw) and b["skipped"] == 0
            offset = stream.layout.offsets[stream.layout.index(name)]
            for key, label in zip(b["key"], b["label"].tolist()):
                index = foreign.keys[name, "test"].index(key)
                assert label - offset == index % 4  # the writers' label: i % classes
            keys += b["key"]
        assert sorted(keys) == sorted(foreign.keys[name, "test"])


def test_members_nobody_asked_for_are_never_kept(foreign):
    """img2dataset's .txt captions are read past, not carried into the window."""
    src = resolve("i2d", str(foreign.out), "train")
    from pipeline import stages

    data = stages.Reader(src, {"skipped": 0})(stages.Window(tuple(src.urls[:1]), "t", 0))
    assert len(data) == 20 and set(data.exts) == {"jpg"}
    assert all(img[:2] == b"\xff\xd8" for img in data.images)


@pytest.mark.parametrize("case, needle", [
    ("no match", "no shards"), ("missing files", "do not exist"), ("no image", r"no \.png/\.jpg"),
    ("no label", "no .cls, .txt or .index"), ("bad label", "not an integer"), ("garbage", "unreadable|not a tar"),
])
def test_index_errors_are_one_line(tmp_path, case, needle):
    import io
    import tarfile

    folder = tmp_path / "d"
    folder.mkdir()
    spec = str(folder)
    members = {"no image": [("a.cls", b"1"), ("a.txt", b"x")], "no label": [("a.jpg", _jpeg())],
               "bad label": [("a.jpg", _jpeg()), ("a.cls", b"cat")]}
    if case == "no match":
        spec = str(folder / "x-{000..003}.tar")
        (folder / "unrelated.txt").write_text("x")
        spec = str(folder)
    elif case == "missing files":
        spec = str(folder / "x-{000..003}.tar")
    elif case == "garbage":
        (folder / "x.tar").write_bytes(b"\x01" * 5000)
    else:
        with tarfile.open(folder / "x.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
            for name, data in members[case]:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    p = make_shards("--index", f"x:train={spec}", "--out", tmp_path / "out")
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    import re

    assert re.search(needle, p.stderr), p.stderr
    assert not (tmp_path / "out" / "x-train.json").exists()


def _jpeg():
    from helpers import encode_pil, foreign_image

    return encode_pil(foreign_image(0, (8, 8), 0), "JPEG")


def test_expand_takes_folders_and_patterns(tmp_path):
    for name in ("b.tar", "a.tar.gz", "c.tgz", "notes.txt"):
        (tmp_path / name).write_bytes(b"")
    assert [os.path.basename(u) for u in expand(str(tmp_path))] == ["a.tar.gz", "b.tar", "c.tgz"]
    assert expand("http://h/x-{0..2}.tar") == ["http://h/x-0.tar", "http://h/x-1.tar", "http://h/x-2.tar"]


def test_training_on_unindexed_shards_says_how_to_index_them(tmp_path):
    write_gnu_tar(tmp_path, 30)
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-m", "pipeline.train", "--train", f"pets={tmp_path}/gnu-{{0000..0001}}.tar",
                        "--out", str(tmp_path / "run")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert f"make_shards.py --index 'pets:train={tmp_path}/gnu-{{0000..0001}}.tar'" in p.stderr


@pytest.mark.slow
def test_foreign_webdatasets_train_next_to_our_shards_under_torchrun(foreign, tmp_path):
    """2 ranks over three foreign layouts and a make_shards source: equal batches, no key
    twice within an epoch, every test sample counted once, and the run learns."""
    out = tmp_path / "run"
    base = f"{foreign.out}/"
    args = [a for n in ("sw", "gnu", "i2d", "mnist") for a in ("--train", f"{n}={base}", "--eval", f"{n}={base}")]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                        f"--master_port={free_port()}", "-m", "pipeline.train", *args, "--epochs", "6",
                        "--weights", "sw=240,gnu=240,i2d=240,mnist=400", "--epoch-samples", "560",
                        "--batch-size", "16", "--workers", "2", "--width", "16", "--shuffle-buffer", "40",
                        "--record-keys", "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    per_epoch = 560 // 32  # half of the data an epoch, by size: no slot runs out of its shards
    assert [e["batches"] for e in s["epochs"]] == [{"rank0": per_epoch, "rank1": per_epoch}] * 6
    assert {k: v["count"] for k, v in s["eval"].items()} == {"sw": 60, "gnu": 60, "i2d": 60, "mnist": 100}
    lines = [ln.split("\t") for r in (0, 1) for ln in (out / f"keys-rank{r}.txt").read_text().splitlines()]
    for epoch in range(1, 7):
        keys = [k for e, k in lines if int(e) == epoch]
        assert len(keys) == per_epoch * 32 and len(set(keys)) == len(keys), f"a key twice in epoch {epoch}"
    for name in ("sw", "gnu", "i2d"):
        assert s["accuracy"][name] > 0.6, s["accuracy"]  # 4 classes: chance is 0.25
        assert s["data"][name]["origin"] == "an indexed WebDataset"


def test_gzip_shards_index_even_when_they_compress_well(tmp_path):
    """Compressed sizes say nothing about sample counts: plain images in a gzipped tar take a
    fraction of 1 KB a sample, which the check for uncompressed shards would have refused."""
    import gzip

    from PIL import Image

    from helpers import encode_pil, write_tar

    (tmp_path / "gz").mkdir()
    for i in range(2):
        members = []
        for k in range(20):
            members += [(f"s{i}-{k:03d}.png", encode_pil(Image.new("L", (28, 28), k), "PNG")),
                        (f"s{i}-{k:03d}.cls", str(k % 3).encode())]
        write_tar(tmp_path / "plain.tar", members)
        (tmp_path / "gz" / f"m-{i}.tar.gz").write_bytes(gzip.compress((tmp_path / "plain.tar").read_bytes()))
    assert (tmp_path / "gz" / "m-0.tar.gz").stat().st_size < 20 * 1024
    p = make_shards("--index", f"m:train={tmp_path / 'gz'}", "--out", tmp_path / "gz")
    assert p.returncode == 0, p.stderr
    assert resolve("m", str(tmp_path / "gz"), "train").total == 40
