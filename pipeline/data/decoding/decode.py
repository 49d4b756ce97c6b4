"""From a sample's members to what the model takes: a uint8 C,H,W image of its source's
shape and an integer class index.

Only image and label members are ever decoded, each by a decoder chosen by its
extension: nothing is unpickled or torch.load-ed (webdataset's default decoders
do both for .pyd/.pickle/.pth), and PIL is only asked to open the one format
an extension names (an .png member that is really EPS would make PIL run
Ghostscript). An image's size, as its decoder will produce it, is checked
against `pipeline.data.decoding.image_caps` before its pixels are decoded (`open_image`), and
16-bit grey images keep their top 8 bits rather than saturate; grey of unknown range (a
TIFF of 32-bit integers or floats) is refused, not guessed.

Images of another size or mode are brought to the source's shape here, inside
the loader workers: grey/RGB/RGBA to the source's channel count, JPEGs
turned upright by their EXIF orientation, the shorter side resized to fit, then
a crop (random for training, centred for evaluation). JPEG goes through
libjpeg-turbo by simplejpeg where it is installed (`pipeline.data.decoding.turbo`: a batch's
images of the target's size straight into its buffer, larger ones at a DCT scale), else
through torchvision.io.decode_jpeg, and PIL's draft mode for a JPEG at least twice
the target size in both directions (README.md "JPEG decoding" has the measured
reasons). Exactly what make_shards writes
(raw pixels, or a PNG with the Up filter on every row) takes the fast paths in
`pipeline/data/decoding/png.py`, one numpy operation a batch.
"""
import functools
import re
import warnings
from dataclasses import dataclass

import numpy as np

from pipeline.data.decoding import image_caps, jpeg, png, rgbx, turbo
from pipeline.data.decoding.pil_images import (SIXTEEN_BIT, _converted, _hwc, _npy, _pil, open_image,  # noqa: F401
                                                pil_reason, pixels_of, upright, webp_size)
from pipeline.errors import cut
from pipeline.data.decoding.labelling import CONTENT_ERRORS, label_member, parse_label_key

IMAGE_EXTS = ("raw", "png", "jpg", "jpeg", "webp", "ppm", "pgm", "bmp", "tif", "tiff", "gif", "npy")
MAX_PIXELS = image_caps.MAX_PIXELS
_MEMBER_EXT = re.compile(r"[a-z0-9_-]+(\.[a-z0-9_-]+)*\Z")


@dataclass(frozen=True)
class Target:
    """What one source's samples decode to.

    shape: (C, H, W) with C 1 or 3; image_exts: the image members to look for, in order
    (`png`, or a multi-part extension such as `rgb.png`, decoded by its last part);
    label: the label rule (see `parse_label_key`); classes: how many classes the model
    has for this source; label_values: the raw label of each class index when a data
    set's integer labels are not 0..classes-1; names: the class names, when labels are
    names rather than integers (each name maps to its index); skip_unlabelled: samples
    without a label are passed by, not reported as damage.
    """

    shape: tuple
    image_exts: tuple = ("png",)
    label: str = "cls"
    classes: int = 10
    label_values: tuple = None
    names: tuple = None
    skip_unlabelled: bool = False

    def __post_init__(self):
        bad = [e for e in self.image_exts if image_format(e) is None]
        if bad or not self.image_exts:
            raise ValueError(f"image extensions {list(self.image_exts)}: each must end in one of "
                             f"{', '.join(IMAGE_EXTS)}")
        parse_label_key(self.label)

    @property
    def members(self):
        """The extensions a sample is read for: everything else is dropped unread."""
        member = label_member(self.label)
        return set(self.image_exts) | ({member} if member else set())

    def lookup(self):
        """Raw label -> class index: names or label values, or None for labels 0..classes-1."""
        if self.names:
            return {v: i for i, v in enumerate(self.names)}
        return {v: i for i, v in enumerate(self.label_values)} if self.label_values else None


