"""tools/make_shards.py end to end on tiny files in the real formats, and its answers to bad input.

Runs that import torchvision cost seconds each in a fresh process, so the few checks that
need the real command line (exit code, stderr) run it as a subprocess and the rest call
main(argv) in-process.
"""
import collections
import contextlib
import importlib.util
import re
import json
import os
import pickle
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from helpers import HANG, make_shards_in_process, run_capture, write_tar
from pipeline.writers import shards, sources
from pipeline.writers import verify

TOOL = Path(__file__).resolve().parents[1] / "tools" / "make_shards.py"


def cli_subprocess(cwd, *args):
    """Run the tool as a user would; cwd is a scratch folder so defaults never touch the repo."""
    return run_capture([sys.executable, str(TOOL), *map(str, args)], cwd=cwd, capture_output=True,
                       text=True, timeout=HANG)


def cli(cwd, *args):
    """The tool's main() in process from `cwd`, as a CompletedProcess: no interpreter to start.
    test_synthetic_writes_both_datasets_and_splits runs the real script (cli_subprocess)."""
    with contextlib.chdir(cwd):
        return make_shards_in_process(args)


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("make_shards_under_test", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def main(tool, capsys):
    """main(*argv) in-process -> (exit code, stdout, stderr); an uncaught exception fails the test."""
    def run(*argv):
        try:
            code = tool.main([str(a) for a in argv])
        except SystemExit as e:
            code = e.code
        out, err = capsys.readouterr()
        return code, out, err
    return run


def assert_one_error_line(code, err, *fragments):
    assert code == 2
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("make-shards: error:"), err
    for f in fragments:
        assert f in lines[0], err


def manifests(folder):
    return {f[:-5]: json.loads((folder / f).read_text()) for f in os.listdir(folder) if f.endswith(".json")}


def decoded_samples(folder, m, read_tar, decode_image):
    """{index in the source: (CHW image, label)} for every sample of a manifest, read with tarfile."""
    out = {}
    for s in m["shards"]:
        for key, sample in read_tar(folder / s["name"]):
            assert set(sample) == {m["encoding"], "cls"}
            i = int(key.rsplit("-", 1)[1])
            assert i not in out
            out[i] = (decode_image(sample[m["encoding"]], m["encoding"], m["shape"]), int(sample["cls"]))
    assert len(out) == m["total"] == sum(s["samples"] for s in m["shards"])
    return out


def save_images(folder, images, mode=None):
    folder.mkdir(parents=True, exist_ok=True)
    for i, a in enumerate(images):
        Image.fromarray(a, mode).save(folder / f"{i:02d}.png")


# ---------------------------------------------------------------- data sets


def test_synthetic_writes_both_datasets_and_splits(tmp_path, read_tar, decode_image):
    p = cli_subprocess(tmp_path, "--synthetic", "--limit", 12, "--maxcount", 5, "--workers", 2, "--quiet",
                       "--out", "out")
    assert p.returncode == 0, p.stderr
    assert p.stderr == ""
    out = tmp_path / "out"
    ms = manifests(out)
    assert sorted(ms) == ["cifar10-test", "cifar10-train", "mnist-test", "mnist-train"]
    for name, m in ms.items():
        dataset = name.split("-")[0]
        assert m["shape"] == {"mnist": [1, 28, 28], "cifar10": [3, 32, 32]}[dataset]
        assert m["classes"] == sources.CLASSES[dataset] and len(m["classes"]) == 10
        assert [s["samples"] for s in m["shards"]] == [5, 5, 2]
        assert name in p.stdout
        for image, label in decoded_samples(out, m, read_tar, decode_image).values():
            assert image.shape == tuple(m["shape"]) and 0 <= label < 10
    assert verify.verify(str(out)) == []


def write_idx(path, array):
    """The MNIST IDX format: big-endian magic 0x0803 (uint8, 3 dims) or 0x0801, dims, then the bytes."""
    magic = {3: 2051, 1: 2049}[array.ndim]
    path.write_bytes(struct.pack(f">I{array.ndim}I", magic, *array.shape) + array.astype(np.uint8).tobytes())


def test_mnist_from_idx_files(tmp_path, read_tar, decode_image):
    rng = np.random.default_rng(0)
    raw = tmp_path / "root" / "MNIST" / "raw"
    raw.mkdir(parents=True)
    data = {}
    for split, prefix, n in (("train", "train", 7), ("test", "t10k", 4)):
        images, labels = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8), rng.integers(0, 10, n, dtype=np.uint8)
        write_idx(raw / f"{prefix}-images-idx3-ubyte", images)
        write_idx(raw / f"{prefix}-labels-idx1-ubyte", labels)
        data[split] = images, labels

    p = cli(tmp_path, "--datasets", "mnist", "--root", "root", "--out", "out", "--maxcount", 3, "--workers", 1,
            "--quiet")
    assert p.returncode == 0, p.stderr
    ms = manifests(tmp_path / "out")
    assert sorted(ms) == ["mnist-test", "mnist-train"]
    for split, (images, labels) in data.items():
        m = ms[f"mnist-{split}"]
        assert m["shape"] == [1, 28, 28] and m["classes"] == [str(d) for d in range(10)]
        got = decoded_samples(tmp_path / "out", m, read_tar, decode_image)
        assert sorted(got) == list(range(len(images)))
        for i, (image, label) in got.items():
            np.testing.assert_array_equal(image, images[i][None])
            assert label == labels[i]


