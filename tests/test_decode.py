"""pipeline/decode.py: every supported image format to the source's shape, labels from every
supported member, and nothing else ever decoded."""
import io
import json
import struct
import time
import zlib

import numpy as np
import pytest
from PIL import Image

from pipeline import decode, png
from pipeline.decode import Target
from test_png import handmade_png, pil_png, pixels

SHAPES = [(1, 28, 28), (3, 32, 32), (3, 5, 7)]


def encoded(a, fmt, **kw):
    """uint8 CHW -> bytes in a PIL format."""
    buf = io.BytesIO()
    Image.fromarray(a[0] if a.shape[0] == 1 else a.transpose(1, 2, 0)).save(buf, format=fmt, **kw)
    return buf.getvalue()


@pytest.mark.parametrize("shape", SHAPES)
def test_pngs_written_by_others_decode_identically(shape):
    a = pixels(shape, seed=1)
    for data in (pil_png(a), pil_png(a, optimize=True), handmade_png(a, 0), handmade_png(a, 1), png.encode(a)):
        assert (decode.decode_image(data, "png", shape) == a).all()


@pytest.mark.parametrize("shape", SHAPES)
def test_a_batch_decodes_at_once_whichever_path_each_image_took(shape):
    """Fast-path PNGs are unfiltered together, the others go through PIL: all come out
    identical to their originals, in order, with damaged ones reported by position."""
    images = [pixels(shape, seed=s) for s in range(5)]
    datas = [png.encode(images[0]), pil_png(images[1]), png.encode(images[2]), handmade_png(images[3], 1),
             png.encode(images[4])]
    datas.insert(2, b"\x89PNG\r\n\x1a\n garbage")
    out, kept, errors = decode.decode_batch(datas, ["png"] * 6, Target(shape))
    assert kept == [0, 1, 3, 4, 5] and [e[0] for e in errors] == [2] and "undecodable" in errors[0][1]
    assert (out == np.stack(images)).all()


def test_raw_batches_check_their_length():
    shape = (1, 4, 4)
    good = [pixels(shape, s).tobytes() for s in range(3)]
    out, kept, errors = decode.decode_batch(good[:1] + [b"short"] + good[1:], ["raw"] * 4, Target(shape, ("raw",)))
    assert kept == [0, 2, 3] and errors[0][0] == 1 and "5 raw bytes, expected 16" in errors[0][1]
    assert (out == np.stack([np.frombuffer(g, np.uint8).reshape(shape) for g in good])).all()


@pytest.mark.parametrize("fmt,ext", [("JPEG", "jpg"), ("WEBP", "webp"), ("PPM", "ppm"), ("BMP", "bmp")])
@pytest.mark.parametrize("mode_shape", [(3, 40, 56), (1, 40, 56)])
def test_every_format_and_mode_comes_to_the_target_shape(fmt, ext, mode_shape):
    """RGB and grey images of another size, in each format, to both a grey and a colour target."""
    c, h, w = mode_shape
    yy, xx = np.mgrid[:h, :w]
    a = np.stack([(xx * 4 + yy * k) % 256 for k in range(c)]).astype(np.uint8)  # smooth: lossy formats keep it
    data = encoded(a, fmt, **({"quality": 95} if fmt in ("JPEG", "WEBP") else {}))
    for target in ((3, 32, 32), (1, 24, 24)):
        out = decode.decode_image(data, ext, target)
        assert out.shape == target and out.dtype == np.uint8
    same = decode.decode_image(data, ext, mode_shape)  # no resize needed: close to the original
    tolerance = 12 if fmt in ("JPEG", "WEBP") else 0
    assert np.abs(same.astype(int) - a).mean() <= tolerance


def test_rgba_and_palette_images_decode():
    rgba = Image.fromarray(np.random.default_rng(0).integers(0, 256, (10, 10, 4), dtype=np.uint8), "RGBA")
    pal = rgba.convert("RGB").convert("P")
    for img in (rgba, pal):
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        assert decode.decode_image(buf.getvalue(), "png", (3, 10, 10)).shape == (3, 10, 10)


def test_resize_keeps_the_shorter_side_and_crops():
    """A 40x80 image to 20x20: resized to 20x40, then cropped 20x20, centred for evaluation,
    placed by the crop numbers for training."""
    a = np.zeros((40, 80, 3), np.uint8)
    a[:, :40] = 255  # left half white
    centre = decode.fit(a, (3, 20, 20))
    left = decode.fit(a, (3, 20, 20), crop=(0.0, 0.0))
    right = decode.fit(a, (3, 20, 20), crop=(0.0, 0.999))
    assert centre.shape == left.shape == right.shape == (3, 20, 20)
    assert left.mean() > 250 and right.mean() < 5 and 100 < centre.mean() < 155


