"""How large an image may be: the caps, and the one check every decoder calls before it
makes a pixel buffer.

A few kilobytes of PNG, BMP or JPEG can claim millions of pixels, and a thin image
resized so its shorter side fits its target grows by the target's size. So every
image is checked with the size its decoder will produce (PIL's for the formats PIL
decodes itself, libjpeg's frame header for JPEG, see `pipeline.data.decoding.jpeg`) against:
- MAX_PIXELS: the most pixels a source image may hold, whatever the target;
- MAX_ASPECT: how many times as elongated as its target shape an image may be;
- MAX_DECODE_RATIO: how many times its target's pixels an image may decode to. A 49 KB PNG
  of 4096x4096 cost 0.25-0.5 s of CPU to decode for a 28x28 target, where the target's own
  PNG costs microseconds: the CPU a sample may take follows from the job's target shape,
  not from what a file claims. A JPEG counts at the smallest scale its decoder reaches
  (libjpeg's DCT scaling, 1/8 a side: `REDUCED`), the other formats at their full size.
The resize itself makes no buffer beyond the crop it keeps (`decode.fit` resizes only
that box), so once an image passes, what it costs is bounded by these caps and the
target shape. A decoder added later calls `check` with its own decoded size.

These caps are the training stream's (`STREAM`). Converting a user's own photo folder
(`make-shards --imagefolder --shape`) is an offline step, not a stream of files anyone
could have written: its `CONVERSION` caps keep no relative limit and take as many pixels
as PIL opens without a DecompressionBombWarning (`Image.MAX_IMAGE_PIXELS`), as torchvision's
ImageFolder would load the same files. A 24 MP camera photo then converts at 3x32x32.
"""
from dataclasses import dataclass

MAX_PIXELS = 4096 * 4096  # 16.8 M pixels: 48 MiB as RGB; a source image claiming more is refused
MAX_ASPECT = 32  # a 1 x 1,500,000 image for a square target is refused; a 1:32 banner passes
MAX_DECODE_RATIO = 256  # 16 times the target's side: 448x448 for 28x28, 3584x3584 for 224x224
REDUCED = {"jpg": 8, "jpeg": 8}  # how many times smaller a side a format's decoder can decode to (PIL's draft)


@dataclass(frozen=True)
class Caps:
    """The caps one decode is held to: `pixels` (None: PIL's MAX_IMAGE_PIXELS, read when checked),
    and whether the caps relative to the target shape (MAX_ASPECT, MAX_DECODE_RATIO) apply."""

    pixels: int = None
    relative: bool = True

    def most_pixels(self):
        """(pixels, the name of the limit), for the check and its message."""
        if self.pixels is not None:
            return self.pixels, "pipeline.data.decoding.image_caps.MAX_PIXELS"
        from PIL import Image

        return Image.MAX_IMAGE_PIXELS, "PIL.Image.MAX_IMAGE_PIXELS"


STREAM = Caps(MAX_PIXELS, relative=True)  # training, indexing: any file anyone wrote
CONVERSION = Caps(None, relative=False)  # make-shards --imagefolder: the user's own photos, converted offline


def check(width, height, shape=None, ext=None, caps=STREAM):
    """Raise ValueError (one line) unless a `width` x `height` image, as its decoder will
    produce it, may be decoded for a target of `shape` (C, H, W) under `caps`; shape None
    checks the pixel count only (indexing, before the target shape is known). `ext`: the
    image's format (`decode.image_format`), for the scale it can be decoded at (REDUCED)."""
    if width < 1 or height < 1:
        raise ValueError(f"image is {width}x{height}")
    most, name = caps.most_pixels()
    if width * height > most:
        raise ValueError(f"image is {width}x{height}, more than {most} pixels ({name})")
    if shape is not None and caps.relative:
        _, h, w = shape
        stretch = max(width * h / (height * w), height * w / (width * h))
        if stretch > MAX_ASPECT:
            raise ValueError(f"image is {width}x{height}, {stretch:.0f} times as elongated as its {w}x{h} target "
                             f"(at most {MAX_ASPECT}, pipeline.data.decoding.image_caps.MAX_ASPECT)")
        scale = REDUCED.get(ext, 1)
        decoded = -(-width // scale) * -(-height // scale)
        if decoded > MAX_DECODE_RATIO * h * w:
            at = f" at 1/{scale} scale" if scale > 1 else ""
            raise ValueError(f"image is {width}x{height}, {decoded / (h * w):.0f} times its {w}x{h} target's pixels "
                             f"as decoded{at} (at most {MAX_DECODE_RATIO}, pipeline.data.decoding.image_caps.MAX_DECODE_RATIO)")