def write_cifar(root, rng, sizes):
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rows = {}
    for name, n in sizes.items():
        rows[name] = rng.integers(0, 256, (n, 3072), dtype=np.uint8), rng.integers(0, 10, n).tolist()
        batch = {"batch_label": name, "data": rows[name][0], "labels": rows[name][1],
                 "filenames": [f"{name}_{i}.png" for i in range(n)]}
        (folder / name).write_bytes(pickle.dumps(batch, protocol=2))
    meta = {"label_names": sources.CLASSES["cifar10"], "num_cases_per_batch": 2, "num_vis": 3072}
    (folder / "batches.meta").write_bytes(pickle.dumps(meta, protocol=2))
    return rows


@pytest.mark.parametrize("download, says", [(False, "could not read the files under"),
                                             (True, "could not download to or read the files under")])
def test_an_os_error_says_what_was_being_done(tmp_path, monkeypatch, download, says):
    """An OSError from torchvision is a failed download only maybe, and only when one was asked
    for (torchvision reads the files it finds instead); without --download it is a file that
    could not be read. The message says so on one line, with the error's last line, its cause."""
    import torchvision

    def unreadable(*args, **kwargs):
        raise PermissionError("reading 'root/MNIST/raw/train-images-idx3-ubyte' failed:\n[Errno 13] Permission denied")

    monkeypatch.setattr(torchvision.datasets, "MNIST", unreadable)
    with pytest.raises(sources.SourceError) as raised:
        sources.torchvision_source("mnist", "train", str(tmp_path), download=download)
    message = str(raised.value)
    assert says in message and "Permission denied" in message and "\n" not in message, message
    assert ("could not download" in message) == download, message


def test_cifar10_from_pickle_batches(tmp_path, monkeypatch, read_tar, decode_image):
    import torchvision

    sizes = {**{f"data_batch_{k}": 2 for k in range(1, 6)}, "test_batch": 3}
    rows = write_cifar(tmp_path / "root", np.random.default_rng(1), sizes)
    with pytest.raises(sources.SourceError, match="no usable data"):  # our fake files fail the md5 check
        sources.torchvision_source("cifar10", "test", str(tmp_path / "root"))

    monkeypatch.setattr(torchvision.datasets.CIFAR10, "_check_integrity", lambda self: True)
    monkeypatch.setattr(torchvision.datasets.cifar, "check_integrity", lambda *a, **k: True)  # batches.meta
    for split, names in (("train", [f"data_batch_{k}" for k in range(1, 6)]), ("test", ["test_batch"])):
        src = sources.torchvision_source("cifar10", split, str(tmp_path / "root"))
        assert (len(src), src.shape) == (sum(sizes[n] for n in names), (3, 32, 32))
        m = shards.build(src, str(tmp_path / "out"), maxcount=4, progress=False)
        # a CIFAR row is planar: 1024 red, 1024 green, 1024 blue bytes
        images = np.concatenate([rows[n][0] for n in names]).reshape(-1, 3, 32, 32)
        labels = sum((rows[n][1] for n in names), [])
        got = decoded_samples(tmp_path / "out", m, read_tar, decode_image)
        assert sorted(got) == list(range(len(images)))
        for i, (image, label) in got.items():
            np.testing.assert_array_equal(image, images[i])
            assert label == labels[i]


def test_imagefolder_with_holdout(tmp_path, main, read_tar, decode_image):
    rng = np.random.default_rng(2)
    expected = collections.Counter()
    for label, cls in enumerate(["cat", "dog", "emu"]):
        images = rng.integers(0, 256, (4, 5, 6, 3), dtype=np.uint8)  # 6 wide, 5 high
        save_images(tmp_path / "pets" / cls, images)
        expected.update((a.transpose(2, 0, 1).tobytes(), label) for a in images)

    code, out, err = main("--imagefolder", f"pets:train={tmp_path / 'pets'}", "--holdout", 3,
                          "--out", tmp_path / "out", "--maxcount", 4, "--workers", 1, "--quiet")
    assert code == 0, err
    assert "pets-train" in out and "pets-test" in out
    ms = manifests(tmp_path / "out")
    assert sorted(ms) == ["pets-test", "pets-train"]
    assert (ms["pets-train"]["total"], ms["pets-test"]["total"]) == (9, 3)
    got = {}
    for name, m in ms.items():
        assert m["shape"] == [3, 5, 6] and m["classes"] == ["cat", "dog", "emu"]
        got[name] = collections.Counter((image.tobytes(), label) for image, label in
                                        decoded_samples(tmp_path / "out", m, read_tar, decode_image).values())
    assert got["pets-train"] + got["pets-test"] == expected
    assert not got["pets-train"] & got["pets-test"]


