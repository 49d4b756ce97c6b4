"""A sample schema: named fields, each read from a member of the sample and decoded to a type.

    Schema([Column("image", "image", "jpg;png;webp", fit="center-crop", size=(64, 64)),
            Column("caption", "text", "txt", max_bytes=1000),
            Column("score", "float", "json:aesthetic")],
           stages=[augment.Flip("image"), augment.Tokenize("caption", my_tokenizer, 32)])

A member is named by its extension (`txt`, `rgb.png`), by alternatives tried in order
(`jpg;png;webp`), or by a path into the sample's .json (`json:caption`, `json:meta.tags.0`).
Types: `image` (decoded, then fitted: `resize` to HxW, `center-crop`/`random-crop` after a
shorter-side resize, `pad` keeping the aspect, `native` shrunk only to fit its cap), `text`
(UTF-8, at most `max_bytes`), `int`/`float` (a scalar or a vector of `length`), `class` (a
class index 0..N-1, N the classes the manifest lists, its raw value mapped as the default
schema maps a label (the manifest's label_values or class names, labelling.class_of), a value with no class
a damaged sample; offset in the batch past the classes of the sources before it, as an
image-and-label source's are), `array` (a .npy of at most
`shape`, cast to `dtype`), `bytes` (at most `max_bytes`).

Every cap comes from the schema, never from the data: a member over its field's cap, a
.npy whose header claims more than the shape or holds objects, a .json over
MAX_JSON_BYTES, a value of the wrong type, is a ValueError naming the field and why; the
reader counts the sample as skipped with that line (pipeline.data.streams.stages). The sample
stages of a schema (`augment` or any function of the sample dict) run after decoding,
each with a `random.Random` drawn from the sample's seed, a pure function of its
position, so a resumed stream repeats them.

Image and class is the default schema (pipeline.data.fields.columns.default_columns): a source
without a schema has an image field at its manifest's shape and a class field, decoded by
the image-and-label reader (pipeline.data.decoding.decode.Target), and batched like any other.
"""
import dataclasses
import math
import random
import re

import numpy as np

from pipeline.data.decoding import decode
from pipeline.data.decoding import labelling
from pipeline.data.shards.read import MAX_MEMBER
from pipeline.data.fields.member_values import NPY_HEADER, user_stage, value_of
from pipeline.errors import cut

KINDS = ("image", "text", "int", "float", "class", "array", "bytes")
FITS = ("resize", "center-crop", "random-crop", "pad", "native")
PADDED = ("pad", "native")  # fits whose images keep their own size: padded in the batch, with NAME_size
DTYPES = ("uint8", "int8", "uint16", "int16", "int32", "int64", "float16", "float32", "float64", "bool")
MAX_TEXT = 64 << 10  # bytes of a text field unless its max_bytes says otherwise
MAX_BYTES = 1 << 20  # bytes of a bytes field unless its max_bytes says otherwise
MAX_JSON_BYTES = labelling.MAX_LABEL_JSON  # a .json member any field reads from
MAX_LENGTH = 1 << 16  # values of an int/float vector, tokens of a text field
MAX_ELEMENTS = 1 << 24  # elements of an array field (64 MiB as float32)
MAX_SIDE = 4096  # pixels a side of an image field (manifest.MAX_SIDE)
SUFFIXES = ("_mask", "_size", "_len", "_shape")  # batch fields a column may add beside its own
RESERVED = ("source", "key", "state", "skipped", "slot", "plan")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_EXT = re.compile(r"[a-z0-9_-]+(\.[a-z0-9_-]+)*\Z")
_PART = re.compile(r"[^.\s]+\Z")


class Oversized:
    """What the tar reader hands over for a member larger than a schema reads (read.iter_samples
    `oversized`): its size, the bytes stepped over unread."""

    __slots__ = ("size",)

    def __init__(self, size):
        self.size = size


