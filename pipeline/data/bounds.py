"""How large an image may be: the caps, and the one check every decoder calls before it
makes a pixel buffer.

A few kilobytes of PNG, BMP or JPEG can claim millions of pixels, and a thin image
resized so its shorter side fits its target grows by the target's size. So every
image is checked with the size its decoder will produce (PIL's for the formats PIL
decodes itself, libjpeg's frame header for JPEG, see `pipeline.data.jpeg`) against:
- MAX_PIXELS: the most pixels a source image may hold, whatever the target;
- MAX_ASPECT: how many times as elongated as its target shape an image may be.
The resize itself makes no buffer beyond the crop it keeps (`decode.fit` resizes only
that box), so once an image passes, what it costs is bounded by MAX_PIXELS and the
target shape. A decoder added later calls `check` with its own decoded size.
"""
MAX_PIXELS = 4096 * 4096  # 16.8 M pixels: 48 MiB as RGB; a source image claiming more is refused
MAX_ASPECT = 32  # a 1 x 1,500,000 image for a square target is refused; a 1:32 banner passes


def check(width, height, shape=None):
    """Raise ValueError (one line) unless a `width` x `height` image, as its decoder will
    produce it, may be decoded for a target of `shape` (C, H, W); shape None checks the
    pixel count only (indexing, before the target shape is known)."""
    if width < 1 or height < 1:
        raise ValueError(f"image is {width}x{height}")
    if width * height > MAX_PIXELS:
        raise ValueError(f"image is {width}x{height}, more than {MAX_PIXELS} pixels (pipeline.data.bounds.MAX_PIXELS)")
    if shape is not None:
        _, h, w = shape
        stretch = max(width * h / (height * w), height * w / (width * h))
        if stretch > MAX_ASPECT:
            raise ValueError(f"image is {width}x{height}, {stretch:.0f} times as elongated as its {w}x{h} target "
                             f"(at most {MAX_ASPECT}, pipeline.data.bounds.MAX_ASPECT)")
