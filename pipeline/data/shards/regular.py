"""Shards whose every sample is the same members of the same sizes (what make_shards writes) read
as arrays: every header found and checked at once with numpy, no member parsed one by one."""
import numpy as np

from pipeline.errors import ShardError
from pipeline.data.shards.read import GZIP_MAGIC, MAX_MEMBER, _PAX, _REGULAR, _pax_records, key_texts


def regular(buf, image_ext="raw", label_ext="cls"):
    """A whole tar in memory whose samples are all [image member][label member], read at
    once with numpy (see `regular_members`): (keys, images, labels int64), images an
    (n, size) uint8 array for raw members of one size, evenly spaced (a read-only view into
    `buf`: its one copy is the caller's), else a list of bytes. None for any other layout,
    which `iter_samples` then reads."""
    found = regular_members(buf, image_ext, label_ext)
    if found is None:
        return None
    keys, labels, starts, image_sizes = found
    period = int(starts[1] - starts[0]) if len(starts) > 1 else 0
    if image_ext == "raw" and (image_sizes == image_sizes[0]).all() and (np.diff(starts) == period).all():
        size = int(image_sizes[0])  # evenly spaced (a PAX header may take more blocks): one strided view
        images = np.ndarray((len(starts), size), np.uint8, buf, int(starts[0]), (period, 1))
        return keys, images, labels
    return keys, [buf[a:a + z] for a, z in zip(starts.tolist(), image_sizes.tolist())], labels


def regular_members(buf, image_ext="raw", label_ext="cls"):
    """(keys, labels int64, image offsets in `buf`, image sizes) of a whole tar in memory
    (bytes, or a memoryview of them) whose samples are all [image member][label member of
    at most 18 digits], or the label first as wds.TarWriter sorts them, either with a PAX
    header before each member that sets neither path nor size (as wds.TarWriter writes
    them); None for any other layout, which `iter_samples` then reads.

    The members' headers are found in one of two ways and then checked alike (type, size
    digits, name: the same key in both members, the expected extensions, a new key each
    sample), so a shard reads exactly as `iter_samples` would read it or is left to it:
    `_periodic`, where every sample spans the same blocks (raw images of one size, as
    make_shards writes them), reads only the headers where the chain of sizes from the
    first two says they are; `_chain` finds them by where the USTAR magic stands, then
    proves them to be the tar's own chain, so magic inside a member's data sends the
    shard to `iter_samples` rather than misreading it. The numpy path cost 1.5-3.1 us a
    sample against 5.3-9.3 us through the sequential loop (docs/benchmarks.md, "Tar format").
    """
    n = len(buf) // 512
    if n < 4 or buf[257:262] != b"ustar" or buf[:2] == GZIP_MAGIC or image_ext == label_ext:
        return None
    flat = np.frombuffer(buf, np.uint8, n * 512)
    found = _periodic(buf, flat, n) or _chain(buf, flat, n)
    if found is None:
        return None
    (h1, starts1, sizes1), (h2, starts2, sizes2) = found
    first = bytes(h1[0, :100]).split(b"\0", 1)[0]
    label_first = first[first.rfind(b".") + 1:] == label_ext.encode()  # wds.TarWriter: .cls first
    head, starts, image_sizes = (h2, starts2, sizes2) if label_first else (h1, starts1, sizes1)
    tail, label_starts, label_sizes = (h1, starts1, sizes1) if label_first else (h2, starts2, sizes2)
    keys = _checked_keys(head, tail, image_ext, label_ext)
    if keys is None or label_sizes.min() < 1 or label_sizes.max() > 18 or image_sizes.max() > MAX_MEMBER:
        return None  # 19 digits could pass int64; a member over MAX_MEMBER the sequential reader refuses
    labels = _labels(flat, label_starts, label_sizes)
    if labels is None:
        return None
    return keys, labels, starts, image_sizes


