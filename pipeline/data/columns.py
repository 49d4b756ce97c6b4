"""The batch of a stream whose sources have schemas (pipeline.data.schema): every field of
every source, in one dict.

Fixed-shape fields go in the ring's slot (pipeline.data.ring), stacked, so the hand-over
from the workers carries them without a copy, as it carries images: images of a fitted size
(uint8, B x C x H x W), int64 and float32 scalars and vectors, token ids (padded with 0,
NAME_len beside), arrays (padded with 0 to the field's shape, NAME_shape beside) and images
of `pad`/`native` fits (padded at the bottom and right, NAME_size (h, w) beside). Text and
bytes travel as lists in the batch's pickled part. `source`, `key`, `skipped` and (from a
training stream) `state` are what they are for image and label.

Sources may have different schemas: a field several sources have is one field of the batch
(they must agree on its type and shape), and a field some sources lack, or an optional
field, has NAME_mask beside it, False (and the value zero or None) where a sample lacks it.
A source without a schema contributes its `image` (uint8 at its manifest's shape) and
`label` (its class index, not offset). Images stay uint8: normalise them in your loop.
"""
import numpy as np

from pipeline.data.ring import Field, Spec
from pipeline.data.schema import Column
from pipeline.errors import InputError


def default_columns(source):
    """A source without a schema as fields: its image at the manifest's shape and its label."""
    c, h, w = source.shape
    return (Column("image", "image", "png", fit="resize", size=(h, w), channels=c), Column("label", "int", "cls"))


def fields_of(col):
    """The fixed-shape batch fields (ring.Field) that hold a column: none for a listed one."""
    n = col.name
    if col.kind == "image":
        return [Field(n, np.uint8, (col.channels, *col.size))] + ([Field(n + "_size", np.int64, (2,))]
                                                                  if col.padded else [])
    if col.kind == "text":
        return [] if col.tokens is None else [Field(n, np.int64, (col.tokens,)), Field(n + "_len", np.int64)]
    if col.kind in ("int", "float"):
        return [Field(n, np.int64 if col.kind == "int" else np.float32, () if col.length is None else (col.length,))]
    if col.kind == "array":
        return [Field(n, col.dtype, col.shape), Field(n + "_shape", np.int64, (len(col.shape),))]
    return []


def _form(col):
    return col.kind, col.listed, [(f.name, f.dtype, f.shape) for f in fields_of(col)]


class FieldLayout:
    """Where each source's fields go in a batch (the counterpart of batch.Layout for schemas)."""

    def __init__(self, sources):
        self.sources = list(sources)
        self.names = [s.name for s in self.sources]
        self.finals = [s.schema.final if getattr(s, "schema", None) else default_columns(s) for s in self.sources]
        union, first = {}, {}
        for s, cols in zip(self.sources, self.finals):
            for col in cols:
                have = union.setdefault(col.name, col)
                first.setdefault(col.name, s.name)
                if _form(have) != _form(col):
                    raise ValueError(f"field {col.name!r} is {_said(have)} in source {first[col.name]} and "
                                     f"{_said(col)} in source {s.name}; one batch field needs one type and shape: "
                                     f"give the sources' schemas the same, or another name")
        self.columns = list(union.values())
        self.masked = [c.name for c in self.columns
                       if any(all(o.name != c.name for o in cols) or any(o.name == c.name and o.optional for o in cols)
                              for cols in self.finals)]
        self.fixed = [f for c in self.columns for f in fields_of(c)]
        self.fixed += [Field(n + "_mask", np.bool_) for n in self.masked] + [Field("source", np.int64)]
        self.zeroed = [f.name for c in self.columns if c.padded or c.name in self.masked for f in fields_of(c)]

    def _refusal(self):
        named = [s.name for s in self.sources if getattr(s, "schema", None) is not None]
        return InputError(f"source(s) {', '.join(named)} hold fields of their own (their manifests' or the stream's "
                          f"schemas: {', '.join(c.name for c in self.columns)}); the trainer takes image and label "
                          f"only: stream the fields with MixedStream in your own loop (docs/data.md, 'Fields'), where "
                          f"schemas={{name: None}} also reads such a source as image and label")

    @property
    def num_classes(self):  # what the image-and-label trainer asks of batch.Layout first: one line, not an AttributeError
        raise self._refusal()

    hw = offsets = num_classes

    def normalize(self, *args, **kwargs):
        raise self._refusal()

    def index(self, name):
        try:
            return self.names.index(name)
        except ValueError:
            raise ValueError(f"unknown source {name!r}; sources are {', '.join(self.names)}") from None

    def spec(self, batch_size, normalize=False):
        """The batch's fixed-shape fields as a ring lays them out; images stay uint8 (`normalize`
        applies to the image-and-label layout only)."""
        return Spec(self.fixed, batch_size)

    def memory(self, batch_size):
        """(bytes of one batch with every field at its cap, bytes of the largest image field as
        decoded): what pipeline.data.budget counts for this layout."""
        listed = sum(c.max_bytes + 64 for c in self.columns if c.listed)
        batch = sum(f.nbytes(batch_size) for f in self.fixed) + batch_size * listed
        image = max([c.channels * c.size[0] * c.size[1] for c in self.columns if c.kind == "image"] or [0])
        return batch, image

    def collate(self, choice, parts, skipped=0, out=None):
        """One batch from each source's taken samples: parts[s] is (keys, values, labels), values an
        object array of {field: value} (a schema's source) or uint8 images (a source without one);
        `out`: the arrays of a ring slot to fill, else they are made. Every byte of `out` is
        written, padding included."""
        b = len(choice)
        arrays = dict(out or {})
        for f in self.fixed:
            if f.name not in arrays:
                arrays[f.name] = np.empty((b, *f.shape), f.dtype)
        for name in self.zeroed:
            arrays[name][...] = 0
        for name in self.masked:
            arrays[name + "_mask"][...] = False
        lists = {c.name: [None] * b for c in self.columns if c.listed}
        keys = np.empty(b, object)
        for s, (k, values, labels) in enumerate(parts):
            idx = np.flatnonzero(choice == s)
            if not len(idx):
                continue
            if not len(k):  # places nothing was taken for read as zeros
                for f in self.fixed:
                    arrays[f.name][idx] = 0
                continue
            keys[idx] = k
            by_name = {"image": values, "label": labels} if values.dtype != object else None
            for col in self.finals[s]:
                vals = by_name[col.name] if by_name else [v[col.name] for v in values]
                _put(col, arrays, lists, idx, vals, col.name in self.masked)
        arrays["source"][:] = choice
        return dict(arrays, **lists, key=keys.tolist(), skipped=skipped)


def _said(col):
    shape = ", ".join(f"{f.name} {f.dtype}{list(f.shape)}" for f in fields_of(col)) or "a list"
    return f"{col.kind} ({shape})"


def _put(col, arrays, lists, rows, vals, masked):
    """One column's values into the rows of a batch."""
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
    if not col.padded:
        a[rows] = vals if isinstance(vals, np.ndarray) else np.stack(vals) if col.kind == "image" else vals
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
