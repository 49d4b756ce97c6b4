"""make_loader(..., memory_format="channels_last"): the image field's bytes hold (H, W, C) a sample
(fields.spec.Field.channels_last), as libjpeg-turbo writes them: no transpose into the batch.
The batches must hold the same values as the default (N, C, H, W) ones, only with channels-last
strides: JPEGs of the batch's size, JPEGs resized, grey ones, and a raw source's pixels copied in
transposed, at 0 and 2 workers, uint8 and normalised."""
import numpy as np
import pytest
import torch

from helpers import jpegs_beside_mnist
from pipeline.data.fields.spec import Field, Spec
from pipeline.data.handover.loader import make_loader
from pipeline.data.streams.stream import MixedStream

BATCH, BATCHES = 8, 6


@pytest.fixture(scope="module")
def web(tmp_path_factory):
    """A wds.ShardWriter set of JPEGs of three sizes (one of them the index's 40x56), some grey, and
    beside it a raw grey MNIST-shaped source (padded and repeated onto the 40x56 canvas)."""
    return jpegs_beside_mnist(tmp_path_factory.mktemp("web"))


def _batches(sources, workers, normalize, **kw):
    stream = MixedStream(sources, {s.name: 1 for s in sources}, BATCH, epoch_samples=BATCH * BATCHES,
                         normalize=normalize)
    loader = make_loader(stream, workers, **kw)
    try:
        return [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in b.items()} for b in loader]
    finally:
        loader.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_channels_last_batches_hold_the_nchw_batches_values(web, workers):
    for sources in (web[:1], web):  # JPEGs alone, and mixed with a raw source
        for normalize in (False, True):
            plain = _batches(sources, workers, normalize)
            last = _batches(sources, workers, normalize, memory_format="channels_last")
            assert len(plain) == len(last) == BATCHES
            for a, b in zip(plain, last):
                assert a["key"] == b["key"] and sorted(a) == sorted(b)
                assert a["image"].is_contiguous() and not b["image"].is_contiguous()
                assert b["image"].is_contiguous(memory_format=torch.channels_last)
                assert b["image"].shape == a["image"].shape
                for name in ("image", "label", "source"):
                    assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
            assert {s for b in last for s in b["source"].tolist()} == set(range(len(sources)))


def test_channels_last_reaches_the_device_copy_with_its_strides(web):
    """device="cpu" copies each batch out of the ring (handover.device): values and strides kept."""
    plain = _batches(web, 0, False, device="cpu")
    last = _batches(web, 0, False, device="cpu", memory_format=torch.channels_last)
    for a, b in zip(plain, last):
        assert torch.equal(a["image"], b["image"]) and b["image"].is_contiguous(memory_format=torch.channels_last)


def test_channels_last_with_the_decode_after_the_hand_over(web):
    """decode="device" (device="cpu": torchvision's CPU decoder stands in for nvJPEG): the JPEG
    bytes cross in channels-last rows and come out decoded, the host path's values, strides kept."""
    plain = _batches(web, 0, True, device="cpu")
    last = _batches(web, 0, True, device="cpu", decode="device", memory_format="channels_last")
    for a, b in zip(plain, last):
        assert torch.equal(a["image"], b["image"]) and b["image"].is_contiguous(memory_format=torch.channels_last)


def test_memory_format_is_one_of_two():
    stream = type("S", (), {})()
    with pytest.raises(ValueError, match="needs a stream with a batch layout"):
        make_loader(stream, 0, memory_format="channels_last")


def test_a_bad_memory_format_is_refused_in_one_line(web):
    stream = MixedStream(web, {"web": 1, "mnist": 1}, BATCH, epoch_samples=BATCH * BATCHES)
    with pytest.raises(ValueError, match="memory_format must be 'contiguous' or 'channels_last'.*'nhwc'"):
        make_loader(stream, 0, memory_format="nhwc")