@functools.lru_cache(maxsize=256)
def image_format(ext):
    """The decoder an image member's extension names (its last part: `rgb.png` -> `png`),
    or None for a member that is not an image."""
    if not isinstance(ext, str) or not _MEMBER_EXT.match(ext):
        return None
    last = ext.rpartition(".")[2]
    return last if last in IMAGE_EXTS else None


def image_of(sample, target):
    """(ext, bytes) of the sample's image member; ValueError if it has none."""
    for ext in target.image_exts:
        data = sample.get(ext)
        if data is not None:
            return ext, data
    have = sorted(k for k in sample if not k.startswith("__"))
    raise ValueError(f"no {'/'.join('.' + e for e in target.image_exts)} member (has {have or 'nothing'})")


VIEWS = (None, "hwc", "rgbx")  # decode_batch's `view`: a contiguous array, or the CHW view of which buffer


def decode_batch(images, exts, target, crops=None, view=None):
    """Decode k images to one uint8 array (k', C, H, W) of the target's shape.

    `exts` gives each image's extension; `crops` an (k, 2) array of uniform numbers
    placing a random crop, None for centred crops. Returns (pixels, kept, errors):
    kept lists the positions decoded, in order; errors pairs each other position
    with the reason. `view`: JPEGs decoded by libjpeg-turbo may come as a CHW view, not
    contiguous, so that the one copy made of them, into the batch (columns.put), turns
    them CHW too (the stream's Decode stage; one copy a batch fewer): "hwc", a view of
    their HWC buffer (a straight copy into channels-last batches), or "rgbx", of an RGBX
    buffer (`rgbx`: half the cost of the transpose into NCHW batches).
    """
    if view not in VIEWS:
        raise ValueError(f"view must be one of {VIEWS}, got {view!r}")
    shape, kinds = tuple(target.shape), set(exts)
    if kinds == {"raw"}:
        return _raw(images, shape)
    if kinds == {"png"}:
        return _png_fast(images, exts, target, crops)
    if kinds and kinds <= {"jpg", "jpeg"}:
        if turbo.available():
            return _turbo_batch(images, exts, target, crops, view)
        return _jpeg_batch(images, exts, target, crops)
    return _each(images, exts, target, crops, range(len(images)))


def _turbo_batch(images, exts, target, crops, view=None):
    """JPEGs as `decode_image` decodes them, with simplejpeg (`pipeline.data.decoding.turbo`): each
    of exactly the target's size and upright by one bare simplejpeg call, the others through
    decode_image, then all joined into one HWC (or RGBX) array by one bytes.join (made CHW at once,
    or handed on as its CHW `view`). Not `buffer=` a row of the batch: simplejpeg then
    wraps the buffer in a new array by two Python calls, which cost more than the join's copy
    (np.stack costs more again: docs/benchmarks.md, "JPEG decoders"). Its headers are read
    first, each checked before its pixels."""
    c, h, w = shape = tuple(target.shape)
    try:
        image_caps.check(w, h, shape, "jpg")  # what bounds says of every image of the target's own size
        exact = (h, w, 1)
    except ValueError:
        exact = None  # each goes through decode_image, which says why
    kept, errors, decoded = [], [], []  # decoded: HWC pixels of each kept image
    four = c == 3 and view != "hwc"  # RGBX: made CHW by rgbx.assign, here or in the batch
    resized = []  # positions in `decoded` of images decode_image made (HWC, not RGBX)
    dec, header = turbo.decode_into(), jpeg.header
    space, size = ("RGBX", (h, w, 4)) if four else (turbo.colour_space(c), (h, w, c))
    direct, prefix, short = None, None, 0  # the last header of the target's size seen, as jpeg.known_again says
    for i, data in enumerate(images):
        if len(data) < short and type(data) is bytes and data.startswith(prefix):
            head = direct  # what jpeg.header gives, without its call
        else:
            try:
                head = header(data)
            except ValueError as e:
                errors.append((i, str(e)))
                continue
        if head is direct or (head.height, head.width, head.orientation) == exact and head.components in turbo.COLOUR:
            if head is not direct:
                direct = head
                prefix, short = jpeg.known_again(head) or (None, 0)
            try:
                pixels = dec(data, colorspace=space, strict=True)
                if pixels.shape == size:
                    decoded.append(pixels)
                    kept.append(i)
                    continue
            except turbo.REFUSED:
                pass  # libjpeg-turbo refused or only warned (strict): decode_image decodes what it warned
                # of leniently, as PIL does (docs/data.md), and says why it refuses the rest
        try:
            chw = decode_image(data, exts[i], shape, None if crops is None else crops[i], hwc=True)
            resized.append(len(decoded))
            decoded.append(np.ascontiguousarray(chw.transpose(1, 2, 0)))  # mostly HWC already: no copy
            kept.append(i)
        except ValueError as e:
            errors.append((i, str(e)))
    if four:
        chw = rgbx.joined_batch(decoded, resized, h, w)
    else:
        chw = np.frombuffer(b"".join(decoded), np.uint8).reshape(len(kept), h, w, c).transpose(0, 3, 1, 2)
    if view or not four:
        return (chw if view else np.ascontiguousarray(chw)), kept, errors  # grey: contiguous already, no copy
    out = np.empty(chw.shape, np.uint8)
    rgbx.assign(out, slice(None), chw)
    return out, kept, errors


