"""pipeline/decode.py: every supported image format to the source's shape, labels from every
supported member, and nothing else ever decoded."""
import io
import os
import json
import struct
import sys
import time
import zlib

import numpy as np
import pytest
from PIL import Image

from helpers import HANG, encoded, exif_rotated, handmade_png, jpeg_cases, pil_png, pixels, run_capture, smooth
from pipeline.data.decoding import decode, jpeg, png, rgbx, turbo
from pipeline.data.decoding import labelling
from pipeline.data.decoding.decode import Target

SHAPES = [(1, 28, 28), (3, 32, 32), (3, 5, 7)]


@pytest.mark.parametrize("shape", SHAPES)
def test_pngs_written_by_others_decode_identically(shape):
    a = pixels(shape, seed=1)
    for data in (pil_png(a), pil_png(a, optimize=True), handmade_png(a, 0), handmade_png(a, 1), png.encode(a)):
        assert (decode.decode_image(data, "png", shape) == a).all()


@pytest.mark.parametrize("shape", SHAPES)
def test_a_batch_decodes_at_once_whichever_path_each_image_took(shape):
    """Fast-path PNGs are unfiltered together, the others go through PIL: all come out
    identical to their originals, in order, with damaged ones reported by position."""
    images = [pixels(shape, seed=s) for s in range(5)]
    datas = [png.encode(images[0]), pil_png(images[1]), png.encode(images[2]), handmade_png(images[3], 1),
             png.encode(images[4])]
    datas.insert(2, b"\x89PNG\r\n\x1a\n garbage")
    out, kept, errors = decode.decode_batch(datas, ["png"] * 6, Target(shape))
    assert kept == [0, 1, 3, 4, 5] and [e[0] for e in errors] == [2] and "undecodable" in errors[0][1]
    assert (out == np.stack(images)).all()


@pytest.mark.parametrize("shape", [(3, 32, 32), (1, 28, 28)])
@pytest.mark.parametrize("cut_scan", [False, True])
def test_a_jpeg_batch_decodes_as_each_image_does_alone(shape, cut_scan, monkeypatch, without_simplejpeg):
    """The batch's one libjpeg-turbo call gives exactly what decode_image gives image by image
    (pixels, random crops, refusals, PIL's draft path for large ones); a JPEG whose scan is
    cut short makes that call fail, and the batch then goes image by image."""
    c = shape[0]
    datas = [encoded(pixels((c, 40, 56), seed=s), "JPEG") for s in range(3)]  # resized, then cropped
    datas += [encoded(pixels(shape, seed=7), "JPEG"), encoded(pixels((c, 128, 128), seed=8), "JPEG"),
              b"\xff\xd8 not a jpeg", encoded(pixels((c, 4, 400), seed=9), "JPEG")]  # too elongated
    if cut_scan:
        good = datas[3]
        sos = good.find(b"\xff\xda")
        datas.insert(2, good[:sos + 4 + int.from_bytes(good[sos + 2:sos + 4], "big") + 10])
    crops = np.random.default_rng(0).random((len(datas), 2))
    alone_out, alone_kept, alone_errors = decoded_alone(datas, shape, crops)
    calls = []
    real = decode._torchvision_jpegs
    monkeypatch.setattr(decode, "_torchvision_jpegs", lambda ds, c: calls.append(len(ds)) or real(ds, c))
    out, kept, errors = decode.decode_batch(datas, ["jpg"] * len(datas), Target(shape, ("jpg",)), crops)
    assert calls[0] == 4 + cut_scan  # the images libjpeg-turbo takes at their size, in one call
    assert len(calls) == (1 + 5 if cut_scan else 1)  # then, after a failure, one call an image
    assert kept == alone_kept and errors == alone_errors and (out == np.stack(alone_out)).all()
    assert len(kept) == 5 and [i for i, _ in errors][-2:] == [len(datas) - 2, len(datas) - 1]