def test_a_channels_last_field_lies_hwc_in_the_slot():
    """Spec's arrays and tensors over one slot's bytes: the image row of sample i is its (H, W, C)
    pixels, contiguous, and every view of it (numpy, torch, torch over a tensor) reads the same."""
    spec = Spec([Field("image", np.uint8, (3, 2, 4), channels_last=True), Field("label", np.int64)], 5)
    memory = np.zeros(spec.slot_bytes, np.uint8)
    arrays = spec.arrays(memory, 5)
    hwc = np.arange(5 * 2 * 4 * 3, dtype=np.uint8).reshape(5, 2, 4, 3)
    arrays["image"][...] = hwc.transpose(0, 3, 1, 2)
    assert (memory[:hwc.size] == hwc.ravel()).all()  # the bytes lie H, W, C a sample
    t = spec.tensors(spec.holder(memory), 5)["image"]
    v = spec.views(torch.from_numpy(memory), 5)["image"]
    for x in (t, v):
        assert x.shape == (5, 3, 2, 4) and x.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(x, torch.from_numpy(hwc).permute(0, 3, 1, 2))
    with pytest.raises(ValueError, match="cannot be channels_last"):
        Field("label", np.int64, (), channels_last=True)


@pytest.fixture(scope="module")
def damaged(tmp_path_factory):
    """72 colour JPEGs of one size in 6 shards, indexed in place, then one JPEG's first bytes overwritten:
    its sample is refused, and the batch it was in takes its last place from the next chunk."""
    from helpers import encoded, make_shards_in_process, smooth, write_tar
    from pipeline.data.streams.stream import resolve

    top = tmp_path_factory.mktemp("damaged")
    (top / "set").mkdir()
    for s in range(6):
        write_tar(top / "set" / f"set-{s:02d}.tar", [m for i in range(12 * s, 12 * s + 12) for m in (
            (f"{i:04d}.jpg", encoded(smooth(3, 16, 24, i), "JPEG", quality=90)), (f"{i:04d}.cls", b"%d" % (i % 2)))])
    p = make_shards_in_process(["--quiet", "--index", f"set:train={top / 'set'}", "--out", str(top / "m")])
    assert p.returncode == 0, p.stderr
    source = resolve("set", str(top / "m"), "train")
    with open(source.urls[0], "r+b") as f:
        f.seek(512)  # the first member's data (a tar header is 512 bytes)
        f.write(b"\0\0")
    return source


@pytest.mark.parametrize("memory_format", ["contiguous", "channels_last"])
def test_each_memory_format_gets_the_jpeg_view_it_copies_fastest(damaged, monkeypatch, memory_format):
    """The Decode stage hands colour JPEGs on as the view the batch's copy takes fastest
    (SourceStream.lay_out_jpegs): RGBX planes into NCHW batches (rgbx.assign's casts), HWC into
    channels-last ones (a straight copy). Every copy into the batch goes through rgbx.assign."""
    from pipeline.data.decoding import rgbx

    seen, assign = [], rgbx.assign

    def spy(a, index, view):
        if view.ndim == 4 and view.shape[1] == 3 and len(view):
            seen.append("rgbx" if rgbx.planes(view) is not None else
                        "hwc" if view.strides[1] == 1 and view.strides[3] == 3 else "planar")
        return assign(a, index, view)

    joined, concatenate = [], rgbx.concatenate

    def spy_joins(parts):  # a source's share of a batch from two chunks (here: a window's end)
        joined.append(any(rgbx.planes(p) is not None for p in parts))
        return concatenate(parts)

    monkeypatch.setattr(rgbx, "assign", spy)
    monkeypatch.setattr(rgbx, "concatenate", spy_joins)
    stream = MixedStream([damaged], {damaged.name: 1}, BATCH, epoch_samples=72, normalize=False)  # every sample
    with pytest.warns(UserWarning, match="no SOI marker"):
        skipped = sum(b["skipped"] for b in make_loader(stream, 0, memory_format=memory_format))
    assert skipped == 1
    if memory_format == "contiguous":
        assert "rgbx" in seen and not set(seen) - {"rgbx", "planar"}, seen
    else:
        assert "hwc" in seen and not set(seen) - {"hwc", "planar"}, seen
    assert joined and any(joined) == (memory_format == "contiguous")
