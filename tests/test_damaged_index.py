"""A foreign WebDataset with a few broken JPEGs (as real img2dataset sets have) is indexed, both
on first use and by make_shards --index: each broken image stays a position of the set, is
named in one warning line, and the stream skips and counts it. A set of nothing but broken
images, or one past MAX_DAMAGED, is one line. The same rule (pipeline.writers.damage) holds for
--fields and for fields inferred on first use; make-shards --max-damaged allows a larger share."""
import json

import pytest
from PIL import Image

from helpers import (encode_pil, foreign_image, make_shards_in_process, one_line_error, train_in_process,
                     write_foreign)
from pipeline.errors import ShardError
from pipeline.stream import MixedStream, resolve
from pipeline.writers import autoindex

BROKEN = {7: "cut", 33: "stray"}  # a JPEG cut short in its scan; one with stray bytes after SOI


def write_damaged(folder, n=60, broken=BROKEN, label=lambda i: str(i % 4).encode(), member="cls"):
    """n JPEG + .cls (or `member`) samples, 20 a shard; the samples in `broken` damaged as it
    says ("all": every one)."""
    def sample(i):
        key = f"{i:06d}"
        jpg = encode_pil(foreign_image(i % 4, (32, 32), i), "JPEG", quality=90)
        how = broken.get(i, broken.get("all"))
        if how == "cut":
            jpg = jpg[:jpg.index(b"\xff\xda") + 40]  # its header whole
        elif how == "stray":
            jpg = jpg[:2] + b"junk" + jpg[2:]
        elif how == "wide":  # decodable, but 40 times as elongated as a square target: no damage, a refusal
            jpg = encode_pil(Image.new("RGB", (1600, 40)), "JPEG")
        return key, [(key + ".jpg", jpg), (f"{key}.{member}", label(i))]
    return write_foreign(folder, n, 20, "d-{:04d}.tar", sample)


def kept_and_skipped(src):
    batches = list(MixedStream([src], {src.name: 1}, 4).eval_stream(src))
    return sum(len(b["key"]) for b in batches), sum(b["skipped"] for b in batches)


def warning_of(err):
    lines = [ln for ln in err.splitlines() if "cannot be decoded" in ln]
    assert len(lines) == 1, err
    return lines[0]


def test_two_broken_jpegs_of_sixty_index_on_first_use_and_train_with_two_skips(tmp_path, capsys):
    write_damaged(tmp_path / "set")
    src = autoindex.trainable(resolve("d", str(tmp_path / "set") + "/", "train"))
    line = warning_of(capsys.readouterr().err)
    assert "2 of 60 samples" in line and "000007" in line and "000033" in line, line
    assert "truncated" in line and "stray bytes" in line and "skipped and counted while training" in line, line
    assert src.total == 60 and src.shape == (3, 32, 32)
    with pytest.warns(UserWarning):  # each skip is named
        assert kept_and_skipped(src) == (58, 2)
    p = train_in_process(["--train", f"d={tmp_path / 'set'}/", "--epochs", "1", "--batch-size", "8",
                          "--out", str(tmp_path / "run"), "--on-error", "warn"])
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.load(open(tmp_path / "run" / "summary.json"))["skipped_samples"] == 2


def test_two_broken_jpegs_of_sixty_index_with_make_shards_and_stream_as_two_skips(tmp_path):
    write_damaged(tmp_path / "set")
    p = make_shards_in_process(["--quiet", "--index", f"d:train={tmp_path / 'set'}", "--out", tmp_path / "out"])
    assert p.returncode == 0, p.stderr
    assert "2 of 60 samples" in warning_of(p.stderr)
    src = resolve("d", str(tmp_path / "out"), "train")
    assert src.total == 60
    with pytest.warns(UserWarning):
        assert kept_and_skipped(src) == (58, 2)