def test_a_jpeg_batch_holds_at_most_one_call_budget_of_full_size_pixels(monkeypatch, without_simplejpeg):
    """torchvision's call keeps every image it decodes until it returns: wide JPEGs that the
    bounds let through at full size (60x1900 for a 32x32 target) go in calls of at most
    JPEG_CALL_PIXELS together, not one call of the whole batch (128 such images of 100 KB at
    447x14000 for 224x224 held 2.2 GiB that way), and still decode as each does alone."""
    wide = [encoded(pixels((3, 60, 1900), seed=s), "JPEG", quality=20) for s in range(5)]
    datas = wide[:2] + [encoded(pixels((3, 32, 32), seed=9), "JPEG")] + wide[2:]
    budget = int(2.5 * 60 * 1900)
    monkeypatch.setattr(decode, "JPEG_CALL_PIXELS", budget, raising=False)  # fails on calls, not on the name
    calls = []
    real = decode._torchvision_jpegs
    monkeypatch.setattr(decode, "_torchvision_jpegs", lambda ds, c: calls.append(len(ds)) or real(ds, c))
    out, kept, errors = decode.decode_batch(datas, ["jpg"] * len(datas), Target((3, 32, 32), ("jpg",)))
    assert calls == [3, 2, 1]  # two wide and the 32x32, two wide, the last: never 3 wide (the budget is 2.5)
    assert kept == list(range(6)) and not errors
    assert (out == np.stack([decode.decode_image(d, "jpg", (3, 32, 32)) for d in datas])).all()


def test_raw_batches_check_their_length():
    shape = (1, 4, 4)
    good = [pixels(shape, s).tobytes() for s in range(3)]
    out, kept, errors = decode.decode_batch(good[:1] + [b"short"] + good[1:], ["raw"] * 4, Target(shape, ("raw",)))
    assert kept == [0, 2, 3] and errors[0][0] == 1 and "5 raw bytes, expected 16" in errors[0][1]
    assert (out == np.stack([np.frombuffer(g, np.uint8).reshape(shape) for g in good])).all()


@pytest.mark.parametrize("fmt,ext", [("JPEG", "jpg"), ("WEBP", "webp"), ("PPM", "ppm"), ("BMP", "bmp")])
@pytest.mark.parametrize("mode_shape", [(3, 40, 56), (1, 40, 56)])
def test_every_format_and_mode_comes_to_the_target_shape(fmt, ext, mode_shape):
    """RGB and grey images of another size, in each format, to both a grey and a colour target."""
    c, h, w = mode_shape
    yy, xx = np.mgrid[:h, :w]
    a = np.stack([(xx * 4 + yy * k) % 256 for k in range(c)]).astype(np.uint8)  # smooth: lossy formats keep it
    data = encoded(a, fmt, **({"quality": 95} if fmt in ("JPEG", "WEBP") else {}))
    for target in ((3, 32, 32), (1, 24, 24)):
        out = decode.decode_image(data, ext, target)
        assert out.shape == target and out.dtype == np.uint8
    same = decode.decode_image(data, ext, mode_shape)  # no resize needed: close to the original
    tolerance = 12 if fmt in ("JPEG", "WEBP") else 0
    assert np.abs(same.astype(int) - a).mean() <= tolerance


def test_rgba_and_palette_images_decode():
    rgba = Image.fromarray(np.random.default_rng(0).integers(0, 256, (10, 10, 4), dtype=np.uint8), "RGBA")
    pal = rgba.convert("RGB").convert("P")
    for img in (rgba, pal):
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        assert decode.decode_image(buf.getvalue(), "png", (3, 10, 10)).shape == (3, 10, 10)


def test_resize_keeps_the_shorter_side_and_crops():
    """A 40x80 image to 20x20: resized to 20x40, then cropped 20x20, centred for evaluation,
    placed by the crop numbers for training."""
    a = np.zeros((40, 80, 3), np.uint8)
    a[:, :40] = 255  # left half white
    centre = decode.fit(a, (3, 20, 20))
    left = decode.fit(a, (3, 20, 20), crop=(0.0, 0.0))
    right = decode.fit(a, (3, 20, 20), crop=(0.0, 0.999))
    assert centre.shape == left.shape == right.shape == (3, 20, 20)
    assert left.mean() > 250 and right.mean() < 5 and 100 < centre.mean() < 155


def test_jpeg_size_is_read_from_the_frame_header():
    data = encoded(pixels((3, 37, 53)), "JPEG")
    assert decode.jpeg_size(data) == (37, 53)
    assert decode.jpeg_size(b"not a jpeg") is None
    assert decode.jpeg_size(data[:20]) is None  # cut before the frame header


