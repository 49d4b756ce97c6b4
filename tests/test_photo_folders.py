"""make-shards --imagefolder on photo folders as users hold them: large photos at small targets,
a damaged file among them, formats ImageFolder passes by, and keys traced back to their files."""
import json
import os

import numpy as np
import pytest
from PIL import Image

from conftest import tar_samples
from helpers import make_shards_in_process
from pipeline.data.decoding import image_caps
from pipeline.data.decoding.decode import decode_image

SHAPE = (3, 32, 32)


def make(*args):
    p = make_shards_in_process([str(a) for a in args])
    return p.returncode, p.stdout, p.stderr


def photo(h, w, seed=0):
    """A smooth photo-like image (a gradient and a few blobs): small as a JPEG however large."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    rng = np.random.default_rng(seed)
    a = np.stack([(x * rng.uniform(0.1, 1) + y * rng.uniform(0.1, 1)) % 256 for _ in range(3)], axis=2)
    return a.astype(np.uint8)


def small_folder(root, n=3, seed=0):
    """Classes a and b, n small RGB PNGs each, of random pixels."""
    rng = np.random.default_rng(seed)
    for cls in ("a", "b"):
        (root / cls).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            Image.fromarray(rng.integers(0, 256, (40, 36, 3), dtype=np.uint8)).save(root / cls / f"{i}.png")


def manifest(out, name="pets-train"):
    return json.loads((out / f"{name}.json").read_text())


def samples_of(out, m):
    """{key: CHW pixels} of every sample the manifest's shards hold (raw encoding)."""
    got = {}
    for s in m["shards"]:
        for key, sample in tar_samples(out / s["name"]):
            got[key] = np.frombuffer(sample["raw"], np.uint8).reshape(m["shape"])
    return got


def table(path):
    """The rows of a side file (a header line, then tab-separated rows)."""
    lines = path.read_text().splitlines()
    return lines[0].split("\t"), [line.split("\t") for line in lines[1:]]


# ---------------------------------------------------------------- large photos


def test_large_photos_convert_at_a_small_target_while_the_stream_keeps_its_cap(tmp_path):
    """A 600x600 PNG is 352 times a 32x32 target's pixels (the stream's cap is 256) and a 24 MP
    camera JPEG is over the stream's MAX_PIXELS: both were refused; converting takes them."""
    root = tmp_path / "pets"
    small_folder(root, n=1)
    Image.fromarray(photo(600, 600, 1)).save(root / "a" / "big.png")
    Image.fromarray(photo(4000, 6000, 2)).save(root / "b" / "camera.jpg", quality=80)
    big, camera = (root / "a" / "big.png").read_bytes(), (root / "b" / "camera.jpg").read_bytes()
    with pytest.raises(ValueError, match="times its 32x32 target"):  # the stream: unchanged
        decode_image(big, "png", SHAPE)
    with pytest.raises(ValueError, match="MAX_PIXELS"):
        decode_image(camera, "jpg", SHAPE)
    code, out, err = make("--imagefolder", f"pets:train={root}", "--shape", "3,32,32", "--encoding", "raw",
                          "--out", tmp_path / "out", "--workers", 1, "--quiet")
    assert code == 0, err
    m = manifest(tmp_path / "out")
    assert m["total"] == 4
    got = samples_of(tmp_path / "out", m)
    _, rows = table(tmp_path / "out" / "pets-train.files.tsv")
    files = dict(rows)
    for name, data, ext in (("a/big.png", big, "png"), ("b/camera.jpg", camera, "jpg")):
        key = next(k for k, f in files.items() if f == name)
        want = decode_image(data, ext, SHAPE, caps=image_caps.CONVERSION)  # the one decode model, its cap passed in
        np.testing.assert_array_equal(got[key], want)


