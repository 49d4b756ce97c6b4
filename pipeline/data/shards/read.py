"""Reading tar shards the way webdataset groups them, without Python's tarfile.

Handles what webdataset users' shards hold: plain USTAR (this project's
writer, GNU tar), GNU long names (`././@LongLink` members), PAX extended
headers with `path` and `size` overrides (a header per member, as
`wds.TarWriter` writes them) and gzip-compressed tars (`.tar.gz`).

Members group into samples by webdataset's rule: the key is the member path up
to the first dot of its base name, directories included (`train/cat/0001.jpg`
-> key `train/cat/0001`, extension `jpg`), and consecutive members with the same
key form one sample (names that are not UTF-8 get keys by `key_text`). Extensions are lowercased, as webdataset does; members
with no extension are skipped, and so are `__*__` names at the top level and
everything in a top-level `__*__/` folder (webdataset 1.0.2's skip_meta), while
`__meta__.json` is a member of the sample `__meta__` there and here (see
`is_meta`). A tar that ends without its end-of-archive blocks yields every whole
member, as tarfile does; a member cut short (its padding included, as there) is
damage. GNU sparse members are refused by name (their data is a map of holes, not
the file).

Only members whose extension is wanted are copied out; the others are stepped
over, so an unused 60 MB member costs no memory. A wanted member may hold at most
MAX_MEMBER bytes, and a gzip stream may inflate to at most INFLATE_RATIO times the
compressed bytes it has consumed (plus INFLATE_SLACK): a 4 MB .tar.gz of zeros
would otherwise hand gigabytes of wanted members to the reader. webdataset's tarfile-based
reader took 90-300 us a sample here, this loop 5-10 us, and `regular`'s numpy path for
shards of [image][label] samples 1.5-3.1 us (docs/benchmarks.md, "Tar format"; tools/bench_loader.py
--tar-format).
"""
import re
import zlib


from pipeline.errors import ShardError

MAX_MEMBER = 64 << 20  # a wanted member claiming more is corrupt or hostile, not an image or a label
INFLATE_RATIO = 32  # real shards inflate 1-3x (JPEG, PNG) to about 12x (raw MNIST); a gzip bomb, 1000x
INFLATE_SLACK = 4 << 20  # what a small shard may inflate to whatever its ratio (tar padding compresses 100x)
CHUNK = 4 << 20
ZERO_BLOCK = bytes(512)
GZIP_MAGIC = b"\x1f\x8b"
_REGULAR = (48, 0, 55)  # b"0", NUL (old tars), b"7" (contiguous file)
_LONGNAME, _PAX, _GLOBAL_PAX, _SPARSE = 76, 120, 103, 83  # b"L", b"x", b"g", b"S"
_BASE_PLUS_EXT = re.compile(rb"^((?:.*/|)[^.]+)[.]([^/]*)$")  # webdataset's base_plus_ext, for the odd names


def key_text(name):
    """A sample's key (str) from its name's bytes (the member path up to the extension's dot).
    A name in UTF-8 without a backslash is its key as webdataset reads it; in any other name
    a byte that is not UTF-8 is written `\\xNN` and a backslash `\\\\`. Distinct names so get
    distinct keys (U+FFFD for every such byte made two names one key), and every key stays
    printable text for the key logs and JSON. The one rule of every reader (`key_texts`,
    regular.py) and so of the index."""
    try:
        text = name.decode("utf-8")
    except UnicodeDecodeError:
        return name.replace(b"\\", b"\\\\").decode("utf-8", "backslashreplace")
    return text if "\\" not in text else text.replace("\\", "\\\\")


def key_texts(joined):
    """`key_text` of every name in `joined`, names separated by NUL (one decode for all where
    they are all UTF-8 without a backslash, as nearly always)."""
    try:
        text = joined.decode("utf-8")
        if "\\" not in text:
            return text.split("\0")
    except UnicodeDecodeError:
        pass
    return [key_text(n) for n in joined.split(b"\0")]


def is_meta(key):
    """A top-level `__NAME__` key: webdataset yields `__meta__.json` as a sample of that key;
    it holds facts about the shard, not a training sample, so indexing and training pass it by."""
    return "/" not in key and len(key) >= 4 and key.startswith("__") and key.endswith("__")