def test_imagefolder_grey(tmp_path, main, read_tar, decode_image):
    rng = np.random.default_rng(3)
    for cls in ("a", "b"):
        save_images(tmp_path / "in" / cls, rng.integers(0, 256, (3, 4, 7), dtype=np.uint8), "L")
    code, out, err = main("--imagefolder", f"digits:train={tmp_path / 'in'}", "--encoding", "raw",
                          "--out", tmp_path / "out", "--workers", 1, "--quiet")
    assert code == 0, err
    m = manifests(tmp_path / "out")["digits-train"]
    assert (m["shape"], m["classes"], m["total"]) == ([1, 4, 7], ["a", "b"], 6)
    folder = sources.ImageFolderSource("digits", "train", str(tmp_path / "in"))
    for i, (image, label) in decoded_samples(tmp_path / "out", m, read_tar, decode_image).items():
        path, want = folder.samples[i]
        np.testing.assert_array_equal(image, np.asarray(Image.open(path))[None])
        assert label == want


def test_part_then_merge_equals_single_build(tmp_path):
    common = ("--synthetic", "--datasets", "mnist", "--splits", "test", "--limit", 23, "--maxcount", 5,
              "--seed", 3, "--encoding", "raw", "--workers", 1, "--quiet")
    assert cli(tmp_path, *common, "--out", "whole").returncode == 0
    for i in range(2):
        p = cli(tmp_path, *common, "--out", "parts", "--part", f"{i}/3")
        assert p.returncode == 0, p.stderr
    p = cli(tmp_path, "--merge", "--datasets", "mnist", "--splits", "test", "--out", "parts")
    assert_one_error_line(p.returncode, p.stderr, "need 0..2 of 3")
    p = cli(tmp_path, *common, "--out", "parts", "--part", "2/3")
    assert p.returncode == 0, p.stderr
    p = cli(tmp_path, "--merge", "--datasets", "mnist", "--splits", "test", "--out", "parts")
    assert p.returncode == 0, p.stderr
    assert "merged mnist-test: 5 shards, 23 samples" in p.stdout

    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert sorted(os.listdir(parts)) == sorted(os.listdir(whole))  # no part manifests left
    m, w = manifests(parts)["mnist-test"], manifests(whole)["mnist-test"]
    assert [(s["name"], s["samples"], s["sha256"]) for s in m["shards"]] == \
        [(s["name"], s["samples"], s["sha256"]) for s in w["shards"]]
    assert m == w and m["total"] == 23
    for f in os.listdir(whole):
        assert (parts / f).read_bytes() == (whole / f).read_bytes(), f


def test_verify_cli(tmp_path):
    assert cli(tmp_path, "--synthetic", "--datasets", "mnist", "--splits", "test", "--limit", 6, "--maxcount", 3,
               "--workers", 1, "--quiet", "--out", "out").returncode == 0
    p = cli(tmp_path, "--verify", "--out", "out")
    assert p.returncode == 0 and "FAIL" not in p.stdout and "OK" in p.stdout
    # what an OK covers (it printed only "OK")
    assert "checked 1 manifest(s), 2 shard(s), 6 sample(s): each shard's size, sha256 and sample count" in p.stdout
    shard = tmp_path / "out" / "mnist-test-000001.tar"
    data = bytearray(shard.read_bytes())
    data[600] ^= 0xFF
    shard.write_bytes(bytes(data))
    p = cli(tmp_path, "--verify", "--out", "out")
    assert p.returncode == 1
    assert "FAIL mnist-test.json: mnist-test-000001.tar: sha256 differs from the manifest" in p.stdout.splitlines()
    assert "1 problem(s)" in p.stdout and "Traceback" not in p.stderr