def _jpeg_batch(images, exts, target, crops):
    """JPEGs as `decode_image` decodes them, those libjpeg-turbo takes at their own size in
    one torchvision call for the batch: its per-call cost (a deprecation warning, usage
    logging, argument checks), which was a third of a 32x32 image's, is then paid once a
    batch. What that call refuses, and the rest, go image by image as before.

    The call holds every image it decodes at full size until it returns, so a call takes
    images of at most JPEG_CALL_PIXELS pixels together (one image as large as bounds allows):
    128 wide JPEGs of 100 KB each that a 224x224 target lets through at 447x14000 would
    otherwise hold 2.2 GiB at once, where image by image holds one (18 MiB)."""
    shape = tuple(target.shape)
    heads = [_direct_head(d, shape) for d in images]
    out, kept, errors = [], [], []
    for group in _calls(heads):
        crop = None if crops is None else crops[group[0]]
        if heads[group[0]] is None:  # refused, or PIL's draft path: as decode_image says
            _decode_one(lambda: decode_image(images[group[0]], exts[group[0]], shape, crop), group[0], out, kept, errors)
            continue
        decoded = _torchvision_jpegs([images[i] for i in group], shape[0])
        for n, i in enumerate(group):
            crop = None if crops is None else crops[i]
            if decoded is None:  # one of them failed: each on its own, as decode_image does
                _decode_one(lambda: decode_image(images[i], exts[i], shape, crop), i, out, kept, errors)
            else:
                _decode_one(lambda image=decoded[n]: fit(_upright_as(image, heads[i]), shape, crop), i, out, kept,
                            errors)
        del decoded
    c, h, w = shape
    return (np.stack(out) if out else np.zeros((0, c, h, w), np.uint8)), kept, errors


JPEG_CALL_PIXELS = MAX_PIXELS  # what one torchvision call may decode at once, all its images together


def _calls(heads):
    """Positions in order, as runs for one torchvision call each: consecutive images it takes
    at their size (`heads` not None) up to JPEG_CALL_PIXELS together, every other image alone."""
    run, pixels = [], 0
    for i, head in enumerate(heads):
        if run and (head is None or pixels + head.height * head.width > JPEG_CALL_PIXELS):
            yield run
            run, pixels = [], 0
        if head is None:
            yield [i]
        else:
            run.append(i)
            pixels += head.height * head.width
    if run:
        yield run


def _decode_one(make, i, out, kept, errors):
    try:
        out.append(make())
        kept.append(i)
    except ValueError as e:
        errors.append((i, str(e)))


def _direct_head(data, shape):
    """The jpeg.Header of a JPEG that decode_image hands to libjpeg-turbo at its own size,
    else None (an image it refuses, or decodes through PIL's draft mode)."""
    try:
        head = jpeg.header(data)
        ih, iw = head.upright
        image_caps.check(iw, ih, shape, "jpg")
    except ValueError:
        return None
    return head if _direct(ih, iw, shape) else None


