"""A schema field's value from its member's bytes (pipeline.data.fields.schema), and the check of a
value a stage of the user's returns.

Each reader here checks what a member claims before it makes anything of that size: a
.npy's header (numeric, no objects, within the field's shape) before a byte is copied, an
image's size (pipeline.data.decoding.image_caps, through decode.open_image) before a pixel is decoded, a
.json path step by step (no list or object is walked). Each failure is one ValueError line.
"""
import io
import json
import math

import numpy as np

from pipeline.data.decoding import decode
from pipeline.data.decoding import labelling
from pipeline.errors import InputError, cut

NPY_HEADER = 1 << 16  # bytes a .npy's header may take


def value_of(col, ext, path, data, parsed, rng):
    """One field's value from its member's bytes."""
    if path is not None:
        if ext not in parsed:
            parsed[ext] = _json(data)
        return _from_json(col, parsed[ext], path)
    kind = col.kind
    if kind == "image":
        return image_value(bytes(data), decode.image_format(ext), col, rng)
    if kind == "bytes":
        return bytes(data)
    if kind == "array":
        return npy_value(bytes(data), col)
    text = _text(data, ext)
    if kind == "text":
        return text
    if kind == "class":  # an id or a class name: the manifest's classes map it (schema.sample)
        return _class(text, f".{ext}")
    return _numbers(col, text.replace(",", " ").split(), f".{ext}")


def _class(value, where):
    """A class field's value as labelling.class_value reads every label: an id or a name."""
    try:
        value = labelling.class_value(value)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    if isinstance(value, int) and not 0 <= value < (1 << 31):
        raise ValueError(f"{where}: {value} is not a class index (0, 1, 2 ...)")
    return value


def _text(data, ext):
    try:
        return bytes(data).decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f".{ext} is not UTF-8 text ({e.reason} at byte {e.start})") from None


def _json(data):
    try:
        return json.loads(bytes(data))
    except RecursionError:
        raise ValueError(".json nested too deeply to read") from None
    except (ValueError, MemoryError, TypeError) as e:
        raise ValueError(f".json is not valid JSON ({cut(e, 80)})") from None


def _from_json(col, value, path):
    where = "json:" + ".".join(path)
    for part in path:
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            raise ValueError(f"{where}: no {part!r} there ({_shape_of(value)})")
    if col.kind == "text":
        if not isinstance(value, str):
            raise ValueError(f"{where} is {_shape_of(value)}, not a string")
        if len(value) > col.max_bytes or len(value.encode("utf-8")) > col.max_bytes:
            raise ValueError(f"{where}: text of more than {col.max_bytes} bytes (the field's max_bytes)")
        return value
    if col.kind == "class":
        return _class(value, where)
    items = value if isinstance(value, list) else [value]
    if col.length is None and isinstance(value, list):
        raise ValueError(f"{where} is {_shape_of(value)}, not a scalar (give the field a length)")
    return _numbers(col, items, where)


def _shape_of(value):
    if isinstance(value, list):
        return f"a list of {len(value)}"
    if isinstance(value, dict):
        return f"an object of {len(value)} keys"
    return f"a JSON {type(value).__name__}"


def _numbers(col, items, where):
    n = col.length or 1
    if len(items) != n:
        raise ValueError(f"{where} holds {len(items)} value(s), the field takes {n}")
    out = []
    for x in items:
        if isinstance(x, str):
            try:
                x = int(x) if labelling._INTEGER.match(x) else float(x)  # an integer is checked as one
            except ValueError:
                raise ValueError(f"{where}: {cut(repr(x), 40)} is not a number") from None
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            raise ValueError(f"{where}: {cut(repr(x), 40)} is not a number")
        if col.kind == "int" and (isinstance(x, float) or not -(1 << 63) <= x < (1 << 63)):
            raise ValueError(f"{where}: {cut(repr(x), 40)} is not a 64-bit integer")
        if col.kind == "class" and (isinstance(x, float) or not 0 <= x < (1 << 31)):
            raise ValueError(f"{where}: {cut(repr(x), 40)} is not a class index (0, 1, 2 ...)")
        if col.kind == "float" and not math.isfinite(x):
            raise ValueError(f"{where}: {x} is not finite")
        out.append(x)
    if col.kind != "float":
        a = np.array(out, np.int64)
        return a if col.length is not None else a[0]
    with np.errstate(over="ignore"):  # 1e40 is inf in float32: refused below, not warned of
        a = np.array(out, np.float32)
    # Python compares an int and a float exactly: 2**24+1 is not float32's 2**24 (1.1 rounded is a float's precision)
    lost = [x for x, y in zip(out, a.tolist()) if x != y and (isinstance(x, int) or math.isinf(y))]
    if lost:
        x = lost[0]
        why = "not exactly a float32" if isinstance(x, int) else "past the range of float32"
        raise ValueError(f"{where}: {cut(repr(x), 40)} is {why}, a float field's dtype"
                         f"{' (give the field kind int)' if isinstance(x, int) else ''}")
    return a if col.length is not None else a[0]