def _skipped_name(name):
    """webdataset 1.0.2 skips a top-level `__*__` name and anything under a top-level `__*__/`
    folder (tar_file_iterator's meta rule and skip_meta=r"__[^/]*__($|/)")."""
    first = name.split(b"/", 1)[0]
    return len(first) >= 4 and first[:2] == b"__" and first[-2:] == b"__"


def iter_samples(stream, want=None, url=None, *, max_member=MAX_MEMBER, chunk=CHUNK, oversized=None):
    """Yield sample dicts {"__key__", "__url__", ext: bytes, ...} from a tar stream.

    `want`: the set of (lowercase) extensions to keep, or None for all; a sample is
    yielded even when none of its members is wanted, so counts stay true. `oversized`:
    a wanted member over `max_member` is stepped over unread and its sample gets
    oversized(size) in its place (a schema then skips that one sample), instead of the
    ShardError that ends the shard. Raises
    ShardError at the first damage (a bad header, a member or header cut short, an empty
    stream, a repeated member within a sample, a GNU sparse member), after yielding the
    sample it was assembling when all its members read so far are whole. A stream that ends
    after a whole member without the end-of-archive blocks ends the samples, as in tarfile.
    """
    sample, current = None, None
    try:
        for key, ext, data in _members(stream, want, max_member, chunk, oversized):
            if key != current:
                if sample is not None:
                    yield sample
                current = key
                sample = {"__key__": key_text(key), "__url__": url}
            elif ext in sample:
                name, sample = f"{sample['__key__']}.{ext}", None  # the damaged sample is not yielded
                raise ShardError(f"member {name} appears twice in one sample")
            sample[ext] = data
    except ShardError:
        if sample is not None:  # its members are whole (the damage comes after them): the schema decides
            yield sample  # whether they are enough, as webdataset's warn_and_continue reads it
        raise
    if sample is not None:
        yield sample


def _members(stream, want, max_member, chunk, oversized=None):
    """(key bytes, ext, data) for each regular file member, data None where `want` says
    so; see iter_samples. The common case (a USTAR header for a regular file) runs inline."""
    buf = _read(stream, chunk)
    if buf[:2] == GZIP_MAGIC:
        stream = _Gunzip(_Prefixed(buf, stream))
        buf = _read(stream, chunk)
    exts = {}  # extension bytes -> (lowercase str, wanted)
    pos, long_name, pax, seen = 0, None, None, False
    while True:
        if len(buf) - pos < 512:
            buf, pos = buf[pos:] + _read(stream, chunk), 0
            if len(buf) < 512:  # between members, without end blocks: the end, as tarfile (and webdataset) read it
                if not seen:
                    raise ShardError("truncated tar header" if buf else "empty file, not a tar")
                if buf.strip(b"\0"):  # part of a header: the member it starts is cut short
                    raise ShardError("truncated tar header")
                if long_name is not None or pax is not None:
                    raise ShardError("tar ends after an extended header, before its member")
                return
        seen = True
        if buf[pos + 257:pos + 262] != b"ustar":
            if buf[pos:pos + 512] == ZERO_BLOCK:
                return
            _check_old_header(buf, pos)
        kind = buf[pos + 156]
        try:
            size = int(buf[pos + 124:pos + 135], 8)  # what tarfile and GNU tar write: 11 octal digits
        except ValueError:
            size = _size(buf, pos)
        if size < 0:  # int() takes a sign: a negative size would step the parser back, looping forever
            raise ShardError(f"bad size field {buf[pos + 124:pos + 136]!r} in the tar header at byte offset {pos}")
        start = pos + 512
        if kind == _SPARSE or (pax is not None and "sparse" in pax and kind in _REGULAR):
            name = pax["path"] if pax and "path" in pax else long_name or _name(buf, pos)
            raise ShardError(f"member {name.decode(errors='replace')!r} is a GNU sparse file, which this reader "
                             f"does not expand; write the tar without --sparse (-S)")
        if kind in _REGULAR:
            if pax is None and long_name is None:
                name = buf[pos:pos + 100]
                if name[99]:
                    name = _name(buf, pos)
                else:
                    name = name[:name.find(b"\0")]
                    if buf[pos + 345] and buf[pos + 257:pos + 265] == b"ustar\x0000":
                        name = _name(buf, pos)
            else:
                size = pax.get("size", size) if pax else size
                name = pax["path"] if pax and "path" in pax else long_name or _name(buf, pos)
                pax = long_name = None
            end = start + ((size + 511) & ~511)
            slash = name.rfind(b"/")
            dot = name.find(b".", slash + 1)
            if name[:2] == b"__" and _skipped_name(name):
                dot = -1
            elif dot == slash + 1:  # a base name starting with a dot: webdataset's regex decides
                found = _BASE_PLUS_EXT.match(name)
                dot = len(found.group(1)) if found else -1
            if dot > 0:
                ext = exts.get(name[dot + 1:])
                if ext is None:
                    ext = exts[name[dot + 1:]] = _ext(name[dot + 1:], want)
                if ext[1]:
                    if size > max_member:
                        if oversized is None:
                            raise ShardError(f"member {name.decode(errors='replace')!r} claims {size} bytes "
                                             f"(limit {max_member})")
                        yield name[:dot], ext[0], oversized(size)
                    else:
                        if len(buf) < start + size:
                            buf, pos, start, end = _fill(stream, buf, pos, start, end, start + size, chunk)
                        yield name[:dot], ext[0], buf[start:start + size]
                else:
                    yield name[:dot], ext[0], None
        else:
            end = start + ((size + 511) & ~511)
            if kind in (_LONGNAME, _PAX, _GLOBAL_PAX):
                if size > 1 << 20:
                    raise ShardError(f"tar extension header of {size} bytes")
                if len(buf) < start + size:
                    buf, pos, start, end = _fill(stream, buf, pos, start, end, start + size, chunk)
                body = buf[start:start + size]
                if kind == _LONGNAME:
                    long_name = body.split(b"\0", 1)[0]
                elif kind == _PAX:
                    pax = _pax_records(body)
            else:  # directories, links, ...: an extended header before one applies to it alone
                pax = long_name = None
        if end <= len(buf):
            pos = end
        else:  # step over the rest of a large member without keeping it
            _skip(stream, end - len(buf), chunk)
            buf, pos = b"", 0