def _direct(ih, iw, shape):
    """Whether libjpeg-turbo decodes an upright ih x iw JPEG at its own size for `shape`: not
    when both sides are twice the target's or more (PIL's draft mode shrinks it while it
    decodes), nor beyond MAX_PIXELS. The one rule for decode_image and the batch path."""
    c, h, w = shape
    return not (ih >= 2 * h and iw >= 2 * w) and ih * iw <= MAX_PIXELS


def _raw(images, shape):
    nbytes = int(np.prod(shape))
    kept = [i for i, d in enumerate(images) if len(d) == nbytes]
    errors = [(i, f"{len(d)} raw bytes, expected {nbytes} for shape {shape}")
              for i, d in enumerate(images) if len(d) != nbytes]
    data = b"".join(images) if not errors else b"".join(images[i] for i in kept)
    return np.frombuffer(data, np.uint8).reshape(len(kept), *shape), kept, errors


def _png_fast(images, exts, target, crops):
    """PNGs exactly as make_shards writes them: one inflate each, then one add a row for all."""
    shape = tuple(target.shape)
    rows, kept, other = [], [], []
    for i, d in enumerate(images):
        r = png.fast_rows(d, shape)
        if r is None:
            other.append(i)
        else:
            rows.append(r)
            kept.append(i)
    pixels = png.unfilter(b"".join(rows), len(rows), shape)
    if not other:
        return pixels, kept, []
    more, more_kept, errors = _each(images, exts, target, crops, other)
    order = np.argsort(np.array(kept + more_kept), kind="stable")
    return np.concatenate([pixels, more])[order], sorted(kept + more_kept), errors


def _each(images, exts, target, crops, positions):
    c, h, w = target.shape
    out, kept, errors = [], [], []
    for i in positions:
        try:
            out.append(decode_image(images[i], exts[i], target.shape, None if crops is None else crops[i]))
            kept.append(i)
        except ValueError as e:
            errors.append((i, str(e)))
    return (np.stack(out) if out else np.zeros((0, c, h, w), np.uint8)), kept, errors


def decode_image(data, ext, shape, crop=None, hwc=False, caps=image_caps.STREAM):
    """One image member -> uint8 array of exactly `shape` (C, H, W); ValueError otherwise,
    whatever the member holds (a decoder's other errors become ValueErrors naming them).
    `hwc`: the array may be a CHW view of HWC pixels, not contiguous (for a caller that
    stores HWC: one transpose fewer). `caps`: the image_caps its size is held to (the
    stream's; make-shards converting a photo folder passes image_caps.CONVERSION)."""
    try:
        return _decode_image(data, ext, shape, crop, hwc, caps)
    except ValueError:
        raise
    except CONTENT_ERRORS as e:
        raise ValueError(f"undecodable .{ext} image ({type(e).__name__}: {cut(pil_reason(e), 80)})") from None


def _decode_image(data, ext, shape, crop, hwc=False, caps=image_caps.STREAM):
    c, h, w = shape
    if ext == "raw":
        if len(data) != c * h * w:
            raise ValueError(f"{len(data)} raw bytes, expected {c * h * w} for shape {tuple(shape)}")
        return np.frombuffer(data, np.uint8).reshape(shape)
    if ext == "png":
        fast = png.fast_rows(data, shape)
        if fast is not None:
            return png.unfilter(fast, 1, shape)[0]
    if ext in ("jpg", "jpeg"):
        head = jpeg.header(data)
        ih, iw = head.upright
        image_caps.check(iw, ih, shape, ext, caps)
        if turbo.available() and head.components in turbo.COLOUR:
            pixels = turbo.decode(data, head, shape)
            if pixels is not None:
                return fit(pixels, shape, crop, hwc)
        if _direct(ih, iw, shape):  # without simplejpeg, CMYK, or what its strict mode refused (below)
            pixels = _torchvision_jpeg(data, c, head)
            if pixels is not None:
                return fit(pixels, shape, crop, hwc)
        return fit(_pil(data, ext, shape, head, caps), shape, crop, hwc)
    return fit(_pil(data, ext, shape, caps=caps), shape, crop, hwc)


