"""JPEG headers the way libjpeg reads them: the frame's size, its components and the EXIF
orientation, before anything is decoded.

A header read apart from the decoder can disagree with it: libjpeg (inside both
torchvision and PIL) steps over stray bytes before a marker, so a frame header that
a lenient reader finds among such bytes says 32x32 while the frame libjpeg decodes
is 20000x20000. This reader accepts only what leaves libjpeg no other reading: SOI,
then marker segments back to back (0xFF fill bytes allowed) up to the first scan,
with exactly one frame header. libjpeg refuses a second frame header after that
itself. Anything else is refused with one line, so the size checked is the size
decoded. A progressive file may hold at most MAX_SCANS scans: libjpeg passes over
every block once a scan.
"""
from dataclasses import dataclass

from pipeline.data.decoding import exif

MAX_COMPONENTS = 4  # grey, YCbCr, CMYK/YCCK; libjpeg takes up to 10, each a full-size plane
MAX_SCANS = 100  # progressive files have about 10; libjpeg passes over every block once a scan
SCAN_BYTES = 10  # the fewest bytes a scan takes: marker, length, one component (2), Ss, Se, Ah/Al
_FRAMES = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}  # SOF0-15 but DHT, JPG, DAC
_STANDALONE = frozenset([0x01, *range(0xD0, 0xD8)])  # TEM, RST0-7: no length field
_SOI, _EOI, _SOS, _APP1 = 0xD8, 0xD9, 0xDA, 0xE1


@dataclass(frozen=True)
class Header:
    """height, width: the frame as stored; orientation: EXIF 1-8 (1 when absent), as PIL reads it
    (`pipeline.data.decoding.exif`): every decoder turns the image by this one reading."""

    height: int
    width: int
    components: int
    orientation: int = 1

    @property
    def upright(self):
        """(height, width) once the EXIF orientation is applied (5-8 turn the image a quarter)."""
        return (self.width, self.height) if self.orientation >= 5 else (self.height, self.width)


KNOWN = 8  # headers remembered by the bytes that led to them: a set's JPEGs share a few such prefixes
_known = []  # (the bytes up to the end of the first scan's header, where its scan count starts, Header)


def header(data):
    """The Header of JPEG bytes; ValueError saying why there is none libjpeg would agree on.

    JPEGs written by one encoder at one size share every byte up to their first scan (tables,
    frame header, EXIF), so a header is remembered by those bytes: bytes that start with them
    read the same Header by the same steps, and only their scans are counted. The walk costs
    more than a small JPEG's decode takes beside it. Scans are counted only where the bytes
    after the first could hold MAX_SCANS more (SCAN_BYTES each): a small JPEG cannot, and
    the count was over half the cost of its header."""
    if type(data) is bytes:
        for prefix, at, head in _known:
            if data.startswith(prefix):
                if len(data) - at >= SCAN_BYTES * MAX_SCANS and data.count(b"\xff\xda", at) >= MAX_SCANS:
                    _check_scans(data, at)  # scans past the first
                return head
    head, prefix, at = _walk(data)
    if type(data) is bytes:
        _known[:] = [(prefix, at, head)] + _known[:KNOWN - 1]
    return head


def known_again(head):
    """(the bytes a remembered Header was read from, the length below which bytes that start
    with them need no scan count), or None if `head` is not remembered: what a batch's loop
    checks inline, without a call a JPEG (decode._turbo_batch), to reuse the header `header` gives."""
    for prefix, at, h in _known:
        if h is head:
            return prefix, at + SCAN_BYTES * MAX_SCANS
    return None


def _check_scans(data, at):
    scans = 1 + data.count(b"\xff\xda", at)  # entropy-coded data stuffs 0xFF with 0x00: these are markers
    if scans > MAX_SCANS:
        raise ValueError(f"JPEG with {scans} scans (at most {MAX_SCANS}, pipeline.data.decoding.jpeg.MAX_SCANS)")


def _walk(data):
    """(Header, the bytes it was read from, where the scans are counted from): the header's
    segments walked one by one."""
    if data[:2] != b"\xff\xd8":
        raise ValueError("not a JPEG (no SOI marker)")
    i, n, frame, joined, xmp = 2, len(data), None, [], None  # joined: the Exif segments, joined once at the end
    while True:
        if i >= n:
            raise ValueError("JPEG ends before its first scan")
        if data[i] != 0xFF:
            raise ValueError(f"JPEG with stray bytes before a marker at byte {i}: libjpeg would skip them, "
                             f"so its frame size is not the header's")
        while i < n and data[i] == 0xFF:
            i += 1
        if i >= n:
            raise ValueError("JPEG ends before its first scan")
        marker = data[i]
        i += 1
        if marker in _STANDALONE:
            continue
        if marker in (0x00, _SOI, _EOI):
            raise ValueError(f"JPEG with marker 0x{marker:02X} before its first scan")
        length = int.from_bytes(data[i:i + 2], "big")
        if i + 2 > n or length < 2 or i + length > n:
            raise ValueError(f"JPEG segment 0x{marker:02X} at byte {i} cut short")
        segment = data[i + 2:i + length]
        if marker in _FRAMES:
            if frame is not None:
                raise ValueError("JPEG with two frame headers")
            frame = _frame(segment)
        elif marker == _APP1 and segment[:6] == b"Exif\0\0":
            joined.append(segment[6:] if joined else segment)  # as PIL joins them (pipeline.data.decoding.exif)
        elif marker == _APP1 and segment[:len(exif.XMP)] == exif.XMP:
            xmp = bytes(segment[len(exif.XMP):])  # PIL reads the last one
        elif marker == _SOS:
            if frame is None:
                raise ValueError("JPEG scan before its frame header")
            _check_scans(data, i)
            turned = exif.orientation(b"".join(joined), xmp) if joined or xmp else 1
            return Header(*frame, turned), bytes(data[:i + length]), i
        i += length


def _frame(segment):
    if len(segment) < 6:
        raise ValueError("JPEG frame header cut short")
    height, width, components = int.from_bytes(segment[1:3], "big"), int.from_bytes(segment[3:5], "big"), segment[5]
    if len(segment) != 6 + 3 * components:
        raise ValueError("JPEG frame header of the wrong length")
    if not 1 <= components <= MAX_COMPONENTS:
        raise ValueError(f"JPEG with {components} components (at most {MAX_COMPONENTS})")
    if height < 1 or width < 1:
        raise ValueError(f"JPEG frame of {width}x{height}")
    return height, width, components

