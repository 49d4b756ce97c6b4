"""Images opened through PIL (every format but the fast paths), and .npy arrays: each opened as
the one format its extension names, its size checked against `image_caps` before a pixel is
decoded, turned upright by its EXIF orientation, and brought to the channels its source takes."""
import io
import re

import numpy as np

from pipeline.data.decoding import image_caps, jpeg

_PIL_FORMATS = {"png": "PNG", "jpg": "JPEG", "jpeg": "JPEG", "webp": "WEBP", "ppm": "PPM", "pgm": "PPM",
                "bmp": "BMP", "tif": "TIFF", "tiff": "TIFF", "gif": "GIF"}


def pil_reason(error):
    """PIL's message without the repr of the BytesIO it was given ("cannot identify image file
    <_io.BytesIO object at 0x7f...>"): an address that differs in every run says nothing."""
    return re.sub(r"\s*<_io\.BytesIO object at 0x[0-9a-fA-F]+>", "", str(error)) or type(error).__name__


def open_image(data, ext, shape=None, head=None, caps=image_caps.STREAM):
    """(PIL image, EXIF orientation) of an image member, opened as the format its extension
    names, its size checked by `image_caps.check` for `shape` before any pixel is decoded: the
    image comes back unloaded. A JPEG's size is libjpeg's (`jpeg.header`, or `head` if read
    already) and PIL must agree with it; a GIF is its first frame. A `.npy` member's size is
    its header's, checked before np.load (without pickles) makes the array. `caps`: the
    image_caps.Caps it is checked against. ValueError for an image refused or unreadable."""
    from PIL import Image

    if ext == "npy":
        return Image.fromarray(_npy(data, shape, caps)), 1
    is_jpeg = ext in ("jpg", "jpeg")
    if is_jpeg and head is None:
        head = jpeg.header(data)
    if ext == "webp" and webp_size(data):  # libwebp allocates its canvas on opening, before PIL's size is known
        image_caps.check(*webp_size(data), shape, ext, caps)
    try:
        img = Image.open(io.BytesIO(data), formats=[_PIL_FORMATS[ext]])
    except (OSError, SyntaxError, Image.DecompressionBombError, KeyError) as e:
        raise ValueError(f"undecodable image: {pil_reason(e)}") from None
    w, h = img.size
    orientation = 1
    if is_jpeg:
        if (w, h) != (head.width, head.height):
            raise ValueError(f"JPEG headers disagree: PIL reads {w}x{h}, the frame is {head.width}x{head.height}")
        orientation = head.orientation
        h, w = head.upright
    image_caps.check(w, h, shape, ext, caps)
    if img.format == "TIFF":
        _check_tiles(img)
    return img, orientation