def test_large_jpeg_takes_pils_draft_path_and_small_one_libjpeg():
    big, small = encoded(pixels((3, 128, 128)), "JPEG"), encoded(pixels((3, 32, 32)), "JPEG")
    assert decode.decode_image(big, "jpg", (3, 32, 32)).shape == (3, 32, 32)
    via_turbo = decode._torchvision_jpeg(small, 3, jpeg.header(small))
    assert via_turbo is not None and via_turbo.shape == (32, 32, 3)
    pil = np.asarray(Image.open(io.BytesIO(small)).convert("RGB"))
    assert np.abs(via_turbo.astype(int) - pil).mean() < 3  # the same image, either decoder


@pytest.mark.parametrize("fmt", ["BMP", "TIFF", "GIF"])
def test_other_image_formats_named_png_are_refused(fmt):
    """PIL opens dozens of formats (EPS through Ghostscript); a .png member must be a PNG."""
    data = encoded(pixels((3, 32, 32)), fmt)
    with pytest.raises(ValueError, match="undecodable"):
        decode.decode_image(data, "png", (3, 32, 32))


def test_an_unidentified_image_is_named_without_a_memory_address():
    """PIL names the BytesIO it was given, at an address that differs in every run."""
    with pytest.raises(ValueError) as e:
        decode.decode_image(b"not an image at all", "webp", (3, 32, 32))
    assert str(e.value) == "undecodable image: cannot identify image file", str(e.value)


