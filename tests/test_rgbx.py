"""pipeline.data.decoding.rgbx: colour images as CHW views of an RGBX buffer, copied plane by plane.
Every copy must equal numpy's own of the same view, whatever the destination and the parts."""
import numpy as np
import pytest

from pipeline.data.decoding import decode, rgbx
from pipeline.data.decoding.decode import Target


def rgbx_parts(rng, sizes, h=5, w=7):
    """Parts as the Decode stage hands them on (rgbx.joined), each over a buffer of its own."""
    parts = []
    for n in sizes:
        four = rng.integers(0, 256, (n, h, w, 4), np.uint8)
        parts.append(rgbx.joined(list(four), n, h, w))
    return parts


@pytest.mark.parametrize("seed", range(20))
def test_concatenate_equals_numpys_and_is_contiguous(seed, monkeypatch):
    """A batch of one source from two or more chunks (a damaged sample, a window's end): RGBX views,
    contiguous parts and empty ones joined, in any order; never an RGBX view by numpy's concatenate,
    which copies it three bytes at a time."""
    numpys = np.concatenate

    def refuse_views(parts, *a, **kw):
        assert all(rgbx.planes(p) is None for p in parts if isinstance(p, np.ndarray))
        return numpys(parts, *a, **kw)

    monkeypatch.setattr(np, "concatenate", refuse_views)
    rng = np.random.default_rng(seed)
    parts = rgbx_parts(rng, rng.integers(0, 6, rng.integers(2, 5)))
    parts.insert(int(rng.integers(0, len(parts) + 1)), rng.integers(0, 256, (3, 3, 5, 7), np.uint8))
    parts = [p[::2] if rng.random() < 0.3 else p for p in parts]  # a strided slice is no RGBX view: numpy's copy
    joined = rgbx.concatenate(parts)
    assert joined.flags.c_contiguous and np.array_equal(joined, numpys(parts))
    if any(rgbx.planes(p) is not None for p in parts):
        assert rgbx.planes(joined) is None  # copied into planes, not another view


def test_concatenate_leaves_object_and_float_parts_to_numpy():
    objects = [np.array([{"a": 1}], object), np.array([{"b": 2}], object)]
    assert list(rgbx.concatenate(objects)) == [{"a": 1}, {"b": 2}]
    floats = [np.full((1, 3, 2, 2), 0.5, np.float32), np.zeros((2, 3, 2, 2), np.float32)]
    out = rgbx.concatenate(floats)
    assert out.dtype == np.float32 and np.array_equal(out, np.concatenate(floats))


@pytest.mark.parametrize("dtype", [np.uint8, np.float32, np.int16])
def test_assign_equals_numpys_copy_into_any_destination(dtype):
    """The casts keep a plane's low byte only into uint8; any other destination gets numpy's copy."""
    view = rgbx_parts(np.random.default_rng(1), [4])[0]
    assert rgbx.planes(view) is not None
    for index in (slice(1, 5), np.array([0, 2, 4, 5])):
        a, b = np.zeros((6, 3, 5, 7), dtype), np.zeros((6, 3, 5, 7), dtype)
        rgbx.assign(a, index, view)
        b[index] = view
        assert np.array_equal(a, b)


def test_a_view_without_its_pad_is_copied_by_numpy():
    """The last pixel's last plane reads 3 bytes past it: without rgbx.PAD numpy's bounds check
    refuses the planes, and the copy falls back."""
    four = np.random.default_rng(2).integers(0, 256, (2, 3, 4, 4), np.uint8)
    view = four.transpose(0, 3, 1, 2)[:, :3]
    assert rgbx.planes(view) is None
    a = np.zeros((2, 3, 3, 4), np.uint8)
    rgbx.assign(a, slice(None), view)
    assert np.array_equal(a, view)


@pytest.mark.parametrize("view", ["HWC", True, "planes"])
def test_decode_batch_refuses_an_unknown_view(view):
    with pytest.raises(ValueError, match="view must be one of"):
        decode.decode_batch([], [], Target((3, 4, 4), ("jpg",)), view=view)
