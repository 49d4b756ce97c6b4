"""pipeline.read: the tar reader against Python's tarfile, foreign tar dialects, damage, and
the vectorised path for regular shards."""
import gzip
import io
import itertools
import tarfile

import numpy as np
import pytest
from PIL import Image

from helpers import array_source, build_source, project_samples
from pipeline.data.shards import read
from pipeline.data.shards import regular
from pipeline.writers import shards
from pipeline.errors import ShardError


def member_list(stream, **kw):
    """[(member name, bytes)] of the wanted members, as pipeline.read groups them."""
    return [(f"{s['__key__']}.{ext}", data) for s in read.iter_samples(stream, **kw)
            for ext, data in s.items() if not ext.startswith("__")]


class Trickle(io.RawIOBase):
    """A pipe-like stream: short reads of at most `step` bytes; records the largest request."""

    def __init__(self, data, step=7):
        self.f, self.step, self.largest = io.BytesIO(data), step, 0

    def read(self, n=-1):
        self.largest = max(self.largest, n)
        return self.f.read(min(n, self.step) if n >= 0 else self.step)


@pytest.mark.parametrize("encoding", shards.ENCODINGS)
def test_reader_matches_tarfile(tmp_path, read_tar, encoding):
    m = build_source(array_source(12, (3, 9, 9)), tmp_path, encoding=encoding, maxcount=12)
    path = tmp_path / m["shards"][0]["name"]
    expected = read_tar(path)
    assert len(expected) == 12
    for chunk in (512, 700, 1 << 20):  # header and member boundaries fall inside and across chunks
        assert project_samples(path, chunk=chunk) == expected
    assert project_samples(None, Trickle(path.read_bytes()), chunk=1000) == expected  # short reads


def test_reader_reads_webdataset_pax_shards(tmp_path, read_tar):
    import webdataset as wds

    path = tmp_path / "wds.tar"
    rng = np.random.default_rng(0)
    with wds.TarWriter(str(path)) as w:
        for i in range(6):
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 256, (6, 6, 3), dtype=np.uint8)).save(buf, format="PNG")
            w.write({"__key__": f"d/sample-{i:03d}", "png": buf.getvalue(), "cls": str(i % 3).encode()})
    raw = path.read_bytes()
    typeflags = [raw[o + 156:o + 157] for o in range(0, len(raw), 512) if raw[o + 257:o + 262] == b"ustar"]
    assert b"x" in typeflags  # the file really has PAX headers, so the test covers them
    expected = read_tar(path)
    assert [k for k, _ in expected] == [f"d/sample-{i:03d}" for i in range(6)]
    assert project_samples(path) == expected
    assert project_samples(path, chunk=512) == expected


def small_shard(tmp_path):
    m = build_source(array_source(4, (1, 20, 20)), tmp_path, encoding="raw", maxcount=4)
    path = tmp_path / m["shards"][0]["name"]
    with tarfile.open(path) as tar:
        return path.read_bytes(), tar.getmembers()


@pytest.mark.parametrize("where", ["mid_data", "mid_header", "mid_padding", "empty"])
def test_reader_rejects_truncated_shard(tmp_path, where):
    """A member cut short is damage (a cut between whole members is not: see below)."""
    raw, members = small_shard(tmp_path)
    cut = {"mid_data": members[2].offset_data + 100, "mid_header": members[3].offset + 200,
           "mid_padding": members[3].offset - 10, "empty": 0}[where]
    with pytest.raises(ShardError):
        list(member_list(io.BytesIO(raw[:cut])))


@pytest.mark.parametrize("n", [100, 5000])
def test_reader_rejects_garbage(tmp_path, n):
    garbage = np.random.default_rng(n).integers(1, 256, n, dtype=np.uint8).tobytes()
    with pytest.raises(ShardError):
        list(member_list(io.BytesIO(garbage)))
    raw, members = small_shard(tmp_path)  # a good first member followed by garbage
    with pytest.raises(ShardError):
        list(member_list(io.BytesIO(raw[:members[1].offset] + garbage)))


def header(name, size, fmt=tarfile.USTAR_FORMAT):
    info = tarfile.TarInfo(name)
    info.size = size
    return info.tobuf(format=fmt)


@pytest.mark.parametrize("size,fmt,limit", [
    (8 ** 11 - 1, tarfile.USTAR_FORMAT, read.MAX_MEMBER),  # 8 GiB in octal
    (1 << 40, tarfile.GNU_FORMAT, read.MAX_MEMBER),        # base-256 size field
    (5000, tarfile.USTAR_FORMAT, 4096),                      # just over a caller's limit
])
def test_reader_rejects_oversized_member_without_reading_it(size, fmt, limit):
    hdr = header("big.raw", size, fmt)
    assert len(hdr) == 512 and hdr[257:262] == b"ustar"
    stream = Trickle(hdr + bytes(range(256)) * 64, step=1 << 20)
    with pytest.raises(ShardError, match="claims"):
        list(member_list(stream, chunk=4096, max_member=limit))
    assert stream.largest <= 4096  # it never asked for the claimed size


