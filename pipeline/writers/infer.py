"""Fields inferred from a WebDataset's members, as webdataset's decoders name them.

A set opened by its URL with no manifest and no `--fields` (pipeline.writers.autoindex) gets
its schema from the first samples of its first shard: an image extension (`jpg`, `png`,
`rgb.png`, ...) is an image field, `txt` the caption, `cls` the class, each key of a
`.json` a field of its value's type (`json:KEY`), a `.npy` an array of the largest shape
seen (int64 where every one holds integers, else float32). A member missing from some
samples is optional. A class must look like one: a member that looks like free text (most
values distinct, or long) is text, never a class, so a caption in `.cls` never becomes a
1,000-way head.

The result is a Schema (pipeline.data.fields.schema) plus the label rule of the class, if any
(`cls`, `json:label`), which the image-and-label trainer reads; `override` puts a user's
`--fields` columns in place of the inferred ones of the same name.
"""
import collections
import dataclasses
import io
import json
import re

from pipeline.data.decoding.decode import image_format
from pipeline.data.decoding.labelling import CLASS_KEYS
from pipeline.data.shards.read import MAX_MEMBER
from pipeline.data.fields.schema import MAX_SIDE, MAX_TEXT, RESERVED, SUFFIXES, Column, Schema
from pipeline.data.fields.member_values import NPY_HEADER
from pipeline.writers.fields import FIELDS_SHOWN

SAMPLES = 256  # samples of the first shard read to infer the fields
MAX_CLASS_TEXT = 32  # a class name longer than this (in characters, on average) is free text
DISTINCT = 0.5  # more than this share of distinct values among the samples read: free text, not a class
MIN_FOR_DISTINCT = 16  # fewer samples than this say nothing about how many values are distinct
_NAME = re.compile(r"[^A-Za-z0-9_]")


def infer(samples, classes=True):
    """(Schema, label rule or None) of the sample dicts read from a shard (read.iter_samples).
    classes=False: no member is taken as the class (the whole set showed it to be free text).
    ValueError (one line) when no sample holds a member a field can read."""
    samples = [s for s in samples if not s["__key__"].startswith("__")]
    if not samples:
        raise ValueError("no samples to infer the fields from")
    seen = collections.Counter(e for s in samples for e in s if not e.startswith("__"))
    n = len(samples)
    columns, label = [], None
    images = sorted(e for e in seen if image_format(e) not in (None, "npy", "raw"))
    for ext in images:
        name = "image" if len(images) == 1 else _name(ext)
        columns.append(Column(name, "image", ext, fit="center-crop", size=_common_size(samples, ext),
                              optional=seen[ext] < n))
    if "txt" in seen:
        columns.append(Column("caption", "text", "txt", max_bytes=_text_cap(samples, "txt"), optional=seen["txt"] < n))
    if "cls" in seen:
        values = _texts(samples, "cls")
        if classes and looks_like_class(values):
            label = "cls"
            columns.append(Column("label", _class_kind(values), "cls", optional=seen["cls"] < n))
        else:
            columns.append(Column("cls", "text", "cls", max_bytes=_text_cap(samples, "cls"), optional=seen["cls"] < n))
    if "json" in seen:
        more, json_label = _json_columns(samples, {c.name for c in columns}, classes and label is None)
        columns += more
        label = label or json_label
    for ext in sorted(e for e in seen if e.rpartition(".")[2] == "npy"):
        shape, dtype = _npy_layout(samples, ext)
        columns.append(Column(_name(ext), "array", ext, shape=shape, dtype=dtype, optional=seen[ext] < n))
    if not columns:
        raise ValueError(f"no member a field can read (members: {', '.join(sorted(seen)) or 'none'}); "
                         f"name the fields with --fields")
    return Schema(columns), label


