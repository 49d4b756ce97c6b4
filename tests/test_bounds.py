"""A few kilobytes must never cost gigabytes: hostile images, gzip bombs and special files.

Every payload here is written by the test: tiny files that claim or expand to huge
sizes (a 1 x 1,500,000 PNG, a JPEG whose first frame header lies, BMP, PPM and PNG
headers claiming far more than they hold, a gzip bomb), FIFOs and /dev/zero named
by a manifest. The memory tests decode in a process of their own under an address-space
limit a few hundred MB above its own baseline, and assert a one-line reason or a counted
skip where an unbounded decode would die.
"""
import gzip
import io
import json
import os
import struct
import sys
import tarfile
import textwrap
import threading
import zlib

import numpy as np
import pytest
from PIL import Image, ImageOps

from helpers import Forker, HANG, make_shards_in_process, one_line_error, run_capture, write_tar
from pipeline.data.decoding import image_caps, decode, jpeg, png
from pipeline.data.shards import read
from pipeline.data.store import remote
from pipeline.errors import ShardError
from pipeline.data.manifests.manifest import FORMAT

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEADROOM = 400 << 20  # the address space a memory test may add to what its imports took


# ---------------------------------------------------------------- hostile payloads


def png_of(width, height, mode=0, depth=8, rows=None):
    """A valid PNG of width x height (grey by default) whose rows are all zero: tiny when compressed."""
    stride = 1 + (width * depth * {0: 1, 2: 3}[mode] + 7) // 8
    body = zlib.compress(bytes(stride * height) if rows is None else rows, 9)
    ihdr = struct.pack(">IIBBBBB", width, height, depth, mode, 0, 0, 0)
    return png.SIGNATURE + png._chunk(b"IHDR", ihdr) + png._chunk(b"IDAT", body) + png._chunk(b"IEND", b"")


