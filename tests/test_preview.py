"""pipeline.preview on tiny synthetic shard sets: the PNG, the captions against each
sample's true class, grey images kept grey, and the title's data set and origin."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from helpers import HANG, build_shards, figure_texts, key_index, run_capture
from pipeline.writers import preview as pv
from pipeline.errors import ShardError


@pytest.fixture(scope="module")
def mnist(tmp_path_factory):
    out = tmp_path_factory.mktemp("mnist")
    _, source = build_shards(out, "mnist", "train", 40, shape=(1, 28, 28), encoding="png", maxcount=10)
    return out / "mnist-train.json", source


@pytest.fixture(scope="module")
def cifar(tmp_path_factory):
    out = tmp_path_factory.mktemp("cifar")
    _, source = build_shards(out, "cifar10", "test", 12, shape=(3, 32, 32), encoding="raw", maxcount=5)
    return out / "cifar10-test.json", source


def grid_images(fig):
    """The pixel arrays the figure shows, in grid order."""
    return [im for ax in fig.axes for im in ax.get_images()]


def test_preview_writes_a_png_grid(mnist, tmp_path):
    path, _ = mnist
    sizes = []
    for n in (4, 36):
        out = tmp_path / f"sheet{n}.png"
        assert pv.preview(str(path), str(out), n=n) == str(out)
        assert out.read_bytes()[:4] == b"\x89PNG"
        with Image.open(out) as im:
            sizes.append(im.size)
    for w, h in sizes:
        assert 300 <= w <= 3000 and 200 <= h <= 3000, sizes
    assert sizes[1][0] > sizes[0][0] and sizes[1][1] > sizes[0][1]  # 6x6 cells need more room than 2x2


def test_captions_are_the_true_class_names(mnist):
    path, source = mnist
    src, keys, _, _, _ = pv.samples(str(path), 12, 0)
    fig = pv.build_figure(str(path), n=12)
    captions = [ax.get_title() for ax in fig.axes if ax.get_images()]
    assert len(captions) == 12
    assert captions == [source.classes[source.label(key_index(k))] for k in keys]
    assert all(c in source.classes for c in captions)


def test_title_names_the_data_set_and_says_synthetic(mnist):
    path, _ = mnist
    texts = "\n".join(figure_texts(pv.build_figure(str(path), n=8)))
    assert "SYNTHETIC" in texts
    assert "mnist / train" in texts and "8 of 40 samples" in texts
    assert texts.count("look-alike") == 1, texts  # said once, not "SYNTHETIC look-alike data: ... look-alike data"


def test_grey_images_are_shown_grey_and_match_the_source(mnist):
    path, source = mnist
    _, keys, _, _, _ = pv.samples(str(path), 6, 0)
    shown = grid_images(pv.build_figure(str(path), n=6))
    assert len(shown) == 6
    for im, key in zip(shown, keys):
        a = np.asarray(im.get_array())
        assert a.ndim == 2 and im.get_cmap().name == "gray"
        assert im.get_clim() == (0, 255)  # no contrast stretch: a dark image looks dark
        assert np.array_equal(a, source.image(key_index(key))[0])


def test_colour_images_are_shown_in_colour(cifar):
    path, source = cifar
    _, keys, _, _, _ = pv.samples(str(path), 4, 0)
    shown = grid_images(pv.build_figure(str(path), n=4))
    for im, key in zip(shown, keys):
        a = np.asarray(im.get_array())
        assert a.shape == (32, 32, 3)
        assert np.array_equal(a, source.image(key_index(key)).transpose(1, 2, 0))


def test_more_than_there_is_gives_every_sample_once(cifar):
    path, _ = cifar
    _, keys, images, labels, skipped = pv.samples(str(path), 100, 3)
    assert sorted(keys) == sorted(set(keys)) and len(keys) == 12 and skipped == 0
    assert len(grid_images(pv.build_figure(str(path), n=100))) == 12


def test_seed_picks_the_shards_reproducibly(mnist):
    path, _ = mnist
    first = {seed: pv.samples(str(path), 10, seed)[1] for seed in range(4)}
    assert pv.samples(str(path), 10, 2)[1] == first[2]
    assert len({tuple(k) for k in first.values()}) > 1  # 4 shards of 10: the seed changes which is shown


def test_real_data_is_not_called_synthetic(tmp_path):
    build_shards(tmp_path, "cifar10", "train", 10, shape=(3, 32, 32), encoding="png", maxcount=5)
    path = tmp_path / "cifar10-train.json"
    m = json.loads(path.read_text())
    m["origin"] = {"kind": "imagefolder", "note": r"images from an ImageFolder tree of 10 files, cost $\frac{1$"}
    path.write_text(json.dumps(m))
    out = tmp_path / "real.png"
    fig = pv.build_figure(str(path), n=4)
    texts = "\n".join(figure_texts(fig))
    assert "SYNTHETIC" not in texts
    assert "imagefolder" in texts and "ImageFolder tree of 10 files" in texts
    pv.preview(str(path), str(out), n=4)  # the `$` is drawn as text, not read as math
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_bad_input_raises_a_plain_error(tmp_path, mnist):
    with pytest.raises(ShardError):
        pv.preview(str(tmp_path / "nothing.json"), str(tmp_path / "x.png"))
    with pytest.raises(ValueError):
        pv.preview(str(mnist[0]), str(tmp_path / "x.png"), n=0)
    assert not (tmp_path / "x.png").exists()


def test_importing_the_preview_does_not_import_matplotlib():
    code = "import sys, pipeline.writers.preview; sys.exit('matplotlib' in sys.modules)"
    root = Path(__file__).resolve().parents[1]
    r = run_capture([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=HANG)
    assert r.returncode == 0, r.stderr


def test_captions_of_an_indexed_set_are_its_class_names(tmp_path):
    """A WebDataset labelled by name (.json {"label": "cat"}), indexed in place: each thumbnail
    is captioned with the name its sample holds."""
    import json

    from helpers import NAMES, write_named_shardwriter
    from pipeline.writers.index import index

    keys = write_named_shardwriter(tmp_path / "named", 40)
    index("named", "train", str(tmp_path / "named"), str(tmp_path), progress=False)
    samples = {}
    import tarfile

    for shard in sorted((tmp_path / "named").iterdir()):
        with tarfile.open(shard) as tar:
            for m in tar.getmembers():
                if m.name.endswith(".json") and not m.name.startswith("__"):
                    samples[m.name[:-5]] = json.loads(tar.extractfile(m).read())["label"]
    src, got, _, labels, _ = pv.samples(str(tmp_path / "named-train.json"), 8, 0)
    assert src.classes == list(NAMES) and set(got) <= set(keys)
    fig = pv.build_figure(str(tmp_path / "named-train.json"), n=8)
    captions = [ax.get_title() for ax in fig.axes if ax.get_images()]
    assert captions == [samples[k] for k in got]


def test_a_remote_preview_is_written_under_out_or_a_temporary_folder_never_here(mnist, tmp_path):
    """--preview of an HTTP manifest: under --out when given; without it in a new temporary
    folder, never ./shards/ of wherever the command runs."""
    import contextlib
    import os

    from helpers import make_shards_in_process, serve

    here = tmp_path / "here"
    here.mkdir()
    with serve(mnist[0].parent) as url, contextlib.chdir(here):
        p = make_shards_in_process(["--preview", url + "mnist-train.json"])
        assert p.returncode == 0, p.stderr
        written = Path(p.stdout.split("wrote ")[-1].strip())
        assert written.name == "mnist-train-preview.png" and written.exists()
        assert written.parent.name.startswith("make_shards-preview-") and list(here.iterdir()) == []
        written.unlink()
        written.parent.rmdir()
        p = make_shards_in_process(["--preview", url + "mnist-train.json", "--out", tmp_path / "d"])
        assert p.returncode == 0, p.stderr
        assert (tmp_path / "d" / "mnist-train-preview.png").exists() and list(here.iterdir()) == []
    assert not os.path.exists(here / "shards")