def test_reader_rejects_negative_size_field():
    hdr = bytearray(header("neg.raw", 0))
    hdr[124:136] = b"-0000001750\0"  # -1000: would step the parser backwards forever
    hdr[148:156] = b"        "
    hdr[148:156] = b"%06o\0 " % sum(hdr)
    stream = io.BytesIO(bytes(hdr) + bytes(4096))
    with pytest.raises(ShardError):
        list(itertools.islice(read.iter_samples(stream), 10))


def test_reader_skips_directories_and_links():
    long_name = "d/" + "a" * 60 + "/" + "k" * 60 + ".cls"
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        d = tarfile.TarInfo("d")
        d.type = tarfile.DIRTYPE
        tar.addfile(d)
        link = tarfile.TarInfo("d/l.cls")
        link.type, link.linkname = tarfile.SYMTYPE, "x"
        tar.addfile(link)
        f = tarfile.TarInfo(long_name)  # over 100 characters: split into USTAR's prefix field
        f.size = 1
        tar.addfile(f, io.BytesIO(b"7"))
    assert buf.getvalue()[1024 + 345:1024 + 350] == b"d/aaa"  # third header's prefix
    assert member_list(io.BytesIO(buf.getvalue())) == [(long_name, b"7")]




def sequential(buf, image_ext, label_ext="cls"):
    """(keys, images, labels) as iter_samples reads the image and label members."""
    samples = list(read.iter_samples(io.BytesIO(buf), {image_ext, label_ext}))
    return [s["__key__"] for s in samples], [s[image_ext] for s in samples], [int(s[label_ext]) for s in samples]


def ustar(members):
    """A plain USTAR tar (tarfile) of (name, bytes) members."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.mark.parametrize("encoding", shards.ENCODINGS)
def test_regular_reads_project_shards_exactly_as_the_sequential_reader(tmp_path, encoding):
    src = array_source(23, (3, 9, 9))
    src.images[::3] = 0  # these compress: png members of different sizes
    m = build_source(src, tmp_path, encoding=encoding, maxcount=23)
    buf = (tmp_path / m["shards"][0]["name"]).read_bytes()
    found = regular.regular(buf, encoding, "cls")
    assert found is not None  # the fast path is taken for the shards make_shards writes
    keys, images, labels = found
    want_keys, want_images, want_labels = sequential(buf, encoding)
    assert keys == want_keys and labels.tolist() == want_labels and len(keys) == 23
    if encoding == "raw":
        assert isinstance(images, np.ndarray) and [r.tobytes() for r in images] == want_images
        assert not images.flags.writeable and images.base is not None  # a view into buf: the caller copies
    else:
        assert images == want_images and len({len(x) for x in images}) > 1  # sizes differ: the chain, not a period


def test_regular_reads_two_member_tars_of_other_writers(tmp_path):
    rng = np.random.default_rng(0)
    members = []
    for i in range(7):
        members += [(f"s{i:03d}.jpg", rng.bytes(int(rng.integers(1, 3000)))), (f"s{i:03d}.cls", str(i * 11).encode())]
    buf = ustar(members)
    keys, images, labels = regular.regular(buf, "jpg", "cls")
    assert (keys, images, labels.tolist()) == sequential(buf, "jpg")


def pax_tar(members, pax):
    """A tar with a PAX header of pax(name) records before every member (tarfile)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.pax_headers = len(data), pax(name)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.mark.parametrize("ext", ["raw", "jpg"])
def test_regular_reads_wds_tarwriter_shards_exactly_as_the_sequential_reader(ext):
    """wds.TarWriter sorts a sample's members (.cls first) and writes a PAX header before
    each (its mtimes are floats): the fast path reads those shards too, keys with folders."""
    import webdataset as wds

    rng = np.random.default_rng(1)
    buf = io.BytesIO()
    with wds.TarWriter(buf) as sink:
        for i in range(9):
            data = rng.bytes(48) if ext == "raw" else rng.bytes(int(rng.integers(1, 2000)))
            sink.write({"__key__": f"train/{i % 3}/{i:04d}", ext: data, "cls": str(i % 4).encode()})
    buf = buf.getvalue()
    found = regular.regular(buf, ext, "cls")
    assert found is not None and buf[156:157] == b"x"  # PAX headers, and still the fast path
    keys, images, labels = found
    want_keys, want_images, want_labels = sequential(buf, ext)
    assert keys == want_keys and labels.tolist() == want_labels and len(keys) == 9
    assert [bytes(x) for x in images] == want_images and keys[4] == "train/1/0004"