def jpeg_of(width, height, mode="RGB", **kw):
    buf = io.BytesIO()
    yy, xx = np.mgrid[:height, :width]
    a = np.stack([xx * 250 // width, yy * 250 // height, (xx + yy) * 120 // (width + height)], -1).astype(np.uint8)
    Image.fromarray(a).convert(mode).save(buf, format="JPEG", quality=95, **kw)
    return buf.getvalue()


def lying_jpeg(real=(20000, 20000)):
    """A 16x16 JPEG whose real frame header says `real` (height, width), behind a fake
    32x32 frame header in stray bytes that libjpeg steps over and a lenient reader takes."""
    data = bytearray(jpeg_of(16, 16))
    at = data.find(b"\xff\xc0")
    struct.pack_into(">HH", data, at + 5, *real)
    fake = b"\xc0\x00\x11\x08\x00\x20\x00\x20\x03\x01\x22\x00\x02\x11\x01\x03\x11\x01"
    return bytes(data[:at]) + fake + bytes(data[at:])


def bmp_of(width, height, pixels=b""):
    """A BMP header (8-bit, RLE8, grey palette) claiming width x height, with `pixels` behind it."""
    palette = b"".join(bytes((i, i, i, 0)) for i in range(256))
    offset = 14 + 40 + len(palette)
    info = struct.pack("<IiiHHIIiiII", 40, width, height, 1, 8, 1, len(pixels), 2835, 2835, 256, 0)
    return b"BM" + struct.pack("<IHHI", offset + len(pixels), 0, 0, offset) + info + palette + pixels


def ppm_of(width, height, maxval=255, body=b""):
    return f"P5 {width} {height} {maxval}\n".encode() + body


def webp_canvas(width, height):
    """A WebP whose VP8X header claims a width x height canvas over one 1x1 lossless frame."""
    buf = io.BytesIO()
    Image.new("RGB", (1, 1)).save(buf, format="WEBP", lossless=True)
    frame = buf.getvalue()[12:]  # the VP8L chunk
    vp8x = b"VP8X" + struct.pack("<I", 10) + bytes(4) + (width - 1).to_bytes(3, "little") \
        + (height - 1).to_bytes(3, "little")
    body = b"WEBP" + vp8x + frame
    return b"RIFF" + struct.pack("<I", len(body)) + body


def webp_lossy_claiming(width, height):
    """A 16x16 lossy WebP (no VP8X) whose VP8 frame header says width x height."""
    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (9, 80, 200)).save(buf, format="WEBP", quality=50)
    data = bytearray(buf.getvalue())
    struct.pack_into("<HH", data, data.find(b"\x9d\x01\x2a") + 3, width, height)
    return bytes(data)


def scan_bomb(scans):
    """A progressive 16x16 JPEG with its last scan repeated until it has `scans` scans."""
    data = jpeg_of(16, 16, progressive=True)
    last, end = data.rfind(b"\xff\xda"), data.rfind(b"\xff\xd9")
    have = data.count(b"\xff\xda")
    return data[:end] + data[last:end] * (scans - have) + data[end:]


def exif_jpeg(width, height, orientation):
    exif = Image.Exif()
    exif[0x0112] = orientation
    return jpeg_of(width, height, exif=exif.tobytes())


ISSUE_CASES = ("png 1x1500000", "jpeg 32x32 header before a 20000x20000 frame")  # the issue's two
HOSTILE = {  # name: (ext, bytes); each is a few kilobytes at most
    "png 1x1500000": ("png", png_of(1, 1_500_000)),
    "png 1500000x1": ("png", png_of(1_500_000, 1)),
    "png IHDR 60000x60000, no rows": ("png", png_of(60000, 60000, rows=b"")),
    "jpeg 32x32 header before a 20000x20000 frame": ("jpg", lying_jpeg()),
    "jpeg 4000x1": ("jpg", jpeg_of(4000, 1)),
    "bmp 1x1500000": ("bmp", bmp_of(1, 1_500_000)),
    "bmp claims 30000x30000": ("bmp", bmp_of(30000, 30000, b"\x00\x01")),
    "ppm 1x1500000": ("ppm", ppm_of(1, 1_500_000)),
    "pgm claims 40000x40000": ("pgm", ppm_of(40000, 40000, body=b"\x00" * 64)),
    "webp canvas 16384x16384": ("webp", webp_canvas(16384, 16384)),
    "webp canvas 1x16384": ("webp", webp_canvas(1, 16384)),
    # past MAX_PIXELS but under PIL's own bomb limit: only our cap stands in the way
    "png IHDR 10000x10000, no rows": ("png", png_of(10000, 10000, rows=b"")),
    "jpeg frame 10000x10000, 16x16 of data": ("jpg", lying_jpeg((10000, 10000)).replace(
        b"\xc0\x00\x11\x08\x00\x20\x00\x20\x03\x01\x22\x00\x02\x11\x01\x03\x11\x01", b"", 1)),
    "bmp claims 10000x10000": ("bmp", bmp_of(10000, 10000, b"\x00\x01")),
    "pgm claims 10000x10000": ("pgm", ppm_of(10000, 10000, body=b"\x00" * 64)),
    "webp canvas 10000x10000": ("webp", webp_canvas(10000, 10000)),
    "webp lossy frame header 16383x16383": ("webp", webp_lossy_claiming(16383, 16383)),
    "jpeg progressive, 2000 scans": ("jpg", scan_bomb(2000)),
}


def tiled_tiff(width, height, tile, body, compression=1):
    """A little-endian RGB TIFF of width x height held in one `tile` x `tile` tile of `body`."""
    tags = [(256, 3, width), (257, 3, height), (258, 3, 8), (259, 3, compression), (262, 3, 2), (277, 3, 3),
            (284, 3, 1), (322, 4, tile), (323, 4, tile), (324, 4, 8 + 2 + 12 * 11 + 4), (325, 4, len(body))]
    ifd = struct.pack("<H", len(tags)) + b"".join(
        struct.pack("<HHI", t, k, 1) + (struct.pack("<HH", v, 0) if k == 3 else struct.pack("<I", v))
        for t, k, v in tags)
    return b"II*\0" + struct.pack("<I", 8) + ifd + bytes(4) + body


def test_a_tiff_tile_larger_than_its_image_needs_is_refused():
    """libtiff decodes a tile whole into a buffer of its size: a 32x32 image in a 4096x4096
    deflated tile is 49 KB that cost 48 MB (780 KB cost 770 MB at 16384x16384)."""
    ok = decode.decode_image(tiled_tiff(32, 32, 32, bytes(range(256)) * 12), "tif", (3, 32, 32))
    assert ok.shape == (3, 32, 32) and ok.any()
    bomb = tiled_tiff(32, 32, 4096, zlib.compress(bytes(4096 * 4096 * 3), 9), compression=8)
    assert len(bomb) < 60_000
    with pytest.raises(ValueError, match="TIFF of 32x32 in tiles of 4096x4096, larger than the image needs"):
        decode.decode_image(bomb, "tif", (3, 32, 32))


def gzip_bomb(members=60, size=read.MAX_MEMBER - 512):
    """A .tar.gz of `members` samples, each a `size`-byte .png of zeros and a .cls: about
    3.9 MB that inflates to 3.8 GB. Built from concatenated gzip members (gzip allows it),
    so the zeros are compressed once."""
    zeros = gzip.compress(bytes(size), 9)
    pad = (-size) % 512
    out = []
    for i in range(members):
        head = tarfile.TarInfo(f"s{i:03d}.png")
        head.size = size
        out.append(gzip.compress(head.tobuf(tarfile.USTAR_FORMAT)))
        out.append(zeros)
        cls = tarfile.TarInfo(f"s{i:03d}.cls")
        cls.size = 1
        out.append(gzip.compress(bytes(pad) + cls.tobuf(tarfile.USTAR_FORMAT) + b"0" + bytes(511)))
    out.append(gzip.compress(bytes(1024)))
    return b"".join(out)


# ---------------------------------------------------------------- a manifest over any shard


def write_samples(path, samples, label=b"0"):
    """A tar of [(key, ext, bytes)] samples, each with a .cls member holding `label`."""
    write_tar(path, [m for key, ext, data in samples for m in ((f"{key}.{ext}", data), (f"{key}.cls", label))])


def write_set(folder, samples, shape=(3, 32, 32), exts=decode.IMAGE_EXTS[1:], name="hostile"):
    """A shard of [(key, ext, bytes)] samples (label 0 each) and a local manifest for it."""
    folder.mkdir(exist_ok=True)
    shard = folder / f"{name}-train-000000.tar"
    write_samples(shard, samples)
    return write_manifest(folder, [(shard.name, len(samples), shard.stat().st_size)], shape, exts, name)


def write_manifest(folder, shards, shape=(3, 32, 32), exts=("png",), name="hostile"):
    m = {"format": FORMAT, "dataset": name, "split": "train", "encoding": exts[0], "image_exts": list(exts),
         "label": "cls", "shape": list(shape), "classes": ["a", "b"], "total": sum(s[1] for s in shards),
         "shards": [{"name": n, "samples": k, "bytes": b} for n, k, b in shards],
         "mean": [0.5] * shape[0], "std": [0.25] * shape[0], "origin": {"kind": "index"}}
    path = folder / f"{name}-train.json"
    path.write_text(json.dumps(m))
    return path


def good(key, shape=(3, 32, 32)):
    rng = np.random.default_rng(len(key))
    return key, "png", png.encode(rng.integers(0, 256, shape, dtype=np.uint8))


# ---------------------------------------------------------------- a process under an address-space limit


PREAMBLE = """
import os, resource, sys, warnings
sys.path.insert(0, {root!r})
import numpy, torch, torchvision, PIL.Image
from pipeline.data.decoding import decode
from pipeline.data.streams import stream
from pipeline.data.store import remote
from pipeline.writers import index
def vm():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) << 10 for l in f if l.startswith("VmSize:"))
"""
CAP = """
limit = vm() + {headroom}
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
warnings.simplefilter("ignore")
"""


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    """limited(body, *args): `body` in a process whose address space may grow HEADROOM past its
    imports. The imports are made once (helpers.Forker); each body runs in a child forked
    from them, which sets its own cap from its own size."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_ARENA_MAX="2", PYTHONPATH=ROOT)
    with Forker(PREAMBLE.format(root=ROOT), tmp_path_factory.mktemp("limited"), env=env, cwd=ROOT) as forker:
        yield lambda body, *args, timeout=HANG: forker.run(CAP.format(headroom=HEADROOM) + textwrap.dedent(body),
                                                          *args, timeout=timeout)


# ---------------------------------------------------------------- 1. decoded size bounded


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_an_image_outside_the_caps_is_refused_from_its_header(case):
    ext, data = HOSTILE[case]
    assert len(data) < 64 << 10
    with pytest.raises(ValueError) as e:
        decode.decode_image(data, ext, (3, 32, 32))
    assert "\n" not in str(e.value)
    assert any(w in str(e.value) for w in ("MAX_PIXELS", "MAX_ASPECT", "MAX_SCANS", "stray bytes",
                                           "decompression bomb", "undecodable")), str(e.value)


@pytest.mark.slow
def test_every_hostile_image_is_refused_in_a_few_hundred_mb(tmp_path, limited):
    """The decode of every payload above, in one process whose address space may grow
    HEADROOM: each is a one-line reason, none a MemoryError or a kill."""
    cases = tmp_path / "cases.json"
    cases.write_text(json.dumps({k: (e, d.hex()) for k, (e, d) in HOSTILE.items()}))
    p = limited("""
        import json
        cases = json.loads(open(sys.argv[1]).read())
        for name, (ext, hexdata) in sorted(cases.items()):
            try:
                decode.decode_image(bytes.fromhex(hexdata), ext, (3, 32, 32))
                print(name, "| DECODED")
            except ValueError as e:
                print(name, "|", str(e).replace(chr(10), " "))
        """, cases)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.splitlines()
    assert len(lines) == len(HOSTILE) and not [ln for ln in lines if "DECODED" in ln], p.stdout


def test_the_lying_jpeg_was_a_real_threat():
    """libjpeg reads the real frame, not the fake one a lenient reader finds first."""
    data = lying_jpeg((300, 200))
    assert Image.open(io.BytesIO(data)).size == (200, 300)
    with pytest.raises(ValueError, match="stray bytes"):
        jpeg.header(data)
    assert decode.jpeg_size(data) is None


@pytest.mark.slow
def test_progressive_jpegs_decode_but_scan_bombs_do_not():
    data = jpeg_of(48, 40, progressive=True)
    assert 1 < data.count(b"\xff\xda") <= jpeg.MAX_SCANS
    assert decode.decode_image(data, "jpg", (3, 32, 32)).shape == (3, 32, 32)
    assert decode.decode_image(scan_bomb(jpeg.MAX_SCANS), "jpg", (3, 32, 32)).shape == (3, 32, 32)
    with pytest.raises(ValueError, match="MAX_SCANS"):
        decode.decode_image(scan_bomb(jpeg.MAX_SCANS + 1), "jpg", (3, 32, 32))


def test_the_caps_are_relative_to_the_target():
    image_caps.check(512, 512, (3, 32, 32))  # 256 times the target's pixels
    image_caps.check(4096, 4096, (3, 32, 32), "jpg")  # a JPEG decodes at 1/8 a side: 512x512
    image_caps.check(1, 4096, (1, 4096, 1))  # a thin target takes thin images
    for size, ext in (((513, 512), "png"), ((4096, 4096), "png"), ((4096, 4096), "npy"), ((4096, 4096), "bmp")):
        with pytest.raises(ValueError, match=r"times its 32x32 target's pixels as decoded \(.*MAX_DECODE_RATIO"):
            image_caps.check(*size, (3, 32, 32), ext)
    with pytest.raises(ValueError, match=r"334 times its 28x28 target's pixels as decoded at 1/8 scale"):
        image_caps.check(4096, 4096, (3, 28, 28), "jpg")
    image_caps.check(32 * 32, 32, (3, 32, 32))
    with pytest.raises(ValueError, match="MAX_ASPECT"):
        image_caps.check(33 * 32, 32, (3, 32, 32))
    with pytest.raises(ValueError, match="MAX_PIXELS"):
        image_caps.check(4097, 4096)
    with pytest.raises(ValueError, match="image is 0x5"):
        image_caps.check(0, 5)


def huge_png(side=4096):
    """The hostile trial's PNG: side x side RGB in one colour, 49 KB at 4096 (0.25-0.5 s of CPU to decode)."""
    return png_of(side, side, mode=2)


def test_a_png_of_far_more_pixels_than_its_target_is_refused_before_a_pixel_is_decoded(monkeypatch):
    """A 4096x4096 PNG of 49 KB for a 28x28 target: refused from its header (the decoder never
    runs, so it costs what reading the header does), in one line naming the cap; one of 16 times
    the target's side still decodes."""
    from PIL import ImageFile

    data = huge_png()
    assert len(data) < 64 << 10
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: pytest.fail("a huge PNG was decoded"))
    with pytest.raises(ValueError) as e:
        decode.decode_image(data, "png", (1, 28, 28))
    assert str(e.value) == ("image is 4096x4096, 21400 times its 28x28 target's pixels as decoded (at most 256, "
                            "pipeline.data.decoding.image_caps.MAX_DECODE_RATIO)"), str(e.value)
    monkeypatch.undo()
    assert decode.decode_image(huge_png(16 * 28), "png", (1, 28, 28)).shape == (1, 28, 28)
    assert decode.decode_image(jpeg_of(8 * 16 * 28, 8 * 16 * 28), "jpg", (1, 28, 28)).shape == (1, 28, 28)