def test_damaged_images_raise_value_error():
    good = encoded(pixels((3, 32, 32)), "JPEG")
    for ext, data in (("jpg", good[:len(good) // 3]), ("jpg", b"\xff\xd8garbage"), ("png", b""), ("webp", b"x")):
        with pytest.raises(ValueError):
            decode.decode_image(data, ext, (3, 32, 32))


@pytest.mark.parametrize("side", [5_000, 100_000])  # over our limit; over PIL's own bomb limit too
def test_decompression_bomb_is_refused_from_its_header(side):
    """A header claiming side x side RGB pixels over a small zlib stream: refused before any
    pixel buffer is made (100,000 x 100,000 would be 30 GB)."""
    ihdr = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    bomb = png.SIGNATURE + png._chunk(b"IHDR", ihdr) + png._chunk(b"IDAT", zlib.compress(bytes(1 << 20))) \
        + png._chunk(b"IEND", b"")
    t0 = time.process_time()  # CPU seconds: what other processes take of the cores does not count
    with pytest.raises(ValueError, match=f"image is {side}x{side}|decompression bomb"):
        decode.decode_image(bomb, "png", (3, 32, 32))
    assert time.process_time() - t0 < 5


def test_labels_from_every_member_kind():
    t = Target((1, 4, 4), label="cls", classes=10)
    assert labelling.label_of({"cls": b"7"}, t) == 7
    assert labelling.label_of({"txt": b" 3\n"}, Target((1, 4, 4), label="txt")) == 3
    assert labelling.label_of({"index": b"2"}, Target((1, 4, 4), label="index")) == 2
    nested = Target((1, 4, 4), label="json:meta.label")
    assert labelling.label_of({"json": json.dumps({"meta": {"label": 4}}).encode()}, nested) == 4
    sparse = Target((1, 4, 4), classes=3, label_values=(3, 7, 12))
    assert labelling.label_of({"cls": b"12"}, sparse, sparse.lookup()) == 2
    assert labelling.label_of({"json": b'{"meta": {"label": "4"}}'}, nested) == 4  # an integer, written as text
    names = Target((1, 4, 4), label="json:label", classes=3, names=("cat", "dog", "n01440764"))
    assert labelling.label_of({"json": b'{"label": "dog"}'}, names, names.lookup()) == 1
    synsets = Target((1, 4, 4), label="cls", classes=3, names=("cat", "dog", "n01440764"))
    assert labelling.label_of({"cls": b"n01440764\n"}, synsets, synsets.lookup()) == 2
    folders = Target((1, 4, 4), label="dir", classes=2, names=("257.clutter", "airplane"))
    assert labelling.label_of({"__key__": "train/257.clutter/0001"}, folders, folders.lookup()) == 0
    first = Target((1, 4, 4), label="dir:0", classes=2, names=("257.clutter", "airplane"))
    assert labelling.label_of({"__key__": "airplane/x/0001"}, first, first.lookup()) == 1
    unlabelled = [({"cls": b"-1"}, t), ({}, t), ({"json": b"{}"}, nested),
                  ({"json": b'{"meta": {"label": null}}'}, nested), ({"json": b'{"meta": {"label": -1}}'}, nested)]
    for sample, target in unlabelled:
        with pytest.raises(labelling.Unlabelled):
            labelling.label_of(sample, target, target.lookup())
    bad = [({"cls": b"10"}, t, "outside 0..9"), ({"cls": b"cat"}, t, "not an integer"),
           ({}, t, "no .cls member"), ({"cls": b"-1"}, t, "marks a sample without a label"),
           ({"json": b"{}"}, nested, "no meta.label field"),
           ({"json": b'{"meta": {"label": true}}'}, nested, "not an integer or a class name"),
           ({"json": b"not json"}, nested, "not valid JSON"), ({"cls": b"5"}, sparse, "not one of"),
           ({"json": b'{"label": "cow"}'}, names, "class name 'cow' is not one of the source's 3 classes"),
           ({"__key__": "0001"}, folders, "has no folder")]
    for sample, target, message in bad:
        with pytest.raises(ValueError, match=message):
            labelling.label_of(sample, target, target.lookup())


def test_label_keys_and_image_extensions_are_checked():
    for bad in ("pyd", "json", "json:", "json:a..b", "pth", "", "dir:x", "dir:-1"):
        with pytest.raises(ValueError):
            labelling.parse_label_key(bad)
    with pytest.raises(ValueError):
        Target((3, 8, 8), image_exts=("pyd",))
    assert Target((3, 8, 8), ("jpg", "png"), "json:label").members == {"jpg", "png", "json"}


def test_only_named_members_are_ever_looked_at():
    """A sample full of pickles and tensors: image_of and label_of touch only .png and .cls."""
    class Explodes(bytes):
        def __getattribute__(self, name):
            raise AssertionError("a member that should never be read was read")

    t = Target((1, 2, 2), ("png",), "cls")
    sample = {"png": png.encode(np.zeros((1, 2, 2), np.uint8)), "cls": b"1", "pyd": Explodes(b"x"),
              "pth": Explodes(b"y"), "pickle": Explodes(b"z")}
    assert decode.image_of(sample, t)[0] == "png" and labelling.label_of(sample, t) == 1


def test_tiff_gif_and_npy_images_decode():
    """.tif/.tiff and .gif (its first frame) through PIL, .npy (uint8 HxW or HxWxC) through numpy
    without pickles; a multi-part member extension (rgb.png, depth.npy) decodes by its last part."""
    import io

    from PIL import Image

    rng = np.random.default_rng(0)
    rgb = rng.integers(0, 256, (12, 10, 3), dtype=np.uint8)
    for fmt, ext in (("TIFF", "tif"), ("TIFF", "tiff")):
        buf = io.BytesIO()
        Image.fromarray(rgb).save(buf, format=fmt)
        assert (decode.decode_image(buf.getvalue(), ext, (3, 12, 10)) == rgb.transpose(2, 0, 1)).all()
    frames = [Image.fromarray(np.full((8, 8), v, np.uint8)).convert("P") for v in (40, 200)]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:])
    assert (decode.decode_image(buf.getvalue(), "gif", (1, 8, 8)) == 40).all()  # the first frame
    for array, shape in ((rgb, (3, 12, 10)), (rgb[:, :, 0], (1, 12, 10)), (rgb[:, :, :1], (1, 12, 10))):
        buf = io.BytesIO()
        np.save(buf, array)
        out = decode.decode_image(buf.getvalue(), "npy", shape)
        assert out.shape == shape and (out[0] == array[..., 0] if array.ndim == 3 else out[0] == array).all()
    assert decode.image_format("rgb.png") == "png" and decode.image_format("depth.npy") == "npy"
    assert decode.image_format("json") is None and decode.image_format("x.pyd") is None
    assert Target((3, 8, 8), image_exts=("rgb.png",)).members == {"rgb.png", "cls"}


@pytest.mark.parametrize("array, message", [
    (np.zeros((4, 4), np.float32), "float32"), (np.zeros((4, 4, 2), np.uint8), "shape"),
    (np.array([{"a": 1}], dtype=object), "object"),
])
def test_npy_that_is_no_image_is_one_line(array, message):
    import io

    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=True)
    with pytest.raises(ValueError, match=message):
        decode.decode_image(buf.getvalue(), "npy", (1, 4, 4))



