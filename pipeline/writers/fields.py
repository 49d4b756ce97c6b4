"""Indexing a WebDataset of any fields (`make_shards --index ... --fields ...`), and the
fields of the sets make_shards writes with captions.

Each sample of each shard is checked against the schema as training will read it: every
field's member present (or the field optional), within its cap, its value readable
(text, numbers, .json paths, .npy headers), every image decoded (at about STAT_SIDE) and
its size within the bounds of its field's size (pipeline.data.decoding.image_caps). The
first image field's pixels give
the manifest's per-channel mean and std, as for image-and-label sets. The manifest records
the schema (`fields`); a sample that does not fit ends the index with one line naming the
shard, the sample and the field, as damage does there. An image that cannot be decoded (in any
image field) is the exception, as there: a damaged sample (pipeline.writers.damage).
"""
import collections
import random
import warnings

import numpy as np

from pipeline.data.decoding import decode, image_caps
from pipeline.data.decoding.decode import image_format, open_image, pil_reason, pixels_of
from pipeline.data.decoding.labelling import CONTENT_ERRORS, mixed_classes
from pipeline.data.manifests.manifest import CLASSES_WHY, FORMAT, MAX_CLASSES
from pipeline.data.fields.schema import MAX_TEXT, Column, Schema, parse_fields
from pipeline.data.fields.member_values import value_of
from pipeline.errors import ShardError, cut, redact
from pipeline.writers.damage import decoded  # the one rule for an image that cannot be decoded
from pipeline.writers.classes import resolve_classes  # the one rule for a split taking another's classes

STAT_SIDE = 64  # images are decoded at most about this big for the mean and std (JPEG draft mode)
GREY_MODES = {"1", "L", "LA", "I", "I;16", "I;16B", "I;16L", "F"}


def scan_fields(sample, scan, url):
    """Check one sample against the scan's schema; count it, with its first image's statistics.
    An image that cannot be decoded, in any image field, makes the sample damaged
    (pipeline.writers.damage), left out of the counts, as --index without --fields takes it
    and as training skips it."""
    from PIL import Image

    schema, key = scan["fields"], sample["__key__"]
    stats, held, labels = None, [], []
    try:
        record = schema.pick(sample)
        parsed = {}
        for col in schema.columns:
            got = record.get(col.name)
            if got is None:
                continue
            held.append(col.name)
            ext, path, data = got
            if col.kind != "image":
                try:
                    value = value_of(col, ext, path, data, parsed, lambda: random.Random(0))
                except ValueError as e:  # which field: two may read one member (an inferred one and --fields')
                    raise ValueError(f"field {col.name}: {e}") from None
                if col.kind == "class":  # the classes: 0 to the largest index seen, or the names seen
                    labels.append(value)
            else:  # every image field's pixels decoded (the damage rule); the first's give the mean and std
                got = decoded(scan, key, ext, lambda: stat_pixels(data, ext, (col.channels, *col.size)))
                if got is None:
                    return
                (h, w), fmt = got[0], image_format(ext)  # decodable, but is it within the field's size?
                image_caps.check(w, h, (col.channels, *col.size), fmt)
                stats = stats or (ext, *got)
    except ValueError as e:
        raise ShardError(f"{url}: sample {key}: {e}") from None
    except (Image.DecompressionBombError, *CONTENT_ERRORS) as e:
        raise ShardError(f"{url}: sample {key}: unreadable member ({pil_reason(e)})") from None
    scan["samples"] += 1
    for name in held:
        scan["held"][name] += 1
    for value in labels:
        scan["labels"][value] += 1
        scan["first"].setdefault(value, key)
    if stats is not None:
        ext, size, grey, rgb, g = stats
        scan["exts"][ext] += 1
        scan["shapes"][(1 if grey else 3, *size)] += 1
        scan["rgb"] += [len(rgb), *rgb.sum(0), *(rgb * rgb).sum(0)]
        scan["grey"] += [len(g), g.sum(), (g * g).sum()]