def npy_value(data, col):
    """A .npy member as an array of the field's dtype, its header checked before a byte is
    copied: numeric, no objects, the field's number of dimensions, none larger than the field's
    (a 0-d .npy is one value of shape (1,), the shape pipeline.writers.infer gives its field); a
    value the field's dtype would change (inexact: 2**53+1 as float64, 1e40 as float32) is refused."""
    import tokenize

    from numpy.lib import format as npformat

    f = io.BytesIO(data)
    try:
        version = npformat.read_magic(f)
        read = npformat.read_array_header_1_0 if version == (1, 0) else npformat.read_array_header_2_0
        shape, fortran, dtype = read(f, max_header_size=NPY_HEADER)
    except (ValueError, OSError, SyntaxError, tokenize.TokenError, TypeError) as e:
        raise ValueError(f"undecodable .npy: {cut(e, 80)}") from None
    if dtype.hasobject or dtype.fields is not None or dtype.kind not in "biuf":
        raise ValueError(f".npy holds {cut(str(dtype), 40)}, not numbers")
    scalar = not shape  # a 0-d .npy (np.save of a scalar): one value, shape (1,), as inference reads it
    if len(shape or (1,)) != len(col.shape) or any(s > m for s, m in zip(shape or (1,), col.shape)):
        raise ValueError(f".npy of shape {cut(str(shape), 60)}{' (a scalar)' if scalar else ''}, the field takes at "
                         f"most {col.shape}")
    want = np.dtype(col.dtype)
    if not np.can_cast(dtype, want, "same_kind"):
        raise ValueError(f".npy of {dtype} cannot be {want} without losing its kind (give the field dtype {dtype})")
    count = math.prod(shape)
    if len(data) - f.tell() < count * dtype.itemsize:
        raise ValueError(f".npy header claims {count} values, the member holds {len(data) - f.tell()} bytes")
    a = np.frombuffer(data, dtype, count, f.tell())
    a = a.reshape(shape[::-1]).T if fortran else a.reshape(shape or (1,))
    with np.errstate(over="ignore"):  # a value past the dtype's range: refused below, not warned of
        out = np.ascontiguousarray(a, dtype=want)
    problem = inexact(a, out)
    if problem:
        raise ValueError(f".npy {problem}: give the field a dtype that holds it (--fields NAME:array=npy,dtype=...)")
    return out


def inexact(a, out):
    """None if `out` (`a` cast to a field's dtype) holds every value of `a`, else one line naming the
    first it changed: an integer not kept exactly (int64 2**53+1 as float64 is 2**53: can_cast calls
    that cast safe, so each value is cast back and compared), an integer past an integer dtype's
    range, a finite float made inf (1e40 as float32). NaN and inf stay what they were; a float
    merely rounded (1.1 as float32) is a float's precision, not a change. Vectorised: none where the
    dtypes alone make the cast exact, a reduction or two where every value is within (the common case),
    else a cast and a compare per array."""
    src, want = a.dtype, out.dtype
    if src == want or src.kind == "b" or (np.can_cast(src, want, "safe") and want.itemsize > src.itemsize):
        return None  # int32 as float64, float32 as float64, int8 as int16: exact by their dtypes
    a, out = a.ravel(), out.ravel()
    if not a.size:
        return None
    if want.kind == "f" and src.kind in "iu":
        limit = 2 ** (np.finfo(want).nmant + 1)  # every integer within is a float exactly
        if -limit <= a.min() and a.max() <= limit:
            return None
    elif want.kind == "f" and np.isfinite(out.sum()):  # no inf made (nor NaN there; a sum past the range: below)
        return None
    with np.errstate(invalid="ignore", over="ignore"):  # a float past the integers' range: not equal
        if src.kind in "iu" and want.kind in "iu":
            lost = (a < np.iinfo(want).min) | (a > np.iinfo(want).max)
        elif src.kind in "iu":  # past 2**63 (int64's) a float cast back is no number: compared in floats
            lost = (out >= 2.0 ** (8 * src.itemsize - (src.kind == "i"))) | (out.astype(src) != a)
        else:
            lost = np.isinf(out) & np.isfinite(a)
    i = np.flatnonzero(lost)
    if not len(i):
        return None
    past = src.kind == "f"
    return f"value {a[i[0]]} ({src}) is {f'past the range of {want}' if past else f'not exactly a {want}'}, " \
           f"the field's dtype"