def test_a_failed_download_is_named_in_one_line_and_not_suggested_again(tmp_path, main, monkeypatch):
    """Offline, --download fails in torchvision with a multi-line error (one line per mirror
    tried): the fallback says the download failed, with its cause, and does not tell the
    user to pass the --download they passed; without the fallback the error is one line."""
    import torchvision

    def offline(*args, **kwargs):
        raise RuntimeError("Error downloading train-images-idx3-ubyte.gz:\nTried https://a/, got:\n"
                           "<urlopen error [Errno -2] Name or service not known>\n")

    monkeypatch.setattr(torchvision.datasets, "MNIST", offline)
    common = ["--datasets", "mnist", "--splits", "train", "--root", tmp_path, "--download", "--limit", 5,
              "--workers", 1, "--quiet"]
    code, out, err = main(*common, "--fallback-synthetic", "--out", tmp_path / "out")
    assert code == 0, err
    assert len(err.splitlines()) == 1 and "could not download" in err and "Name or service not known" in err, err
    assert "SYNTHETIC" in err and "--download" not in err.split("for real data")[1]
    code, out, err = main(*common, "--out", tmp_path / "out2")
    assert code == 2 and len(err.splitlines()) == 1 and "could not download to" in err and "\\n" not in err, err

    def damaged(*args, **kwargs):
        raise AssertionError()  # what torchvision asserts on files it finds damaged, without a message

    monkeypatch.setattr(torchvision.datasets, "MNIST", damaged)
    code, out, err = main(*common, "--out", tmp_path / "out3")
    assert code == 2 and len(err.splitlines()) == 1 and err.rstrip().endswith("AssertionError"), err


def test_fallback_synthetic(tmp_path, main):
    (tmp_path / "empty").mkdir()
    code, out, err = main("--datasets", "mnist", "--splits", "train", "test", "--root", tmp_path / "empty",
                          "--fallback-synthetic", "--limit", 5, "--out", tmp_path / "out", "--workers", 1, "--quiet")
    assert code == 0, err
    lines = err.splitlines()  # one line for the data set, naming every way to supply real data
    assert len(lines) == 1 and "mnist: no real data" in lines[0] and "SYNTHETIC" in lines[0], err
    assert "MNIST/raw/" in lines[0] and "--download" in lines[0]
    assert "mnist-train: SYNTHETIC look-alike data" in out and "mnist-test: SYNTHETIC look-alike data" in out
    m = manifests(tmp_path / "out")["mnist-test"]
    assert (m["total"], m["shape"], m["origin"]["kind"]) == (5, [1, 28, 28], "synthetic")


def test_cifar10_as_a_folder_of_images(tmp_path, main):
    """make demo CIFAR10_DIR=DIR: train/ and test/ class folders become cifar10-train and -test."""
    from PIL import Image

    for split, n in (("train", 3), ("test", 2)):
        for c in ("airplane", "automobile"):
            (tmp_path / "c10" / split / c).mkdir(parents=True)
            for i in range(n):
                Image.new("RGB", (32, 32), (i * 40, 0, 0)).save(tmp_path / "c10" / split / c / f"{i}.jpg")
    code, out, err = main("--datasets", "mnist", "--synthetic", "--limit", 10, "--cifar10-dir", tmp_path / "c10",
                          "--out", tmp_path / "out", "--workers", 1, "--quiet")
    assert code == 0, err
    ms = manifests(tmp_path / "out")
    assert ms["cifar10-train"]["total"] == 6 and ms["cifar10-test"]["total"] == 4
    assert ms["cifar10-train"]["origin"]["kind"] == "imagefolder" and ms["mnist-train"]["origin"]["kind"] == "synthetic"
    assert "cifar10-train: real images from the ImageFolder" in out


# ---------------------------------------------------------------- bad input


def test_missing_data_without_download(tmp_path):
    (tmp_path / "empty").mkdir()
    p = cli(tmp_path, "--datasets", "mnist", "--splits", "test", "--root", "empty", "--out", "out", "--quiet")
    assert_one_error_line(p.returncode, p.stderr, "mnist test", "--download")
    assert not (tmp_path / "out").exists()  # the folder it made for them is taken back


@pytest.mark.parametrize("args,fragment", [
    (["--datasets", "imagenet"], "unknown dataset 'imagenet'"),
    (["--part", "3/3"], "need 0 <= I < N"),
    (["--part", "two"], "expected I/N"),
    (["--limit", "0"], "--limit must be at least 1"),
    (["--imagefolder", "pets=dir"], "expected NAME:SPLIT="),
    (["--imagefolder", "my.pets:train=dir"], "letters, digits and _ only"),
])
def test_bad_arguments(tmp_path, args, fragment):
    p = cli(tmp_path, "--synthetic", *args)
    assert_one_error_line(p.returncode, p.stderr, fragment)
    assert os.listdir(tmp_path) == []


def test_unwritable_output_folder(tmp_path):
    (tmp_path / "afile").write_text("not a folder")
    p = cli(tmp_path, "--synthetic", "--datasets", "mnist", "--splits", "test", "--limit", 3, "--quiet",
            "--out", "afile/sub")
    assert_one_error_line(p.returncode, p.stderr, "afile/sub")