def test_npy_with_an_unclosed_bracket_in_its_header_is_one_line():
    """numpy tokenizes a header it can't parse again, and tokenize's TokenError is no ValueError:
    one such member crashed the DataLoader worker with a traceback."""
    import io

    buf = io.BytesIO()
    np.save(buf, np.zeros((20, 24, 3), np.uint8))
    data = buf.getvalue().replace(b"(20, 24, 3)", b"(20, 24, 3-")
    with pytest.raises(ValueError, match="undecodable .npy"):
        decode.decode_image(data, "npy", (3, 16, 16))


def test_npy_header_claiming_a_huge_image_is_refused_before_loading():
    """The header says 100,000 x 100,000 (10 GB); only the header is read, so this fails at once."""
    import io

    from numpy.lib import format as npformat

    buf = io.BytesIO()
    npformat.write_array_header_1_0(buf, {"descr": "|u1", "fortran_order": False, "shape": (100000, 100000)})
    t0 = time.process_time()  # CPU seconds: what other processes take of the cores does not count
    with pytest.raises(ValueError, match="more than"):
        decode.decode_image(buf.getvalue() + bytes(64), "npy", (1, 8, 8))
    assert time.process_time() - t0 < 1


def test_npy_claiming_more_pixels_than_it_holds_is_refused_before_any_array(tmp_path):
    """Within the pixel limit, but the data is missing: np.load would allocate the claimed array
    first; under an address-space limit below that size, the check answers in one line."""
    import sys

    from numpy.lib import format as npformat

    buf = io.BytesIO()
    side = int(decode.MAX_PIXELS ** 0.5) - 1
    npformat.write_array_header_1_0(buf, {"descr": "|u1", "fortran_order": False, "shape": (side, side, 4)})
    (tmp_path / "x.npy").write_bytes(buf.getvalue() + bytes(4096))
    code = """
import resource, sys
import numpy as np
from pipeline.data.decoding import decode
soft, hard = resource.getrlimit(resource.RLIMIT_AS)
used = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (used + (32 << 20), hard))  # half the claimed array
try:
    decode.decode_image(open(sys.argv[1], "rb").read(), "npy", (3, 256, 256))  # 256x256: within MAX_DECODE_RATIO
except ValueError as e:
    print("refused:", e)
"""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = run_capture([sys.executable, "-c", code, str(tmp_path / "x.npy")], capture_output=True, text=True,
                    timeout=HANG, env=dict(os.environ, PYTHONPATH=root))
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("refused: .npy header claims") and "Traceback" not in p.stderr



def test_npy_goes_through_the_bounds_check_for_its_target():
    """The header's size meets pipeline.bounds as every decoder's does: a 2 x 2000 array for a
    square target is far more elongated than MAX_ASPECT allows."""
    buf = io.BytesIO()
    np.save(buf, np.zeros((2, 2000), np.uint8))
    with pytest.raises(ValueError, match="elongated"):
        decode.decode_image(buf.getvalue(), "npy", (1, 8, 8))


@pytest.mark.parametrize("shape", [(3, 32, 32), (1, 28, 28)])
def test_jpegs_decode_the_same_with_simplejpeg_and_without(shape, monkeypatch):
    """simplejpeg (pipeline.data.decoding.turbo) or, where it is missing, torchvision and PIL: the same
    images kept, the same refusals, the same pixels for every image decoded at its own size
    (both are libjpeg-turbo), and within a mean of 6 levels for one simplejpeg decodes at a
    smaller DCT scale before the resize (3/8 here, where PIL's draft mode takes 1/2)."""
    pytest.importorskip("simplejpeg")
    datas = jpeg_cases(shape)
    crops = np.random.default_rng(0).random((len(datas), 2))
    target = Target(shape, ("jpg",))
    assert turbo.available()
    with_turbo = decode.decode_batch(datas, ["jpg"] * len(datas), target, crops)
    monkeypatch.setitem(sys.modules, "simplejpeg", None)
    turbo._module.cache_clear()
    try:
        assert not turbo.available()
        without = decode.decode_batch(datas, ["jpg"] * len(datas), target, crops)
    finally:
        monkeypatch.undo()
        turbo._module.cache_clear()
    (out, kept, errors), (out0, kept0, errors0) = with_turbo, without
    assert kept == kept0 == [0, 1, 2, 3, 4, 8] and errors == errors0
    same = [kept.index(i) for i in (0, 1, 2, 4, 8)]
    assert (out[same] == out0[same]).all()
    scaled = kept.index(3)
    assert np.abs(out[scaled].astype(int) - out0[scaled]).mean() <= 6  # 4.4 seen: another scale, another resize