def _check_tiles(img):
    """ValueError for a TIFF whose tiles are larger than its image needs: libtiff decodes each
    tile whole into a buffer of the tile's size, so a 32x32 image in one 16384x16384 tile (780
    KB deflated) cost 770 MB. Tiles are multiples of 16 that cover the image, so none need be
    larger than the image rounded up to 16."""
    w, h = img.size
    tw, tl = img.tag_v2.get(322), img.tag_v2.get(323)  # TileWidth, TileLength
    if tw is None and tl is None:
        return
    if not (isinstance(tw, int) and isinstance(tl, int)) or not (1 <= tw <= -(-w // 16) * 16 and
                                                                  1 <= tl <= -(-h // 16) * 16):
        raise ValueError(f"TIFF of {w}x{h} in tiles of {tw}x{tl}, larger than the image needs")


def _pil(data, ext, shape, head=None, caps=image_caps.STREAM):
    """The image through PIL, opening only the format the extension names: a PIL image of
    the target's mode (`fit` resizes it without a copy into numpy first), or HWC uint8."""
    from PIL import Image

    c, h, w = shape
    img, orientation = open_image(data, ext, shape, head, caps)
    try:
        if ext in ("jpg", "jpeg"):  # DCT scaling: decode at 1/2..1/8 size, still >= the target
            img.draft("L" if c == 1 else "RGB", (h, w) if orientation >= 5 else (w, h))
        return _converted(upright(img, orientation), c)
    except (OSError, SyntaxError, Image.DecompressionBombError, KeyError) as e:
        raise ValueError(f"undecodable image: {pil_reason(e)}") from None


def _npy(data, target=None, caps=image_caps.STREAM):
    """An HxW or HxWxC (C 1, 3 or 4) uint8 array from .npy bytes; its header is read and its
    size checked (`image_caps.check` for the target shape) first, so a claimed shape costs nothing."""
    import tokenize

    from numpy.lib import format as npformat

    f = io.BytesIO(data)
    try:
        version = npformat.read_magic(f)
        shape, fortran, dtype = (npformat.read_array_header_1_0 if version == (1, 0) else
                                 npformat.read_array_header_2_0)(f)
    except (ValueError, OSError, SyntaxError, tokenize.TokenError) as e:  # numpy tokenizes odd headers again
        raise ValueError(f"undecodable .npy: {e}") from None
    if dtype != np.uint8 or not (len(shape) == 2 or (len(shape) == 3 and shape[2] in (1, 3, 4))):
        raise ValueError(f".npy holds a {dtype} array of shape {shape}; an image is uint8 HxW or HxWxC (C 1, 3 or 4)")
    image_caps.check(shape[1], shape[0], target, "npy", caps)
    if len(data) - f.tell() < int(np.prod(shape)):  # np.load would make the whole array before finding out
        raise ValueError(f".npy header claims {'x'.join(map(str, shape))} bytes of pixels, the member holds "
                         f"{len(data) - f.tell()}")
    f.seek(0)
    try:
        a = np.load(f, allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise ValueError(f"undecodable .npy: {e}") from None
    a = np.ascontiguousarray(a)
    return a[:, :, 0] if a.ndim == 3 and a.shape[2] == 1 else a


def upright(img, orientation):
    """A PIL image turned by its EXIF orientation (1-8), as PIL's ImageOps.exif_transpose does."""
    if orientation in (1, None):
        return img
    from PIL import Image

    turn = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180, 4: Image.Transpose.FLIP_TOP_BOTTOM,
            5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE,
            8: Image.Transpose.ROTATE_90}[orientation]
    return img.transpose(turn)


SIXTEEN_BIT = frozenset({"I;16", "I;16B", "I;16L", "I;16N"})  # PIL's modes for unsigned 16-bit grey (PNG, TIFF)
SIXTEEN_BIT_I = frozenset({"PNG", "PPM"})  # formats whose mode "I" is 16-bit: PIL scales a PGM's maxval to 65535


def sixteen_bit(img):
    """True for 16-bit grey, whose top 8 bits are kept; False for a mode PIL converts to L or RGB
    itself. ValueError for integer or float grey of unknown range (a TIFF's mode "I", 32-bit or
    signed, or "F"): any scale to 8 bits would be a guess (values 3..253 shifted by 8 were black)."""
    if img.mode in SIXTEEN_BIT or img.mode == "I" and img.format in SIXTEEN_BIT_I:
        return True
    if img.mode in ("I", "F"):
        kind = "floating-point" if img.mode == "F" else "32-bit or signed integer"
        raise ValueError(f"{img.format or 'image'} of mode {img.mode} ({kind} grey) has no one mapping to 8 bits; "
                         f"convert it to 8-bit grey (mode L) or 16-bit unsigned grey first")
    return False


def pixels_of(img, c):
    """HWC uint8 with c channels (1 or 3) of a PIL image. 16-bit grey keeps its top 8 bits
    (>> 8, as PIL itself reads 16-bit RGB): PIL's convert("L") would clip it at 255."""
    return _hwc(_converted(img, c), c)


def _converted(img, c):
    """A PIL image in mode L (c 1) or RGB (c 3), or for 16-bit grey HWC uint8 (see pixels_of)."""
    if sixteen_bit(img):
        a = (np.clip(np.asarray(img), 0, 65535) >> 8).astype(np.uint8)[:, :, None]
        return np.repeat(a, 3, axis=2) if c == 3 else a
    return img.convert("L" if c == 1 else "RGB")


def _hwc(pixels, c):
    if isinstance(pixels, np.ndarray):
        return pixels
    return np.asarray(pixels, dtype=np.uint8).reshape(pixels.size[1], pixels.size[0], c)


def webp_size(data):
    """(width, height) of the canvas libwebp makes for a WebP: its VP8X header's, else its one
    frame's; None for any other layout (PIL then says what is wrong)."""
    if len(data) < 30 or data[:4] != b"RIFF" or data[8:12] != b"WEBP":
        return None
    kind, head = data[12:16], data[20:30]
    if kind == b"VP8X":
        return 1 + int.from_bytes(head[4:7], "little"), 1 + int.from_bytes(head[7:10], "little")
    if kind == b"VP8L" and head[0] == 0x2F:
        bits = int.from_bytes(head[1:5], "little")
        return 1 + (bits & 0x3FFF), 1 + (bits >> 14 & 0x3FFF)
    if kind == b"VP8 " and head[3:6] == b"\x9d\x01\x2a":
        return int.from_bytes(head[6:8], "little") & 0x3FFF, int.from_bytes(head[8:10], "little") & 0x3FFF
    return None