def test_regular_reads_damaged_mtime_pax_headers_as_the_sequential_reader():
    """wds.TarWriter's PAX headers hold one mtime record each and are checked for all members at
    once (regular._mtime_only): any byte of one changed reads as iter_samples reads it, or is left
    to it (None), never otherwise."""
    members = [(f"k{i}.{ext}", bytes([i]) * 20 if ext == "jpg" else str(i).encode())
               for i in range(4) for ext in ("jpg", "cls")]
    buf = pax_tar(members, lambda name: {"mtime": "1796506823.467961"})  # as wds.TarWriter's, one length
    body = 3 * 2048 + 512  # the fourth member's PAX body: not the first of its length
    size = int(buf[body - 512 + 124:body - 512 + 135], 8)
    assert regular.regular(buf, "jpg", "cls") is not None and b"mtime=" in buf[body:body + size]
    for at in range(size):
        for byte in b"0 =.\n\0x9":
            damaged = bytearray(buf)
            damaged[body + at] = byte
            found = regular.regular(bytes(damaged), "jpg", "cls")
            try:
                want = sequential(bytes(damaged), "jpg")
            except ShardError:
                want = None
            if found is not None:
                keys, images, labels = found
                assert (keys, [bytes(x) for x in images], labels.tolist()) == want, (at, byte)


def test_regular_leaves_pax_headers_that_change_a_member_to_the_sequential_reader():
    members = [("a.raw", b"x" * 9), ("a.cls", b"1"), ("b.raw", b"y" * 9), ("b.cls", b"2")]
    for pax in ({"path": "z.raw"}, {"size": "9"}, {"GNU.sparse.size": "9"}):
        buf = pax_tar(members, lambda name, pax=pax: dict(pax) if name == "b.raw" else {"mtime": "1.5"})
        assert regular.regular(buf, "raw", "cls") is None
    # a PAX header of several blocks before one member: the raw images are no longer evenly spaced
    buf = pax_tar(members, lambda name: {"comment": "c" * 700} if name == "a.cls" else {"mtime": "1.5"})
    keys, images, labels = regular.regular(buf, "raw", "cls")
    assert (keys, [bytes(x) for x in images], labels.tolist()) == sequential(buf, "raw") == (
        ["a", "b"], [b"x" * 9, b"y" * 9], [1, 2])


def test_regular_reads_raw_images_spaced_unevenly_by_a_long_pax_header_exactly():
    """Raw images of one size that a PAX header of several blocks spaces unevenly (the third
    starts a block later than a period from the second would say): a strided view over them
    would hand out the wrong bytes for every image after it. Two samples can't show it: two
    starts always make one period."""
    members = [(f"{k}.{e}", (k * 9).encode() if e == "raw" else b"1") for k in "abcd" for e in ("raw", "cls")]
    buf = pax_tar(members, lambda name: {"comment": "c" * 700} if name == "b.cls" else {"mtime": "1.5"})
    keys, images, labels = regular.regular(buf, "raw", "cls")
    assert (keys, [bytes(x) for x in images], labels.tolist()) == sequential(buf, "raw") == (
        list("abcd"), [k.encode() * 9 for k in "abcd"], [1] * 4)


def test_regular_leaves_a_last_member_without_its_pair_and_huge_pax_headers_to_the_sequential_reader():
    """A tar whose last image has no label member (an odd count of members) and one whose PAX
    header is over 1 MiB of harmless records (iter_samples refuses that size): neither is read
    by the fast path, which would pair members wrongly or accept what the sequential reader refuses."""
    members = [("a.raw", b"x" * 9), ("a.cls", b"1"), ("b.raw", b"y" * 9), ("b.cls", b"2")]
    odd = ustar(members + [("c.raw", b"z" * 9)])
    assert regular.regular(odd, "raw", "cls") is None
    assert [sorted(s) for s in read.iter_samples(io.BytesIO(odd))][-1] == ["__key__", "__url__", "raw"]
    huge = pax_tar(members, lambda name: {"comment": "c" * (1 << 20)} if name == "b.raw" else {"mtime": "1.5"})
    assert regular.regular(huge, "raw", "cls") is None
    with pytest.raises(ShardError, match="tar extension header of"):
        list(read.iter_samples(io.BytesIO(huge)))