def _torchvision_jpeg(data, c, head):
    """HWC uint8 from libjpeg-turbo, turned upright by `head` (its jpeg.Header), or None where
    it can't (CMYK it refuses, damage: PIL then says why)."""
    if head.height * head.width > MAX_PIXELS:
        return None
    decoded = _torchvision_jpegs([data], c)
    return None if decoded is None else _upright_as(decoded[0], head)


def _torchvision_jpegs(datas, c, device="cpu"):
    """CHW uint8 tensors of JPEGs from libjpeg-turbo, as stored (not turned), in one torchvision
    call; None if it refuses any of them (CMYK, damage). Its own EXIF reading is left off: it differs
    from PIL's (an XMP segment before the Exif one hides it; an `Exif\0\xff` segment counts), so
    the callers turn each by jpeg.header's (`_upright_as`). On a CUDA `device` nvJPEG decodes
    them there (pipeline.data.decoding.gpujpeg sends only JPEGs upright as stored)."""
    import torch
    from torchvision.io import ImageReadMode, decode_jpeg

    # torchvision 0.29 says its decoders will move to torchcodec; until they do, they are the
    # fastest here. Set each call, not once: a caller's catch_warnings may have reset the filters
    warnings.filterwarnings("ignore", "The image decoding and encoding capabilities of TorchVision",
                            DeprecationWarning)
    try:
        return decode_jpeg([torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in datas],
                           mode=ImageReadMode.GRAY if c == 1 else ImageReadMode.RGB, device=device,
                           apply_exif_orientation=False)
    except RuntimeError:
        return None


def _upright_as(t, head):
    """A CHW tensor decoded as stored, as HWC numpy turned by its header's EXIF orientation
    (`turbo.upright`), once its size is checked to be exactly the header's frame."""
    if tuple(t.shape[1:]) != (head.height, head.width):
        raise ValueError(f"libjpeg decoded {t.shape[2]}x{t.shape[1]}, its frame header says {head.width}x{head.height}")
    hwc = t.permute(1, 2, 0).numpy()
    return hwc if head.orientation == 1 else turbo.upright(hwc, head.orientation)


def fit(pixels, shape, crop=None, hwc=False):
    """HWC uint8, or a PIL image in the target's mode, of any size -> CHW of exactly `shape`
    (with `hwc` maybe a view of HWC pixels, as decode_image says):
    the shorter side resized to fit, then a crop placed by `crop` (two numbers in [0, 1)) or
    centred. Only the box the crop keeps is resized, straight from a PIL image without a copy
    into numpy first, so however large or elongated the image, no new buffer exceeds the target."""
    c, h, w = shape
    array = isinstance(pixels, np.ndarray)
    ih, iw = pixels.shape[:2] if array else pixels.size[::-1]
    if (ih, iw) != (h, w):
        scale = max(h / ih, w / iw)
        nh, nw = max(h, round(ih * scale)), max(w, round(iw * scale))
        if crop is None:
            top, left = (nh - h) // 2, (nw - w) // 2
        else:
            top, left = int(crop[0] * (nh - h + 1)), int(crop[1] * (nw - w + 1))
        if (nh, nw) == (ih, iw):
            pixels = _hwc(pixels, c)[top:top + h, left:left + w]
        else:
            from PIL import Image

            img = pixels if not array else Image.fromarray(pixels[:, :, 0] if c == 1 else pixels)
            sy, sx = ih / nh, iw / nw  # the crop's box in the image's own pixels
            box = (left * sx, top * sy, (left + w) * sx, (top + h) * sy)
            pixels = img.resize((w, h), Image.BILINEAR, box=box, reducing_gap=3.0)
    chw = _hwc(pixels, c).transpose(2, 0, 1)
    return chw if hwc else np.ascontiguousarray(chw)


def jpeg_size(data):
    """(height, width) of a JPEG's frame as libjpeg reads it (`jpeg.header`), or None if it has none."""
    try:
        head = jpeg.header(data)
    except ValueError:
        return None
    return head.height, head.width