def test_huge_pngs_in_a_shard_are_skipped_and_counted_with_their_reason(tmp_path):
    write_set(tmp_path, [good(f"g{i}", (1, 28, 28)) for i in range(4)] + [(f"h{i}", "png", huge_png()) for i in range(4)],
              shape=(1, 28, 28))
    from pipeline.data.streams.stream import MixedStream, resolve

    src = resolve("hostile", str(tmp_path) + "/", "train")
    with pytest.warns(UserWarning) as said:
        batches = list(MixedStream([src], {"hostile": 1}, 2).eval_stream(src))
    assert (sum(len(b["key"]) for b in batches), sum(b["skipped"] for b in batches)) == (4, 4)
    lines = [str(w.message) for w in said if "skipped sample h" in str(w.message)]
    assert len(lines) == 4 and all("MAX_DECODE_RATIO" in ln and "\n" not in ln for ln in lines), lines


@pytest.mark.slow
def test_a_thin_image_within_the_caps_resizes_without_a_large_buffer(limited):
    """fit resizes only the box its crop keeps: a 128x4096 image (1:32, within the caps) to a
    4096x4096 target, under the address-space limit. Resizing it whole first would make a
    4096 x 131072 RGB buffer, 1.5 GiB."""
    p = limited("""
        import numpy as np
        a = np.zeros((128, 4096, 3), np.uint8)
        a[:, 2048:] = 200
        out = decode.fit(a, (3, 4096, 4096))
        left = decode.fit(a, (3, 4096, 4096), crop=(0.0, 0.0))
        print(out.shape, round(float(out[:, :, :2000].mean())), round(float(out[:, :, 2100:].mean())), int(left.max()))
        """)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split() == ["(3,", "4096,", "4096)", "0", "200", "0"], p.stdout