def test_regular_reads_samples_whose_label_comes_first():
    buf = ustar([("s1.cls", b"3"), ("s1.jpg", b"one"), ("s2.cls", b"17"), ("s2.jpg", b"two!")])
    keys, images, labels = regular.regular(buf, "jpg", "cls")
    assert (keys, images, labels.tolist()) == sequential(buf, "jpg") == (["s1", "s2"], [b"one", b"two!"], [3, 17])
    mixed = ustar([("s1.cls", b"3"), ("s1.jpg", b"one"), ("s2.jpg", b"two!"), ("s2.cls", b"17")])
    assert regular.regular(mixed, "jpg", "cls") is None  # one order throughout, or the sequential reader


def forged_headers_inside_data():
    """A member whose bytes are tar headers that pair up as samples would: only the chain
    of sizes from the first header shows they are data (iter_samples reads a, then c)."""
    forged = ustar([("a.cls", b"1"), ("b.raw", b""), ("b.cls", b"2"), ("a.raw", b"")])[:6 * 512]
    return ustar([("a.raw", forged), ("a.cls", b"1"), ("c.raw", b""), ("c.cls", b"3")])


def nul_in_second_key():
    b = bytearray(ustar([("aaa.raw", b"x"), ("aaa.cls", b"1"), ("bbb.raw", b"y"), ("bbb.cls", b"2")]))
    b[2049] = b[3073] = 0  # the sequential reader sees "b": no extension, no sample
    return bytes(b)


def gzip_magic_names():
    """A tar whose first bytes are gzip's magic: the sequential reader takes it for gzip."""
    b = bytearray(ustar([("xxk.raw", b"x"), ("xxk.cls", b"1"), ("xxj.raw", b"y"), ("xxj.cls", b"2")]))
    for at in (0, 1024, 2048, 3072):
        b[at:at + 2] = read.GZIP_MAGIC
    return bytes(b)


def two_samples():
    return ustar([("a.raw", b"x" * 9), ("a.cls", b"1"), ("b.raw", b"y" * 9), ("b.cls", b"2")])


def third_image_header(at, value, fmt=tarfile.USTAR_FORMAT):
    """Three samples of one layout, the third image header's bytes from `at` set to `value`:
    what the periodic finder must see in every header, not only the first two."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt) as tar:
        for name in (f"{k}.{e}" for k in "abc" for e in ("raw", "cls")):
            info = tarfile.TarInfo(name)
            info.size = 9 if name.endswith("raw") else 1
            tar.addfile(info, io.BytesIO(b"x" * 9 if name.endswith("raw") else b"1"))
    b = bytearray(out.getvalue())
    b[4096 + at:4096 + at + len(value)] = value  # 4 blocks a sample: its image header at block 8
    return bytes(b)


def not_octal_first_size():
    """The first header's size digits hold an 8 (read from the first header alone: _blocks)."""
    b = bytearray(two_samples())
    b[134] = ord("8")
    return bytes(b)


@pytest.mark.parametrize("make", [
    forged_headers_inside_data,
    lambda: ustar([("a.raw", b"x" * 9), ("a.cls", b"1"), ("a.json", b"{}"), ("b.raw", b"y" * 9), ("b.cls", b"2"),
                   ("b.json", b"{}")]),                                            # three members a sample
    lambda: ustar([("a.raw", b"x" * 9), ("a.cls", b"1a"), ("b.raw", b"y" * 9), ("b.cls", b"2")]),  # not digits
    lambda: ustar([("a.raw", b"x" * 9), ("a.cls", b"1"), ("bb.raw", b"y" * 9), ("b.cls", b"2")]),  # keys differ
    lambda: ustar([("a.raw", b"x" * 9), ("a.cls", b"1"), ("b.raw", b"y" * 9), ("bb.cls", b"2")]),  # keys differ
    lambda: ustar([("a.raw", b"x" * 9), ("a.cls", b"1"), ("b.c.raw", b"y" * 9), ("b.c.cls", b"2")]),  # a dot
    lambda: ustar([("a.raw", b"x" * 9), ("b.cls", b"1"), ("bb.raw", b"y" * 9), ("bb.cls", b"2")]),  # keys differ
    lambda: ustar([("ab.raw", b"x"), ("ab.cls", b"1"), ("cd.raw", b"y"), ("ce.cls", b"2")]),  # keys of one length differ
    lambda: ustar([("abc.raw", b"x"), ("abc.cls", b"1"), ("d.e.raw", b"y"), ("d.e.cls", b"2")]),  # a dot, one length
    lambda: ustar([("a.raw", b"x" * 9), ("a.clsx", b"1"), ("b.raw", b"y" * 9), ("b.clsx", b"2")]),  # not .cls
    lambda: ustar([("a.RAW", b"x" * 9), ("a.cls", b"1"), ("b.RAW", b"y" * 9), ("b.cls", b"2")]),   # other case
    lambda: ustar([("a.raw", b"x" * 9), ("a.cls", b"1"), ("a.raw", b"y" * 9), ("a.cls", b"2")]),   # a key twice
    lambda: two_samples()[:4 * 1024],                                               # no end-of-archive block
    lambda: ustar([("a.raw", b"x"), ("a.cls", str(2 ** 64 + 3).encode()), ("b.raw", b"y"), ("b.cls", b"1")]),
    lambda: ustar([("ab/.raw", b"x"), ("ab/.cls", b"1"), ("cd/.raw", b"y"), ("cd/.cls", b"2")]),  # no key
    lambda: ustar([("aaaaa.raw", b"x"), ("aaaaa.cls", b"1"), ("__x__.raw", b"y"), ("__x__.cls", b"2")]),
    lambda: nul_in_second_key(),
    not_octal_first_size,
    lambda: third_image_header(156, b"2"),        # a symbolic link, same size
    lambda: third_image_header(262, b"\x0000" + bytes(80) + b"p", tarfile.GNU_FORMAT),  # POSIX with a name prefix
    lambda: third_image_header(124, b"1"),        # another size, in its first digit
    lambda: third_image_header(257, b"x"),        # no USTAR magic in an image header
    lambda: third_image_header(1024 + 257, b"x"),  # nor in the label header after it
    lambda: ustar([("a.raw", b"x" * 9), ("a.cls", b"x"), ("b.raw", b"y" * 9), ("b.cls", b"2")]),  # one letter
    lambda: gzip_magic_names(),
])
def test_regular_leaves_every_other_layout_to_the_sequential_reader(make):
    """None, not a misreading: iter_samples then reads (or rejects) the shard."""
    assert regular.regular(make(), "raw", "cls") is None
    assert regular.regular(two_samples(), "raw", "cls") is not None  # the unbroken layout is read