def _ext(raw, want):
    ext = key_text(raw).lower()  # the keys' rule: two extensions that differ only in bytes not UTF-8 stay two
    return ext, want is None or ext in want


def _name(buf, pos):
    end = buf.find(b"\0", pos, pos + 100)
    name = buf[pos:end if end >= 0 else pos + 100]
    if buf[pos + 345] and buf[pos + 257:pos + 265] == b"ustar\x0000":  # POSIX prefix field (GNU headers hold times there)
        prefix = buf[pos + 345:pos + 500].split(b"\0", 1)[0]
        name = prefix + b"/" + name
    return name


def _size(buf, pos):
    """The size field in its other spellings: base-256, or octal with spaces or NULs."""
    field = buf[pos + 124:pos + 136]
    if field[0] & 0x80:  # base-256: only for members of 8 GiB and more
        return int.from_bytes(field[1:], "big")
    try:
        size = int(field.split(b"\0", 1)[0].strip() or b"0", 8)
    except ValueError:
        size = -1
    if size < 0:  # a negative size would step the parser backwards, looping forever
        raise ShardError(f"bad size field {field!r} in the tar header at byte offset {pos}")
    return size


def _check_old_header(buf, pos):
    """A header without the "ustar" magic: accept a pre-POSIX tar header only if its checksum holds."""
    header = buf[pos:pos + 512]
    try:
        stored = int(header[148:156].split(b"\0", 1)[0].strip() or b"-1", 8)
    except ValueError:
        stored = -1
    if stored != sum(header[:148]) + 8 * 32 + sum(header[156:]):
        raise ShardError(f"not a tar header at byte offset {pos}")


