"""tools/bench/tar_parse.py: another tree's tar parse timed against this tree's, shard by shard,
only where both read every shard alike."""
import sys
from pathlib import Path

import pytest

from helpers import array_source, build_source

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from bench import tar_parse  # noqa: E402

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