def test_regular_reads_keys_of_different_lengths_as_the_sequential_reader():
    """Keys as tools/write_wds.py writes them (`cat/0655`, `truck/3050`), of any lengths: the
    numpy path, as iter_samples reads them (a JPEG set's shards read 2x faster that way)."""
    members = []
    for i, key in enumerate(["cat/0655", "truck/3050", "a", "horse/1", "dog/" + "7" * 80]):
        members += [(f"{key}.jpg", bytes([i]) * (i + 1)), (f"{key}.cls", str(i).encode())]
    buf = ustar(members)
    keys, images, labels = regular.regular(buf, "jpg", "cls")
    assert (keys, [bytes(x) for x in images], labels.tolist()) == sequential(buf, "jpg")
    assert keys[:3] == ["cat/0655", "truck/3050", "a"] and labels.tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("names", [
    ["a.jpg", "a.cls", "bb.jpg", "bb.clsx"],   # not .cls
    ["a.jpg", "a.cls", "bb.jpg", "bc.cls"],    # keys differ
    ["a.jpg", "a.cls", "bb.jpeg", "bb.cls"],   # not .jpg
    ["a.jpg", "a.cls", "b.b.jpg", "b.b.cls"],  # a dot
    ["a.jpg", "a.cls", "bb/.jpg", "bb/.cls"],  # no key
])
def test_regular_leaves_other_layouts_with_keys_of_different_lengths_to_the_sequential_reader(names):
    """Keys of differing lengths take their own checks (regular._checked_keys): each name that
    iter_samples would read another way leaves the shard to it."""
    data = [b"x", b"1", b"y", b"2"]
    assert regular.regular(ustar(list(zip(names, data))), "jpg", "cls") is None
    assert regular.regular(ustar(list(zip(["a.jpg", "a.cls", "bb.jpg", "bb.cls"], data))), "jpg", "cls") is not None


@pytest.mark.parametrize("last", ["embedding", "embeddinx"])
def test_regular_reads_long_extensions_as_the_sequential_reader(last):
    """An extension and its NUL longer than the 8 bytes the one-length check reads as one
    integer: compared byte by byte, a difference in its last letter seen."""
    members = []
    for i, key in enumerate(["k0", "k1", "k2"]):
        members += [(f"{key}.{last if i == 2 else 'embedding'}", bytes([i]) * 3), (f"{key}.cls", str(i).encode())]
    found = regular.regular(ustar(members), "embedding", "cls")
    if last == "embedding":
        keys, images, labels = found
        assert (keys, [bytes(x) for x in images], labels.tolist()) == sequential(ustar(members), "embedding")
    else:
        assert found is None


def test_regular_reads_keys_the_first_of_which_is_the_longest_as_the_sequential_reader():
    """A wds.ShardWriter set's shard whose first key is its longest (`automobile/4547` before
    `bird/3887`): the numpy path too, not left to the sequential reader."""
    members = []
    for i, key in enumerate(["automobile/4547", "bird/3887", "cat/12", "automobile/1"]):
        members += [(f"{key}.cls", str(i).encode()), (f"{key}.jpg", bytes([i]) * (i + 1))]
    buf = ustar(members)
    found = regular.regular(buf, "jpg", "cls")
    assert found is not None
    keys, images, labels = found
    assert (keys, [bytes(x) for x in images], labels.tolist()) == sequential(buf, "jpg")
    assert keys == ["automobile/4547", "bird/3887", "cat/12", "automobile/1"]


