"""JPEGs decoded after the hand-over (issue 55 item 3, make_loader's decode="device"): the
workers' half (`pack`) and the consumer's (`unpack`).

The host reads and checks every header (pipeline.data.decoding.jpeg, image_caps) before anything
is decoded, as the host path does. A JPEG of exactly the target's size, upright as stored,
grey or YCbCr, ending in its EOI marker (a cut scan does not) and no larger than its image's
pixels travels as its bytes; every other image (to be resized or turned, CMYK, cut, or
refused) goes through decode.decode_batch in the worker, so a refused sample is reported
and replaced there as always and the batch stays full.

Where the bytes live: in the batch's own `image` row. A row holds C*H*W bytes, so a JPEG
that fits it is written there (zero-padded) and its length goes in the batch field SIZES
(0: the row holds pixels). The ring's slot grows by 4 bytes a sample, the bound of the
bytes is the bound of the pixels, and the chain from the decode to the ring (take, mix,
collate) moves rows without looking into them. `unpack` copies the rows to the device and
decodes the JPEG rows there in one torchvision.io.decode_jpeg call (nvJPEG on a CUDA
device, libjpeg-turbo on the CPU: the tests' stand-in). What the device will not decode (damage
inside the scan) is decoded on the host; what neither decodes is left zero, counted in the
batch's `skipped` and said in a warning, since the batch has already left its worker. A frame
the device does not decode (not 8-bit baseline or extended Huffman: 12-bit, lossless,
arithmetic, progressive) never travels: the worker decodes or refuses it as the host path does.
"""
import math
import warnings

import numpy as np

from pipeline.data.decoding import decode, image_caps, jpeg, turbo

SIZES = "jpeg_size"  # the batch field of each row's JPEG length (0: pixels), taken out by unpack
EOI = b"\xff\xd9"


def pack(images, exts, target, crops=None):
    """(rows (k, C, H, W) uint8, kept, errors, sizes (k,) int32): decode_batch's (pixels, kept,
    errors) but each exact-size upright JPEG left as its bytes in its row, its length in sizes."""
    c, h, w = shape = tuple(target.shape)
    try:
        image_caps.check(w, h, shape, "jpg")  # what bounds says of every image of the target's own size
        exact = (h, w, 1)
    except ValueError:
        exact = None  # each goes through decode_batch, which says why
    encoded, host = [], []
    for i, (data, ext) in enumerate(zip(images, exts)):
        travels = exact is not None and ext in ("jpg", "jpeg") and len(data) <= c * h * w and _exact(data, exact)
        (encoded if travels else host).append(i)
    pixels, kept, errors = decode.decode_batch([images[i] for i in host], [exts[i] for i in host], target,
                                               None if crops is None else crops[host])
    at = [host[k] for k in kept] + encoded
    order = np.argsort(at, kind="stable")
    rows = np.zeros((len(at), c, h, w), np.uint8)
    rows[:len(kept)] = pixels
    sizes = np.zeros(len(at), np.int32)
    flat = rows.reshape(len(at), c * h * w)
    for j, i in enumerate(encoded, len(kept)):
        flat[j, :len(images[i])] = np.frombuffer(images[i], np.uint8)
        sizes[j] = len(images[i])
    return rows[order], sorted(at), sorted((host[k], why) for k, why in errors), sizes[order]


def _exact(data, exact):
    """Whether a JPEG's header says (height, width, orientation) `exact`, grey or YCbCr, a frame the
    device decodes (_device_frame), and its data ends in EOI."""
    try:
        head = jpeg.header(data)
    except ValueError:
        return False  # decode_batch refuses it with the reason
    return (head.height, head.width, head.orientation) == exact and head.components in turbo.COLOUR and \
        bytes(data[-2:]) == EOI and _device_frame(data)


DEVICE_FRAMES = (0xC0, 0xC1)  # SOF0 baseline, SOF1 extended: Huffman-coded, sequential
_frames = []  # (the bytes up to the first scan, whether the device takes the frame): a set shares a few


def _device_frame(data):
    """Whether the frame header (after jpeg.header passed the walk) is one the device decodes: 8-bit
    baseline or extended Huffman. A 12-bit, lossless, arithmetic-coded or progressive frame (or
    one that claims progressive over a baseline scan) is decoded on the host, which decodes it or
    refuses and counts it, where the device would leave zeros."""
    for prefix, ok in _frames:
        if data.startswith(prefix):
            return ok
    i, n, ok = 2, len(data), False
    while i + 4 <= n and data[i] == 0xFF:
        marker = data[i + 1]
        if marker == 0xFF:  # a fill byte
            i += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD7:  # TEM, RST0-7: no length
            i += 2
            continue
        if marker == 0xDA:
            _frames[:] = [(bytes(data[:i]), ok)] + _frames[:jpeg.KNOWN - 1]
            return ok
        if marker in (0xC0, 0xC1, 0xC2, 0xC3, *range(0xC5, 0xC8), *range(0xC9, 0xCC), *range(0xCD, 0xD0)):
            ok = marker in DEVICE_FRAMES and i + 4 < n and data[i + 4] == 8  # the sample precision
        i += 2 + int.from_bytes(data[i + 2:i + 4], "big")
    return False


def unpack(image, sizes, device, move):
    """(the batch's `image` on `device`, how many JPEGs neither the device nor the host decoded):
    the rows of pixels (`sizes` 0) moved there by `move`, the JPEG rows decoded there; only pixels
    and compressed bytes cross to the device. A JPEG both refuse is left zeros (the batch has
    left its worker, which would have replaced it) and counted for the batch's `skipped`.
    image: (n, C, H, W) uint8 CPU tensor, the slot's rows."""
    import torch

    at = np.flatnonzero(sizes.numpy())
    if not len(at):
        return move(image), 0
    shape = tuple(image.shape[1:])
    out = torch.empty_like(image, device=device)  # the same strides: channels last stays so
    host = np.flatnonzero(sizes.numpy() == 0)
    if len(host):
        out[torch.as_tensor(host, device=device)] = move(image[torch.from_numpy(host)])
    flat = image.numpy().reshape(len(image), math.prod(shape))
    datas = [flat[i, :s].tobytes() for i, s in zip(at.tolist(), sizes.numpy()[at].tolist())]
    decoded = decode._torchvision_jpegs(datas, shape[0], device)
    refused = 0
    if decoded is None or any(tuple(t.shape) != shape for t in decoded):  # one refused: each on its own
        decoded = [_one(d, shape, device) for d in datas]
        refused = sum(t is None for t in decoded)
        decoded = [torch.zeros(shape, dtype=torch.uint8, device=device) if t is None else t for t in decoded]
    out[torch.as_tensor(at, device=device)] = torch.stack(decoded)
    return out, refused


def _one(data, shape, device):
    """One JPEG on the device, else (refused there) decoded on the host as decode_image does;
    None and a warning where that refuses it too."""
    import torch

    decoded = decode._torchvision_jpegs([data], shape[0], device)
    if decoded is not None and tuple(decoded[0].shape) == shape:
        return decoded[0]
    try:
        pixels = decode.decode_image(data, "jpg", shape)
    except ValueError as e:
        warnings.warn(f"a JPEG whose header passed was refused after the hand-over ({e}); its image is zeros, "
                      f"counted in the batch's skipped (make_loader's decode='host' replaces such samples)",
                      stacklevel=3)
        return None
    return torch.from_numpy(pixels).to(device)
