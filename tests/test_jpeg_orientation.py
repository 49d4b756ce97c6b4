"""One EXIF orientation for every JPEG decoder: jpeg.header reads it as PIL reads it
(pipeline/data/decoding/exif.py), and simplejpeg, torchvision (host, CMYK, what simplejpeg's
strict mode refuses, decode="device" on the CPU) and PIL all turn by that reading, so an image
comes out as PIL's ImageOps.exif_transpose gives it whichever decoder runs."""
import io
import struct
import warnings

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from helpers import encoded, smooth
from pipeline.data.decoding import decode, exif, gpujpeg, jpeg, turbo
from pipeline.data.decoding.decode import Target

EXIF = b"Exif\0\0"
XMP = exif.XMP


def tiff(orientation, order="<", typ=3):
    """A TIFF block whose first directory holds one Orientation entry, its value in the entry."""
    value = struct.pack(order + ("HH" if typ == 3 else "I"), *((orientation, 0) if typ == 3 else (orientation,)))
    return ((b"II" if order == "<" else b"MM") + struct.pack(order + "HI", 42, 8) + struct.pack(order + "H", 1) +
            struct.pack(order + "HHI", 0x0112, typ, 1) + value + struct.pack(order + "I", 0))


def with_app1(data, *payloads):
    """The JPEG with APP1 segments of these payloads right after its SOI."""
    return data[:2] + b"".join(b"\xff\xe1" + struct.pack(">H", len(p) + 2) + p for p in payloads) + data[2:]


LAYOUTS = {  # the EXIF as a camera writes it, and the four layouts the readers disagreed on
    "plain": lambda d, o: with_app1(d, EXIF + tiff(o)),
    "xmp first": lambda d, o: with_app1(d, XMP + b"<x:xmpmeta/>", EXIF + tiff(o)),  # torchvision missed the Exif
    "Exif 0 ff": lambda d, o: with_app1(d, b"Exif\0\xff" + tiff(o)),  # no EXIF to PIL; torchvision turned it
    "big-endian LONG": lambda d, o: with_app1(d, EXIF + tiff(o, ">", 4)),  # jpeg.header read 1
    "empty first": lambda d, o: with_app1(d, EXIF, EXIF + tiff(o)),  # jpeg.header read 1, PIL the second
}