def test_hostile_images_in_a_shard_are_skipped_and_counted_by_the_stream(tmp_path, limited):
    """The trainer's stream, under the address-space limit: every hostile image is a
    counted skip with a warning naming it, the good ones arrive."""
    samples = [good(f"g{i}") for i in range(4)] + [(f"h{i}", *HOSTILE[k]) for i, k in enumerate(sorted(HOSTILE))]
    write_set(tmp_path, samples)
    p = limited("""
        warnings.simplefilter("default")
        src = stream.resolve("hostile", sys.argv[1], "train")
        batches = list(stream.MixedStream([src], {"hostile": 1}, 2).eval_stream(src))
        print(sum(len(b["key"]) for b in batches), sum(b["skipped"] for b in batches))
        """, str(tmp_path) + "/")
    assert p.returncode == 0, p.stderr[-3000:]
    kept, skipped = map(int, p.stdout.split())
    assert (kept, skipped) == (4, len(HOSTILE)), p.stderr[-3000:]
    assert p.stderr.count("skipped sample h") == len(HOSTILE), p.stderr[-3000:]
    assert "Traceback" not in p.stderr


def test_strict_stops_at_the_first_hostile_image(tmp_path):
    write_set(tmp_path, [good("g0"), ("h0", *HOSTILE["png 1x1500000"])])
    from pipeline.data.streams.stream import MixedStream, resolve

    src = resolve("hostile", str(tmp_path) + "/", "train")
    with pytest.raises(ShardError, match="sample h0: image is 1x1500000"):
        list(MixedStream([src], {"hostile": 1}, 2, strict=True).eval_stream(src))


