"""JPEG pixels from libjpeg-turbo through simplejpeg, when it is installed: the decoder with
the least cost around libjpeg-turbo's own (no tensor per image, no per-call checks), and
DCT scaling to any of libjpeg-turbo's eighths (`min_height`/`min_width`) where PIL's draft
mode has only halves. Measured in README.md "JPEG decoders" (`tools/bench_loader.py --jpeg`).

Without simplejpeg (`available()` False) pipeline.data.decoding.decode decodes JPEGs as it did
before: torchvision.io.decode_jpeg, and PIL's draft mode for large ones. Either way the
header is read and checked first (`pipeline.data.decoding.jpeg`, `pipeline.data.decoding.image_caps`); the
callers here are handed its Header and decode nothing it has not passed. The pixels of an
image decoded at its own size are libjpeg-turbo's in both (the same library, the same
IDCT and upsampling); a downscaled one differs by the DCT scale simplejpeg picks.
"""
import functools

import numpy as np

COLOUR = (1, 3)  # frame components simplejpeg decodes here (grey, YCbCr); CMYK goes PIL's way


@functools.lru_cache(maxsize=None)
def _module():
    try:
        import simplejpeg
    except ImportError:
        return None
    return simplejpeg


def available():
    """Whether simplejpeg is installed (then JPEGs decode here)."""
    return _module() is not None


REFUSED = (ValueError, OSError, RuntimeError)  # what simplejpeg raises where libjpeg-turbo refuses or warns (strict)


def colour_space(c):
    """simplejpeg's colour space for c channels (grey or RGB)."""
    return "GRAY" if c == 1 else "RGB"


def decode_into():
    """simplejpeg.decode_jpeg itself, for a batch's loop (decode._turbo_batch) to call with
    `strict=True`, catching REFUSED: no Python frame around each call (a wrapper's cost
    0.3-0.8 us of a 32x32 image's ~13)."""
    return _module().decode_jpeg


def decode(data, head, shape):
    """HWC uint8 of a JPEG, turned upright by its EXIF orientation (head: its jpeg.Header),
    decoded at the smallest DCT scale that still covers the target `shape` (C, H, W) on both
    sides; None where libjpeg-turbo refuses it or warns."""
    c, h, w = shape
    if head.orientation >= 5:  # stored turned a quarter: the frame's width becomes the height
        h, w = w, h
    try:
        pixels = _module().decode_jpeg(data, colorspace=colour_space(c), min_height=h, min_width=w, strict=True)
    except REFUSED:
        return None
    return upright(pixels, head.orientation)


def upright(a, orientation):
    """An HWC array turned by its EXIF orientation (1-8), as PIL's ImageOps.exif_transpose turns an image."""
    if orientation in (2, 3):
        a = a[:, ::-1]
    if orientation in (3, 4):
        a = a[::-1]
    if orientation >= 5:  # 5 transpose, 6 rotate 90 clockwise, 7 transverse, 8 rotate 90 counter-clockwise
        a = a.transpose(1, 0, 2)
        if orientation in (6, 7):
            a = a[:, ::-1]
        if orientation in (7, 8):
            a = a[::-1]
    return np.ascontiguousarray(a)