def test_a_set_of_only_broken_jpegs_is_one_line_both_ways(tmp_path):
    write_damaged(tmp_path / "set", broken={"all": "cut"})
    p = make_shards_in_process(["--quiet", "--index", f"d:train={tmp_path / 'set'}", "--out", tmp_path / "out"])
    one_line_error(p, "none of its 60 samples can be decoded", "sample 000000", "truncated")
    with pytest.raises(ShardError) as e:
        resolve("d", str(tmp_path / "set") + "/", "train")
    assert "\n" not in str(e.value) and "none of its 60 samples can be decoded" in str(e.value)


def test_more_than_max_damaged_is_refused_naming_the_first(tmp_path):
    write_damaged(tmp_path / "set", broken={i: "cut" for i in range(0, 60, 10)})  # 6 of 60: 10 %
    p = make_shards_in_process(["--quiet", "--index", f"d:train={tmp_path / 'set'}", "--out", tmp_path / "out"])
    one_line_error(p, "6 of 60 samples cannot be decoded, more than 5%", "MAX_DAMAGED", "sample 000000")


def test_a_refusal_from_an_indexing_worker_is_one_line_with_no_remote_traceback(tmp_path):
    """A label no class reads, in the second shard: found by a forked worker, raised here alone."""
    write_damaged(tmp_path / "set", broken={}, label=lambda i: b"\xff" if i == 25 else str(i % 4).encode())
    with pytest.raises(ShardError) as e:
        resolve("d", str(tmp_path / "set") + "/", "train", workers=2)
    assert "sample 000025" in str(e.value) and "\n" not in str(e.value)
    assert e.value.__cause__ is None and e.value.__suppress_context__, repr(e.value.__cause__)


FIELDS = "image:image=jpg,size=32x32 label:class=cls"


def test_two_broken_jpegs_of_sixty_index_with_fields_and_stream_as_two_skips(tmp_path):
    write_damaged(tmp_path / "set")
    p = make_shards_in_process(["--quiet", "--index", f"d:train={tmp_path / 'set'}", "--fields", FIELDS,
                                "--out", tmp_path / "out"])
    assert p.returncode == 0, p.stderr
    line = warning_of(p.stderr)
    assert "2 of 60 samples" in line and "000007" in line and "000033" in line, line
    m = json.load(open(tmp_path / "out" / "d-train.json"))
    assert m["total"] == 60 and m["classes"] == ["0", "1", "2", "3"] and "fields" in m
    src = resolve("d", str(tmp_path / "out"), "train")
    with pytest.warns(UserWarning):
        assert kept_and_skipped(src) == (58, 2)


def test_fields_inferred_on_first_use_take_two_broken_jpegs_as_two_skips(tmp_path, capsys):
    """Captions, not classes: the first use infers image and text fields and indexes them as --fields does."""
    write_damaged(tmp_path / "set", label=lambda i: f"a photo of thing number {i} on a table".encode(), member="txt")
    src = autoindex.trainable(resolve("d", str(tmp_path / "set") + "/", "train"))
    assert "2 of 60 samples" in warning_of(capsys.readouterr().err)
    fields = json.load(open(src.manifest))["fields"]
    assert src.total == 60 and [f["type"] for f in fields] == ["image", "text"], fields


def test_fields_refuse_a_set_of_only_broken_jpegs_and_one_over_the_share_in_one_line(tmp_path):
    write_damaged(tmp_path / "all", broken={"all": "cut"})
    write_damaged(tmp_path / "ten", broken={i: "cut" for i in range(0, 60, 10)})  # 6 of 60: 10 %
    for folder, needle in (("all", "none of its 60 samples can be decoded"), ("ten", "6 of 60 samples cannot be")):
        p = make_shards_in_process(["--quiet", "--index", f"d:train={tmp_path / folder}", "--fields", FIELDS,
                                    "--out", tmp_path / "out"])
        one_line_error(p, needle, "sample 000000")


