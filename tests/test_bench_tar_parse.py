"""tools/bench/tar_parse.py: another tree's tar parse timed against this tree's, shard by shard,
only where both read every shard alike; tools/bench/jpeg_members.py: JPEG members as copies or views;
tools/bench/jpeg_pair.py: two trees' JPEG streams paired in both layouts."""
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers import array_source, build_source, write_shardwriter

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from bench import jpeg_members, tar_parse  # noqa: E402

REGULAR = Path(__file__).resolve().parents[1] / "pipeline" / "data" / "shards" / "regular.py"


def test_tar_parse_prints_both_times_and_their_ratio(tmp_path, capsys):
    build_source(array_source(12, (3, 4, 4)), tmp_path / "raw", encoding="raw", maxcount=4)
    tar_parse.main([str(REGULAR), str(tmp_path / "raw"), "--rounds", "2", "--every", "1"])
    out = capsys.readouterr().out
    assert "3 shards x 2 rounds" in out and "this/other" in out


def test_tar_parse_refuses_a_tree_that_reads_the_shards_otherwise(tmp_path):
    build_source(array_source(8, (3, 4, 4)), tmp_path / "raw", encoding="raw", maxcount=4)
    other = tmp_path / "other.py"
    other.write_text(REGULAR.read_text() + "\n\n_read = regular_members\n\n\ndef regular_members(buf, *a):\n"
                     "    keys, labels, starts, sizes = _read(buf, *a)\n    return keys, labels + 1, starts, sizes\n")
    with pytest.raises(SystemExit, match="read .* differently"):
        tar_parse.main([str(other), str(tmp_path / "raw"), "--rounds", "1", "--every", "1"])


def test_tar_parse_times_jpeg_shards_by_their_extensions(tmp_path, capsys):
    write_shardwriter(tmp_path / "wds", 12, per_shard=6)  # wds.ShardWriter's PAX-laden jpg + cls shards
    tar_parse.main([str(REGULAR), str(tmp_path / "wds"), "--rounds", "1", "--every", "1", "--exts", "jpg", "cls"])
    assert "2 shards x 1 rounds" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="read .* differently"):  # raw members: no shard of them here
        tar_parse.main([str(REGULAR), str(tmp_path / "wds"), "--rounds", "1", "--every", "1"])


def test_jpeg_members_times_copies_and_views_that_find_the_same_headers(tmp_path, capsys):
    write_shardwriter(tmp_path / "wds", 12, per_shard=6)
    jpeg_members.main([str(tmp_path / "wds"), "--rounds", "2"])
    out = capsys.readouterr().out
    assert "12 members of 2 shards, 2 rounds" in out and "view + offset" in out and "bytes(slice)" in out


def test_jpeg_pair_times_each_tree_in_both_layouts(tmp_path, capsys):
    from PIL import Image

    from bench import jpeg, jpeg_pair

    for i in range(2 * jpeg.BATCH + 8):  # two batches after the first one
        folder = tmp_path / "cifar" / f"c{i % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.full((32, 32, 3), i % 250, np.uint8)).save(folder / f"{i:04d}.jpg", quality=90)
    jpeg.build(str(tmp_path / "cifar"), str(tmp_path / "work" / "jpeg-small"), "jpegsmall", (3, 32, 32))
    root = str(Path(__file__).resolve().parents[1])
    jpeg_pair.main(["--other", root, "--work-dir", str(tmp_path / "work"), "--rounds", "1"])
    out = capsys.readouterr().out
    assert "other channels_last" in out and "this channels_last over the other's channels_last stream" in out
    assert "this contiguous over the other's contiguous stream" in out