def test_jpeg_size_is_read_from_the_frame_header():
    data = encoded(pixels((3, 37, 53)), "JPEG")
    assert decode.jpeg_size(data) == (37, 53)
    assert decode.jpeg_size(b"not a jpeg") is None
    assert decode.jpeg_size(data[:20]) is None  # cut before the frame header


def test_large_jpeg_takes_pils_draft_path_and_small_one_libjpeg():
    big, small = encoded(pixels((3, 128, 128)), "JPEG"), encoded(pixels((3, 32, 32)), "JPEG")
    assert decode.decode_image(big, "jpg", (3, 32, 32)).shape == (3, 32, 32)
    via_turbo = decode._torchvision_jpeg(small, 3, (32, 32))
    assert via_turbo is not None and via_turbo.shape == (32, 32, 3)
    pil = np.asarray(Image.open(io.BytesIO(small)).convert("RGB"))
    assert np.abs(via_turbo.astype(int) - pil).mean() < 3  # the same image, either decoder


@pytest.mark.parametrize("fmt", ["BMP", "TIFF", "GIF"])
def test_other_image_formats_named_png_are_refused(fmt):
    """PIL opens dozens of formats (EPS through Ghostscript); a .png member must be a PNG."""
    data = encoded(pixels((3, 32, 32)), fmt)
    with pytest.raises(ValueError, match="undecodable"):
        decode.decode_image(data, "png", (3, 32, 32))


def test_damaged_images_raise_value_error():
    good = encoded(pixels((3, 32, 32)), "JPEG")
    for ext, data in (("jpg", good[:len(good) // 3]), ("jpg", b"\xff\xd8garbage"), ("png", b""), ("webp", b"x")):
        with pytest.raises(ValueError):
            decode.decode_image(data, ext, (3, 32, 32))


@pytest.mark.parametrize("side", [5_000, 100_000])  # over our limit; over PIL's own bomb limit too
def test_decompression_bomb_is_refused_from_its_header(side):
    """A header claiming side x side RGB pixels over a small zlib stream: refused before any
    pixel buffer is made (100,000 x 100,000 would be 30 GB)."""
    ihdr = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    bomb = png.SIGNATURE + png._chunk(b"IHDR", ihdr) + png._chunk(b"IDAT", zlib.compress(bytes(1 << 20))) \
        + png._chunk(b"IEND", b"")
    t0 = time.time()
    with pytest.raises(ValueError, match=f"image is {side}x{side}|decompression bomb"):
        decode.decode_image(bomb, "png", (3, 32, 32))
    assert time.time() - t0 < 5


def test_labels_from_every_member_kind():
    t = Target((1, 4, 4), label="cls", classes=10)
    assert decode.label_of({"cls": b"7"}, t) == 7
    assert decode.label_of({"txt": b" 3\n"}, Target((1, 4, 4), label="txt")) == 3
    assert decode.label_of({"index": b"2"}, Target((1, 4, 4), label="index")) == 2
    nested = Target((1, 4, 4), label="json:meta.label")
    assert decode.label_of({"json": json.dumps({"meta": {"label": 4}}).encode()}, nested) == 4
    sparse = Target((1, 4, 4), classes=3, label_values=(3, 7, 12))
    assert decode.label_of({"cls": b"12"}, sparse, sparse.lookup()) == 2
    bad = [({"cls": b"10"}, t, "outside 0..9"), ({"cls": b"-1"}, t, "outside"), ({"cls": b"cat"}, t, "not an integer"),
           ({}, t, "no .cls member"), ({"json": b"{}"}, nested, "no meta.label field"),
           ({"json": b'{"meta": {"label": "4"}}'}, nested, "not an integer"),
           ({"json": b'{"meta": {"label": true}}'}, nested, "not an integer"),
           ({"json": b"not json"}, nested, "no meta.label"), ({"cls": b"5"}, sparse, "not one of")]
    for sample, target, message in bad:
        with pytest.raises(ValueError, match=message):
            decode.label_of(sample, target, target.lookup())


def test_label_keys_and_image_extensions_are_checked():
    for bad in ("pyd", "json", "json:", "json:a..b", "pth", ""):
        with pytest.raises(ValueError):
            decode.parse_label_key(bad)
    with pytest.raises(ValueError):
        Target((3, 8, 8), image_exts=("pyd",))
    assert Target((3, 8, 8), ("jpg", "png"), "json:label").members == {"jpg", "png", "json"}


def test_only_named_members_are_ever_looked_at():
    """A sample full of pickles and tensors: image_of and label_of touch only .png and .cls."""
    class Explodes(bytes):
        def __getattribute__(self, name):
            raise AssertionError("a member that should never be read was read")

    t = Target((1, 2, 2), ("png",), "cls")
    sample = {"png": png.encode(np.zeros((1, 2, 2), np.uint8)), "cls": b"1", "pyd": Explodes(b"x"),
              "pth": Explodes(b"y"), "pickle": Explodes(b"z")}
    assert decode.image_of(sample, t)[0] == "png" and decode.label_of(sample, t) == 1
