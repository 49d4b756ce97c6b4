"""Tar member names that are not UTF-8 (pipeline.data.shards.read.key_text): two names that
differ only in such bytes are two keys, not one (U+FFFD for each made them one), the same in
the numpy reader (regular.py), the sequential one and the index, and every key is printable
text that the trainer's key log writes and reads back."""
import io
import json
import tarfile

import pytest

from helpers import encode_pil, foreign_image, make_shards_in_process
from pipeline.data.shards.read import key_text
from pipeline.stream import MixedStream, resolve
from pipeline.train.metrics import KeyLog, read_keys

# (name bytes, its key): names alike but for a byte that is not UTF-8, a valid name spelling the
# escape of another with a real backslash, latin-1 beside UTF-8, odd bytes in a folder
NAMES = [(b"k\xff", "k\\xff"), (b"k\xfe", "k\\xfe"), (b"k\\xff", "k\\\\xff"), (b"caf\xc3\xa9", "caf\u00e9"),
         (b"caf\xe9", "caf\\xe9"), (b"d\xff/a", "d\\xff/a"), (b"d\xfe/a", "d\\xfe/a")]
NAMES += [(f"p{i}".encode(), f"p{i}") for i in range(5)]
BROKEN = b"k\xfe"  # its JPEG cut short: a damaged sample both the index and the stream name


def write_odd_names(path, gz):
    """One tar of JPEG + .cls samples under NAMES, written by tarfile with the bytes as they are."""
    with tarfile.open(path, "w:gz" if gz else "w", format=tarfile.USTAR_FORMAT, encoding="utf-8",
                      errors="surrogateescape") as tar:
        for i, (name, _) in enumerate(NAMES):
            jpg = encode_pil(foreign_image(i % 4, (16, 16), i), "JPEG", quality=90)
            if name == BROKEN:
                jpg = jpg[:jpg.index(b"\xff\xda") + 40]
            for ext, data in ((b".jpg", jpg), (b".cls", str(i % 4).encode())):
                info = tarfile.TarInfo((name + ext).decode("utf-8", "surrogateescape"))
                info.size, info.mtime, info.mode = len(data), 0, 0o644
                tar.addfile(info, io.BytesIO(data))


def test_the_rule_gives_distinct_printable_keys():
    keys = [key_text(n) for n, _ in NAMES]
    assert keys == [k for _, k in NAMES] and len(set(keys)) == len(keys)
    assert all(k.isprintable() for k in keys) and json.loads(json.dumps(keys, ensure_ascii=False)) == keys


@pytest.mark.parametrize("gz", [False, True])  # a plain tar goes through regular.py's numpy reader, .tar.gz not
def test_names_not_utf8_index_and_stream_as_distinct_keys(tmp_path, gz):
    (tmp_path / "set").mkdir()
    write_odd_names(tmp_path / "set" / ("odd.tar.gz" if gz else "odd.tar"), gz)
    p = make_shards_in_process(["--quiet", "--index", f"odd:train={tmp_path / 'set'}", "--max-damaged", "0.2",
                                "--out", tmp_path / "out"])
    assert p.returncode == 0, p.stderr
    assert "1 of 12 samples" in p.stderr and "sample k\\xfe:" in p.stderr, p.stderr  # the index names its key
    src = resolve("odd", str(tmp_path / "out"), "train")
    assert src.total == len(NAMES)
    with pytest.warns(UserWarning, match=r"sample k\\xfe:"):  # the stream names the damaged sample by the same key
        batches = list(MixedStream([src], {"odd": 1}, 4).eval_stream(src))
    keys = [k for b in batches for k in b["key"]]
    assert sum(b["skipped"] for b in batches) == 1
    assert sorted(keys) == sorted(k for n, k in NAMES if n != BROKEN)
    log = KeyLog(str(tmp_path), 0)  # the trainer's key log writes them and reads them back as they were
    log.add(0, keys)
    log.flush()
    assert read_keys(log.path) == [(0, k) for k in keys]


def test_extensions_not_utf8_are_two_members_not_one(tmp_path):
    """Two members k.x\\xff and k.x\\xfe beside a sample's image and class: their extensions decoded
    with U+FFFD were one, and the index refused the whole shard ("member k.x\ufffd appears twice in one
    sample"; hostileI). With the keys' rule they are two extras, which no field wants."""
    (tmp_path / "set").mkdir()
    with tarfile.open(tmp_path / "set" / "e.tar", "w", format=tarfile.USTAR_FORMAT, encoding="utf-8",
                      errors="surrogateescape") as tar:
        for i in range(6):
            jpg = encode_pil(foreign_image(i % 4, (16, 16), i), "JPEG", quality=90)
            members = [(b".jpg", jpg), (b".cls", str(i % 2).encode())]
            members += [(b".x\xff", b"a"), (b".x\xfe", b"b")] if i == 2 else []
            for ext, data in members:
                info = tarfile.TarInfo((b"k%d" % i + ext).decode("utf-8", "surrogateescape"))
                info.size, info.mtime, info.mode = len(data), 0, 0o644
                tar.addfile(info, io.BytesIO(data))
    p = make_shards_in_process(["--quiet", "--index", f"e:train={tmp_path / 'set'}", "--out", tmp_path / "out"])
    assert p.returncode == 0, p.stderr
    src = resolve("e", str(tmp_path / "out"), "train")
    keys = [k for b in MixedStream([src], {"e": 1}, 3).eval_stream(src) for k in b["key"]]
    assert src.total == 6 and sorted(keys) == [f"k{i}" for i in range(6)], keys