def test_regular_reads_keys_and_labels_of_every_form_as_the_sequential_reader():
    """Keys that are not UTF-8 (their odd bytes escaped by read.key_text, a key at a time there,
    all at once here where they can be), keys in folders, and labels of 1 to 18 digits."""
    names = [b"caf\xc3\xa9", b"bad\xff\xfe", b"cut\xe2\x82", b"dir/x", b"\xe2\x82\xac!!"]  # 5 bytes each
    digits = [b"7", b"42", b"123456789012345678", b"0", b"000000000000000009"]
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT, encoding="latin-1") as tar:
        for i, (name, label) in enumerate(zip(names, digits)):
            for ext, data in (("raw", bytes([i]) * 9), ("cls", label)):
                info = tarfile.TarInfo(f"{name.decode('latin-1')}.{ext}")  # latin-1: the bytes as they are
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    buf = out.getvalue()
    keys, images, labels = regular.regular(buf, "raw", "cls")
    assert (keys, [bytes(x) for x in images], labels.tolist()) == sequential(buf, "raw")
    assert labels.tolist() == [int(d) for d in digits] and keys[1:4] == ["bad\\xff\\xfe", "cut\\xe2\\x82", "dir/x"]


def test_regular_reads_evenly_spaced_samples_whose_data_holds_tar_magic():
    """Image bytes that look like tar headers (the USTAR magic at byte 257 of a block): the
    chain of sizes from the first header says where the headers are, so the shard is read,
    exactly as the sequential reader reads it."""
    fake = ustar([("x.raw", b"1"), ("x.cls", b"2")])[:512]  # a whole tar header as data
    members = []
    for i in range(6):
        members += [(f"k{i}.raw", fake + bytes([i]) * 512), (f"k{i}.cls", str(i).encode())]
    buf = ustar(members)
    found = regular.regular(buf, "raw", "cls")
    assert found is not None
    keys, images, labels = found
    assert (keys, [bytes(x) for x in images], labels.tolist()) == sequential(buf, "raw")


def test_regular_leaves_a_member_over_the_member_limit_to_the_sequential_reader(monkeypatch):
    """iter_samples refuses a wanted member over MAX_MEMBER bytes; the fast path must not read
    it either (the Reader never hands it such a shard, a caller of `regular` might)."""
    buf = ustar([("a.raw", b"x" * 101), ("a.cls", b"1"), ("b.raw", b"y" * 101), ("b.cls", b"2")])
    monkeypatch.setattr(regular, "MAX_MEMBER", 101)  # the limit as the fast path reads it
    assert regular.regular(buf, "raw", "cls") is not None
    monkeypatch.setattr(regular, "MAX_MEMBER", 100)
    assert regular.regular(buf, "raw", "cls") is None
    with pytest.raises(ShardError, match="claims 101 bytes"):
        list(read.iter_samples(io.BytesIO(buf), {"raw", "cls"}, max_member=100))


def test_regular_never_reads_one_extension_as_image_and_label():
    twice = ustar([("a.cls", b"1"), ("a.cls", b"1"), ("b.cls", b"2"), ("b.cls", b"2")])
    with pytest.raises(ShardError, match="twice"):
        list(read.iter_samples(io.BytesIO(twice)))
    assert regular.regular(twice, "cls", "cls") is None