@pytest.mark.parametrize("shape", [(3, 32, 32), (1, 28, 28)])
def test_a_jpeg_batch_with_simplejpeg_decodes_as_each_image_does_alone(shape):
    """The batch's straight-into-the-buffer path gives exactly what decode_image gives."""
    pytest.importorskip("simplejpeg")
    datas = jpeg_cases(shape)
    crops = np.random.default_rng(1).random((len(datas), 2))
    out, kept, errors = decode.decode_batch(datas, ["jpg"] * len(datas), Target(shape, ("jpg",)), crops)
    alone_out, alone_kept, alone_errors = decoded_alone(datas, shape, crops)
    assert kept == alone_kept and errors == alone_errors and (out == np.stack(alone_out)).all()


@pytest.mark.parametrize("shape", [(3, 32, 32), (1, 28, 28), (3, 5, 7)])
@pytest.mark.parametrize("which", ["exact", "every kind"])
@pytest.mark.parametrize("how", ["hwc", "rgbx"])
def test_a_jpeg_batch_left_as_a_view_holds_the_same_pixels_and_is_contiguous_unless_asked(shape, which, how):
    """view= (the stream's Decode stage) may hand the pixels as the CHW view of libjpeg-turbo's
    HWC or RGBX buffer, for collate's one copy to make CHW; the pixels are the same, and every
    other caller (gpujpeg.pack, a schema's fields) still gets a C-contiguous array."""
    pytest.importorskip("simplejpeg")
    datas = jpeg_cases(shape)
    if which == "exact":  # all of the target's size and upright: the path that leaves the buffer HWC
        datas = [datas[0], datas[-1], datas[0]]
    target, crops = Target(shape, ("jpg",)), np.random.default_rng(2).random((len(datas), 2))
    out, kept, errors = decode.decode_batch(datas, ["jpg"] * len(datas), target, crops)
    view, view_kept, view_errors = decode.decode_batch(datas, ["jpg"] * len(datas), target, crops, view=how)
    assert out.flags.c_contiguous and out.shape == (len(kept), *shape)
    assert view_kept == kept and view_errors == errors and view.shape == out.shape and (view == out).all()
    alone, alone_kept, _ = decoded_alone(datas, shape, crops)
    assert alone_kept == kept and (out == np.stack(alone)).all()
    if shape[0] == 3:
        assert not view.flags.c_contiguous  # the copy left to collate (else this path was not taken)
        assert (rgbx.planes(view) is not None) == (how == "rgbx")


def test_a_batch_mostly_resized_is_not_decoded_as_rgbx():
    """Padding resized images to RGBX cost more than the planes save (a 500x375 set at 224x224 ran at
    0.76x): a batch is an RGBX view only where at least half its JPEGs are of the target's own size,
    and its pixels are the same either way."""
    pytest.importorskip("simplejpeg")
    target = Target((3, 8, 12), ("jpg",))
    big = [encoded(smooth(3, 16, 24, seed), "JPEG", quality=90) for seed in range(3)]
    exact = [encoded(smooth(3, 8, 12, seed), "JPEG", quality=90) for seed in range(3)]
    for batch, four in ((big, False), (big + exact[:2], False), (exact[:2] + big[:2], True), (exact, True)):
        view, kept, errors = decode.decode_batch(batch, ["jpg"] * len(batch), target, view="rgbx")
        out, _, _ = decode.decode_batch(batch, ["jpg"] * len(batch), target)
        assert len(kept) == len(batch) and (rgbx.planes(view) is not None) == four
        assert np.array_equal(view, out) and np.array_equal(out, np.stack(decoded_alone(batch, (3, 8, 12), [None] * len(batch))[0]))


