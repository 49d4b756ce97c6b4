"""pipeline/data/decoding/gpujpeg.py: a batch's JPEGs split on the host (headers checked, the
exact-size ones left encoded) and decoded on a device to what decode_batch gives."""
import pickle

import pytest
import torch

from pipeline.data.decoding import image_caps as bounds, decode, gpujpeg, turbo
from pipeline.data.decoding.decode import Target
from helpers import encoded, jpeg_cases, smooth

SHAPES = [(3, 32, 32), (1, 28, 28)]


@pytest.mark.parametrize("shape", SHAPES)
def test_only_exact_upright_jpegs_travel_encoded(shape):
    """The target's size as stored, grey or colour: bytes; turned, larger, CMYK: decoded on the
    host; not a JPEG, too elongated: refused from their headers; a cut scan passes its header."""
    datas = jpeg_cases(shape)
    parcel = gpujpeg.pack(datas, ["jpg"] * len(datas), Target(shape, ("jpg",)))
    assert parcel.device_at == [0, 1, 5, 8] and parcel.datas == [datas[i] for i in (0, 1, 5, 8)]
    assert parcel.host_at == [2, 3, 4] and parcel.pixels.shape == (3, *shape)
    assert [e[0] for e in parcel.errors] == [6, 7]
    assert pickle.loads(pickle.dumps(parcel)).datas == parcel.datas  # what a worker hands over


@pytest.mark.parametrize("shape", SHAPES)
def test_unpacked_on_the_cpu_as_decode_batch_decodes(shape):
    """The device's part decoded by torchvision on the CPU, the cut scan it refuses decoded (and
    refused) on the host: decode_batch's images, positions and reasons."""
    datas = jpeg_cases(shape)
    target = Target(shape, ("jpg",))
    want, want_kept, want_errors = decode.decode_batch(datas, ["jpg"] * len(datas), target)
    pixels, kept, errors = gpujpeg.unpack(gpujpeg.pack(datas, ["jpg"] * len(datas), target), "cpu")
    assert kept == want_kept and errors == want_errors and [e[0] for e in errors] == [5, 6, 7]
    assert pixels.dtype == torch.uint8 and (pixels.numpy() == want).all()


def test_a_hostile_header_is_refused_on_the_host_before_any_decode(monkeypatch):
    """A JPEG whose header claims more pixels than bounds allows never reaches a decoder."""
    big = bytearray(encoded(smooth(3, 32, 32), "JPEG", quality=90))
    sof = big.find(b"\xff\xc0")
    big[sof + 5:sof + 9] = (20000).to_bytes(2, "big") * 2  # height, width
    calls = []
    monkeypatch.setattr(decode, "_torchvision_jpegs", lambda *a: calls.append(a))
    monkeypatch.setattr(decode, "_pil", lambda *a, **k: calls.append(a))
    recorder = type("simplejpeg", (), {"decode_jpeg": staticmethod(lambda *a, **k: calls.append(a))})
    monkeypatch.setattr(turbo, "_module", lambda: recorder)
    parcel = gpujpeg.pack([bytes(big)], ["jpg"], Target((3, 32, 32), ("jpg",)))
    assert parcel.datas == [] and not calls
    assert "20000x20000" in parcel.errors[0][1] and "image_caps.MAX_PIXELS" in parcel.errors[0][1]
    assert bounds.MAX_PIXELS < 20000 * 20000


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("shape", SHAPES)
def test_unpacked_on_the_gpu_as_decode_batch_decodes(shape):
    """nvJPEG's pixels within a level or two of libjpeg-turbo's (another IDCT), the same kept."""
    datas = jpeg_cases(shape)
    target = Target(shape, ("jpg",))
    want, want_kept, want_errors = decode.decode_batch(datas, ["jpg"] * len(datas), target)
    pixels, kept, errors = gpujpeg.unpack(gpujpeg.pack(datas, ["jpg"] * len(datas), target), "cuda")
    assert pixels.device.type == "cuda" and kept == want_kept and errors == want_errors
    assert (pixels.cpu().int() - torch.from_numpy(want).int()).abs().float().mean() < 3