def test_progress_bars_written_to_a_log_file_are_lines(tmp_path):
    """Off a terminal tqdm's carriage-return redraws made one huge line of a whole build."""
    p = cli(tmp_path, "--synthetic", "--datasets", "mnist", "--splits", "test", "--limit", 40, "--maxcount", 10,
            "--workers", 1, "--out", "out")
    assert p.returncode == 0, p.stderr
    assert "\r" not in p.stderr and "mnist-test" in p.stderr, p.stderr
    assert all(len(line) <= 200 for line in p.stderr.splitlines()), p.stderr


@pytest.mark.parametrize("out", ["", "  "])
def test_an_empty_out_is_one_line_as_the_trainer_s(tmp_path, out):
    """`--out ""` wrote ./shards/ without a word; the trainer refuses an empty --out."""
    p = cli(tmp_path, "--synthetic", "--datasets", "mnist", "--splits", "test", "--limit", 3, "--quiet", "--out", out)
    assert_one_error_line(p.returncode, p.stderr, "--out: empty")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("layout", ["empty", "no_images", "absent"])
def test_empty_imagefolder(tmp_path, main, layout):
    folder = tmp_path / "pets"
    if layout != "absent":
        folder.mkdir()
    if layout == "no_images":
        (folder / "cat").mkdir()
        (folder / "cat" / "notes.txt").write_text("no images here")
    code, _, err = main("--imagefolder", f"pets:train={folder}", "--out", tmp_path / "out", "--workers", 1,
                        "--quiet")
    assert_one_error_line(code, err, str(folder))


def odd_imagefolder(root, odd):
    """RGB 6x5 images in classes a and b; `odd` replaces one of them."""
    rng = np.random.default_rng(4)
    for cls in ("a", "b"):
        save_images(root / cls, rng.integers(0, 256, (4, 5, 6, 3), dtype=np.uint8))
    if odd == "size":  # last in sorted order, so found while writing, in a writer process
        Image.fromarray(rng.integers(0, 256, (6, 6, 3), dtype=np.uint8)).save(root / "b" / "99.png")
    elif odd == "rgba":
        Image.fromarray(rng.integers(0, 256, (5, 6, 4), dtype=np.uint8), "RGBA").save(root / "b" / "99.png")
    elif odd == "palette_first":  # first in sorted order, so it decides the mode
        Image.fromarray(rng.integers(0, 256, (5, 6), dtype=np.uint8), "L").convert("P").save(root / "a" / "00.png")


@pytest.mark.parametrize("odd,fragments", [
    ("size", ["99.png", "RGB 6x6", "a/00.png, is RGB 6x5", "--shape 3,5,6"]),
    ("rgba", ["99.png", "RGBA 6x5", "a/00.png, is RGB 6x5", "--shape 3,5,6"]),
    ("palette_first", ["00.png", "image mode P", "give --shape C,H,W"]),
])
def test_imagefolder_with_an_odd_image(tmp_path, main, odd, fragments):
    odd_imagefolder(tmp_path / "pets", odd)
    code, _, err = main("--imagefolder", f"pets:train={tmp_path / 'pets'}", "--out", tmp_path / "out",
                        "--maxcount", 2, "--workers", 2, "--quiet")
    assert_one_error_line(code, err, *fragments)
    assert not (tmp_path / "out").exists()  # nothing written: the folder it made is taken back


def mixed_imagefolder(root):
    """Photos as a camera roll holds them: sizes, grey, CMYK, palette, RGBA, one turned by EXIF."""
    rng = np.random.default_rng(5)
    (root / "a").mkdir(parents=True)
    (root / "b").mkdir()
    Image.fromarray(rng.integers(0, 256, (5, 6, 3), dtype=np.uint8)).save(root / "a" / "0.png")
    Image.fromarray(rng.integers(0, 256, (9, 8), dtype=np.uint8), "L").save(root / "a" / "1.jpg")
    Image.fromarray(rng.integers(0, 256, (7, 10, 4), dtype=np.uint8), "CMYK").save(root / "a" / "2.jpg")
    Image.fromarray(rng.integers(0, 256, (12, 11), dtype=np.uint8), "L").convert("P").save(root / "b" / "0.png")
    Image.fromarray(rng.integers(0, 256, (6, 6, 4), dtype=np.uint8), "RGBA").save(root / "b" / "1.png")
    exif = Image.Exif()
    exif[0x0112] = 6  # stored turned: upright it is 16 wide and 20 high
    Image.fromarray(rng.integers(0, 256, (16, 20, 3), dtype=np.uint8)).save(root / "b" / "2.jpg", exif=exif)