def make_shards(*args, timeout=HANG):
    """make_shards.py --quiet ARGS in this process (test_make_shards.py proves the script's wiring),
    in a thread, so that a hang (a FIFO opened) fails the test after `timeout` seconds."""
    done, streams = [], (sys.stdout, sys.stderr)

    def run():
        try:
            done.append(make_shards_in_process(["--quiet", *args]))
        except BaseException as e:  # noqa: B036 -- raised again in the test's thread
            done.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        sys.stdout, sys.stderr = streams  # the hung run never leaves its redirection
        pytest.fail(f"make_shards.py {' '.join(map(str, args))} still running after {timeout} s: a hang")
    if isinstance(done[0], BaseException):
        raise done[0]
    return done[0]


@pytest.mark.parametrize("case", ["png 1x1500000",
                                  pytest.param("jpeg 32x32 header before a 20000x20000 frame", marks=pytest.mark.slow),
                                  pytest.param("bmp claims 30000x30000", marks=pytest.mark.slow)])
def test_index_refuses_a_hostile_image_with_one_line(tmp_path, case, limited):
    folder = tmp_path / "shards"
    folder.mkdir()
    write_samples(folder / "a.tar", [good("g0"), good("g1"), ("bad", *HOSTILE[case])], b"1")
    one_line_error(make_shards("--index", f"x:train={folder}", "--out", tmp_path / "out"), "a.tar", "sample bad")
    p = limited("""
        try:
            index.index("x", "train", sys.argv[1], sys.argv[2], progress=False)
        except Exception as e:
            print(type(e).__name__, e)
        """, folder, tmp_path / "out")
    assert p.returncode == 0 and p.stdout.startswith("ShardError") and "sample bad" in p.stdout, \
        (p.stdout, p.stderr[-3000:])


def test_index_refuses_an_image_the_manifests_shape_would_refuse(tmp_path):
    """1x64 images pass the pixel cap; against the most common shape, 32x32, they are too thin."""
    folder = tmp_path / "shards"
    folder.mkdir()
    write_samples(folder / "a.tar", [good("g0"), good("g1"), ("thin", "png", png_of(1, 64 * 32))], b"1")
    p = make_shards("--index", f"x:train={folder}", "--out", tmp_path / "out")
    one_line_error(p, "sample thin", "MAX_ASPECT")
    p = make_shards("--index", f"x:train={folder}", "--shape", "1,2048,1", "--out", tmp_path / "out")
    assert p.returncode != 0 and "sample g0" in p.stderr  # now the square ones are the outliers