def parse_member(text):
    """'jpg;png;webp' -> (('jpg', None), ('png', None), ('webp', None)); 'json:meta.tags.0' ->
    (('json', ('meta', 'tags', '0')),). Raises ValueError."""
    out = []
    for alt in str(text).split(";"):
        ext, colon, path = alt.strip().partition(":")
        ext = ext.lower()
        if not _EXT.match(ext):
            raise ValueError(f"member {alt!r}: an extension (txt, jpg, rgb.png) or json:PATH expected")
        if colon:
            parts = tuple(path.split("."))
            if ext != "json" or not all(_PART.match(p) for p in parts):
                raise ValueError(f"member {alt!r}: a path goes into a .json member only, e.g. json:caption, "
                                 f"json:meta.tags.0")
            out.append((ext, parts))
        else:
            out.append((ext, None))
    return tuple(out)


def _pair(value, what):
    """224, '224', '64x48', (64, 48) -> (H, W)."""
    if isinstance(value, str):
        value = [int(x) for x in value.lower().split("x")] if re.fullmatch(r"\d+(x\d+)?", value) else None
    elif isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if value is None or not 1 <= len(value) <= 2:
        raise ValueError(f"{what}: HxW or N expected")
    value = tuple(int(v) for v in value) * (3 - len(value))
    return value[:2]


@dataclasses.dataclass(frozen=True)
class Column:
    """One field of a sample. `name`: its key in the batch; `kind`: one of KINDS; `member`: where
    it is (see parse_member). image: `fit` (FITS), `size` (H, W) (the cap for `native`),
    `channels` 1 or 3; text and bytes: `max_bytes`; int and float: `length` (None: a scalar);
    class: a class index (see the module's docstring); array: `shape` (the largest per dimension)
    and `dtype`; `optional`: a sample without the
    member is kept, the field masked (NAME_mask False), rather than skipped. `tokens`: set by
    a tokenising stage (augment.Tokenize), the text is then token ids, at most that many."""

    name: str
    kind: str
    member: str
    fit: str = None
    size: tuple = None
    channels: int = 3
    max_bytes: int = None
    length: int = None
    shape: tuple = None
    dtype: str = None
    optional: bool = False
    tokens: int = None

    def __post_init__(self):
        bad = lambda why: ValueError(f"field {self.name!r}: {why}")  # noqa: E731
        if not isinstance(self.name, str) or not _NAME.match(self.name) or self.name in RESERVED:
            raise bad(f"a name of letters, digits and _ expected, none of {', '.join(RESERVED)}")
        if self.kind not in KINDS:
            raise bad(f"type {self.kind!r}; one of {', '.join(KINDS)} expected")
        try:
            members = parse_member(self.member)
        except ValueError as e:
            raise bad(str(e)) from None
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen: normalised once, here)
        set_("member", ";".join(e + (":" + ".".join(p) if p else "") for e, p in members))
        set_("_members", members)  # parsed once: every sample asks
        if self.kind == "image":
            if any(p or decode.image_format(e) in (None, "npy") for e, p in members):
                raise bad(f"image member {self.member!r}: image extensions expected "
                          f"({', '.join(x for x in decode.IMAGE_EXTS if x != 'npy')})")
            set_("fit", self.fit or "center-crop")
            if self.fit not in FITS:
                raise bad(f"fit {self.fit!r}; one of {', '.join(FITS)} expected")
            if self.size is None:
                raise bad("an image field needs its size (HxW; for fit native, the most it may be)")
            try:
                set_("size", _pair(self.size, "size"))
            except ValueError as e:
                raise bad(str(e)) from None
            if not all(1 <= s <= MAX_SIDE for s in self.size) or self.channels not in (1, 3):
                raise bad(f"size {self.size} and channels {self.channels}: sides 1..{MAX_SIDE}, channels 1 or 3")
        if self.kind in ("array", "bytes") and any(p for _, p in members):
            raise bad(f"a {self.kind} field reads a whole member, not a .json path")
        if self.kind == "array" and any(e.rpartition(".")[2] != "npy" for e, _ in members):
            raise bad("an array field reads .npy members")
        if self.kind in ("text", "bytes"):
            default = MAX_TEXT if self.kind == "text" else MAX_BYTES
            set_("max_bytes", default if self.max_bytes is None else self.max_bytes)
            _within(self.max_bytes, 1, MAX_MEMBER, bad, "max_bytes")
        if self.kind == "class" and self.length is not None:
            raise bad("a class field holds one class index a sample (no length)")
        if self.kind in ("int", "float") and self.length is not None:
            _within(self.length, 1, MAX_LENGTH, bad, "length")
        if self.tokens is not None:
            if self.kind != "text":
                raise bad("only a text field is tokenised")
            _within(self.tokens, 1, MAX_LENGTH, bad, "tokens")
        if self.kind == "array":
            if self.shape is None:
                raise bad("an array field needs its shape (the most each dimension may be, e.g. 512 or 3x64x64)")
            shape = tuple(int(x) for x in (self.shape.lower().split("x") if isinstance(self.shape, str)
                                           else np.atleast_1d(self.shape)))
            set_("shape", shape)
            if not shape or not all(s >= 1 for s in shape) or math.prod(shape) > MAX_ELEMENTS:
                raise bad(f"shape {shape}: dimensions of at least 1, at most {MAX_ELEMENTS} elements in all")
            set_("dtype", self.dtype or "float32")
            if self.dtype not in DTYPES:
                raise bad(f"dtype {self.dtype!r}; one of {', '.join(DTYPES)} expected")

    @property
    def members(self):
        return self._members

    @property
    def padded(self):
        """Whether the batch pads this field's values to a fixed shape, with their sizes beside."""
        return (self.kind == "image" and self.fit in PADDED) or self.kind == "array" or self.tokens is not None

    @property
    def listed(self):
        """Whether the batch holds this field as a list (strings, bytes), not an array."""
        return self.kind == "bytes" or (self.kind == "text" and self.tokens is None)

    def cap(self, ext):
        """The most bytes a member `ext` of this field may hold."""
        if ext == "json":
            return MAX_JSON_BYTES
        if self.kind in ("text", "bytes"):
            return self.max_bytes
        if self.kind in ("int", "float", "class"):
            return 32 * (self.length or 1) + 64
        if self.kind == "array":
            return NPY_HEADER + 8 * math.prod(self.shape)
        return MAX_MEMBER

    def to_json(self):
        out = {"name": self.name, "type": self.kind, "member": self.member}
        for key in ("fit", "size", "channels", "max_bytes", "length", "shape", "dtype", "tokens"):
            v = getattr(self, key)
            if v is not None and not (key == "channels" and self.kind != "image"):
                out[key] = list(v) if isinstance(v, tuple) else v
        if self.optional:
            out["optional"] = True
        return out