def image_value(data, ext, col, rng):
    """uint8 (C, h, w): (h, w) the field's size, or for pad and native the image's own size
    within it. The image's size is checked (pipeline.data.decoding.image_caps) against the field's size
    before a pixel is decoded."""
    from PIL import Image

    c, (h, w) = col.channels, col.size
    shape = (c, h, w)
    if ext == "raw" or col.fit in ("center-crop", "random-crop"):
        u = rng() if col.fit == "random-crop" else None
        crop = None if u is None else (u.random(), u.random())  # as schema.decode_images draws it
        return decode.decode_image(data, ext, shape, crop)
    try:
        pixels = decode._pil(data, ext, shape)
    except (OSError, SyntaxError, Image.DecompressionBombError) as e:
        raise ValueError(f"undecodable image: {decode.pil_reason(e)}") from None
    img = pixels if not isinstance(pixels, np.ndarray) else Image.fromarray(pixels[:, :, 0] if c == 1 else pixels)
    iw, ih = img.size
    if col.fit == "resize":
        nh, nw = h, w
    else:
        scale = min(h / ih, w / iw)
        if col.fit == "native":
            scale = min(scale, 1.0)
        nh, nw = max(1, min(h, round(ih * scale))), max(1, min(w, round(iw * scale)))
    if (nh, nw) != (ih, iw):
        img = img.resize((nw, nh), Image.BILINEAR, reducing_gap=3.0)
    return np.ascontiguousarray(np.asarray(img, dtype=np.uint8).reshape(nh, nw, c).transpose(2, 0, 1))


def check_value(col, value):
    """None if `value` fits the field as the batch holds it, else what is wrong (for a stage of the user's)."""
    if col.kind == "image":
        a = value if isinstance(value, np.ndarray) else None
        if a is None or a.dtype != np.uint8 or a.ndim != 3 or a.shape[0] != col.channels:
            return f"a uint8 ({col.channels}, H, W) array expected, got {_described(value)}"
        if (a.shape[1:] != col.size) if not col.padded else (a.shape[1] > col.size[0] or a.shape[2] > col.size[1]):
            return f"image of {a.shape[1]}x{a.shape[2]}, the field takes {'at most ' if col.padded else ''}" \
                   f"{col.size[0]}x{col.size[1]}"
    elif col.kind == "text" and col.tokens is not None:
        a = np.asarray(value) if isinstance(value, (list, tuple, np.ndarray)) else None
        if a is None or a.ndim != 1 or a.dtype.kind not in "iu" or len(a) > col.tokens:
            return f"at most {col.tokens} integer token ids expected, got {_described(value)}"
    elif col.listed:
        if not isinstance(value, str if col.kind == "text" else bytes):
            return f"{'a str' if col.kind == 'text' else 'bytes'} expected, got {_described(value)}"
    elif col.kind in ("int", "float", "class"):
        a = np.asarray(value) if isinstance(value, (int, float, np.number, np.ndarray, list)) else None
        want = () if col.length is None else (col.length,)
        if a is None or a.shape != want or a.dtype.kind not in ("iuf" if col.kind == "float" else "iu"):
            return f"{col.kind} of shape {want} expected, got {_described(value)}"
        return _held(a, np.float32 if col.kind == "float" else np.int64)
    elif col.kind == "array":
        a = value if isinstance(value, np.ndarray) else None
        if a is None or a.ndim != len(col.shape) or any(s > m for s, m in zip(a.shape, col.shape)):
            return f"an array of at most {col.shape} expected, got {_described(value)}"
        if not np.can_cast(a.dtype, col.dtype, "same_kind"):
            return f"an array of {col.dtype} expected, got {_described(value)}"
        return _held(a, col.dtype)
    return None


def _held(a, dtype):
    """inexact for a value the batch will cast to `dtype` (its field's): a stage's int64 2**53+1 in a
    float field, or 1e40 as float32, is refused as a member's is."""
    with np.errstate(over="ignore", invalid="ignore"):
        return inexact(a, a.astype(dtype))


def _described(value):
    if isinstance(value, np.ndarray):
        return f"{value.dtype} {value.shape}"
    return type(value).__name__


def stage_name(fn):
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


def call_stage(fn, sample, key):
    """A user's sample stage on a sample dict: what it returns, a dict or None (dropped); whatever it
    raises, or any other return, one InputError line naming the stage and the sample."""
    name = stage_name(fn)
    try:
        sample = fn(sample)
    except Exception as e:  # noqa: BLE001 - the user's code: say whose and on what, in one line
        raise InputError(f"sample stage {name} raised {e.__class__.__name__}: {cut(e, 200)} (sample {key})") from None
    if sample is not None and not isinstance(sample, dict):
        raise InputError(f"sample stage {name} returned {type(sample).__name__}, not the sample dict or None "
                         f"(sample {key})")
    return sample


def user_stage(fn, values, key, source, seed, final):
    """A function of the user's on the sample dict {fields..., "__key__", "__source__", "__seed__"}."""
    sample = call_stage(fn, dict(values, __key__=key, __source__=source, __seed__=seed), key)
    if sample is None:
        return None
    name = stage_name(fn)
    out = {}
    for col in final:
        v = sample.get(col.name)
        problem = None if v is None and (col.optional or values.get(col.name) is None) else check_value(col, v)
        if problem:
            raise InputError(f"sample stage {name} returned field {col.name}: {problem} (sample {key})")
        out[col.name] = v
    return out