def test_index_refuses_an_image_of_far_more_pixels_than_the_manifests_shape(tmp_path):
    """The trainer would skip it: --index says so, naming the sample; a JPEG counts at 1/8 a side."""
    folder = tmp_path / "shards"
    folder.mkdir()
    write_samples(folder / "a.tar", [good("g0"), good("g1"), ("big", "png", huge_png(1024))], b"1")
    one_line_error(make_shards("--index", f"x:train={folder}", "--out", tmp_path / "out"), "sample big",
                   "MAX_DECODE_RATIO")
    write_samples(folder / "a.tar", [good("g0"), good("g1"), ("big", "jpg", jpeg_of(512, 512))], b"1")
    assert make_shards("--index", f"x:train={folder}", "--out", tmp_path / "out").returncode == 0


# ---------------------------------------------------------------- 6. images smaller than the model takes


def test_images_smaller_than_the_model_takes_are_resized_up():
    import torch

    from pipeline.train.model import MIN_SIDE, Net

    net = Net(4, width=4)
    for h, w in ((1, 1), (2, 3), (3, 40)):
        assert net(torch.zeros(2, 3, h, w)).shape == (2, 4)
    assert MIN_SIDE == 4


@pytest.mark.slow
def test_tiny_images_decode_to_the_target():
    for ext, data in (("png", png_of(1, 1)), ("jpg", jpeg_of(1, 1)), ("bmp", bmp_of(1, 1, b"\x01\x05\x00\x01")),
                      ("ppm", ppm_of(1, 1, body=b"\x80"))):
        out = decode.decode_image(data, ext, (3, 32, 32))
        assert out.shape == (3, 32, 32), ext


# ---------------------------------------------------------------- 7. EXIF orientation, 16-bit PNGs


@pytest.mark.parametrize("orientation", [3, 6, 8, 5])
@pytest.mark.parametrize("size,target", [((24, 40), (3, 40, 24)), ((96, 160), (3, 40, 24))])  # libjpeg; PIL's draft
def test_exif_orientation_is_applied_as_pil_does(orientation, size, target):
    """A 24x40 (and 96x160) JPEG stored sideways with an EXIF orientation decodes upright:
    the same pixels as PIL's ImageOps.exif_transpose, on the torchvision path and on PIL's."""
    w, h = size if orientation < 5 else size[::-1]
    data = exif_jpeg(w, h, orientation)
    assert jpeg.header(data).orientation == orientation and jpeg.header(data).upright == size[::-1]
    want = ImageOps.exif_transpose(Image.open(io.BytesIO(data)))
    assert want.size == size
    want = decode.fit(np.asarray(want.convert("RGB")), target)
    got = decode.decode_image(data, "jpg", target)
    assert got.shape == target
    assert np.abs(got.astype(int) - want).mean() < 4, np.abs(got.astype(int) - want).mean()


def test_sixteen_bit_grey_pngs_are_scaled_not_saturated():
    a = (np.arange(16 * 16, dtype=np.uint16).reshape(16, 16) * 257)
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, format="PNG")
    data = buf.getvalue()
    assert Image.open(io.BytesIO(data)).mode.startswith("I")
    assert (decode.decode_image(data, "png", (1, 16, 16))[0] == (a >> 8)).all()
    rgb = decode.decode_image(data, "png", (3, 16, 16))
    assert (rgb == (a >> 8)[None]).all()
    ppm = ppm_of(16, 16, 65535, a.astype(">u2").tobytes())
    assert (decode.decode_image(ppm, "pgm", (1, 16, 16))[0] == (a >> 8)).all()


def test_sixteen_bit_tiffs_are_scaled_and_grey_of_unknown_range_is_refused():
    """16-bit TIFFs (PIL's I;16 and I;16B) keep their top 8 bits as PNGs do; a TIFF of mode I
    (32-bit) or F holds values of no known range: refused naming its mode, not shifted to black."""
    a = np.arange(16 * 16, dtype=np.uint16).reshape(16, 16) * 257
    for img in (Image.fromarray(a), Image.frombytes("I;16B", (16, 16), a.astype(">u2").tobytes())):
        buf = io.BytesIO()
        img.save(buf, format="TIFF")
        assert Image.open(io.BytesIO(buf.getvalue())).mode == img.mode
        assert (decode.decode_image(buf.getvalue(), "tiff", (1, 16, 16))[0] == (a >> 8)).all()
    small = np.random.default_rng(0).integers(3, 254, (16, 16))
    for img, mode in ((Image.fromarray(small.astype(np.int32), "I"), "I"),
                      (Image.fromarray(small.astype(np.float32), "F"), "F")):
        buf = io.BytesIO()
        img.save(buf, format="TIFF")
        with pytest.raises(ValueError, match=f"TIFF of mode {mode} .* convert it to 8-bit grey"):
            decode.decode_image(buf.getvalue(), "tiff", (1, 16, 16))