def _pax_records(body):
    """PAX records "LEN key=value\\n" -> {"path": str, "size": int} (the overrides that matter here)."""
    out, i = {}, 0
    while i < len(body):
        space = body.find(b" ", i)
        try:
            length = int(body[i:space])
        except ValueError:
            raise ShardError("malformed PAX extended header") from None
        if length <= 0 or space < 0:
            raise ShardError("malformed PAX extended header")
        key, _, value = body[space + 1:i + length - 1].partition(b"=")
        if key == b"path":
            out["path"] = value
        elif key.startswith(b"GNU.sparse."):
            out["sparse"] = True
        elif key == b"size":
            try:
                out["size"] = int(value)
            except ValueError:
                raise ShardError(f"bad PAX size {value!r}") from None
            if out["size"] < 0:
                raise ShardError(f"bad PAX size {value!r}")
        i += length
    return out


def _fill(stream, buf, pos, start, end, need, chunk):
    """Make buf hold bytes up to `need` (an offset into the current buf); returns the
    new (buf, pos, start, end) with offsets shifted to the kept part."""
    buf = buf[pos:]
    shift = pos
    more = _read(stream, max(chunk, need - shift - len(buf)))
    buf += more
    if len(buf) < need - shift:
        raise ShardError("truncated tar member")
    return buf, 0, start - shift, end - shift


def _skip(stream, n, chunk):
    while n > 0:
        got = len(_read(stream, min(n, chunk)))
        if not got:
            raise ShardError("truncated tar member")
        n -= got


def _read(stream, n):
    """Read up to n bytes, looping over short reads from pipes and sockets."""
    parts, got = [], 0
    while got < n:
        b = stream.read(n - got)
        if not b:
            break
        parts.append(b)
        got += len(b)
    return parts[0] if len(parts) == 1 else b"".join(parts)


class _Gunzip:
    """A gzip stream read as webdataset reads it: the members, and nothing after them. Bytes
    after a whole member that do not start another (trailing garbage, zero padding) end the
    data quietly, where Python's gzip raises and the shard would give nothing; tarfile, under
    webdataset, reads the tar before them. Damage inside a member is a ShardError (the shard
    is bad), while the I/O errors of the stream under it stay what they are (they may be
    retried). It inflates to at most INFLATE_RATIO times the compressed bytes read so far,
    plus INFLATE_SLACK."""

    def __init__(self, raw):
        self.raw, self.got, self.inflated = raw, 0, 0
        self.z, self.carry, self.done = zlib.decompressobj(31), b"", False  # 31: a gzip header and trailer

    def read(self, n=-1):
        out = b""
        while not out and not self.done and n != 0:
            if self.z.eof and not self._next_member():
                break
            room = INFLATE_RATIO * self.got + INFLATE_SLACK - self.inflated + 1  # one byte more says it overflows
            data = self.z.unconsumed_tail or self._more(CHUNK)  # b"" at the end: what zlib still holds
            try:
                out = self.z.decompress(data, min(n, room) if n > 0 else room)
            except zlib.error as e:
                raise ShardError(f"damaged gzip stream: {e}") from None
            if not data and not out and not self.z.eof:
                raise ShardError("damaged gzip stream: it ends inside a compressed member")
            self.inflated += len(out)
            if self.inflated > INFLATE_RATIO * self.got + INFLATE_SLACK:
                raise ShardError(f"gzip stream inflates {self.got} compressed bytes to more than "
                                 f"{INFLATE_RATIO}x plus {INFLATE_SLACK >> 20} MiB (pipeline.data.shards.read.INFLATE_RATIO): "
                                 f"a gzip bomb, or a shard to store uncompressed")
        return out

    def _more(self, n):
        if self.carry:  # counted when read
            data, self.carry = self.carry, b""
            return data
        data = self.raw.read(n)
        self.got += len(data)
        return data

    def _next_member(self):
        """After a member's end: start the next one (True), or end the data (False)."""
        rest = self.z.unused_data
        while len(rest) < 2:
            more = self.raw.read(CHUNK)
            if not more:
                break
            self.got += len(more)
            rest += more
        if rest[:2] != GZIP_MAGIC:
            self.done = True
            return False
        self.z, self.carry = zlib.decompressobj(31), rest
        return True


class _Prefixed:
    """A stream whose first bytes were already read: they come first."""

    def __init__(self, first, stream):
        self.first, self.stream = first, stream

    def read(self, n=-1):
        if self.first:
            out, self.first = (self.first, b"") if n < 0 or n >= len(self.first) else \
                (self.first[:n], self.first[n:])
            return out
        return self.stream.read(n) if n >= 0 else self.stream.read()