def _periodic(buf, flat, n):
    """The two members' (headers, data offsets, sizes) of a tar whose samples all span the
    blocks its first sample spans, read at the headers the first sample's sizes predict;
    None for any other layout. Every header found is checked to be there (the USTAR magic),
    to be a regular file and to have the size (in blocks) that leads to the next predicted
    one, and the block after the last sample must be the end-of-archive block: that is the
    chain `iter_samples` walks, so it reads the same members."""
    a = _blocks(buf, 0)
    if a is None or a >= n:
        return None
    b = _blocks(buf, a)
    if b is None:
        return None
    period = a + b  # blocks a sample spans, its two headers included
    m = (n - 1) // period  # samples that fit before at least one more block
    if m < 1:
        return None
    heads = [np.ndarray((m, 512), np.uint8, buf, first * 512, (period * 512, 1)) for first in (0, a)]
    magic = np.ndarray((m, 2), "<u8", buf, 257, (period * 512, a * 512))  # each sample's two headers' bytes 257-264
    complete = ((magic & 0xFF_FFFF_FFFF) == _USTAR).all(axis=1)
    count = m if complete.all() else int(complete.argmin())  # samples before the first that is not one
    if count < 1 or flat[count * period * 512:(count * period + 1) * 512].any():
        return None
    out = []
    for first, blocks, head in zip((0, a), (a, b), heads):
        head = head[:count]
        # the first header is checked (_blocks); the others are asked to agree with it where
        # they may differ without changing what is read: type and format (bytes 156 and
        # 262-264, 261 being the magic's "r" in all), and size (124-134), each run of bytes
        # read as one integer a header (a take of those 15 columns and its compare cost 2x)
        if not (_agree(head, 156, 1) and _agree(head, 261, 4)) or bytes(head[0, 262:265]) == b"\x0000" \
                and head[:, 345].any():
            return None  # another type of member, another tar format, or a POSIX name prefix
        if _agree(head, 124, 8) and _agree(head, 127, 8):  # one size throughout, as raw images have
            sizes = np.full(count, int(bytes(head[0, 124:135]), 8), np.int64)
        else:
            sizes = _sizes(head[:, 124:135])
            if sizes is None or ((sizes + 511) // 512 != blocks - 1).any():
                return None
        out.append((head, np.arange((first + 1) * 512, (count * period + first + 1) * 512, period * 512), sizes))
    return out


def _agree(headers, at, width):
    """Whether every header has the first's `width` (1, 4 or 8) bytes from byte `at`."""
    words = headers[:, at:at + width].view(_WORDS[width])
    return not (words != words[0]).any()


_WORDS = {1: np.uint8, 4: "<u4", 8: "<u8"}


def _blocks(buf, block):
    """Blocks of the member whose header is at `block`, its header included (None: no USTAR
    header of a regular file with 11 octal size digits there)."""
    at = block * 512
    header = buf[at:at + 512]
    if len(header) < 512 or header[257:262] != b"ustar" or header[156] not in _REGULAR:
        return None
    digits = bytes(header[124:135])
    if digits.translate(None, b"01234567"):  # a byte that is not an octal digit (one C call, not a loop)
        return None
    return 1 + (int(digits, 8) + 511) // 512


def _chain(buf, flat, n):
    """The two members' (headers, data offsets, sizes) found by where the USTAR magic
    stands, proved to be the tar's own chain (each header's size leads exactly to the
    next, the last to the end-of-archive block); wds.TarWriter's PAX headers are stepped
    over. None for any other layout. Finding the magic with one strided 8-byte read per
    block (not a 5-column compare over every block) took a 500-sample shard from 660 to
    350 us (2026-12-02)."""
    blocks = flat.reshape(n, 512)
    magic = np.ndarray((n,), "<u8", buf, 257, (512,))  # bytes 257-264 of each block: one strided read, not 5 columns
    at = np.flatnonzero((magic & 0xFF_FFFF_FFFF) == _USTAR)
    if len(at) < 2:
        return None
    # only the size fields and types of all, whole headers of the members only (PAX headers,
    # half of wds.TarWriter's, are not copied: their gather cost a third of this path)
    sizes = _sizes(np.ndarray((n, 11), np.uint8, buf, 124, (512, 1))[at])
    if sizes is None:
        return None
    after = at + 1 + (sizes + 511) // 512
    if at[0] or (after[:-1] != at[1:]).any() or after[-1] >= n or blocks[after[-1]].any():
        return None
    kinds = blocks[at, 156]
    if kinds[0] == _PAX:  # wds.TarWriter's layout: a PAX header before every member
        found = _past_pax(buf, at, kinds, sizes)
        if found is None:
            return None
        at, sizes = found
    headers = np.take(blocks, at, axis=0)
    if len(at) % 2 or not _regular_kinds(headers) or _posix_prefix(headers):
        return None
    starts = (at + 1) * 512
    return (headers[0::2], starts[0::2], sizes[0::2]), (headers[1::2], starts[1::2], sizes[1::2])


def _sizes(fields):
    """The sizes of (n, 11) size fields (bytes 124-134 of headers), when each is 11 octal digits
    (what tarfile and GNU tar write); None otherwise."""
    digits = fields - np.uint8(48)  # uint8: a byte below "0" wraps past 7
    if not (digits <= 7).all():
        return None
    return digits.astype(np.int64) @ _OCTAL


def _regular_kinds(headers):
    kinds = headers[:, 156]
    return bool(((kinds == 48) | (kinds == 0) | (kinds == 55)).all())  # _REGULAR


def _checked_keys(head, tail, image_ext, label_ext):
    """The keys (str, `read.key_text` of each name, as iter_samples makes them) of samples
    whose image headers are `head` and label headers `tail`, if every name reads as iter_samples
    would group it: KEY.image_ext then KEY.label_ext, no dot, NUL or leading "__" in a key, a
    new key each sample; else None. Keys may differ in length (`cat/0655`, `truck/3050`, as
    tools/write_wds.py writes them: `_keys_of_lengths`); where they all have the first's
    (make_shards' keys: `_keys_of_one_length`) the checks take slices of that length rather
    than masks: a third of the time. (The finders refuse POSIX name prefixes.)"""
    if head[:, 99].any() or tail[:, 99].any():  # a name of 100 bytes: iter_samples reads it another way
        return None
    image, label = b"." + image_ext.encode() + b"\0", b"." + label_ext.encode() + b"\0"
    first = int((head[0, :100] == 0).argmax())  # the first name's length
    k = first - len(image) + 1  # the first key's length
    if k < 1:
        return None
    if (head[:, :2].view("<u2") == _UNDERSCORES).any():  # webdataset skips top-level __*__ names
        return None
    keys = _keys_of_one_length(head, tail, k, image, label)
    return _keys_of_lengths(head, tail, image, label) if keys is None else keys


def _keys_of_one_length(head, tail, k, image, label):
    """`_checked_keys` where every key has the first's length `k`; None where one has not
    (or a check fails: `_keys_of_lengths` then decides). Each extension and its NUL is read
    as one integer a header (one compare where a (n, 5) slice against its bytes cost 8 us),
    and the keys, a NUL after each, are decoded in one piece (half the time of joining them)."""
    if not (_ends_with(head, k, image) and _ends_with(tail, k, label)):
        return None
    keys = np.zeros((len(head), k + 1), np.uint8)  # each key, then a NUL
    keys[:, :k] = head[:, :k]
    texts = keys.view(f"S{k + 1}").ravel()
    if not (keys[:, :k].all() and not (keys == 46).any()  # no NUL, no dot in a key
            and (keys[:, k - 1] != 47).all()  # a key ends before its dot, not in a slash
            and (keys[:, :k] == tail[:, :k]).all()  # the label's key is the image's
            and (texts[1:] != texts[:-1]).all()):  # a new key each sample
        return None
    return key_texts(keys.tobytes())[:-1]


def _ends_with(headers, k, suffix):
    """Whether every header's name has the bytes `suffix` (its extension and the NUL) from
    column `k`: read as one little-endian integer a header where they fit in 8 bytes."""
    if len(suffix) > 8:
        return bool((headers[:, k:k + len(suffix)] == np.frombuffer(suffix, np.uint8)).all())
    mask = (1 << 8 * len(suffix)) - 1
    return bool(((headers[:, k:k + 8].view("<u8") & mask) == int.from_bytes(suffix, "little")).all())


def _keys_of_lengths(head, tail, image, label):
    """`_checked_keys` for keys of any lengths: each name's extension and the label name's
    NUL gathered at its key's end; masks, not np.where (two np.where over the names cost
    more than all the other checks)."""
    image, label = np.frombuffer(image[:-1], np.uint8), np.frombuffer(label, np.uint8)
    ends = (head[:, :100] == 0).argmax(axis=1)  # each name's length: its first NUL
    width = int(ends.max()) + 1  # the columns any name reaches: the checks below look at no others
    more = max(len(label) - 1 - len(image), 0)  # a label's name reaches further when its extension is longer
    names, tails = np.ascontiguousarray(head[:, :width]), np.ascontiguousarray(tail[:, :width + more])
    key_len = ends - len(image)
    if key_len.min() < 1:
        return None
    at = key_len[:, None]
    rows = np.arange(len(names))[:, None]
    inside = np.arange(width, dtype=np.int16) < at.astype(np.int16)  # int16: half the work of int64
    if not ((names[rows, at + np.arange(len(image))] == image).all()
            and (tails[rows, at + np.arange(len(label))] == label).all()
            and not ((names != tails[:, :width]) & inside).any()):
        return None
    keys = names * inside  # each key, NULs after it
    texts = keys.view(f"S{keys.shape[1]}").ravel()  # a key holds no NUL, so the S type drops only the padding
    if ((keys == 46).any() or not (names[np.arange(len(names)), key_len - 1] != 47).all()
            or not (texts[1:] != texts[:-1]).all()):  # a dot in a key, a key ending in a slash, a key twice
        return None
    return key_texts(b"\0".join(texts.tolist()))


_UNDERSCORES = int.from_bytes(b"__", "little")


def _labels(flat, starts, sizes):
    """The integer labels of decimal members of 1-18 digits at `starts` (None if any is not digits)."""
    width = int(sizes.max())
    if width == 1:  # one digit each (ten classes or fewer): no mask, no Horner steps
        digits = flat[starts] - np.uint8(48)  # uint8: a byte below "0" wraps past 9
        return None if (digits > 9).any() else digits.astype(np.int64)
    rows = np.ndarray((len(flat) - width + 1, width), np.uint8, flat, 0, (1, 1))  # row o: the bytes from offset o
    digits = rows[starts] - np.uint8(48)  # uint8: a byte below "0" wraps past 9
    inside = np.arange(width) < sizes[:, None]
    if ((digits > 9) & inside).any():
        return None
    labels = digits[:, 0].astype(np.int64)
    for j in range(1, width):  # Horner's rule over the digits each label has
        labels = np.where(j < sizes, labels * 10 + digits[:, j], labels)
    return labels


def _past_pax(buf, at, kinds, sizes):
    """(at, sizes) of the members of a tar with a PAX header before each, as
    wds.TarWriter writes them (for its float mtimes), if those headers change nothing that
    `iter_samples` takes from them (path, size, sparse); else None. Each is parsed as
    iter_samples parses it, so one it would refuse leaves the shard to it."""
    if len(at) % 2 or not (kinds[0::2] == _PAX).all() or (kinds[1::2] == _PAX).any():
        return None
    starts, lengths = (at[0::2] + 1) * 512, sizes[0::2]
    other = np.flatnonzero(~_mtime_only(np.frombuffer(buf, np.uint8, len(buf)), starts, lengths))
    for a, size in zip(starts[other].tolist(), lengths[other].tolist()):
        if size > 1 << 20:
            return None
        try:
            if _pax_records(bytes(buf[a:a + size])):
                return None
        except ShardError:
            return None
    return at[1::2], sizes[1::2]


def _mtime_only(flat, starts, sizes):
    """Which PAX bodies at `starts` hold one well-formed record and it is an mtime (as
    wds.TarWriter writes them: "27 mtime=1796506195.041254\n"), checked for all at once: a
    body of 10-64 bytes whose record says its own length in two digits, then " mtime=".
    `_pax_records` reads {} from each (it reads no more of an mtime record), so only the
    others are parsed one by one. (One gather for all, where one a body length cost 5 times as much.)"""
    ok = (sizes >= 10) & (sizes <= 64)
    pick = np.flatnonzero(ok)
    rows = np.ndarray((len(flat) - 8, 9), np.uint8, flat, 0, (1, 1))[starts[pick]]  # row o: 9 bytes from offset o
    tens, ones = rows[:, 0] - np.uint8(48), rows[:, 1] - np.uint8(48)  # uint8: a byte below "0" wraps past 9
    ok[pick] = ((tens <= 9) & (ones <= 9) & (tens * 10 + ones.astype(np.int64) == sizes[pick])
                & (rows[:, 2:] == _MTIME).all(axis=1))
    return ok


_MTIME = np.frombuffer(b" mtime=", np.uint8)
_USTAR = int.from_bytes(b"ustar", "little")
_OCTAL = 8 ** np.arange(10, -1, -1)


def _posix_prefix(headers):
    """True if any POSIX header uses its name-prefix field (the name is then longer)."""
    posix = (headers[:, 262] == 0) & (headers[:, 263] == 48) & (headers[:, 264] == 48)
    return bool((posix & (headers[:, 345] != 0)).any())