def _within(value, lo, hi, bad, what):
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise bad(f"{what} {value!r}: an integer in {lo}..{hi} expected")


def column_from_json(d):
    """A Column from a manifest's `fields` entry; ValueError for anything else."""
    if not isinstance(d, dict) or not isinstance(d.get("name"), str):
        raise ValueError(f"{cut(repr(d), 80)}: an object with name, type and member expected")
    known = {"name", "type", "member", "fit", "size", "channels", "max_bytes", "length", "shape", "dtype", "optional",
             "tokens"}
    extra = sorted(set(d) - known)
    if extra:
        raise ValueError(f"field {d['name']!r}: unknown key(s) {', '.join(map(str, extra))}")
    for key in ("size", "shape"):
        if key in d and not (isinstance(d[key], list) and all(isinstance(x, int) and not isinstance(x, bool)
                                                              for x in d[key])):
            raise ValueError(f"field {d['name']!r}: {key} {cut(repr(d[key]), 60)}: a list of integers expected")
    if not isinstance(d.get("optional", False), bool):
        raise ValueError(f"field {d['name']!r}: optional: true or false expected")
    kw = {k: d[k] for k in known - {"name", "type", "member"} if k in d}
    return Column(d["name"], d.get("type"), d.get("member"), **kw)


def parse_fields(text):
    """--fields 'image:image=jpg;png,fit=pad,size=64x64 caption:text=txt,max=500 score:float=json:score':
    fields separated by spaces, each NAME:TYPE=MEMBER, then options (fit, size, channels, max, length,
    shape, dtype, optional). Raises ValueError naming the field and the fix."""
    specs = text.split() if isinstance(text, str) else [t for part in text for t in part.split()]
    if not specs:
        raise ValueError("--fields: at least one NAME:TYPE=MEMBER expected")
    columns = []
    for spec in specs:
        head, eq, rest = spec.partition("=")
        name, colon, kind = head.partition(":")
        if not (eq and colon and rest):
            raise ValueError(f"--fields {spec!r}: NAME:TYPE=MEMBER[,OPTION=VALUE...] expected, e.g. "
                             f"caption:text=txt,max=1000 or image:image=jpg;png,size=64x64")
        member, *options = rest.split(",")
        kw = {}
        for opt in options:
            key, _, value = opt.partition("=")
            key = {"max": "max_bytes"}.get(key, key)
            if key == "optional" and not value:
                kw[key] = True
            elif key in ("fit", "dtype", "size", "shape") and value:
                kw[key] = value
            elif key in ("channels", "max_bytes", "length") and value.isdigit():
                kw[key] = int(value)
            else:
                raise ValueError(f"--fields {spec!r}: option {opt!r}; fit=, size=HxW, channels=, max=BYTES, "
                                 f"length=N, shape=AxB, dtype= or optional expected")
        columns.append(Column(name, kind, member, **kw))
    return Schema(columns)