def picture(h, w):
    """CHW RGB gradients with a block in one corner: every turn and flip of it differs."""
    a = smooth(3, h, w, 3)
    a[:, :h // 3, :w // 4] = np.array([250, 10, 120], np.uint8)[:, None, None]
    return a


def base(kind, h, w):
    """A JPEG stored h x w: YCbCr, CMYK, or one libjpeg-turbo warns of (simplejpeg's strict mode refuses it)."""
    a = picture(h, w)
    if kind == "cmyk":
        buf = io.BytesIO()
        Image.fromarray(a.transpose(1, 2, 0)).convert("CMYK").save(buf, format="JPEG", quality=95)
        return buf.getvalue()
    data = encoded(a, "JPEG", quality=95)
    if kind == "warned":  # its scan cut short, then its EOI: libjpeg-turbo fills the rest and warns
        scan = data.find(b"\xff\xda")
        return data[:scan + (len(data) - scan) * 4 // 5] + b"\xff\xd9"
    return data


def reference(data):
    """HWC RGB as PIL's ImageOps.exif_transpose turns it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB"))


def cases(kind, h, w):
    """[(layout, orientation, JPEG bytes, PIL's upright HWC)] over every layout and orientation 1-8."""
    stored = base(kind, h, w)
    out = []
    for name, layout in LAYOUTS.items():
        for o in range(1, 9):
            data = layout(stored, o)
            out.append((name, o, data, reference(data)))
    return out


def assert_as_pil(all_cases, tolerance=0, shrink=1):
    """Each case through decode_image and, with those of its upright shape, through one
    decode_batch: the pixels of PIL + exif_transpose (at `shrink` times smaller, within a mean
    of `tolerance` levels of PIL's image resized as decode.fit resizes it)."""
    by_shape = {}
    for case in all_cases:
        h, w = case[3].shape[:2]
        by_shape.setdefault((3, h // shrink, w // shrink), []).append(case)
    for shape, group in by_shape.items():
        want = [decode.fit(ref, shape) for _, _, _, ref in group]
        datas = [data for _, _, data, _ in group]
        batch, kept, errors = decode.decode_batch(datas, ["jpg"] * len(datas), Target(shape, ("jpg",)))
        assert kept == list(range(len(datas))) and not errors, errors
        for (name, o, data, _), expect, got in zip(group, want, batch):
            alone = decode.decode_image(data, "jpg", shape)
            for pixels in (alone, got):
                diff = np.abs(pixels.astype(int) - expect)
                assert (diff.max() == 0) if not tolerance else diff.mean() <= tolerance, \
                    (name, o, diff.max(), diff.mean())


def test_the_header_reads_each_layout_as_pil_does():
    for name, o, data, ref in cases("rgb", 24, 40):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pil = Image.open(io.BytesIO(data)).getexif().get(0x0112, 1)
        assert jpeg.header(data).orientation == (1 if name == "Exif 0 ff" else o) == pil, (name, o)


def test_simplejpeg_turns_as_pil_does():
    pytest.importorskip("simplejpeg")
    assert turbo.available()
    assert_as_pil(cases("rgb", 24, 40))


def test_torchvision_turns_as_pil_does(without_simplejpeg):
    """Without simplejpeg: torchvision's batch call and decode_image's, EXIF not read by torchvision."""
    assert_as_pil(cases("rgb", 24, 40))


def test_cmyk_through_torchvision_turns_as_pil_does():
    """CMYK, which simplejpeg does not take here: torchvision decodes it even where simplejpeg is installed."""
    assert_as_pil(cases("cmyk", 24, 40))


def test_what_simplejpegs_strict_mode_refuses_turns_as_pil_does():
    """libjpeg-turbo warns of a scan cut short: simplejpeg (strict) refuses it, torchvision decodes it as PIL does."""
    pytest.importorskip("simplejpeg")
    data = base("warned", 24, 40)
    with pytest.raises(turbo.REFUSED):
        turbo.decode_into()(data, colorspace="RGB", strict=True)
    assert_as_pil(cases("warned", 24, 40))


def test_pils_path_turns_as_pil_does(monkeypatch, without_simplejpeg):
    """torchvision refusing (as it refuses damage): PIL decodes, turned by jpeg.header's reading."""
    monkeypatch.setattr(decode, "_torchvision_jpegs", lambda *a, **k: None)
    assert_as_pil(cases("rgb", 24, 40))


def test_resized_images_turn_as_pil_does(without_simplejpeg):
    """Four times the target on each side: PIL's draft mode (as test_bounds allows, a mean of 4)."""
    assert_as_pil(cases("rgb", 96, 160), tolerance=4, shrink=4)


def test_resized_images_through_simplejpeg_turn_as_pil_does():
    """simplejpeg at a DCT scale (as test_decode allows, a mean of 6)."""
    pytest.importorskip("simplejpeg")
    assert_as_pil(cases("rgb", 96, 160), tolerance=6, shrink=4)


def test_decode_on_the_device_turns_as_pil_does():
    """decode="device" on the CPU (the tests' stand-in for nvJPEG): the JPEGs its header says are
    upright travel as bytes and are decoded there as stored (an `Exif\\0\\xff` segment is no
    EXIF), the others are turned on the host; every one comes out as PIL gives it."""
    shape = (3, 32, 32)  # square: a quarter turn keeps the shape, only the pixels show it
    all_cases = cases("rgb", 32, 32)
    datas = [data for _, _, data, _ in all_cases]
    rows, kept, errors, sizes = gpujpeg.pack(datas, ["jpg"] * len(datas), Target(shape, ("jpg",)))
    assert kept == list(range(len(datas))) and not errors
    travelled = {all_cases[kept[j]][:2] for j in np.flatnonzero(sizes)}
    assert ("Exif 0 ff", 6) in travelled and ("xmp first", 6) not in travelled
    pixels, refused = gpujpeg.unpack(torch.from_numpy(rows), torch.from_numpy(sizes), torch.device("cpu"),
                                     torch.Tensor.clone)
    assert refused == 0
    for (name, o, _, ref), got in zip(all_cases, pixels.numpy()):
        assert (got == ref.transpose(2, 0, 1)).all(), (name, o)


def test_a_decoded_size_other_than_the_frame_is_refused_not_taken_for_a_turn():
    """The size torchvision gives is checked against the frame exactly: a quarter turn is not
    another reading of the EXIF any more (the only reading is jpeg.header's)."""
    data = with_app1(base("rgb", 24, 40), EXIF + tiff(6))
    head = jpeg.header(data)
    t = decode._torchvision_jpegs([data], 3)[0]
    assert decode._upright_as(t, head).shape == (40, 24, 3)
    with pytest.raises(ValueError, match="libjpeg decoded 24x40, its frame header says 40x24"):
        decode._upright_as(t.transpose(1, 2), head)


def pil_orientation(data):
    """The orientation PIL's ImageOps.exif_transpose turns a JPEG by; None where PIL raises on its EXIF."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            value = Image.open(io.BytesIO(data)).getexif().get(0x0112, 1)
        except Exception:  # noqa: BLE001 (PIL's own failures: no reference to agree with)
            return None
    return {k: k for k in range(2, 9)}.get(value, 1)  # exif_transpose's lookup, whatever the value's type


def entry(tag, typ, count, value, order="<"):
    return struct.pack(order + "HHI", tag, typ, count) + value


def block(entries, order="<", prefix=None, data=b""):
    """A TIFF block: its header, one directory of `entries` at offset 8, then `data` (offset 14 + 12 n)."""
    head = prefix or (b"II*\0" if order == "<" else b"MM\0*")
    return head + struct.pack(order + "I", 8) + struct.pack(order + "H", len(entries)) + b"".join(entries) + \
        b"\0\0\0\0" + data


def _rules():
    """PIL's ways of reading an Orientation, each with what it turns the image by."""
    x6, after = XMP + b'<x tiff:Orientation="6"/>', lambda n: struct.pack("<I", 14 + 12 * n)
    return {
        "SHORT, LONG, SSHORT, SLONG, IFD": [(with_app1(b"", EXIF + block([entry(0x112, t, 1, struct.pack(
            "<" + f + ("x" * (4 - struct.calcsize(f))), 6))])), 6) for t, f in ((3, "H"), (4, "I"), (8, "h"),
                                                                              (9, "i"), (13, "I"))],
        "BYTE, ASCII, UNDEFINED are no number": [(with_app1(b"", EXIF + block([entry(0x112, t, 1, b"\x06\0\0\0")])),
                                                   1) for t in (1, 2, 7)],
        "SBYTE": [(with_app1(b"", EXIF + block([entry(0x112, 6, 1, b"\x06\0\0\0")])), 6)],
        "RATIONAL 12/2, 13/2, 6/0": [(with_app1(b"", EXIF + block([entry(0x112, 5, 1, after(1))],
                                                                   data=struct.pack("<II", *nd))), o)
                                     for nd, o in (((12, 2), 6), ((13, 2), 1), ((6, 0), 1))],
        "FLOAT 6.0, DOUBLE 8.0, FLOAT 6.5": [
            (with_app1(b"", EXIF + block([entry(0x112, 11, 1, struct.pack("<f", 6.0))])), 6),
            (with_app1(b"", EXIF + block([entry(0x112, 12, 1, after(1))], data=struct.pack("<d", 8.0))), 8),
            (with_app1(b"", EXIF + block([entry(0x112, 11, 1, struct.pack("<f", 6.5))])), 1)],
        "count 2: the first value": [(with_app1(b"", EXIF + block([entry(0x112, 3, 2, struct.pack("<HH", 6, 8))])), 6)],
        "count 0, an unknown type: the next entry; a value past the end: the directory's end": [
            (with_app1(b"", EXIF + block([entry(0x112, t, c, v), entry(0x112, 3, 1, b"\x08\0\0\0")])), o)
            for t, c, v, o in ((3, 0, b"\x06\0\0\0", 8), (14, 1, b"\x06\0\0\0", 8), (3, 3, b"\xff\0\0\0", 1))],
        "a directory cut after the entry": [
            (with_app1(b"", EXIF + block([entry(0x112, 3, 1, b"\x03\0\0\0")])[:22]), 3)],
        "swapped magic": [(with_app1(b"", EXIF + block([entry(0x112, 3, 1, b"\0\x07\0\0", ">")], ">",
                                                        b"MM*\0")), 7),
                          (with_app1(b"", EXIF + block([entry(0x112, 3, 1, b"\x07\0\0\0")], "<", b"II\0*")), 7),
                          (with_app1(b"", EXIF + block([entry(0x112, 3, 1, b"\0\x06\0\0", ">")], ">",
                                                        b"MM\0+")), 6)],  # BigTIFF's magic to PIL only as II+\0
        "two Exif prefixes, not three": [(with_app1(b"", EXIF + EXIF + tiff(6)), 6),
                                         (with_app1(b"", EXIF + EXIF + EXIF + tiff(6)), 1)],
        "segments joined": [(with_app1(b"", EXIF + tiff(6)[:10], EXIF + tiff(6)[10:]), 6),
                            (with_app1(b"", EXIF + tiff(1), EXIF + tiff(6)), 1)],
        "XMP without an Orientation entry": [(with_app1(b"", x6), 6),
                                             (with_app1(b"", XMP + b"<tiff:Orientation>8</tiff:Orientation>"), 8),
                                             (with_app1(b"", EXIF, x6), 6),
                                             (with_app1(b"", EXIF + b"II*\0" + struct.pack("<I", 800), x6), 6),
                                             (with_app1(b"", EXIF + block([entry(0x112, 3, 3, b"\xff\0\0\0")]), x6), 6),
                                             (with_app1(b"", x6, XMP + b"<x/>"), 1),  # the last XMP counts
                                             (with_app1(b"", XMP + b'<x tiff:Orientation="9"/>'), 1)],
        "XMP under an Orientation entry, or an EXIF PIL cannot open": [
            (with_app1(b"", EXIF + tiff(1), x6), 1),
            (with_app1(b"", EXIF + block([entry(0x112, 7, 1, b"\x06\0\0\0")]), x6), 1),
            (with_app1(b"", EXIF + b"garbage!", x6), 1), (with_app1(b"", EXIF + b"II*\0", x6), 1),
            (with_app1(b"", EXIF + b"II+\0" + bytes(12), x6), 1)],  # BigTIFF
    }


@pytest.mark.parametrize("rule", list(_rules()))
def test_the_header_reads_the_orientation_by_pils_rules(rule):
    """Each of PIL's ways of reading the Orientation (pipeline/data/decoding/exif.py), in a JPEG
    stored 24 x 40: jpeg.header gives what PIL gives."""
    stored = base("rgb", 24, 40)
    for k, (segments, want) in enumerate(_rules()[rule]):
        data = stored[:2] + segments + stored[2:]  # the APP1 segments after the SOI
        assert (jpeg.header(data).orientation, pil_orientation(data)) == (want, want), (rule, k)


def _random_exif(rng):
    """APP1 segments of a random EXIF (and sometimes XMP), of the shapes the rules above name."""
    order = "<" if rng.random() < 0.5 else ">"
    entries, data = [], b""
    n = int(rng.integers(0, 4))
    for k in range(n):
        tag = int(rng.choice([0x112, 0x112, 0x11A, 0x128, 0x8769]))
        typ = int(rng.choice([1, 2, 3, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 16, 0]))
        count = int(rng.choice([0, 1, 1, 1, 2, 3, 70000]))
        value = int(rng.integers(0, 10))
        fmt = {3: "H", 4: "I", 6: "b", 8: "h", 9: "i", 11: "f", 12: "d", 13: "I", 16: "Q", 5: "II", 10: "ii"}
        fmt = fmt.get(typ, "B")
        packed = struct.pack(order + fmt, *([value, int(rng.choice([1, 2, 0]))] if typ in (5, 10) else
                                            [float(value) if typ in (11, 12) else value]))
        if len(packed) * max(count, 1) > 4 or rng.random() < 0.1:
            where = 14 + 12 * n + len(data) + int(rng.choice([0, 0, 0, 3, 900]))
            data += packed * min(count, 3)
            field = struct.pack(order + "I", where)
        else:
            field = (packed * 4)[:4]
        entries.append(entry(tag, typ, count, field, order))
    prefix = rng.choice([None, None, None, b"MM*\0", b"II\0*", b"II+\0", b"MM\0+", b"XX*\0"])
    tiff_block = block(entries, order, prefix, data)
    if rng.random() < 0.2:
        tiff_block = tiff_block[:int(rng.integers(0, len(tiff_block) + 1))]
    payload = EXIF * int(rng.choice([1, 1, 1, 2, 3])) + tiff_block
    cuts = sorted(int(c) for c in rng.integers(6, len(payload) + 1, int(rng.integers(0, 3))))
    parts = [payload[a:b] for a, b in zip([0, *cuts], [*cuts, len(payload)])]
    segments = [parts[0]] + [EXIF + p for p in parts[1:]] if rng.random() < 0.9 else []
    if rng.random() < 0.3:
        xmp = XMP + (b'<x tiff:Orientation="%d"/>' if rng.random() < 0.5 else
                     b"<tiff:Orientation>%d</tiff:Orientation>") % int(rng.integers(0, 10))
        segments.insert(int(rng.integers(0, len(segments) + 1)), xmp)
    if rng.random() < 0.1:
        segments.insert(0, b"Exif\0\xff" + tiff(6))
    return segments


def test_the_header_agrees_with_pil_on_random_exif_blocks():
    """Two thousand random EXIF blocks (types, counts, values in and out of line, cut blocks,
    joined segments, XMP): jpeg.header's orientation is PIL's wherever PIL reads one."""
    rng, stored = np.random.default_rng(0), base("rgb", 24, 40)
    checked, turned = 0, 0
    for k in range(2000):
        data = with_app1(stored, *_random_exif(rng))
        want = pil_orientation(data)
        if want is None:
            continue
        assert jpeg.header(data).orientation == want, k
        checked, turned = checked + 1, turned + (want != 1)
    print(f"{checked} of 2000 read by PIL, {turned} turned")
    assert checked > 1800 and turned > 200, (checked, turned)  # most read, many of them turned