def test_damaged_gzip_is_a_shard_error():
    data = bytearray(gzip.compress(two_samples()))
    data[len(data) // 2] ^= 0xFF
    for damaged in (bytes(data), bytes(data[:len(data) // 2]), gzip_magic_names()):
        with pytest.raises(ShardError, match="gzip"):
            list(read.iter_samples(io.BytesIO(damaged)))


def test_forged_headers_read_as_data():
    keys, images, _ = sequential(forged_headers_inside_data(), "raw")
    assert keys == ["a", "c"] and len(images[0]) == 6 * 512


# ---------------------------------------------------------------- the same samples as webdataset

NAME_CHARS = "abcXY019_-."


def random_name(rng):
    """A member path of 0-3 folders, dots anywhere (folders with dots, leading dots, several
    extensions), sometimes long (GNU long names, PAX paths, the USTAR prefix) or __meta__-like."""
    def part(n):
        return "".join(rng.choice(list(NAME_CHARS), int(n)))

    folders = [part(rng.integers(1, 12)) for _ in range(rng.integers(0, 4))]
    if rng.random() < 0.1:
        folders = ["__meta__"] + folders[:1]
    if rng.random() < 0.15:
        folders.append("x" * int(rng.integers(60, 140)))
    base = rng.choice(["__meta__", "__x__", "____"]) if rng.random() < 0.05 else part(rng.integers(0, 10))
    return "/".join(folders + [base])


def random_tar(rng):
    """(bytes, format) of a tar with random samples: consecutive members sharing a key, random
    extensions (case included), directories and links between them, empty and odd-sized data."""
    fmt = rng.choice([tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
    buf = io.BytesIO()

    def add(info, data=b""):
        try:
            tar.addfile(info, io.BytesIO(data))
        except ValueError:  # a name USTAR cannot hold: left out of this tar
            pass

    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for _ in range(rng.integers(0, 8)):
            key = random_name(rng)
            exts = rng.choice(["jpg", "cls", "JSON", "rgb.png", "depth.npy", "txt", "a.b.c", ""],
                              size=rng.integers(1, 4), replace=False)
            for ext in exts:
                if rng.random() < 0.1:
                    d = tarfile.TarInfo(key + "-dir")
                    d.type = tarfile.DIRTYPE
                    add(d)
                if rng.random() < 0.05:
                    link = tarfile.TarInfo(f"{key}.lnk")
                    link.type, link.linkname = tarfile.SYMTYPE, "target"
                    add(link)
                info = tarfile.TarInfo(f"{key}.{ext}" if ext else key)
                data = rng.integers(0, 256, int(rng.choice([0, 1, 511, 512, 513, rng.integers(0, 3000)])),
                                    dtype=np.uint8).tobytes()
                info.size, info.mtime = len(data), float(rng.integers(0, 1 << 30)) + 0.5
                add(info, data)
        members = tar.getmembers()
    raw = buf.getvalue()
    if members and rng.random() < 0.3:  # no end-of-archive blocks
        last = members[-1]
        raw = raw[:last.offset_data + (last.size + 511) // 512 * 512]
    if rng.random() < 0.25:
        raw = gzip.compress(raw, mtime=0)
    return raw, fmt


def webdataset_samples(raw):
    """What webdataset 1.0.2's own tar iterator yields: [sample dict] or the exception type."""
    from webdataset import tariterators

    try:
        files = tariterators.tar_file_expander([{"url": "u", "stream": io.BytesIO(raw)}])
        return [{k: v for k, v in s.items() if k != "__url__"} for s in tariterators.group_by_keys(files)]
    except Exception as e:  # noqa: BLE001  (only whether it failed is compared)
        return type(e)


def project_reads(raw):
    try:
        return [{k: v for k, v in s.items() if k != "__url__"} for s in read.iter_samples(io.BytesIO(raw))]
    except ShardError as e:
        return type(e)


def test_reader_yields_exactly_what_webdataset_yields_on_random_tars():
    """Property: for a few hundred random tars (USTAR, GNU, PAX, gzip, no end blocks, names with
    folders and dots), the same samples, keys, members and bytes in the same order; or both fail."""
    rng = np.random.default_rng(1234)
    formats = set()
    for case in range(300):
        raw, fmt = random_tar(rng)
        formats.add(fmt)
        theirs, ours = webdataset_samples(raw), project_reads(raw)
        if isinstance(theirs, type):
            assert ours is ShardError, (case, theirs, ours)
        else:
            assert ours == theirs, case
    assert len(formats) == 3


def test_tar_without_end_blocks_yields_every_whole_member(tmp_path):
    raw, members = small_shard(tmp_path)
    whole = member_list(io.BytesIO(raw))
    end = members[-1].offset_data + (members[-1].size + 511) // 512 * 512
    assert member_list(io.BytesIO(raw[:end])) == whole
    assert member_list(io.BytesIO(raw[:members[4].offset])) == whole[:4]  # cut at a sample boundary
    with pytest.raises(ShardError, match="truncated"):  # cut in the padding of the last member
        member_list(io.BytesIO(raw[:end - 1]))


def test_meta_members_follow_webdataset():
    tar = ustar([("__meta__.json", b"{}"), ("__meta__/info.json", b"{}"), ("__x__", b"1"),
                 ("a.png", b"p"), ("a.cls", b"1")])
    samples = list(read.iter_samples(io.BytesIO(tar)))
    assert [(s["__key__"], sorted(k for k in s if not k.startswith("__"))) for s in samples] == \
        [("__meta__", ["json"]), ("a", ["cls", "png"])]
    assert samples == [dict(s, __url__=None) for s in webdataset_samples(tar)]
    assert read.is_meta("__meta__") and not read.is_meta("a/__meta__") and not read.is_meta("a")


def test_gnu_sparse_member_is_named(tmp_path):
    import shutil
    import subprocess

    if shutil.which("tar") is None:
        pytest.skip("no tar command")
    path = tmp_path / "holes.img"
    with open(path, "wb") as f:
        f.seek(1 << 20)
        f.write(b"end")
    subprocess.run(["tar", "--format=gnu", "-S", "-cf", str(tmp_path / "s.tar"), "-C", str(tmp_path), "holes.img"],
                   check=True)
    raw = (tmp_path / "s.tar").read_bytes()
    assert raw[156:157] == b"S"  # GNU tar really wrote a sparse member
    with pytest.raises(ShardError, match="'holes.img' is a GNU sparse file"):
        list(read.iter_samples(io.BytesIO(raw)))


def test_a_gzip_shard_with_trailing_garbage_reads_as_webdataset_reads_it(tmp_path):
    """Bytes after the gzip member (garbage, zero padding) end the data, as under webdataset's
    tarfile: all 6 samples, where Python's gzip raised at the garbage and the shard gave none.
    Another member after the first is read too (gzip's rule, which webdataset's tarfile does not
    follow); damage inside a member stays damage."""
    import webdataset as wds

    raw = build_tar(6)
    members = gzip.compress(raw[:3000], mtime=0) + gzip.compress(raw[3000:], mtime=0)
    for tail in (b"this is not gzip" * 40, bytes(1000)):
        for body in (gzip.compress(raw, mtime=0), members):
            path = tmp_path / "garbage.tar.gz"
            path.write_bytes(body + tail)
            ours = [s["__key__"] for s in read.iter_samples(io.BytesIO(path.read_bytes()))]
            assert ours == [f"s{i}" for i in range(6)]
            if body is not members:  # webdataset's tarfile reads the first member only
                assert ours == [s["__key__"] for s in wds.WebDataset(str(path), shardshuffle=False)]
    whole = gzip.compress(raw, mtime=0)
    for damaged in (whole[:-4], whole[:-8] + bytes(4) + whole[-4:], whole + whole[:20]):  # cut, bad CRC, bad 2nd member
        with pytest.raises(ShardError, match="damaged gzip stream"):
            list(read.iter_samples(io.BytesIO(damaged)))


def build_tar(n):
    """A USTAR tar of n samples s0..s{n-1}, each a .cls and a .bin member."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(n):
            for ext, data in (("cls", str(i).encode()), ("bin", bytes([i]) * 700)):
                info = tarfile.TarInfo(f"s{i}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.mark.parametrize("damage", ["garbage_header", "cut_in_header", "cut_in_data", "cut_in_label"])
def test_reader_yields_the_whole_sample_before_damage_and_the_numpy_path_agrees(tmp_path, damage):
    """Six [raw][cls] samples, damaged at s3.raw (or inside s2.cls): s0-s2 come before the
    ShardError, as webdataset's warn_and_continue reads them; a sample cut inside a member
    comes with its whole members only (a schema then refuses it). The numpy path leaves every
    such shard to this reader, so both paths read the same samples."""
    from helpers import write_tar
    write_tar(tmp_path / "s.tar", [(f"s{i}.{ext}", bytes([i]) * 20 if ext == "raw" else b"%d" % i)
                                   for i in range(6) for ext in ("raw", "cls")])
    raw = (tmp_path / "s.tar").read_bytes()
    with tarfile.open(tmp_path / "s.tar") as tar:
        at = {m.name: m for m in tar.getmembers()}
    o = at["s3.raw"].offset
    damaged = {"garbage_header": raw[:o] + bytes([7]) * 512 + raw[o + 512:], "cut_in_header": raw[:o + 100],
               "cut_in_data": raw[:at["s3.raw"].offset_data + 10],
               "cut_in_label": raw[:at["s2.cls"].offset_data]}[damage]
    got = []
    with pytest.raises(ShardError):
        for sample in read.iter_samples(io.BytesIO(damaged)):
            got.append(sorted(k for k in sample if not k.startswith("__")))
    whole = [["cls", "raw"]] * (2 if damage == "cut_in_label" else 3)
    assert got == whole + ([["raw"]] if damage == "cut_in_label" else [])
    assert regular.regular(damaged, "raw", "cls") is None


def test_reader_does_not_yield_a_sample_with_a_member_twice():
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name in ("a.raw", "a.cls", "b.raw", "b.raw", "c.raw"):
            info = tarfile.TarInfo(name)
            info.size = 1
            tar.addfile(info, io.BytesIO(b"1"))
    got = []
    with pytest.raises(ShardError, match="twice"):
        got.extend(s["__key__"] for s in read.iter_samples(io.BytesIO(buf.getvalue())))
    assert got == ["a"]