@pytest.mark.parametrize("shape", [(3, 5, 6), (1, 8, 8)])
def test_imagefolder_with_shape_decodes_every_image_to_it_as_the_stream_does(tmp_path, main, read_tar,
                                                                            decode_image, shape):
    """Without --shape every image must match the first; with it, each is decoded to the shape by
    the stream's own decode_image (orientation, grey, CMYK, palette, resize), byte for byte."""
    mixed_imagefolder(tmp_path / "pets")
    code, _, err = main("--imagefolder", f"pets:train={tmp_path / 'pets'}", "--out", tmp_path / "plain",
                        "--workers", 1, "--quiet")
    assert_one_error_line(code, err, "--shape")
    code, _, err = main("--imagefolder", f"pets:train={tmp_path / 'pets'}", "--shape", ",".join(map(str, shape)),
                        "--encoding", "raw", "--out", tmp_path / "out", "--workers", 1, "--quiet")
    assert code == 0, err
    m = manifests(tmp_path / "out")["pets-train"]
    assert (m["shape"], m["total"]) == (list(shape), 6)
    from pipeline.data.decoding.decode import decode_image as stream_decode

    folder = sources.ImageFolderSource("pets", "train", str(tmp_path / "pets"), shape=shape)
    for i, (image, label) in decoded_samples(tmp_path / "out", m, read_tar, decode_image).items():
        path, want = folder.samples[i]
        np.testing.assert_array_equal(image, stream_decode(Path(path).read_bytes(), path.rsplit(".", 1)[1], shape))
        assert label == want


def test_imagefolder_without_shape_stores_photos_upright(tmp_path, main, read_tar, decode_image):
    """Phone photos stored turned (EXIF orientation 6, 3) were kept as their raw pixels, sideways,
    where --shape and the stream turn them upright (hostileL): upright on both paths."""
    rng = np.random.default_rng(6)
    (tmp_path / "pets" / "a").mkdir(parents=True)
    for i, orientation in enumerate((6, 3, 1)):
        exif = Image.Exif()
        exif[0x0112] = orientation
        stored = rng.integers(0, 256, (20, 36, 3) if orientation == 6 else (36, 20, 3), dtype=np.uint8)
        Image.fromarray(stored).save(tmp_path / "pets" / "a" / f"{i}.jpg", exif=exif, quality=95)
    code, _, err = main("--imagefolder", f"pets:train={tmp_path / 'pets'}", "--encoding", "png", "--out",
                        tmp_path / "out", "--workers", 1, "--quiet")
    assert code == 0, err
    m = manifests(tmp_path / "out")["pets-train"]
    assert m["shape"] == [3, 36, 20]
    from PIL import ImageOps

    folder = sources.ImageFolderSource("pets", "train", str(tmp_path / "pets"))
    for i, (image, _) in decoded_samples(tmp_path / "out", m, read_tar, decode_image).items():
        want = np.asarray(ImageOps.exif_transpose(Image.open(folder.samples[i][0])).convert("RGB"))
        np.testing.assert_array_equal(image, want.transpose(2, 0, 1))


@pytest.mark.parametrize("flags,fragment", [
    (["--imagefolder", "pets:train=DIR", "--shape", "2,5,6"], "C must be 1 or 3"),
    (["--imagefolder", "pets:train=DIR", "--shape", "3,0,6"], "each side 1.."),
    (["--synthetic", "--shape", "3,5,6"], "--shape applies to --index and --imagefolder only"),
])
def test_a_shape_that_cannot_be_is_refused_before_any_image_is_read(tmp_path, main, flags, fragment):
    mixed_imagefolder(tmp_path / "pets")
    code, _, err = main(*[f.replace("DIR", str(tmp_path / "pets")) for f in flags], "--out", tmp_path / "out")
    assert_one_error_line(code, err, fragment)


def test_a_build_that_fails_after_a_split_says_which_were_written(tmp_path, main):
    """A second source failing leaves the first split written whole; a line before the error says
    so (a newcomer otherwise took the set for untouched, then met 'replaced' on the next run)."""
    save_images(tmp_path / "good" / "a", np.zeros((3, 5, 6, 3), np.uint8))
    odd_imagefolder(tmp_path / "odd", "size")
    code, _, err = main("--imagefolder", f"good:train={tmp_path / 'good'}", "--imagefolder",
                        f"odd:train={tmp_path / 'odd'}", "--out", tmp_path / "out", "--workers", 1, "--quiet")
    assert code == 2
    note, error = err.splitlines()
    assert note == f"make-shards: before the error below, wrote good-train.json in {tmp_path / 'out'}; the " \
                   "split(s) after them were not written", err
    assert error.startswith("make-shards: error:") and "99.png" in error
    assert sorted(manifests(tmp_path / "out")) == ["good-train"]


def test_the_last_line_says_what_was_written_where_and_how_long(main, tmp_path):
    code, out, _ = main("--synthetic", "--datasets", "mnist", "--limit", "30", "--maxcount", "10", "--quiet",
                        "--out", tmp_path)
    assert code == 0
    last = out.splitlines()[-1]
    assert re.fullmatch(rf"done in \d+\.\d s: wrote manifests and shards of 2 split\(s\) to {tmp_path}/ "
                        r"\(6 shards, 60 samples, \d+\.\d MB\); manifests: mnist-train\.json, mnist-test\.json",
                        last), last