def looks_like_class(values):
    """True unless the values look like free text: long, or mostly distinct among enough samples.
    Integers are class ids whatever their count (ImageNet's 1,000)."""
    values = [v for v in values if v is not None]
    if not values:
        return False
    if all(_integer(v) for v in values):
        return True
    if sum(len(v) for v in values) / len(values) > MAX_CLASS_TEXT:
        return False
    return len(values) < MIN_FOR_DISTINCT or len(set(values)) <= DISTINCT * len(values)


def looks_like_classes(names, total):
    """looks_like_class over a whole index: its distinct class names and its sample count (the
    first samples can hold a few classes and the rest of the set free text)."""
    if all(_integer(v) for v in names):
        return True
    if names and sum(len(v) for v in names) / len(names) > MAX_CLASS_TEXT:
        return False
    return total < MIN_FOR_DISTINCT or len(names) <= DISTINCT * total


def _class_kind(values):
    """`class` for class ids (0, 1, 2 ...: the kind of our own shards' class field, so a set indexed
    on first use mixes with them) and for class names (the index lists them sorted as the
    manifest's classes, through which the class field maps each to its index, as the default
    schema's label); `int` for negative ids."""
    values = [v for v in values if v is not None]
    if all(_integer(v) for v in values):
        return "class" if all(not v.startswith("-") for v in values) else "int"  # a class index is 0 or more
    return "class"


def ids_as_int(schema):
    """The schema with its class field an int: for class ids that are not the indices 0..N-1 the
    index found (5 and 7), which a class field would read past its N classes."""
    return Schema([dataclasses.replace(c, kind="int") if c.kind == "class" else c for c in schema.columns],
                  schema.stages)


def override(schema, given):
    """The inferred schema with the columns of `given` (a Schema, from --fields) in place of
    those of the same name, and the rest of `given` added after."""
    if given is None:
        return schema
    by_name = {c.name: c for c in given.columns}
    columns = [by_name.pop(c.name, c) for c in schema.columns] + list(by_name.values())
    return Schema(columns, given.stages)


def _json_columns(samples, taken, want_label):
    """The fields of the .json members' top-level keys (numbers, strings, booleans), and the
    label rule of a key that names a class (CLASS_KEYS) when `want_label`."""
    docs = []
    for s in samples:
        try:
            doc = json.loads(bytes(s["json"])) if s.get("json") is not None else None
        except (ValueError, UnicodeDecodeError, RecursionError):  # nested past Python's stack: not a dict
            doc = None
        docs.append(doc if isinstance(doc, dict) else None)
    keys = collections.Counter(k for d in docs if d for k in d)
    columns, label = [], None
    for key in sorted(keys, key=lambda k: (CLASS_KEYS.index(k) if k in CLASS_KEYS else len(CLASS_KEYS), k)):
        values = [d.get(key) for d in docs if d and key in d]
        kind = _json_kind(values)
        if kind is None or not re.fullmatch(r"[^.\s]+", key):
            continue
        name = _name(key)
        if name in taken or name in RESERVED or any(name == t + x for t in taken for x in SUFFIXES):
            name = "json_" + name  # "key", or "image_size" beside an image field: named apart
        if want_label and label is None and key in CLASS_KEYS and kind in ("int", "text") \
                and looks_like_class([str(v) for v in values]):
            label = f"json:{key}"
            if "label" not in taken:  # the class is `label` whichever member holds it, as in every other batch
                name = "label"
        if label == f"json:{key}" and _class_kind([str(v) for v in values]) == "class" \
                and not any(isinstance(v, bool) for v in values):
            kind = "class"  # class ids or names, as .cls's
        cap = {"max_bytes": MAX_TEXT} if kind == "text" else {}
        columns.append(Column(name, kind, f"json:{key}", optional=keys[key] < len(samples), **cap))
        taken.add(name)
    return columns, label


def _json_kind(values):
    if all(isinstance(v, bool) for v in values):
        return "int"
    if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return "int"
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return "float"
    if all(isinstance(v, str) for v in values):
        return "text"
    return None  # lists, objects, nulls and mixtures: name them with --fields


