"""pipeline/png.py: our PNGs take the zlib fast path; every other PNG still decodes (through
PIL) or fails with a ValueError, never with garbage pixels."""
import io
import struct
import time
import zlib

import numpy as np
import pytest
from PIL import Image

from pipeline import png

SHAPES = [(1, 28, 28), (3, 32, 32), (3, 5, 7)]


def pixels(shape, seed=0):
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def pil_png(a, **kw):
    buf = io.BytesIO()
    Image.fromarray(a[0] if a.shape[0] == 1 else a.transpose(1, 2, 0)).save(buf, format="PNG", **kw)
    return buf.getvalue()


def handmade_png(a, filter_type):
    """A PNG whose every row carries `filter_type`, with that filter applied (None or Sub)."""
    c, h, w = a.shape
    rows = a.transpose(1, 2, 0).reshape(h, w * c).astype(np.int16)
    if filter_type == 1:  # Sub: difference from the pixel one to the left
        rows = rows - np.concatenate([np.zeros((h, c), np.int16), rows[:, :-c]], axis=1)
    body = np.concatenate([np.full((h, 1), filter_type), rows % 256], axis=1).astype(np.uint8)
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 0 if c == 1 else 2, 0, 0, 0)
    return png.SIGNATURE + png._chunk(b"IHDR", ihdr) + png._chunk(b"IDAT", zlib.compress(body.tobytes())) \
        + png._chunk(b"IEND", b"")


@pytest.mark.parametrize("shape", SHAPES)
def test_encode_round_trips_on_the_fast_path_and_pil_agrees(shape):
    a = pixels(shape)
    data = png.encode(a)
    assert png._inflate_up(data, shape) is not None
    assert (png.decode(data, shape) == a).all()
    assert (png._decode_pil(data, shape) == a).all()  # a standard PNG, not a private format


@pytest.mark.parametrize("shape", SHAPES)
def test_pngs_written_by_others_decode_identically(shape):
    a = pixels(shape, seed=1)
    c, h, w = shape
    for data in (pil_png(a), pil_png(a, optimize=True), handmade_png(a, 0), handmade_png(a, 1)):
        assert png._inflate_up(data, shape) is None  # not what encode writes: PIL's job
        assert len(png.rows(data, shape)) == h * (1 + w * c)
        assert (png.decode(data, shape) == a).all()


@pytest.mark.parametrize("shape", SHAPES)
def test_a_batch_unfilters_at_once_whichever_path_each_image_took(shape):
    """The stream keeps each image as `rows` and unfilters a batch in one call: images from
    the fast path and from PIL must come out identical to their originals, in order."""
    images = [pixels(shape, seed=s) for s in range(4)]
    encoders = [png.encode, pil_png, png.encode, lambda a: handmade_png(a, 1)]
    data = b"".join(png.rows(enc(a), shape) for enc, a in zip(encoders, images))
    assert (png.unfilter(data, 4, shape) == np.stack(images)).all()


def test_damaged_pngs_raise_value_error():
    shape = (3, 32, 32)
    good = png.encode(pixels(shape))
    flipped = bytearray(good)
    flipped[60] ^= 0xFF  # inside the IDAT data: its CRC no longer matches
    cases = {"truncated": good[:len(good) // 2], "flipped": bytes(flipped), "garbage": b"not a png at all",
             "empty": b""}
    for name, data in cases.items():
        assert png._inflate_up(data, shape) is None, name
        with pytest.raises(ValueError):
            png.rows(data, shape)  # not bytes of another length, which would break a whole batch


@pytest.mark.parametrize("fmt", ["BMP", "TIFF", "GIF"])
def test_other_image_formats_named_png_are_refused(fmt):
    """PIL opens dozens of formats (EPS through Ghostscript); a .png member must be a PNG."""
    a = pixels((3, 32, 32))
    buf = io.BytesIO()
    Image.fromarray(a.transpose(1, 2, 0)).save(buf, format=fmt)
    with pytest.raises(ValueError, match="undecodable"):
        png.rows(buf.getvalue(), (3, 32, 32))


def test_wrong_size_or_mode_is_refused():
    with pytest.raises(ValueError, match="expected 32x32"):
        png.decode(png.encode(pixels((3, 30, 32))), (3, 32, 32))
    with pytest.raises(ValueError, match="mode RGB, expected L"):
        png.decode(png.encode(pixels((3, 28, 28))), (1, 28, 28))


@pytest.mark.parametrize("side", [5_000, 100_000])  # over our limit; over PIL's own bomb limit too
def test_decompression_bomb_is_refused_from_its_header(side):
    """A header claiming side x side RGB pixels over a small zlib stream: refused before any
    pixel buffer is made (100,000 x 100,000 would be 30 GB)."""
    ihdr = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    bomb = png.SIGNATURE + png._chunk(b"IHDR", ihdr) + png._chunk(b"IDAT", zlib.compress(bytes(1 << 20))) \
        + png._chunk(b"IEND", b"")
    t0 = time.time()
    with pytest.raises(ValueError, match=f"image is {side}x{side}|decompression bomb"):
        png.decode(bomb, (3, 32, 32))
    assert time.time() - t0 < 5