def stat_pixels(data, ext, shape=None):
    """((H, W) upright, grey?, RGB and grey pixels at about STAT_SIDE) of an image member, its
    pixel count capped, for both index paths (`shape`: a raw member's (C, H, W)); its size against
    a field's is checked apart (an image that decodes but the field's size refuses is a refusal
    naming the sample, not damage)."""
    fmt = image_format(ext)
    if fmt == "raw":
        img = decode.decode_image(bytes(data), "raw", shape).transpose(1, 2, 0)
        size = tuple(shape[1:])
    else:
        img, orientation = open_image(bytes(data), fmt)
        size = img.size[::-1] if orientation < 5 else img.size
        img = stat_thumbnail(img, fmt)
    grey = isinstance(img, np.ndarray) and img.shape[2] == 1 or getattr(img, "mode", "RGB") in GREY_MODES
    return size, grey, _pixels(img, 3).reshape(-1, 3) / 255.0, _pixels(img, 1).ravel() / 255.0


def stat_thumbnail(img, fmt):
    """The image at about STAT_SIDE for the mean and std (both index paths): a JPEG in draft mode,
    decoded at a DCT scale, else shrunk only when over twice that."""
    if fmt in ("jpg", "jpeg"):
        img.draft("RGB", (STAT_SIDE, STAT_SIDE))
    elif max(img.size) > 2 * STAT_SIDE:
        img.thumbnail((STAT_SIDE, STAT_SIDE))
    return img


def _pixels(img, c):
    if isinstance(img, np.ndarray):
        return np.repeat(img, 3, axis=2) if c == 3 and img.shape[2] == 1 else img if img.shape[2] == c else \
            img.mean(2, keepdims=True).astype(np.uint8)
    return pixels_of(img, c)


def totals(found):
    """(image shapes, member extensions, RGB and grey pixel sums) over every shard's scan."""
    shapes, exts = collections.Counter(), collections.Counter()
    rgb, grey = np.zeros(7), np.zeros(3)
    for f in found:
        shapes += f["shapes"]
        exts += f["exts"]
        rgb += f["rgb"]
        grey += f["grey"]
    return shapes, exts, rgb, grey


def summarise_fields(name, split, spec, found, names, schema, classes_from=None):
    """The manifest of an indexed set of fields, from every shard's scan. classes_from: (path,
    manifest) of the training split of the same set, whose classes this split takes (as --index
    without --fields does), so that a test split short of a class keeps the training indices."""
    shapes, exts, rgb, grey = totals(found)
    held = sum((f.get("held", collections.Counter()) for f in found), collections.Counter())
    never = [c for c in schema.columns if c.optional and not held[c.name]]
    if never and found:  # a misspelt member of an optional field was indexed without a word, and is always empty
        named = ", ".join(f"{c.name} ({_member(c)})" for c in never[:FIELDS_SHOWN])
        more = f" and {len(never) - FIELDS_SHOWN} more" if len(never) > FIELDS_SHOWN else ""
        warnings.warn(f"{name}-{split}: no sample holds the optional field(s) {named}{more}; check the member "
                      f"name(s) in --fields", stacklevel=2)
    image = next((c for c in schema.columns if c.kind == "image"), None)
    c = image.channels if image else 1
    n, s, sq = (rgb[0], rgb[1:4], rgb[4:7]) if c == 3 else (grey[0], grey[1:2], grey[2:3])
    mean = s / max(n, 1) if n else np.full(c, 0.5)
    std = np.sqrt(np.maximum(sq / max(n, 1) - mean ** 2, 1e-12)) if n else np.full(c, 0.25)
    image_exts = [e for e, _ in exts.most_common()] or [image.members[0][0] if image else "png"]
    origin = {"kind": "index", "spec": redact(spec), "note": "an existing WebDataset, indexed in place, not rewritten"}
    labels = collections.Counter()
    for f in found:
        labels += f["labels"]
    named = any(isinstance(v, str) for v in labels)  # class names: sorted, as --index sorts a label's names
    classes = sorted({str(v) for v in labels}) if named else [str(i) for i in range(max(labels) + 1)] if labels else []
    if classes_from is not None and classes_from[1].get("classes"):
        named = bool(classes_from[1].get("label_names"))
        classes = resolve_classes(found, None, classes_from)[0]
    elif named and mixed_classes(labels):
        warnings.warn(f"{name}-{split}: {mixed_classes(labels)}", stacklevel=2)
    if len(classes) > MAX_CLASSES:
        raise ShardError(f"{spec}: class index {len(classes) - 1} in field "
                         f"{next(c.name for c in schema.columns if c.kind == 'class')}, more than the {MAX_CLASSES} "
                         f"classes a manifest may hold: {CLASSES_WHY}; if it is an ID, not a class, make it an int "
                         f"field")
    if shapes:
        origin.update(image_shapes=len(shapes), most_common_shape=list(shapes.most_common(1)[0][0]))
    return {**({"label_names": True} if named else {}),
        "format": FORMAT, "dataset": name, "split": split, "encoding": image_format(image_exts[0]),
        "image_exts": image_exts, "label": "cls", "origin": origin, "fields": schema.to_json(),
        "shape": [c, *image.size] if image else [1, 1, 1], "classes": classes,
        "shards": [{"name": n_, "samples": f["samples"], "bytes": f["bytes"], "sha256": f["sha256"]}
                   for n_, f in zip(names, found)],
        "total": sum(f["samples"] for f in found),
        "mean": np.clip(mean, 0, 1).round(6).tolist(), "std": np.clip(std, 1e-6, 1).round(6).tolist(),
    }