def test_index_takes_the_mean_of_sixteen_bit_pngs_scaled(tmp_path):
    from pipeline.writers.index import index

    a = np.full((8, 8), 40000, np.uint16)
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, format="PNG")
    (tmp_path / "s").mkdir()
    write_tar(tmp_path / "s" / "a.tar", [("k0.png", buf.getvalue()), ("k0.cls", b"0"),
                                         ("k1.png", buf.getvalue()), ("k1.cls", b"1")])
    m = index("x", "train", str(tmp_path / "s"), str(tmp_path / "out"), progress=False)
    assert m["shape"] == [1, 8, 8] and abs(m["mean"][0] - (40000 >> 8) / 255) < 1e-3, m["mean"]


# ---------------------------------------------------------------- 2. gzip bombs, special files


def test_a_gzip_bomb_stops_at_its_inflation_cap():
    bomb = gzip_bomb(members=8)
    assert len(bomb) < 1 << 20
    got = 0
    with pytest.raises(ShardError, match="gzip stream inflates .*INFLATE_RATIO"):
        for sample in read.iter_samples(io.BytesIO(bomb), {"png", "cls"}):
            got += len(sample.get("png", b""))
    assert got <= read.INFLATE_RATIO * len(bomb) + read.INFLATE_SLACK


def test_nested_gzip_is_not_inflated_twice():
    inner = gzip.compress(gzip.compress(bytes(10 << 20)))
    with pytest.raises(ShardError, match="not a tar header"):
        list(read.iter_samples(io.BytesIO(inner)))


@pytest.mark.slow
def test_a_gzip_bomb_in_a_manifest_is_a_counted_skip_in_a_few_hundred_mb(tmp_path, limited):
    bomb = gzip_bomb()
    assert len(bomb) < 4 << 20  # the issue's 3.9 MB
    (tmp_path / "bomb-train-000000.tar.gz").write_bytes(bomb)
    write_manifest(tmp_path, [("bomb-train-000000.tar.gz", 60, len(bomb))], name="bomb")
    p = limited("""
        warnings.simplefilter("default")
        src = stream.resolve("bomb", sys.argv[1], "train")
        batches = list(stream.MixedStream([src], {"bomb": 1}, 2).eval_stream(src))
        print(sum(len(b["key"]) for b in batches), sum(b["skipped"] for b in batches))
        """, str(tmp_path) + "/", timeout=HANG)
    assert p.returncode == 0, p.stderr[-3000:]
    kept, skipped = map(int, p.stdout.split())
    assert kept == 0 and skipped >= 1 and "gzip stream inflates" in p.stderr, p.stderr[-3000:]


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "fifo-train-000000.tar"
    os.mkfifo(path)
    yield path
    # a writer opening it now would block forever: nothing here ever opens it for writing


@pytest.mark.parametrize("special", ["fifo", "/dev/zero", "dir"])
def test_special_files_named_by_a_manifest_are_refused_before_opening(tmp_path, fifo, special):
    path = {"fifo": str(fifo), "/dev/zero": "/dev/zero", "dir": str(tmp_path)}[special]
    with pytest.raises(ShardError, match="not a regular file: refused"):
        remote.read_url(path, lambda f: f.read(10))
    folder = tmp_path / "set"
    folder.mkdir()
    write_set(folder, [good("g0"), good("g1")])
    m = json.loads((folder / "hostile-train.json").read_text())
    m["shards"].append({"name": path, "samples": 2, "bytes": 4096})
    m["total"] = 4
    (folder / "hostile-train.json").write_text(json.dumps(m))
    from pipeline.data.streams.stream import MixedStream, resolve

    done = []

    def run():
        src = resolve("hostile", str(folder) + "/", "train")
        with pytest.warns(UserWarning, match="not a regular file: refused"):
            batches = list(MixedStream([src], {"hostile": 1}, 2).eval_stream(src))
        done.append((sum(len(b["key"]) for b in batches), sum(b["skipped"] for b in batches)))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), f"reading a manifest that names {special} hangs"
    assert done == [(2, 2)], done


def test_a_fifo_in_an_index_folder_is_one_line_not_a_hang(tmp_path):
    folder = tmp_path / "shards"
    folder.mkdir()
    write_samples(folder / "a.tar", [good("g0"), good("g1")], b"1")
    os.mkfifo(folder / "b.tar")
    p = make_shards("--index", f"x:train={folder}", "--out", tmp_path / "out", timeout=HANG)
    one_line_error(p, "b.tar", "a FIFO")


def test_local_reads_have_a_deadline(tmp_path, monkeypatch):
    """A local file whose reads take longer in all than its deadline (a network mount that
    drips) fails with one line; time the consumer spends between reads does not count."""
    import time

    path = tmp_path / "slow.tar"
    path.write_bytes(bytes(4096))
    f = remote.open_local(str(path), remote.Policy(timeout=0.05, min_rate=1 << 30))
    time.sleep(0.1)  # the consumer's time
    assert len(f.read(10)) == 10
    clock = iter(range(0, 1000, 1))  # each read now seems to take a second
    monkeypatch.setattr(remote.time, "monotonic", lambda: next(clock))
    f.read(10)
    with pytest.raises(OSError, match="slow.tar: not read within its 0 s deadline"):
        f.read(10)
    f.close()