def test_a_test_split_indexed_alone_with_other_classes_is_pointed_at_classes_from(main, tmp_path):
    from helpers import write_img2dataset

    write_img2dataset(tmp_path / "train", 20, classes=4, per_shard=10)
    write_img2dataset(tmp_path / "test", 9, classes=3, per_shard=10)
    out = tmp_path / "out"
    code, said, err = main("--index", f"web:train={tmp_path}/train", "--label-key", "json:label", "--out", out)
    assert code == 0, err
    code, said, err = main("--index", f"web:test={tmp_path}/test", "--label-key", "json:label", "--out", out)
    assert code == 0, err
    assert (f"warning: 3 classes here, 4 other ones in {out}/web-train.json: the trainer refuses this pair; index "
            f"this split again with --classes-from {out}/web-train.json") in said
    code, said, err = main("--index", f"web:test={tmp_path}/test", "--label-key", "json:label", "--classes-from",
                           out / "web-train.json", "--out", out)
    assert code == 0 and "warning" not in said, err


def test_a_key_with_control_characters_is_printed_as_escapes(main, tmp_path):
    """A member name is whatever the shard's writer chose: an escape sequence in a key that
    an error quotes is shown as its escape, not sent to the terminal (which it would clear)."""
    evil = "evil\x1b[2J\x1b[31mowned"
    write_tar(tmp_path / "s-000000.tar", [(f"{evil}.png", b"not a png"), (f"{evil}.cls", b"1")])
    code, out, err = main("--index", f"x:train={tmp_path}/s-000000.tar", "--out", tmp_path / "out", "--quiet")
    assert_one_error_line(code, err, "sample evil\\x1b[2J\\x1b[31mowned")
    assert "\x1b" not in err


def test_a_warning_quoting_a_key_escapes_its_control_characters():
    from pipeline.errors import Errors

    with pytest.warns(UserWarning) as caught:
        Errors("warn")("s.tar: sample a\rb\x1b[2J: bad")
    assert str(caught[0].message) == "s.tar: sample a\\rb\\x1b[2J: bad"


# ---------------------------------------------------------------- the folder may hold other people's files


SMALL = ("--synthetic", "--datasets", "mnist", "--splits", "train", "--limit", 12, "--maxcount", 5, "--workers", 1,
         "--quiet", "--out", "out")


def folder_bytes(folder):
    return {f: (folder / f).read_bytes() for f in sorted(os.listdir(folder))}


