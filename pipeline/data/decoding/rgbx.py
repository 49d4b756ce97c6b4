"""Colour JPEGs of a batch as four bytes a pixel (RGBX), so that turning them CHW costs half.

The batch is NCHW; libjpeg-turbo writes pixels interleaved. numpy's copy of an HWC view into
CHW moves one byte at a time (1.3-1.6 us a 32x32 image here). Decoded as RGBX instead (0.1 us
more a decode), each channel plane is a run of little-endian uint32 starting at that channel's
byte, and casting it to uint8 keeps exactly that byte: numpy's vectorised cast does the three
planes in 0.5 us (`python tools/bench/rgbx.py`; docs/benchmarks.md, "JPEG decoders").

The pixels still travel as an ordinary uint8 (n, 3, H, W) view of the RGBX buffer, so every
stage that indexes, concatenates or copies them gets the right bytes; only `assign` (the one copy
into the batch) knows the faster way, and falls back to numpy's where the view is not one."""
import numpy as np

PAD = bytes(4)  # after the last pixel: its last channel's uint32 reads 3 bytes past it


def joined(pixels, n, h, w):
    """The (n, 3, h, w) uint8 view of n RGBX (h, w, 4) images, joined into one buffer."""
    whole = np.frombuffer(b"".join(pixels + [PAD]), np.uint8)
    return whole[:n * h * w * 4].reshape(n, h, w, 4).transpose(0, 3, 1, 2)[:, :3]


def joined_batch(pixels, resized, h, w):
    """One CHW view of a batch's decoded images: `pixels` RGBX (h, w, 4) arrays, but for the
    positions in `resized` (HWC, from decode_image). Where most are RGBX the others are padded and
    the view is an RGBX one; else the RGBX ones are cut to RGB and the view is an HWC one: padding
    every image of a set to resize cost more than the planes save (a 500x375 set at 224x224 ran at
    0.76x the speed; docs/benchmarks.md, "RGBX planes")."""
    n = len(pixels)
    if 2 * len(resized) <= n:
        for j in resized:
            pixels[j] = padded(pixels[j])
        return joined(pixels, n, h, w)
    rgb = [p if p.shape[2] == 3 else np.ascontiguousarray(p[..., :3]) for p in pixels]
    return np.frombuffer(b"".join(rgb), np.uint8).reshape(n, h, w, 3).transpose(0, 3, 1, 2)


def padded(hwc):
    """An (h, w, 3) image as (h, w, 4), to join with libjpeg-turbo's RGBX images."""
    out = np.zeros((*hwc.shape[:2], 4), np.uint8)
    out[..., :3] = hwc
    return out


def planes(view):
    """The three uint32 planes whose low bytes are `view`'s channels, or None where `view` is
    not the CHW view of an RGBX buffer that `joined` made (or a slice of one)."""
    if view.dtype != np.uint8 or view.ndim != 4 or view.shape[1] != 3 or not view.size:
        return None
    h, w = view.shape[2:]
    if view.strides[1:] != (1, 4 * w, 4):
        return None
    root = view
    while isinstance(root.base, np.ndarray):
        root = root.base
    if not root.flags.c_contiguous:
        return None
    at = view.ctypes.data - root.ctypes.data
    strides = (view.strides[0], 4 * w, 4)
    try:  # numpy checks that each plane lies inside `root`: a view without PAD after it is refused here
        return [np.ndarray(view.shape[:1] + view.shape[2:], "<u4", root, at + c, strides) for c in range(3)]
    except (ValueError, TypeError):
        return None


def assign(a, index, view):
    """a[index] = view, plane by plane where `view` is an RGBX view and `a` a uint8 array (a
    uint32 -> uint8 cast keeps each plane's own byte), as numpy copies it else."""
    found = planes(view) if isinstance(a, np.ndarray) and a.dtype == np.uint8 else None
    if found is None:
        a[index] = view
        return
    for c, plane in enumerate(found):
        a[index, c] = plane


def concatenate(parts):
    """np.concatenate of (n, C, H, W) uint8 parts, each placed by `assign`: numpy's own would copy
    RGBX views three bytes at a time, and its result would then be copied into the batch again
    the slow way (a batch of one source from two chunks: a damaged sample, a window's end).
    Parts without an RGBX view among them (object arrays of fields, too) go to numpy's."""
    if all(planes(p) is None for p in parts):
        return np.concatenate(parts)
    out = np.empty((sum(len(p) for p in parts), *parts[0].shape[1:]), np.uint8)
    at = 0
    for p in parts:
        assign(out, slice(at, at + len(p)), p)
        at += len(p)
    return out