class Schema:
    """A source's fields (Columns, in order) and its sample stages (augment stages, or functions
    of the sample dict returning it, or None to drop it)."""

    def __init__(self, columns, stages=()):
        self.columns, self.stages = tuple(columns), tuple(stages)
        if not self.columns:
            raise ValueError("a schema needs at least one field")
        names = [c.name for c in self.columns]
        twice = next((n for n in names if names.count(n) > 1), None)
        if twice:
            raise ValueError(f"field {twice!r} is named twice")
        if sum(c.kind == "class" for c in self.columns) > 1:
            raise ValueError("a schema holds one class field: its classes are the manifest's (make the others int)")
        final = {c.name: c for c in self.columns}
        for stage in self.stages:
            if hasattr(stage, "column"):
                if stage.field not in final:
                    raise ValueError(f"stage {stage!r}: no field {stage.field!r} (fields: {', '.join(names)})")
                final[stage.field] = stage.column(final[stage.field])
            elif not callable(stage):
                raise ValueError(f"stage {stage!r}: an augment stage or a function of the sample expected")
        self.final = tuple(final.values())  # the fields as the batch holds them, after the stages
        made = {c.name + s for c in self.final for s in SUFFIXES}
        clash = next((n for n in names if n in made), None)
        if clash:
            raise ValueError(f"field {clash!r} clashes with a batch field another field adds "
                             f"(NAME{', NAME'.join(SUFFIXES)})")
        self.members = frozenset(e for c in self.columns for e, _ in c.members)
        self.max_member = max(c.cap(e) for c in self.columns for e, _ in c.members)

    def __repr__(self):
        return f"Schema({[c.to_json() for c in self.columns]}, stages={list(self.stages)!r})"

    def to_json(self):
        return [c.to_json() for c in self.columns]

    @classmethod
    def from_json(cls, fields):
        if not isinstance(fields, list):
            raise ValueError("a list of fields expected")
        return cls([column_from_json(f) for f in fields])

    def pick(self, sample):
        """{field: (ext, json path, bytes)} of a sample as read: each field's first member present,
        within its cap. ValueError (one line) for a missing member or one over its cap."""
        record = {}
        for col in self.columns:
            for ext, path in col.members:
                data = sample.get(ext)
                if data is not None:
                    size = data.size if isinstance(data, Oversized) else len(data)
                    if size > col.cap(ext):
                        raise ValueError(f"field {col.name}: .{ext} of {size} bytes, more than its cap of "
                                         f"{col.cap(ext)}{_cap_hint(col, ext)}")
                    record[col.name] = (ext, path, data)
                    break
            else:
                if not col.optional:
                    have = sorted(k for k, v in sample.items() if not k.startswith("__"))
                    raise ValueError(f"field {col.name}: no {' or '.join('.' + e for e, _ in col.members)} member "
                                     f"(has {cut(', '.join(have), 120) or 'nothing'})")
        return record

    def decode_images(self, records, seeds):
        """The crop-fitted image fields of many samples decoded together (decode.decode_batch: one
        torchvision call for a batch of JPEGs, one inflate a PNG as make_shards writes them), as
        `sample` would decode them one by one: [{field: pixels, or the ValueError}] a record."""
        out = [{} for _ in records]
        for k, col in enumerate(self.columns):
            if col.kind != "image" or col.fit not in ("center-crop", "random-crop"):
                continue
            rows = [j for j, r in enumerate(records) if col.name in r]
            if not rows:
                continue
            crops = None
            if col.fit == "random-crop":
                crops = np.array([_crop(_rng(seeds[j], 128 | k)) for j in rows])
            pixels, kept, errors = decode.decode_batch(
                [bytes(records[j][col.name][2]) for j in rows],
                [decode.image_format(records[j][col.name][0]) for j in rows], _Shape((col.channels, *col.size)), crops)
            for n, at in enumerate(kept):
                out[rows[at]][col.name] = pixels[n]
            for at, message in errors:
                out[rows[at]][col.name] = ValueError(message)
        return out

    def sample(self, record, seed, key="?", source="?", decoded=None, *, classes):
        """The sample's values after decoding and the stages ({field: value}, None for an optional
        field it lacks), or None where a stage dropped it; `decoded`: its fields decode_images made;
        `classes`: the source's map of a raw label to its class index (labelling.class_of with its
        Target and lookup), through which a class field's value goes as the default schema's label
        does. ValueError for content that does not fit, a class value among them; InputError for a
        stage of the user's that fails or returns what the fields can't hold."""
        values, parsed = {}, {}
        for k, col in enumerate(self.columns):
            got = record.get(col.name)
            if got is None:
                values[col.name] = None
                continue
            ext, path, data = got
            if decoded is not None and col.name in decoded:
                if isinstance(decoded[col.name], ValueError):
                    raise ValueError(f"field {col.name}: {decoded[col.name]}")
                values[col.name] = decoded[col.name]
                continue
            try:
                values[col.name] = value_of(col, ext, path, data, parsed, lambda k=k: _rng(seed, 128 | k))
                if col.kind == "class":  # an id or a class name (member_values), to its class index
                    raw = values[col.name]
                    values[col.name] = classes(raw if isinstance(raw, str) else int(raw))
            except ValueError as e:
                raise ValueError(f"field {col.name}: {e}") from None
            except labelling.CONTENT_ERRORS as e:
                raise ValueError(f"field {col.name}: unreadable .{ext} ({type(e).__name__}: {cut(e, 80)})") from None
        for k, stage in enumerate(self.stages):
            rng = _rng(seed, k & 127)
            if hasattr(stage, "column"):
                if values[stage.field] is not None:
                    values[stage.field] = stage(values[stage.field], rng)
                continue
            values = user_stage(stage, values, key, source, seed, self.final)
            if values is None:
                return None
        return values


def _rng(seed, salt):
    """The generator of one draw site of a sample: its stage (salt < 128) or its field's crop."""
    return random.Random((seed << 8) | salt)


def _crop(rng):
    return rng.random(), rng.random()


class _Shape:
    """What decode.decode_batch asks of its target: the shape."""

    def __init__(self, shape):
        self.shape = shape


def _cap_hint(col, ext):
    if ext == "json":
        return " (pipeline.data.fields.schema.MAX_JSON_BYTES)"
    return " (raise the field's max_bytes)" if col.kind in ("text", "bytes") else ""