def test_a_photo_over_pils_limit_is_still_refused_naming_the_limit(tmp_path, monkeypatch):
    root = tmp_path / "pets"
    small_folder(root, n=1)
    Image.fromarray(photo(600, 600, 1)).save(root / "a" / "big.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 500 * 500)  # PIL itself refuses twice its limit
    code, _, err = make("--imagefolder", f"pets:train={root}", "--shape", "3,32,32", "--out", tmp_path / "out",
                        "--workers", 1, "--quiet")
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "big.png: not a readable image" in err and "PIL.Image.MAX_IMAGE_PIXELS" in err


# ---------------------------------------------------------------- bad files


def with_bad_files(root):
    """Six good PNGs, a .jpg that is text and a .png cut short."""
    small_folder(root)
    (root / "a" / "notes.jpg").write_bytes(b"this is not a jpeg")
    (root / "b" / "cut.png").write_bytes((root / "b" / "0.png").read_bytes()[:60])


def test_a_bad_file_stops_the_build_naming_it_and_the_flag(tmp_path):
    with_bad_files(tmp_path / "pets")
    code, _, err = make("--imagefolder", f"pets:train={tmp_path / 'pets'}", "--shape", "3,16,16", "--out",
                        tmp_path / "out", "--workers", 2, "--maxcount", 2, "--quiet")
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "notes.jpg: not a readable image" in err and "--skip-bad-images leaves such files out" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("workers", [1, 2])
def test_skip_bad_images_leaves_them_out_counted_and_listed(tmp_path, workers):
    with_bad_files(tmp_path / "pets")
    code, out, err = make("--imagefolder", f"pets:train={tmp_path / 'pets'}", "--shape", "3,16,16", "--encoding",
                          "raw", "--out", tmp_path / "out", "--workers", workers, "--maxcount", 1,
                          "--skip-bad-images", "--quiet")
    assert code == 0, err
    said = [ln for ln in out.splitlines() if "left out" in ln and "unreadable" in ln]
    assert said == [f"  left out 2 unreadable image(s) of 8 (--skip-bad-images); each file and why: "
                    f"{tmp_path / 'out' / 'pets-train.left-out.tsv'}"]
    m = manifest(tmp_path / "out")
    got = samples_of(tmp_path / "out", m)
    assert m["total"] == len(got) == 6 == sum(s["samples"] for s in m["shards"])
    assert len(m["shards"]) == 6  # the shards of one bad image each are not written, nor listed
    assert sorted(os.listdir(tmp_path / "out")) == sorted([s["name"] for s in m["shards"]] + [
        "pets-train.json", "pets-train.files.tsv", "pets-train.left-out.tsv"])
    header, rows = table(tmp_path / "out" / "pets-train.left-out.tsv")
    assert header == ["file", "reason"]
    assert [r[0] for r in rows] == ["a/notes.jpg", "b/cut.png"] and all(r[1] for r in rows)
    _, mapped = table(tmp_path / "out" / "pets-train.files.tsv")
    assert sorted(k for k, _ in mapped) == sorted(got) and not {"a/notes.jpg", "b/cut.png"} & {f for _, f in mapped}
    from pipeline.writers import verify

    assert verify.verify(str(tmp_path / "out")) == []
    # fixed and built again: the old list of left-out files goes with the set it described
    for f in ("a/notes.jpg", "b/cut.png"):
        os.remove(tmp_path / "pets" / f)
    code, out, err = make("--imagefolder", f"pets:train={tmp_path / 'pets'}", "--shape", "3,16,16", "--out",
                          tmp_path / "out", "--workers", 1, "--skip-bad-images", "--quiet")
    assert code == 0, err
    assert not (tmp_path / "out" / "pets-train.left-out.tsv").exists()
    assert ": 1 shard rewritten, 5 shards deleted (no longer listed); pets-train.files.tsv rewritten, " \
           "pets-train.left-out.tsv deleted; no other file touched" in out, out  # hostileN: the .tsv went unsaid


def test_a_held_out_split_short_of_its_unreadable_images_says_so(tmp_path):
    """--holdout draws the held-out files before they are read: with --skip-bad-images the test
    split can hold fewer than N, which its left-out line says."""
    with_bad_files(tmp_path / "pets")
    code, out, err = make("--imagefolder", f"pets:train={tmp_path / 'pets'}", "--shape", "3,8,8", "--holdout", 7,
                          "--out", tmp_path / "out", "--workers", 1, "--skip-bad-images", "--quiet")
    assert code == 0, err
    test = manifest(tmp_path / "out", "pets-test")["total"]
    assert test < 7, out  # 7 of the 8 files held out: at least one bad one among them
    assert f"(--skip-bad-images), so pets-test holds {test} (--holdout drew its files before they were read)" in out


def test_skip_bad_images_with_none_readable_is_one_line(tmp_path):
    (tmp_path / "pets" / "a").mkdir(parents=True)
    (tmp_path / "pets" / "a" / "x.jpg").write_bytes(b"no")
    code, _, err = make("--imagefolder", f"pets:train={tmp_path / 'pets'}", "--shape", "3,16,16", "--out",
                        tmp_path / "out", "--workers", 1, "--skip-bad-images", "--quiet")
    assert code == 2 and len(err.splitlines()) == 1 and "none of its 1 image(s) could be read" in err, err
    assert not (tmp_path / "out" / "pets-train.json").exists()


def test_skip_bad_images_still_stops_at_an_image_of_another_size_without_shape(tmp_path):
    """Another size is not a damaged file: --shape is the fix, and the build says so."""
    small_folder(tmp_path / "pets")
    Image.fromarray(photo(20, 20)).save(tmp_path / "pets" / "b" / "9.png")
    code, _, err = make("--imagefolder", f"pets:train={tmp_path / 'pets'}", "--out", tmp_path / "out",
                        "--workers", 1, "--skip-bad-images", "--quiet")
    assert code == 2 and "9.png" in err and "--shape" in err, err


@pytest.mark.parametrize("other, hint", [("RGB", "--shape 3,40,36"), ("L", "--shape 1,40,36")])
def test_the_shape_hint_is_grey_only_where_both_images_are(tmp_path, other, hint):
    """newuser5 4: a grey first image among colour ones gave '(e.g. --shape 1,40,40)', and copying
    it turned every image grey."""
    small_folder(tmp_path / "pets")
    for path in sorted((tmp_path / "pets").glob("*/*.png")):  # the first grey; the rest too where other is L
        if other == "L" or path.name == "0.png" and path.parent.name == "a":
            Image.fromarray(photo(40, 36)[..., 0]).save(path)
    second = photo(20, 20) if other == "RGB" else photo(20, 20)[..., 0]
    Image.fromarray(second).save(tmp_path / "pets" / "a" / "1.png")
    code, _, err = make("--imagefolder", f"pets:train={tmp_path / 'pets'}", "--out", tmp_path / "out", "--quiet")
    assert code == 2 and len(err.splitlines()) == 1 and f"(e.g. {hint})" in err, err


def test_skip_bad_images_applies_to_image_folders_only(tmp_path):
    code, _, err = make("--synthetic", "--skip-bad-images", "--out", tmp_path / "out")
    assert code == 2 and "--skip-bad-images applies to --imagefolder" in err


# ---------------------------------------------------------------- files ImageFolder passes by


def test_files_imagefolder_leaves_out_are_counted_by_extension(tmp_path):
    root = tmp_path / "pets"
    small_folder(root, n=1)
    Image.fromarray(photo(8, 8)).save(root / "a" / "cat.gif")
    Image.fromarray(photo(8, 8)).save(root / "b" / "dog.gif")
    (root / "b" / "IMG_0001.HEIC").write_bytes(b"heic")
    code, out, err = make("--imagefolder", f"pets:train={root}", "--shape", "3,8,8", "--out", tmp_path / "out",
                          "--workers", 1, "--quiet")
    assert code == 0, err
    said = [ln for ln in out.splitlines() if "left out" in ln]
    assert len(said) == 1 and said[0].startswith(f"pets-train: warning: 3 file(s) in {root} left out (.gif 2, "
                                                 f".heic 1): ImageFolder takes only .jpg"), out
    assert "convert such photos to one of those first" in said[0]
    assert manifest(tmp_path / "out")["total"] == 2
    for cls in ("a", "b"):  # with --captions, the images' captions are taken, not left out
        (root / cls / "0.txt").write_text(f"a photo of {cls}")
    code, out, err = make("--imagefolder", f"pets:train={root}", "--shape", "3,8,8", "--out", tmp_path / "out2",
                          "--workers", 1, "--quiet", "--captions")
    assert code == 0, err
    assert [ln for ln in out.splitlines() if "left out" in ln] == said


def test_hidden_folders_are_no_classes_and_files_outside_classes_are_said_apart(tmp_path):
    """.git/ and .ipynb_checkpoints/ holding a .jpg are no classes (nor part of one), said in one
    line naming them; a photo beside the class folders is "outside any class folder", not a type
    to convert; a file manager's files (.DS_Store, Thumbs.db, desktop.ini) are not counted."""
    root = tmp_path / "pets"
    small_folder(root, n=1)
    for hidden in (root / ".git" / "objects", root / "a" / ".ipynb_checkpoints"):
        hidden.mkdir(parents=True)
        Image.fromarray(photo(8, 8)).save(hidden / "x.jpg")
    Image.fromarray(photo(8, 8)).save(root / "stray.jpg")
    for junk in (root / "a" / ".DS_Store", root / "b" / "Thumbs.db", root / "desktop.ini"):
        junk.write_bytes(b"x")
    code, out, err = make("--imagefolder", f"pets:train={root}", "--shape", "3,8,8", "--out", tmp_path / "out",
                          "--workers", 1, "--quiet")
    assert code == 0, err
    m = manifest(tmp_path / "out")
    assert m["classes"] == ["a", "b"] and m["total"] == 2
    said = [ln for ln in out.splitlines() if "left out" in ln]
    assert said == [f"pets-train: note: left out 2 hidden folder(s) in {root} (.git, a/.ipynb_checkpoints): a "
                    f'folder whose name starts with "." is a tool\'s, not a class',
                    f"pets-train: warning: 1 file(s) in {root} outside any class folder left out (ImageFolder "
                    f"layout: DIR/<class>/<image>)"], out


def test_an_empty_class_folder_is_named(tmp_path):
    root = tmp_path / "pets"
    small_folder(root, n=1)
    (root / "empty").mkdir()
    (root / "empty" / "readme.md").write_text("x")
    code, _, err = make("--imagefolder", f"pets:train={root}", "--shape", "3,8,8", "--out", tmp_path / "out",
                        "--workers", 1, "--quiet")
    assert code == 2 and len(err.splitlines()) == 1 and "class folder(s) empty in" in err, err
    assert "holds no images in ImageFolder layout" not in err


def test_a_folder_imagefolder_takes_whole_says_nothing(tmp_path):
    small_folder(tmp_path / "pets", n=1)
    code, out, err = make("--imagefolder", f"pets:train={tmp_path / 'pets'}", "--shape", "3,8,8", "--out",
                          tmp_path / "out", "--workers", 1, "--quiet")
    assert code == 0 and "left out" not in out + err


# ---------------------------------------------------------------- keys traced to their files


def test_every_key_leads_back_to_its_file_also_in_a_held_out_split(tmp_path):
    """Keys stay NAME-SPLIT-INDEX (short, tar-safe, no dots, parsed nowhere anew); the table beside
    the manifest names each key's file, relative to the folder the manifest's origin names."""
    small_folder(tmp_path / "pets", n=5)
    code, _, err = make("--imagefolder", f"pets:train={tmp_path / 'pets'}", "--shape", "3,16,16", "--encoding",
                        "raw", "--holdout", 3, "--maxcount", 2, "--out", tmp_path / "out", "--workers", 2, "--quiet")
    assert code == 0, err
    for split, n in (("train", 7), ("test", 3)):
        m = manifest(tmp_path / "out", f"pets-{split}")
        got = samples_of(tmp_path / "out", m)
        header, rows = table(tmp_path / "out" / f"pets-{split}.files.tsv")
        assert header == ["key", "file"] and len(rows) == len(got) == n
        for key, rel in rows:
            data = (tmp_path / "pets" / rel).read_bytes()
            np.testing.assert_array_equal(got[key], decode_image(data, "png", (3, 16, 16)))
            assert m["origin"]["root"] == str(tmp_path / "pets")


def test_the_key_table_of_a_build_in_parts_is_merged(tmp_path):
    small_folder(tmp_path / "pets", n=4)
    for part in ("0/2", "1/2"):
        code, out, err = make("--imagefolder", f"pets:train={tmp_path / 'pets'}", "--shape", "3,8,8", "--maxcount",
                              2, "--part", part, "--out", tmp_path / "out", "--workers", 1, "--quiet")
        assert code == 0, err
        name = f"pets-train.part{part[0]}of2.json"
        assert out.splitlines()[-1].endswith(f"manifests: {name}") and (tmp_path / "out" / name).exists(), out
    # the image folder's split is merged, not those of --splits (train test): test was "no part manifests"
    code, out, err = make("--imagefolder", f"pets:train={tmp_path / 'pets'}", "--merge", "--out", tmp_path / "out")
    assert code == 0 and out.splitlines() == ["merged pets-train: 4 shards, 8 samples"], out + err
    header, rows = table(tmp_path / "out" / "pets-train.files.tsv")
    assert header == ["key", "file"] and sorted(f for _, f in rows) == sorted(
        f"{c}/{i}.png" for c in "ab" for i in range(4))
    assert not [f for f in os.listdir(tmp_path / "out") if ".part" in f]


def test_a_file_name_with_a_tab_stays_one_row(tmp_path):
    small_folder(tmp_path / "pets", n=1)
    os.rename(tmp_path / "pets" / "a" / "0.png", tmp_path / "pets" / "a" / "odd\tname.png")
    os.rename(tmp_path / "pets" / "b" / "0.png", tmp_path / "pets" / "b" / "odd\rname.png")
    code, _, err = make("--imagefolder", f"pets:train={tmp_path / 'pets'}", "--shape", "3,8,8", "--out",
                        tmp_path / "out", "--workers", 1, "--quiet")
    assert code == 0, err
    _, rows = table(tmp_path / "out" / "pets-train.files.tsv")
    assert sorted(f for _, f in rows) == ["a/odd\\tname.png", "b/odd\\rname.png"]


def test_the_side_files_go_beside_a_store_manifest_and_a_stale_one_is_removed(s3_bucket, tmp_path):
    from pipeline.data.store import listings, remote

    with_bad_files(tmp_path / "pets")
    out = f"s3://{s3_bucket}/p"
    code, _, err = make("--imagefolder", f"pets:train={tmp_path / 'pets'}", "--shape", "3,8,8", "--out", out,
                        "--workers", 1, "--skip-bad-images", "--quiet")
    assert code == 0, err
    names = listings.names(out)
    assert {"pets-train.json", "pets-train.files.tsv", "pets-train.left-out.tsv"} <= set(names)
    rows = remote.fetch(f"{out}/pets-train.left-out.tsv").decode().splitlines()[1:]
    assert [r.split("\t")[0] for r in rows] == ["a/notes.jpg", "b/cut.png"]
    assert len(remote.fetch(f"{out}/pets-train.files.tsv").decode().splitlines()) == 1 + 6
    os.remove(tmp_path / "pets" / "a" / "notes.jpg")
    os.remove(tmp_path / "pets" / "b" / "cut.png")
    code, said, err = make("--imagefolder", f"pets:train={tmp_path / 'pets'}", "--shape", "3,8,8", "--out", out,
                           "--workers", 1, "--quiet")
    assert code == 0, err
    assert "; pets-train.files.tsv rewritten, pets-train.left-out.tsv deleted; no other key touched" in said, said
    assert "pets-train.left-out.tsv" not in listings.names(out) and "pets-train.files.tsv" in listings.names(out)