def captioned_fields(encoding, shape, longest):
    """The fields of a set make_shards wrote with captions: its image at the manifest's shape,
    the class label, the caption (`.txt`, its cap at least the longest written)."""
    c, h, w = shape
    return Schema([Column("image", "image", encoding, fit="resize", size=(h, w), channels=c),
                   Column("label", "class", "cls"),
                   Column("caption", "text", "txt", max_bytes=max(MAX_TEXT, longest))]).to_json()


FIELDS_SHOWN = 20  # fields a summary line names before "... and K more" (5,000 made a 94,001-character line)


def describe(fields):
    """'image (jpg;png, center-crop 64x64), caption (text .txt)': a manifest's fields in words, the
    first FIELDS_SHOWN of them, each member list cut to a line's part."""
    columns = Schema.from_json(fields).columns
    out = []
    for f in columns[:FIELDS_SHOWN]:
        if f.kind == "image":
            out.append(f"{f.name} ({_member(f)}, {f.fit} {f.size[0]}x{f.size[1]})")
        else:
            out.append(f"{f.name} ({f.kind} {_member(f)})")
    more = len(columns) - FIELDS_SHOWN
    return ", ".join(out) + (f", ... and {more} more field(s)" if more > 0 else "")


def _member(f):
    """A field's member(s) as written (`jpg;png`, `.txt`, `json:score`), cut to about 80 characters."""
    text = f.member if f.kind == "image" or ":" in f.member else "." + f.member
    return cut(text, 80)


def add_options(a):
    """make_shards' --fields and --captions."""
    a("--fields", metavar="SPEC", help="with --index: the samples' fields, recorded in the manifest in place of an "
                                       "image and a label: NAME:TYPE=MEMBER[,OPTION=VALUE...] separated by spaces, "
                                       "e.g. 'image:image=jpg;png;webp,fit=center-crop,size=224x224 caption:text=txt "
                                       "score:float=json:aesthetic' (types image, text, int, float, class, array, "
                                       "bytes; a class field, label:class=cls, is the trainer's label; "
                                       "docs/data.md, 'Fields')")
    a("--captions", action="store_true", help="with --imagefolder: write each image's caption, the .txt file "
                                              "beside it (IMAGE.txt for IMAGE.jpg), as a .txt member (the folder may "
                                              "also be a flat one of image + .txt pairs); the manifest records the "
                                              "fields image, label and caption")


def check_options(p, args, label_flags):
    """--fields parsed into a Schema (p.error, one line, for a malformed one), refused beside the
    flags that describe an image and a label; --captions only for image folders."""
    if args.fields is not None:
        given = [f"--{k.replace('_', '-')}" for k in label_flags if getattr(args, k)]
        if given:
            p.error(f"--fields names every field; {', '.join(given)} describe an image and a label: give the label "
                    f"as a field instead (e.g. label:class=cls)")
        try:
            args.fields = parse_fields(args.fields)
        except ValueError as e:
            p.error(str(e))
    if args.captions and not args.imagefolder and not args.cifar10_dir:
        p.error("--captions applies to --imagefolder (and --cifar10-dir) sources only")
