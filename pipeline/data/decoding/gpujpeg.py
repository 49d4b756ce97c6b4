"""JPEGs decoded on the GPU (issue 55 item 3): the host's half and the device's.

The host reads and checks every header (pipeline.data.decoding.jpeg, pipeline.data.decoding.image_caps) before
anything is decoded, as the CPU path does. A JPEG of exactly the target's size, upright as
stored, grey or YCbCr, travels as its bytes; every other image (to be resized or turned,
CMYK, or refused) goes through decode.decode_batch on the host, so the device decodes only
what needs no step after the decode. `pack` runs in a worker, `unpack` where the batch is
consumed: one torchvision.io.decode_jpeg call for the batch (nvJPEG on a CUDA device), then
both parts in batch order. What the device will not decode (damage past the header, a frame
libjpeg reads otherwise) is decoded on the host instead and refused there as decode_batch
refuses it, so the result is decode_batch's: the same images kept, the same reasons.

Not yet wired into the loader: the workers would hand a Parcel over in place of the pixels
and the consumer call `unpack` on its CUDA stream (the hand-over in pipeline.data.handover.loader).
"""
from dataclasses import dataclass

import numpy as np

from pipeline.data.decoding import image_caps as bounds, decode, jpeg, turbo


@dataclass
class Parcel:
    """One batch's images as a worker hands them over. datas: the JPEG bytes the device
    decodes, at positions `device_at`; pixels: (k, C, H, W) uint8 the host decoded, at
    positions `host_at`; errors: (position, reason) of the images refused."""

    target: object
    datas: list
    device_at: list
    pixels: np.ndarray
    host_at: list
    errors: list


def pack(images, exts, target, crops=None):
    """The Parcel of a batch's images (`exts` each one's extension, `crops` as decode_batch
    takes them): headers checked here, the exact-size JPEGs left encoded, the rest decoded."""
    c, h, w = shape = tuple(target.shape)
    try:
        bounds.check(w, h, shape, "jpg")  # what bounds says of every image of the target's own size
        exact = (h, w, 1)
    except ValueError:
        exact = None  # each goes through decode_batch, which says why
    device_at, host = [], []
    for i, (data, ext) in enumerate(zip(images, exts)):
        if exact is not None and ext in ("jpg", "jpeg") and _exact(data, exact):
            device_at.append(i)
        else:
            host.append(i)
    pixels, kept, errors = decode.decode_batch([images[i] for i in host], [exts[i] for i in host], target,
                                               None if crops is None else crops[host])
    return Parcel(target, [images[i] for i in device_at], device_at, pixels, [host[k] for k in kept],
                  [(host[k], why) for k, why in errors])


def _exact(data, exact):
    """Whether a JPEG's header says (height, width, orientation) `exact` and grey or YCbCr."""
    try:
        head = jpeg.header(data)
    except ValueError:
        return False  # decode_batch refuses it with the reason
    return (head.height, head.width, head.orientation) == exact and head.components in turbo.COLOUR


def unpack(parcel, device):
    """(pixels (k, C, H, W) uint8 on `device`, kept positions in order, errors) of a Parcel,
    as decode.decode_batch gives them for the batch's images."""
    import torch

    shape = tuple(parcel.target.shape)
    decoded = decode._torchvision_jpegs(parcel.datas, shape[0], device) if parcel.datas else []
    if decoded is None or any(tuple(t.shape) != shape for t in decoded):  # the host decodes them, or says why not
        more, kept, errors = decode.decode_batch(parcel.datas, ["jpg"] * len(parcel.datas), parcel.target)
        device_part = torch.from_numpy(more).to(device)
        device_at = [parcel.device_at[k] for k in kept]
        errors = parcel.errors + [(parcel.device_at[k], why) for k, why in errors]
    else:
        device_part = torch.stack(decoded) if decoded else torch.zeros((0, *shape), dtype=torch.uint8, device=device)
        device_at, errors = parcel.device_at, parcel.errors
    at = parcel.host_at + device_at
    order = torch.as_tensor(np.argsort(at, kind="stable"), device=device)
    pixels = torch.cat([torch.from_numpy(parcel.pixels).to(device), device_part])[order]
    return pixels, sorted(at), sorted(errors)