def _name(ext):
    name = _NAME.sub("_", ext)
    return name if re.match(r"[A-Za-z_]", name) else "f_" + name


def _texts(samples, ext):
    out = []
    for s in samples:
        data = s.get(ext)
        try:
            out.append(bytes(data).decode("utf-8").strip() if data is not None else None)
        except UnicodeDecodeError:
            out.append("\ufffd" * (MAX_CLASS_TEXT + 1))  # not text: never a class name
    return out


def _integer(v):
    return v is not None and re.fullmatch(r"[+-]?[0-9]+", v) is not None


def _text_cap(samples, ext):
    longest = max((len(s[ext]) for s in samples if s.get(ext) is not None), default=0)
    return min(MAX_MEMBER, max(MAX_TEXT, 4 * longest))


def _common_size(samples, ext):
    """The most common (H, W) of the image member `ext` among the samples (header only)."""
    from PIL import Image

    sizes = collections.Counter()
    for s in samples:
        if s.get(ext) is None:
            continue
        try:
            with Image.open(io.BytesIO(bytes(s[ext]))) as img:
                sizes[img.size[::-1]] += 1
        except Exception:  # noqa: BLE001 - an undecodable image is the index's to report, naming its sample
            continue
    if not sizes:
        raise ValueError(f"no readable .{ext} image among the first {len(samples)} samples")
    h, w = sizes.most_common(1)[0][0]
    return min(h, MAX_SIDE), min(w, MAX_SIDE)  # larger images are the index's to refuse, naming one


def _npy_layout(samples, ext):
    """(the largest size of each dimension among the .npy headers read, the field's dtype): int64
    where every one holds integers (float32 would change those past 2**24), else float32. A .npy
    of anything but numbers is refused here, naming it, rather than inferring a field that would
    refuse every sample."""
    from numpy.lib import format as npformat

    shape, kinds = None, set()
    for s in samples:
        data = s.get(ext)
        if data is None:
            continue
        try:
            stream = io.BytesIO(bytes(data)[:NPY_HEADER])
            version = npformat.read_magic(stream)
            read = npformat.read_array_header_1_0 if version == (1, 0) else npformat.read_array_header_2_0
            got, _, dtype = read(stream, max_header_size=NPY_HEADER)
        except Exception:  # noqa: BLE001 - the index or the reader names a bad .npy
            continue
        if dtype.hasobject or dtype.fields is not None or dtype.kind not in "biuf":
            raise ValueError(f"sample {s['__key__']}: .{ext} holds {str(dtype)[:40]}, not numbers, which no field "
                             f"reads; name the fields to read with --fields")
        kinds.add(dtype.kind)
        got = tuple(got) or (1,)
        shape = got if shape is None or len(shape) != len(got) else tuple(max(a, b) for a, b in zip(shape, got))
    if shape is None:
        raise ValueError(f"no readable .{ext} array among the first {len(samples)} samples")
    return shape, "int64" if kinds <= set("iu") else "float32"


def describe(schema, label):
    """One line: 'fields: image (image .jpg 32x32), caption (text .txt), label (class .cls), ...', the
    first FIELDS_SHOWN of them (a .json of 5,000 keys made a line of 117,848 characters)."""
    parts = []
    for c in schema.columns[:FIELDS_SHOWN]:
        what = "class" if label and c.member == label else c.kind
        where = c.member if ":" in c.member else "." + c.member
        size = f" {c.channels}x{c.size[0]}x{c.size[1]}" if c.kind == "image" else f" {'x'.join(map(str, c.shape))}" \
            if c.kind == "array" else ""
        parts.append(f"{c.name} ({what} {where}{size}{', optional' if c.optional else ''})")
    more = len(schema.columns) - FIELDS_SHOWN
    return "fields: " + ", ".join(parts) + (f", ... and {more} more field(s)" if more > 0 else "")
