"""The batch fields of a schema's columns (pipeline.data.fields.schema), and how each column's values
are put in them: what batch.Layout, the one layout of every stream, is made of.

Fixed-shape fields go in the ring's slot (pipeline.data.handover.ring), stacked, so the hand-over
from the workers carries them without a copy, as it carries images: images of a fitted size
(uint8, B x C x H x W), int64 and float32 scalars and vectors, token ids (padded with 0,
NAME_len beside), arrays (padded with 0 to the field's shape, NAME_shape beside) and images
of `pad`/`native` fits (padded at the bottom and right, NAME_size (h, w) beside). Text and
bytes travel as lists in the batch's pickled part. `source`, `key`, `skipped` and (from a
training stream) `state` are what they are for image and label.

Sources may have different schemas: a field several sources have is one field of the batch
(they must agree on its type and shape, but for images fitted to a size: those share a canvas
of the largest height, width and channels, smaller ones zero-padded around the centre, grey
ones repeated), and a field some sources lack, or an optional field, has NAME_mask beside
it, False (and the value zero or None) where a sample lacks it. A source without a schema
has the default one (`default_columns`): its image and its class label.
"""
import numpy as np

from pipeline.data.decoding import rgbx
from pipeline.data.fields.spec import Field
from pipeline.data.fields.schema import Column


def default_columns(source):
    """The default schema's fields: the image at the manifest's shape (3 channels: grey images
    are repeated, as the image-and-label batch always held them) and the class label. Such a
    source is read and decoded by the image-and-label reader (decode.Target); these say where
    its values go in the batch."""
    h, w = source.shape[1:]
    return (Column("image", "image", "png", fit="resize", size=(h, w), channels=3), Column("label", "class", "cls"))


def fields_of(col):
    """The fixed-shape batch fields (spec.Field) that hold a column: none for a listed one."""
    n = col.name
    if col.kind == "image":
        return [Field(n, np.uint8, (col.channels, *col.size))] + ([Field(n + "_size", np.int64, (2,))]
                                                                  if col.padded else [])
    if col.kind == "text":
        return [] if col.tokens is None else [Field(n, np.int64, (col.tokens,)), Field(n + "_len", np.int64)]
    if col.kind in ("int", "float", "class"):
        return [Field(n, np.float32 if col.kind == "float" else np.int64, () if col.length is None else (col.length,))]
    if col.kind == "array":
        return [Field(n, col.dtype, col.shape), Field(n + "_shape", np.int64, (len(col.shape),))]
    return []


def canvas(col):
    """Whether a field's images may differ in size and channels between sources (one canvas
    holds them all): images fitted to a size, not padded ones (their sizes ride beside)."""
    return col.kind == "image" and not col.padded


def form(col):
    """What sources must agree on to share a field."""
    if canvas(col):
        return "image", "canvas"
    return col.kind, col.listed, [(f.name, f.dtype, f.shape) for f in fields_of(col)]


def said(col):
    shape = ", ".join(f"{f.name} {f.dtype}{list(f.shape)}" for f in fields_of(col)) or "a list"
    return f"{col.kind} ({shape})"


def put(col, arrays, lists, rows, vals, masked, offset=0):
    """One column's values into the rows of a batch: images of a canvas centred in it, class
    indices past `offset` (the classes of the sources before this one)."""
    name = col.name
    if not isinstance(vals, np.ndarray):
        present = [i for i, v in enumerate(vals) if v is not None]
        if len(present) < len(vals):
            rows, vals = rows[present], [vals[i] for i in present]
    if masked:
        arrays[name + "_mask"][rows] = True
    if not len(rows):
        return
    if col.listed:
        for r, v in zip(rows.tolist(), vals):
            lists[name][r] = v
        return
    a = arrays[name]
    if col.kind == "image" and not col.padded:
        vals = to_canvas(vals if isinstance(vals, np.ndarray) else np.stack(vals), *a.shape[2:])
        run = rows[-1] - rows[0] == len(rows) - 1  # a run of rows (one source's batch): a slice, not a gather
        rgbx.assign(a, slice(rows[0], rows[0] + len(rows)) if run else rows, vals)
        return
    if col.kind == "class":
        a[rows] = np.asarray(vals, np.int64) + offset
        return
    if not col.padded:
        a[rows] = vals
        return
    if col.kind == "image":
        size = arrays[name + "_size"]
        for r, v in zip(rows.tolist(), vals):
            a[r, :, :v.shape[1], :v.shape[2]] = v
            size[r] = v.shape[1:]
    elif col.kind == "text":
        length = arrays[name + "_len"]
        for r, v in zip(rows.tolist(), vals):
            a[r, :len(v)] = v
            length[r] = len(v)
    else:
        shape = arrays[name + "_shape"]
        for r, v in zip(rows.tolist(), vals):
            a[(r, *(slice(0, d) for d in v.shape))] = v
            shape[r] = v.shape


def to_canvas(pixels, h, w):
    """(n, C, sh, sw) uint8 images as (n, C, h, w), zero-padded around the centre. Padding
    here, in a small array, and then placing whole rows in the batch with one fancy
    assignment costs half what one windowed assignment into the batch did (it copies
    28-byte runs for MNIST). A grey channel is not repeated here: the assignment into the
    batch broadcasts it to 3, which costs about half of np.repeat and then the assignment
    (docs/benchmarks.md, "Small choices in the batch code")."""
    c, sh, sw = pixels.shape[1:]
    if (sh, sw) != (h, w):
        top, left = (h - sh) // 2, (w - sw) // 2
        pad = np.zeros((len(pixels), c, h, w), np.uint8)
        pad[:, :, top:top + sh, left:left + sw] = pixels
        pixels = pad
    return pixels