def test_a_file_no_manifest_names_is_left_alone(main, tmp_path, monkeypatch):
    """A user's mnist-train-000099.tar in --out, no manifest: the build writes 000000-000002 and
    the user's file is still there, byte for byte, on the first build and on a rebuild."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mnist-train-000099.tar").write_bytes(b"mine")
    for _ in range(2):
        code, out, err = main(*SMALL)
        assert code == 0, err
        assert (tmp_path / "out" / "mnist-train-000099.tar").read_bytes() == b"mine"
    assert "replaced mnist-train.json" in out and "no other file touched" in out


def test_a_name_the_build_needs_held_by_a_file_no_manifest_names_is_refused(main, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mnist-train-000001.tar").write_bytes(b"mine")
    code, out, err = main(*SMALL)
    assert_one_error_line(code, err, "out/mnist-train-000001.tar exists", "refusing to overwrite")
    assert os.listdir(tmp_path / "out") == ["mnist-train-000001.tar"]
    assert (tmp_path / "out" / "mnist-train-000001.tar").read_bytes() == b"mine"


def test_a_rebuild_removes_only_the_shards_its_old_manifest_listed(main, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(*SMALL[:-2], "--limit", 30, "--out", "out")[0] == 0  # 6 shards
    (tmp_path / "out" / "mnist-train-000042.tar").write_bytes(b"mine")
    code, out, err = main(*SMALL)  # 3 shards: 3 old ones go, the user's stays
    assert code == 0, err
    assert "3 shards rewritten, 3 shards deleted (no longer listed); no other file touched" in out
    assert sorted(os.listdir(tmp_path / "out")) == ["mnist-train-00000%d.tar" % i for i in range(3)] + [
        "mnist-train-000042.tar", "mnist-train.json"]
    code, out, err = main(*SMALL)  # newuser5 5: "0 no longer listed removed" said nothing
    assert code == 0 and "3 shards rewritten; no other file touched" in out and "deleted" not in out, out + err
    code, out, err = main(*SMALL[:-2], "--limit", 30, "--out", "out")  # 6 shards again: 3 of them new
    assert code == 0 and "3 shards rewritten, 3 shards added; no other file touched" in out, out + err


def test_a_rebuild_on_a_full_disk_keeps_the_old_set_usable(main, tmp_path, monkeypatch):
    """The disk fills while the third new shard is written: the old manifest and its shards are
    as they were, no .tmp file is left, and the error is one line."""
    import errno
    monkeypatch.chdir(tmp_path)
    assert main(*SMALL)[0] == 0
    before = folder_bytes(tmp_path / "out")
    written = []
    real = shards._add_member

    def filling(tar, name, data):
        written.append(name)
        if len(written) > 22:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(tar, name, data)

    monkeypatch.setattr(shards, "_add_member", filling)
    code, out, err = main(*SMALL, "--seed", 1)
    assert_one_error_line(code, err, "No space left on device")
    assert folder_bytes(tmp_path / "out") == before
    assert verify.verify(str(tmp_path / "out")) == []


def test_a_rebuild_past_the_file_size_limit_keeps_the_old_set_usable(tmp_path):
    """The same in a real process whose writes fail (RLIMIT_FSIZE, as a full disk would)."""
    import resource
    import signal

    assert cli(tmp_path, *SMALL).returncode == 0
    before = folder_bytes(tmp_path / "out")

    def limited():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (3000, 3000))

    p = run_capture([sys.executable, str(TOOL), *map(str, SMALL), "--seed", "1"], cwd=tmp_path, capture_output=True,
                    text=True, timeout=HANG, preexec_fn=limited)
    assert_one_error_line(p.returncode, p.stderr, "File too large")
    assert folder_bytes(tmp_path / "out") == before


def test_a_fifo_given_as_classes_is_one_line_not_a_hang(main, tmp_path):
    os.mkfifo(tmp_path / "classes.txt")
    code, out, err = main("--index", f"c:train={tmp_path}", "--classes", tmp_path / "classes.txt", "--out", tmp_path)
    assert code == 2 and err.splitlines() == [f"make-shards: error: --classes {tmp_path}/classes.txt: not a regular "
                                              f"file (see --help)"], err


def test_index_says_when_it_replaced_a_manifest_and_counts_one_shard(main, tmp_path):
    """A second --index into the same --out replaced the first manifest without a word; and
    one shard was '1 shards'."""
    from helpers import write_img2dataset

    write_img2dataset(tmp_path / "train", 5, classes=2, per_shard=10)
    out = tmp_path / "out"
    args = ("--index", f"web:train={tmp_path}/train", "--label-key", "json:label", "--out", out, "--quiet")
    code, said, err = main(*args)
    assert code == 0 and said.startswith("indexed web-train: 1 shard, 5 samples") and "replaced" not in said, err
    code, said, err = main(*args)
    assert code == 0 and f"  replaced the manifest that was there before: {out}/web-train.json" in said.splitlines()
    code, said, err = main("--synthetic", "--datasets", "mnist", "--splits", "test", "--limit", "5", "--out",
                           tmp_path / "built", "--quiet", "--workers", "1")
    assert code == 0 and "(1 shard, 5 samples" in said.splitlines()[-1], said


@pytest.mark.parametrize("how", ["index", "imagefolder", "source"])
def test_a_failed_run_takes_back_the_out_folders_it_made(main, tmp_path, how):
    """A failed make_shards left the empty --out folder (and its parents) it had made; one that
    was there before stays."""
    source = {"index": ["--index", f"x:train={tmp_path}/nothere/"],
              "imagefolder": ["--imagefolder", f"x:train={tmp_path}/nothere"],
              "source": ["--datasets", "mnist", "--root", tmp_path / "no-data"]}[how]
    code, said, err = main(*source, "--out", tmp_path / "new" / "deeper")
    assert code == 2 and err.startswith("make-shards: error:"), err
    assert sorted(os.listdir(tmp_path)) == []
    (tmp_path / "kept").mkdir()
    code, said, err = main(*source, "--out", tmp_path / "kept")
    assert code == 2 and sorted(os.listdir(tmp_path)) == ["kept"]


@pytest.mark.slow
def test_a_file_size_limit_reached_says_where_it_was_writing(tmp_path):
    """A full disk or a file size limit gave "[Errno 27] File too large" and nothing else (hostileK):
    the line now says where it was writing. Real limit: RLIMIT_FSIZE, as `ulimit -f` sets it."""
    import resource

    def limited():
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))

    p = run_capture([sys.executable, str(TOOL), "--synthetic", "--datasets", "mnist", "--limit", "400", "--maxcount",
                     "400", "--workers", "1", "--quiet", "--out", "out"], cwd=tmp_path, preexec_fn=limited)
    lines = p.stderr.splitlines()
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert "File too large" in lines[0] and lines[0].endswith(" (writing in out)"), p.stderr
