"""pipeline/png.py: our PNGs take the zlib fast path; every other PNG still decodes (through
PIL) or fails with a ValueError, never with garbage pixels."""
import io

import numpy as np
import pytest
from PIL import Image

from helpers import handmade_png, pil_png, pixels
from pipeline.data.decoding import png

SHAPES = [(1, 28, 28), (3, 32, 32), (3, 5, 7)]


@pytest.mark.parametrize("shape", SHAPES)
def test_encode_round_trips_on_the_fast_path_and_pil_agrees(shape):
    a = pixels(shape)
    data = png.encode(a)
    assert png.fast_rows(data, shape) is not None
    assert (png.decode(data, shape) == a).all()
    img = np.asarray(Image.open(io.BytesIO(data)))  # a standard PNG, not a private format
    assert ((img[None] if img.ndim == 2 else img.transpose(2, 0, 1)) == a).all()


@pytest.mark.parametrize("shape", SHAPES)
def test_pngs_written_by_others_leave_the_fast_path(shape):
    a = pixels(shape, seed=1)
    for data in (pil_png(a), pil_png(a, optimize=True), handmade_png(a, 0), handmade_png(a, 1)):
        assert png.fast_rows(data, shape) is None  # not what encode writes: pipeline.decode hands it to PIL
        with pytest.raises(ValueError):
            png.decode(data, shape)


def test_damaged_pngs_leave_the_fast_path():
    shape = (3, 32, 32)
    good = png.encode(pixels(shape))
    flipped = bytearray(good)
    flipped[60] ^= 0xFF  # inside the IDAT data: its CRC no longer matches
    cases = {"truncated": good[:len(good) // 2], "flipped": bytes(flipped), "garbage": b"not a png at all",
             "empty": b""}
    for name, data in cases.items():
        assert png.fast_rows(data, shape) is None, name
    assert png.fast_rows(good, (3, 0, 32)) is None and png.fast_rows(good, (2, 32, 32)) is None  # shapes encode can't write


def test_unfilter_undoes_the_up_filter_for_a_batch():
    images = [pixels((3, 5, 7), seed=s) for s in range(4)]
    data = b"".join(png.fast_rows(png.encode(a), (3, 5, 7)) for a in images)
    assert (png.unfilter(data, 4, (3, 5, 7)) == np.stack(images)).all()