def test_a_remembered_jpeg_header_is_only_reused_for_the_same_bytes():
    """jpeg.header remembers a header by the bytes up to the first scan: a JPEG that starts
    with them still has its scans counted (a scan bomb is refused), one that differs in a
    byte of its frame header reads its own size."""
    a = smooth(3, 16, 24)
    data = encoded(a, "JPEG", progressive=True)
    assert jpeg.header(data).upright == (16, 24)
    last, end = data.rfind(b"\xff\xda"), data.rfind(b"\xff\xd9")
    bomb = data[:end] + data[last:end] * (jpeg.MAX_SCANS + 1) + data[end:]
    with pytest.raises(ValueError, match="scans"):
        jpeg.header(bomb)
    taller = bytearray(data)
    sof = data.find(b"\xff\xc2")
    taller[sof + 5:sof + 7] = (4000).to_bytes(2, "big")
    assert jpeg.header(bytes(taller)).upright == (4000, 24)
    assert jpeg.header(data).upright == (16, 24)


def test_a_remembered_header_counts_the_scans_of_the_fewest_bytes_that_hold_too_many():
    """jpeg.header skips the scan count of a JPEG too short to hold MAX_SCANS more scans
    (SCAN_BYTES each, the least a scan header takes): one of exactly that many minimal scan
    headers after a remembered prefix is still counted, and refused."""
    data = encoded(smooth(3, 16, 24), "JPEG", progressive=True)
    assert jpeg.header(data).upright == (16, 24)  # remembered
    sos = data.find(b"\xff\xda")
    first = sos + 2 + int.from_bytes(data[sos + 2:sos + 4], "big")
    minimal = b"\xff\xda\x00\x08\x01\x01\x00\x00\x3f\x00"  # one component, nothing coded
    assert len(minimal) == jpeg.SCAN_BYTES
    with pytest.raises(ValueError, match="scans"):
        jpeg.header(data[:first] + minimal * jpeg.MAX_SCANS + b"\xff\xd9")
    assert jpeg.header(data[:first] + minimal * (jpeg.MAX_SCANS - 1) + b"\xff\xd9").upright == (16, 24)


@pytest.mark.parametrize("bomb", ["repeated scans", "minimal scans"])
def test_a_batch_reusing_a_header_still_refuses_a_scan_bomb_with_its_bytes(bomb, monkeypatch):
    """decode_batch's loop reuses the header of the last JPEG of the target's size for bytes
    that start the same (jpeg.known_again): a scan bomb after such a JPEG, sharing every byte
    up to its first scan, is still refused for its scans before libjpeg-turbo sees it."""
    seen = []
    real = turbo.decode_into()
    monkeypatch.setattr(turbo, "decode_into", lambda: lambda d, **kw: seen.append(d) or real(d, **kw))
    data = encoded(smooth(3, 16, 24), "JPEG", progressive=True)
    if bomb == "repeated scans":
        last, end = data.rfind(b"\xff\xda"), data.rfind(b"\xff\xd9")
        bad = data[:end] + data[last:end] * (jpeg.MAX_SCANS + 1) + data[end:]
    else:
        sos = data.find(b"\xff\xda")
        first = sos + 2 + int.from_bytes(data[sos + 2:sos + 4], "big")
        bad = data[:first] + b"\xff\xda\x00\x08\x01\x01\x00\x00\x3f\x00" * jpeg.MAX_SCANS + b"\xff\xd9"
    jpeg._known.clear()
    pixels, kept, errors = decode.decode_batch([data, bad, data], ["jpg"] * 3, Target((3, 16, 24), ("jpg",)))
    assert kept == [0, 2] and [i for i, _ in errors] == [1] and "scans" in errors[0][1]
    assert (pixels[0] == pixels[1]).all() and seen == [data, data]


def decoded_alone(datas, shape, crops):
    """(images, positions kept, (position, error) refused) of JPEGs decoded one by one with
    decode_image: what a batch decode must give."""
    out, kept, errors = [], [], []
    for i, d in enumerate(datas):
        try:
            out.append(decode.decode_image(d, "jpg", shape, crops[i]))
            kept.append(i)
        except ValueError as e:
            errors.append((i, str(e)))
    return out, kept, errors
