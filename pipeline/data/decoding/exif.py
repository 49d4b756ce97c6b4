"""A JPEG's EXIF orientation read the way PIL reads it (`Image.getexif` then
`ImageOps.exif_transpose`, the reference docs/data.md names), so that every decoder turns an
image alike: `pipeline.data.decoding.jpeg.header` reads it once, and simplejpeg, torchvision
(told not to read the EXIF itself) and PIL all turn by that reading.

PIL's rules (Pillow 13.0), each one a case in tests/test_jpeg_orientation.py: the Exif APP1
segments (those starting `Exif\\0\\0`) are joined, the first whole and each later one past its
six bytes, and up to two leading `Exif\\0\\0` are dropped; the rest is a TIFF block (`II*\\0`,
`MM\\0*`, or either with the magic bytes swapped). In its first directory the first Orientation
entry PIL keeps counts: an entry of a type PIL has no reader for or of count 0 is passed by, and
one whose value lies past the block ends the directory. Its first value turns the image when it
equals 2-8, whatever the number's type (SHORT, LONG, signed, RATIONAL 12/2, FLOAT 6.0); bytes,
text or anything else leave it as stored. Without an Orientation entry, `tiff:Orientation` in the
last XMP packet counts. A block PIL cannot open (no TIFF header) leaves the image as stored and
the XMP unread (where the JPEG's JFIF segment gives a resolution, PIL's exif_transpose raises on it).
"""
import re
import struct
from fractions import Fraction

_ORIENTATION = 0x0112
# PIL's PREFIXES but II+\0, the one PIL takes for BigTIFF (it asks byte 2 for 43: MM\0+ reads as MM\0*)
_ORDER = {b"II*\0": "<", b"MM\0*": ">", b"MM*\0": ">", b"II\0*": "<", b"MM\0+": ">"}
_UNIT = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 1, 7: 1, 8: 2, 9: 4, 10: 8, 11: 4, 12: 8, 13: 4, 16: 8}  # PIL's readers
_NUMBER = {3: "H", 4: "L", 6: "b", 8: "h", 9: "l", 11: "f", 12: "d", 13: "L", 16: "Q", 5: "LL", 10: "ll"}
XMP = b"http://ns.adobe.com/xap/1.0/\0"  # the XMP APP1 segment's name
_XMP_ORIENTATION = re.compile(rb'tiff:Orientation(="|>)([0-9])')


def orientation(exif, xmp):
    """EXIF orientation 1-8 of a JPEG, as PIL turns it. exif: its Exif APP1 segments joined as
    PIL joins them (b"" for none); xmp: the packet of its last XMP APP1 segment, or None."""
    if not exif and not xmp:
        return 1  # most JPEGs: nothing to read
    found, value = _ifd0_orientation(exif) if exif else (False, None)
    if not found and xmp:
        match = _XMP_ORIENTATION.search(xmp)
        value = int(match[2]) if match else None
    if isinstance(value, (int, float, Fraction)):  # exif_transpose looks it up among 2-8: 6.0 is 6
        for k in range(2, 9):
            if value == k:
                return k
    return 1


def _ifd0_orientation(exif):
    """(whether IFD0 holds an Orientation entry PIL keeps, its first value)."""
    tiff = exif[6:] if exif.startswith(b"Exif\0\0") else exif
    if tiff.startswith(b"Exif\0\0"):
        tiff = tiff[6:]
    if not tiff:
        return False, None
    order = _ORDER.get(bytes(tiff[:4]))
    if order is None or len(tiff) < 8:
        return True, None  # PIL fails to open it, and then looks no further (not in the XMP either)
    at, n = int.from_bytes(tiff[4:8], _big(order)), len(tiff)
    count = int.from_bytes(tiff[at:at + 2], _big(order)) if at + 2 <= n else 0
    stored, out_of_line = set(), 0
    for k in range(count):
        entry = tiff[at + 2 + 12 * k:at + 14 + 12 * k]
        if len(entry) < 12:
            break  # PIL keeps the entries read before the directory ended
        tag, typ, number = struct.unpack(order + "HHL", entry[:8])
        if tag in stored or typ not in _UNIT:
            continue
        size = number * _UNIT[typ]
        if size > 4:
            out_of_line += size
            if out_of_line > n:
                continue
            start = int.from_bytes(entry[8:12], _big(order))
            data = tiff[start:start + size]
            if len(data) != size:
                break  # PIL's read fails there, and it keeps only the entries before
        else:
            data = entry[8:8 + size]
        if not data:
            continue
        stored.add(tag)
        if tag == _ORIENTATION:
            return True, _first(data, typ, order)
    return False, None


def _first(data, typ, order):
    """The first value of an entry's data as PIL makes it: a number, or None for bytes and text."""
    fmt = _NUMBER.get(typ)
    if fmt is None:
        return None  # BYTE, ASCII, UNDEFINED: bytes or text to PIL, never a turn
    values = struct.unpack_from(order + fmt, data)
    if typ in (5, 10):  # a RATIONAL: PIL's IFDRational, NaN when its denominator is 0
        return Fraction(*values) if values[1] else None
    return values[0]


def _big(order):
    return "big" if order == ">" else "little"