def test_imagefolder_images_are_checked_before_they_are_decoded(tmp_path):
    """make_shards --imagefolder: a FIFO among the images is refused without blocking, an
    image over the caps or with a lying JPEG header before it is decoded."""
    from pipeline.writers.sources import ImageFolderSource, SourceError

    (tmp_path / "cat").mkdir()
    Image.new("RGB", (16, 16)).save(tmp_path / "cat" / "a.png")
    os.mkfifo(tmp_path / "cat" / "b.png")
    (tmp_path / "cat" / "c.png").write_bytes(HOSTILE["png IHDR 10000x10000, no rows"][1])
    (tmp_path / "cat" / "d.jpg").write_bytes(lying_jpeg())
    src = ImageFolderSource("x", "train", str(tmp_path))
    assert src.image(0).shape == (3, 16, 16)
    for i, needle in ((1, "a FIFO"), (2, "MAX_IMAGE_PIXELS"), (3, "stray bytes")):  # a conversion's cap: PIL's
        with pytest.raises(SourceError, match=needle):
            src.image(i)



EPS = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 16 16\nnewpath 0 0 moveto 16 16 lineto stroke showpage\n%%EOF\n"


def test_imagefolder_opens_only_the_format_an_extension_names(tmp_path, monkeypatch):
    """An ImageFolder .png that is really EPS must not reach PIL's EPS plugin (which runs
    Ghostscript), and a WebP's canvas is checked before libwebp allocates it (10000x10000:
    400 MB from 60 bytes)."""
    from PIL import EpsImagePlugin

    from pipeline.writers.sources import ImageFolderSource, SourceError

    opened = []
    monkeypatch.setattr(EpsImagePlugin.EpsImageFile, "_open", lambda self: opened.append(1) or 1 / 0)
    (tmp_path / "cat").mkdir()
    Image.new("RGB", (16, 16)).save(tmp_path / "cat" / "a.png")
    (tmp_path / "cat" / "b.png").write_bytes(EPS)
    (tmp_path / "cat" / "c.webp").write_bytes(webp_canvas(10000, 10000))
    (tmp_path / "cat" / "d.tif").write_bytes(EPS)
    src = ImageFolderSource("x", "train", str(tmp_path))
    for i, needle in ((1, "undecodable image"), (2, "MAX_IMAGE_PIXELS"), (3, "undecodable image")):
        with pytest.raises(SourceError, match=needle):
            src.image(i)
    assert not opened, "PIL tried an EPS file named .png as EPS"


@pytest.mark.slow
def test_the_trainer_skips_the_issues_two_images_under_an_address_space_limit(tmp_path):
    """The issue's attacks end to end: a 1 x 1,500,000 PNG and the lying JPEG among 40 good
    images, trained on and evaluated under an address-space limit HEADROOM + 200 MB above
    the trainer's imports: the run ends, both are counted as skipped (main died with MemoryError)."""
    samples = [good(f"g{i:02d}") for i in range(40)] + [(f"h{i}", *HOSTILE[k]) for i, k in enumerate(ISSUE_CASES)]
    write_set(tmp_path, samples)
    m = json.loads((tmp_path / "hostile-train.json").read_text())
    m["split"] = "test"
    (tmp_path / "hostile-test.json").write_text(json.dumps(m))
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_ARENA_MAX="2", PYTHONPATH=ROOT)
    probe = ("import torch, torchvision, pipeline.train\n"
             "print(next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmSize')) << 10)")
    base = int(run_capture([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=ROOT).stdout)
    limit = base + HEADROOM + (200 << 20)

    def cap():
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    p = run_capture([sys.executable, "-m", "pipeline.train", "--train", f"hostile={tmp_path}/", "--eval",
                     f"hostile={tmp_path}/", "--epochs", "1", "--batch-size", "8", "--workers", "0", "--width", "4",
                     "--out", tmp_path / "run"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=HANG,
                    preexec_fn=cap)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["skipped_samples"] == 2


@pytest.mark.slow
def test_a_manifest_that_is_a_fifo_is_one_line_not_a_hang(tmp_path):
    """--train NAME=PATH where PATH is a FIFO: opening it would block until someone writes."""
    from pipeline.data.manifests.manifest import resolve

    os.mkfifo(tmp_path / "x-train.json")
    done = []

    def run():
        try:
            resolve("x", str(tmp_path / "x-train.json"), "train")
        except ShardError as e:
            done.append(str(e))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "resolving a FIFO manifest hangs"
    assert len(done) == 1 and "a FIFO, not a regular file: refused" in done[0], done
