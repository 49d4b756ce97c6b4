"""Sample stages a schema runs on one field after decoding (pipeline.data.fields.schema.Schema's
`stages`), in the loader's workers: a random resized or random crop, a flip, colour jitter
on uint8 images, a tokeniser of the user's on text.

Each stage names its field, says what the field becomes (`column`: a crop makes an image of
its own size, a tokeniser makes text into token ids), and is called with the field's value
and a `random.Random` that the schema draws from the sample's seed, a pure function of the
sample's position: a resumed stream repeats every crop and flip. Images are uint8 (C, H, W)
numpy arrays; what a stage cannot do with a sample (a crop larger than the image) is a
ValueError, and the sample is skipped and counted with that line.
"""
import dataclasses
import math

import numpy as np

from pipeline.errors import InputError, cut


class Stage:
    field = None

    def column(self, col):
        """The field as it is after this stage."""
        if col.kind != "image":
            raise ValueError(f"{type(self).__name__}({self.field!r}): an image field expected, "
                             f"{col.name!r} is {col.kind}")
        return col

    def __repr__(self):
        return f"{type(self).__name__}({self.field!r})"


def _size(size):
    h, w = (size, size) if isinstance(size, int) else tuple(size)
    if not (isinstance(h, int) and isinstance(w, int) and h >= 1 and w >= 1):
        raise ValueError(f"size {size!r}: (H, W) of positive integers expected")
    return h, w


def resize(a, size, box=None):
    """uint8 (C, h, w) -> (C, H, W), bilinear, of the region `box` (left, top, right, bottom) only."""
    from PIL import Image

    c = a.shape[0]
    h, w = size
    img = Image.fromarray(np.ascontiguousarray(a[0] if c == 1 else a.transpose(1, 2, 0)))
    out = img.resize((w, h), Image.BILINEAR, box=box, reducing_gap=3.0)
    return np.ascontiguousarray(np.asarray(out, dtype=np.uint8).reshape(h, w, c).transpose(2, 0, 1))


class RandomResizedCrop(Stage):
    """A random part of the image (`scale` of its area, `ratio` its aspect), resized to `size`:
    torchvision's RandomResizedCrop, drawn from the sample's seed."""

    def __init__(self, field, size, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
        self.field, self.size, self.scale, self.ratio = field, _size(size), tuple(scale), tuple(ratio)
        if not (0 < self.scale[0] <= self.scale[1] <= 1 and 0 < self.ratio[0] <= self.ratio[1]):
            raise ValueError(f"RandomResizedCrop({field!r}): 0 < scale[0] <= scale[1] <= 1 and 0 < ratio[0] <= "
                             f"ratio[1] expected")

    def column(self, col):
        return dataclasses.replace(super().column(col), fit="resize", size=self.size)

    def __call__(self, a, rng):
        _, h, w = a.shape
        area = h * w
        lo, hi = math.log(self.ratio[0]), math.log(self.ratio[1])
        for _ in range(10):
            target = area * rng.uniform(*self.scale)
            aspect = math.exp(rng.uniform(lo, hi))
            cw, ch = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
            if 0 < cw <= w and 0 < ch <= h:
                top, left = rng.randint(0, h - ch), rng.randint(0, w - cw)
                break
        else:  # torchvision's fallback: the centre, its aspect clamped to the ratios
            aspect = w / h
            cw, ch = (w, h) if self.ratio[0] <= aspect <= self.ratio[1] else \
                ((w, round(w / self.ratio[0])) if aspect < self.ratio[0] else (round(h * self.ratio[1]), h))
            cw, ch = min(cw, w), min(ch, h)
            top, left = (h - ch) // 2, (w - cw) // 2
        return resize(a, self.size, (left, top, left + cw, top + ch))


class RandomCrop(Stage):
    """A random `size` window of the image, not resized: an image smaller than the window is
    skipped (counted, with its size), never padded or stretched."""

    def __init__(self, field, size):
        self.field, self.size = field, _size(size)

    def column(self, col):
        return dataclasses.replace(super().column(col), fit="resize", size=self.size)

    def __call__(self, a, rng):
        _, h, w = a.shape
        ch, cw = self.size
        if h < ch or w < cw:
            raise ValueError(f"image of {h}x{w} is smaller than the {ch}x{cw} crop of RandomCrop({self.field!r})")
        top, left = rng.randint(0, h - ch), rng.randint(0, w - cw)
        return np.ascontiguousarray(a[:, top:top + ch, left:left + cw])


class Flip(Stage):
    """The image mirrored left to right with probability `p`."""

    def __init__(self, field, p=0.5):
        self.field, self.p = field, float(p)

    def __call__(self, a, rng):
        return np.ascontiguousarray(a[:, :, ::-1]) if rng.random() < self.p else a


class ColorJitter(Stage):
    """Brightness, contrast and saturation each scaled by a factor drawn from [1 - x, 1 + x], in
    that order, on the uint8 image (saturation on colour images only)."""

    def __init__(self, field, brightness=0.4, contrast=0.4, saturation=0.4):
        self.field, self.amounts = field, (float(brightness), float(contrast), float(saturation))
        if any(not 0 <= x <= 1 for x in self.amounts):
            raise ValueError(f"ColorJitter({field!r}): amounts in 0..1 expected")

    def __call__(self, a, rng):
        fb, fc, fs = (rng.uniform(max(0.0, 1 - x), 1 + x) for x in self.amounts)
        x = a.astype(np.float32) * fb
        grey = (0.299 * x[0] + 0.587 * x[1] + 0.114 * x[2]) if len(x) == 3 else x[0]
        m = float(grey.mean())
        x = (x - m) * fc + m
        if len(x) == 3:
            g = 0.299 * x[0] + 0.587 * x[1] + 0.114 * x[2]
            x = (x - g) * fs + g
        return np.clip(np.rint(x), 0, 255).astype(np.uint8)


class Tokenize(Stage):
    """A text field as token ids: `fn(text)` (the user's tokeniser) returns integers, of which
    the first `length` are kept; the batch holds them padded with 0, and NAME_len beside."""

    def __init__(self, field, fn, length):
        self.field, self.fn, self.length = field, fn, int(length)

    def column(self, col):
        if col.kind != "text" or col.tokens is not None:
            raise ValueError(f"Tokenize({self.field!r}): a text field not yet tokenised expected")
        return dataclasses.replace(col, tokens=self.length)

    def __call__(self, text, rng):
        try:
            ids = np.asarray(self.fn(text))
        except Exception as e:  # noqa: BLE001 - the user's code: say whose, in one line
            raise InputError(f"tokeniser {getattr(self.fn, '__qualname__', self.fn)!r} of field {self.field} raised "
                             f"{type(e).__name__}: {cut(e, 200)}") from None
        if ids.ndim != 1 or (len(ids) and ids.dtype.kind not in "iu"):
            raise InputError(f"tokeniser {getattr(self.fn, '__qualname__', self.fn)!r} of field {self.field} returned "
                             f"{ids.dtype} {ids.shape}, not a list of integers")
        return ids[:self.length].astype(np.int64)