@pytest.mark.parametrize("fields", [[], ["--fields", FIELDS]])
def test_max_damaged_allows_a_larger_share_and_refuses_above_it(tmp_path, fields):
    write_damaged(tmp_path / "set", broken={i: "cut" for i in range(0, 60, 10)})  # 6 of 60: 10 %
    index = ["--quiet", "--index", f"d:train={tmp_path / 'set'}", *fields, "--out", tmp_path / "out"]
    p = make_shards_in_process(index + ["--max-damaged", "0.1"])
    assert p.returncode == 0, p.stderr
    assert "6 of 60 samples" in warning_of(p.stderr)
    assert json.load(open(tmp_path / "out" / "d-train.json"))["total"] == 60
    one_line_error(make_shards_in_process(index + ["--max-damaged", "0.08"]), "6 of 60", "more than 8%",
                   "--max-damaged")


@pytest.mark.parametrize("bad", ["1.5", "-0.1", "ten", "nan"])
def test_a_bad_max_damaged_is_one_argparse_line(tmp_path, bad):
    p = make_shards_in_process(["--index", f"d:train={tmp_path}", "--out", tmp_path / "out", "--max-damaged", bad])
    one_line_error(p, "--max-damaged", repr(bad), "[0, 1]")


@pytest.mark.parametrize("fields", [[], ["--fields", FIELDS]])
def test_a_decodable_image_the_shape_refuses_stays_a_refusal_not_damage(tmp_path, fields):
    write_damaged(tmp_path / "set", broken={12: "wide"})
    p = make_shards_in_process(["--quiet", "--index", f"d:train={tmp_path / 'set'}", *fields,
                                "--out", tmp_path / "out"])
    one_line_error(p, "sample 000012", "elongated")


@pytest.mark.parametrize("share", ["0.29", "0.57", "0.58", "0.05"])
def test_the_damaged_share_is_compared_as_written_not_in_floats(share):
    """29 of 100 with --max-damaged 0.29 is within the share (0.29 * 100 is 28.999999999999996 in
    floats, which refused it: the last hostile pass); one more is over it."""
    from pipeline.writers.damage import damage_check, share_arg

    at = round(float(share) * 100)

    def found(damaged):
        return [{"damaged": damaged, "samples": 100, "url": "a.tar", "damage": [("s0", "cut short")]}]

    assert "warning" in damage_check(found(at), "x", "x", share_arg(share))
    with pytest.raises(ShardError, match=f"{at + 1} of 100 samples cannot be decoded"):
        damage_check(found(at + 1), "x", "x", share_arg(share))


def test_a_broken_second_image_field_is_damage_to_the_index_as_to_the_stream(tmp_path):
    """Two image fields: a .png cut short in 1 of 40 samples (its .jpg whole) is a damaged sample to
    --index --fields, named and counted under --max-damaged as a broken first field is, and the
    stream skips it once."""
    def sample(i):
        key = f"{i:06d}"
        png = encode_pil(foreign_image(i % 4, (32, 32), 1000 + i), "PNG")
        if i == 13:
            png = png[:len(png) // 2]
        return key, [(key + ".jpg", encode_pil(foreign_image(i % 4, (32, 32), i), "JPEG", quality=90)),
                     (key + ".png", png), (key + ".cls", str(i % 4).encode())]
    write_foreign(tmp_path / "set", 40, 20, "two-{:04d}.tar", sample)
    fields = "image:image=jpg,size=32x32 depth:image=png,size=32x32 label:class=cls"
    index = ["--quiet", "--index", f"d:train={tmp_path / 'set'}", "--fields", fields, "--out", tmp_path / "out"]
    p = make_shards_in_process(index + ["--max-damaged", "0.01"])
    one_line_error(p, "1 of 40 samples cannot be decoded, more than 1%", "sample 000013", ".png")
    p = make_shards_in_process(index)
    assert p.returncode == 0, p.stderr
    line = warning_of(p.stderr)
    assert "1 of 40 samples" in line and "000013" in line, line
    src = resolve("d", str(tmp_path / "out"), "train")
    assert src.total == 40
    with pytest.warns(UserWarning, match="000013"):
        assert kept_and_skipped(src) == (39, 1)
