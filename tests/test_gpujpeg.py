"""pipeline/data/decoding/gpujpeg.py: a batch's JPEGs split on the host (headers checked, the
exact-size ones left as bytes in their rows) and decoded on a device to what decode_batch gives."""
import numpy as np
import pytest
import torch

from pipeline.data.decoding import image_caps as bounds, decode, gpujpeg, turbo
from pipeline.data.decoding.decode import Target
from helpers import encoded, jpeg_cases, smooth

SHAPES = [(3, 32, 32), (1, 28, 28)]


def _unpack(rows, sizes, device="cpu", refused=0):
    move = (lambda t: t.to(device)) if device != "cpu" else torch.Tensor.clone
    pixels, count = gpujpeg.unpack(torch.from_numpy(rows), torch.from_numpy(sizes), torch.device(device), move)
    assert count == refused  # JPEGs neither decoder took: the batch's skipped counts them
    return pixels


@pytest.mark.parametrize("shape", SHAPES)
def test_only_exact_upright_whole_jpegs_travel_as_bytes_in_their_rows(shape):
    """The target's size as stored, grey or colour, ending in EOI, no larger than a row: its bytes
    in its row (zero-padded), its length beside; turned, larger, CMYK, a cut scan: decoded (or
    refused) on the host as decode_batch does; not a JPEG, too elongated: refused from their headers."""
    datas = jpeg_cases(shape)
    rows, kept, errors, sizes = gpujpeg.pack(datas, ["jpg"] * len(datas), Target(shape, ("jpg",)))
    want, want_kept, want_errors = decode.decode_batch(datas, ["jpg"] * len(datas), Target(shape, ("jpg",)))
    assert kept == want_kept == [0, 1, 2, 3, 4, 8] and errors == want_errors and [e[0] for e in errors] == [5, 6, 7]
    travelled = [kept[j] for j in np.flatnonzero(sizes)]
    assert travelled == ([0, 1, 8] if shape[0] == 3 else [0, 8])  # a colour JPEG overfills a grey row
    for j, i in enumerate(kept):
        flat = rows[j].reshape(-1)
        if sizes[j]:
            assert sizes[j] == len(datas[i]) and flat[:sizes[j]].tobytes() == datas[i] and not flat[sizes[j]:].any()
        else:
            assert (rows[j] == want[j]).all()


def test_a_jpeg_larger_than_its_row_is_decoded_on_the_host():
    """The row is the bound of the bytes: a JPEG of the target's size longer than its pixels
    (quality 100 of noise) is decoded in the worker."""
    rng = np.random.default_rng(0)
    noise = encoded(rng.integers(0, 256, (3, 16, 16), dtype=np.uint8), "JPEG", quality=100)
    assert len(noise) > 3 * 16 * 16
    rows, kept, errors, sizes = gpujpeg.pack([noise], ["jpg"], Target((3, 16, 16), ("jpg",)))
    assert kept == [0] and sizes.tolist() == [0]


@pytest.mark.parametrize("shape", SHAPES)
def test_unpacked_on_the_cpu_as_decode_batch_decodes(shape):
    """The rows' JPEGs decoded by torchvision on the CPU, the host's rows copied: decode_batch's
    pixels, byte for byte."""
    datas = jpeg_cases(shape)
    target = Target(shape, ("jpg",))
    want, _, _ = decode.decode_batch(datas, ["jpg"] * len(datas), target)
    rows, kept, errors, sizes = gpujpeg.pack(datas, ["jpg"] * len(datas), target)
    pixels = _unpack(rows, sizes)
    assert sizes.any() and pixels.dtype == torch.uint8 and (pixels.numpy() == want).all()


def test_what_the_device_refuses_is_decoded_on_the_host_and_what_both_refuse_is_zeros(monkeypatch):
    """A JPEG damaged inside its scan after the hand-over: the device's refusal sends it to the
    host decoder; refused there too, its image is zeros, counted and a warning says so."""
    shape = (3, 32, 32)
    datas = jpeg_cases(shape)
    rows, kept, errors, sizes = gpujpeg.pack(datas, ["jpg"] * len(datas), Target(shape, ("jpg",)))
    want = decode.decode_batch(datas, ["jpg"] * len(datas), Target(shape, ("jpg",)))[0]
    monkeypatch.setattr(decode, "_torchvision_jpegs", lambda *a: None)  # the device refuses the batch
    assert (_unpack(rows, sizes).numpy() == want).all()
    j = int(np.flatnonzero(sizes)[0])
    flat = rows[j].reshape(-1)
    flat[sizes[j] // 2:sizes[j] - 2] = 0xFF  # the scan's second half now markers
    with pytest.warns(UserWarning, match="refused after the hand-over.*counted in the batch's skipped"):
        pixels = _unpack(rows, sizes, refused=1)
    assert not pixels[j].any() and (pixels.numpy()[np.arange(len(rows)) != j] == want[np.arange(len(rows)) != j]).all()


def _frame(data, marker=None, precision=None):
    """`data` with its SOF0 frame marker or sample precision rewritten."""
    b = bytearray(data)
    at = b.find(b"\xff\xc0")
    if marker is not None:
        b[at + 1] = marker
    if precision is not None:
        b[at + 4] = precision
    return bytes(b)


def test_a_frame_the_device_cannot_decode_never_travels():
    """12-bit, lossless (SOF3), arithmetic (SOF9), progressive (SOF2, here claimed over a
    baseline scan) headers pass the header check but the GPU path would leave zeros: each is
    decoded or refused in the worker, as decode_batch does; baseline and SOF1 travel."""
    shape = (3, 32, 32)
    base = encoded(smooth(*shape), "JPEG", quality=90)
    datas = [base, _frame(base, 0xC1), _frame(base, precision=12), _frame(base, 0xC3), _frame(base, 0xC9),
             _frame(base, 0xC2)]
    target = Target(shape, ("jpg",))
    rows, kept, errors, sizes = gpujpeg.pack(datas, ["jpg"] * len(datas), target)
    want, want_kept, want_errors = decode.decode_batch(datas, ["jpg"] * len(datas), target)
    assert [kept[j] for j in np.flatnonzero(sizes)] == [0, 1]
    assert kept == want_kept and errors == want_errors
    assert (_unpack(rows, sizes).numpy() == want).all()


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
    rows, kept, errors, sizes = gpujpeg.pack([bytes(big)], ["jpg"], Target((3, 32, 32), ("jpg",)))
    assert kept == [] and not sizes.any() and not calls
    assert "20000x20000" in errors[0][1] and "image_caps.MAX_PIXELS" in errors[0][1]
    assert bounds.MAX_PIXELS < 20000 * 20000


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("shape", SHAPES)
def test_unpacked_on_the_gpu_as_decode_batch_decodes(shape):
    """nvJPEG's pixels within a level or two of libjpeg-turbo's (another IDCT), the same kept."""
    datas = jpeg_cases(shape)
    target = Target(shape, ("jpg",))
    want, want_kept, want_errors = decode.decode_batch(datas, ["jpg"] * len(datas), target)
    rows, kept, errors, sizes = gpujpeg.pack(datas, ["jpg"] * len(datas), target)
    pixels = _unpack(rows, sizes, "cuda")
    assert pixels.device.type == "cuda" and kept == want_kept and errors == want_errors
    assert (pixels.cpu().int() - torch.from_numpy(want).int()).abs().float().mean() < 3
