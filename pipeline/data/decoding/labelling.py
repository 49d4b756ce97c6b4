"""A sample's label: the label rule (cls, txt, index, json:FIELD, dir[:K]), its raw value, and the
class index it maps to. A missing label is Unlabelled, a ValueError the reader counts or skips."""
import functools
import json
import re
import struct
import zlib

from pipeline.errors import cut


LABEL_EXTS = ("cls", "txt", "index")
CLASS_KEYS = ("label", "class", "cls")  # a .json key that names the class, in this order, for both doors
_INTEGER = re.compile(r"[+-]?[0-9]+\Z")
UNLABELLED = -1  # what a label member holding -1 means: the sample has no label
MAX_LABEL_JSON = 1 << 20  # bytes of a .json member parsed for its label: real ones hold a few kB
# What parsing a sample's content may raise besides ValueError (a .json nested 100,000 deep, a
# decoder's struct or zlib error, ...): each becomes a ValueError naming the sample's problem, so
# the reader skips and counts it like any damage instead of ending the run
CONTENT_ERRORS = (ArithmeticError, EOFError, LookupError, MemoryError, OSError, RuntimeError, SyntaxError,
                  TypeError, struct.error, zlib.error)
_LABEL_NAMES = re.compile(r"label|class|categor|target|cls", re.IGNORECASE)


class Unlabelled(ValueError):
    """A sample without a label: a missing label member or field, or a label of -1. `hint`
    gives the rest of the message (the fields the sample has) only when it is shown: a
    source that skips unlabelled samples drops most of these unread."""

    def __init__(self, message, hint=None):
        super().__init__(message)
        self.hint = hint

    def __str__(self):
        text = super().__str__()
        return f"{text}; {self.hint()}" if self.hint else text


@functools.lru_cache(maxsize=256)  # label_of asks once a sample
def parse_label_key(text):
    """The label rule: 'cls' -> ('cls', None); 'json:meta.label' -> ('json', ('meta', 'label'));
    'dir' -> ('dir', -1), the key's last folder; 'dir:K' -> ('dir', K), its K-th folder
    counting from 0. Raises ValueError."""
    ext, _, field = text.partition(":")
    if ext in LABEL_EXTS and not field:
        return ext, None
    if ext == "json" and field and all(field.split(".")):
        return ext, tuple(field.split("."))
    if ext == "dir" and (not field or field.isdigit()):
        return ext, int(field) if field else -1
    raise ValueError(f"label key {text!r}: use cls, txt, index, json:FIELD (e.g. json:label, json:meta.label), "
                     f"dir (the key's last folder) or dir:K (its K-th folder, from 0)")


def label_member(text):
    """The member a label rule reads (None for dir: the key holds the label)."""
    ext = parse_label_key(text)[0]
    return None if ext == "dir" else ext


def describe_label(text):
    """The rule in words, for console lines and errors."""
    ext, path = parse_label_key(text)
    if ext == "json":
        return f'.json field "{".".join(path)}"'
    if ext == "dir":
        return "the key's last folder" if path < 0 else f"folder {path} of the key (from 0)"
    return f".{ext}"


def raw_label(sample, rule):
    """A sample's label as written: an int (a JSON number) or the text (str), which is an
    integer or a class name. Raises Unlabelled for a sample without one, ValueError for
    a malformed one."""
    ext, path = parse_label_key(rule)
    if ext == "dir":
        folders = sample["__key__"].split("/")[:-1]
        if not -len(folders) <= path < len(folders):
            raise ValueError(f"key {sample['__key__']!r} has no folder {'to name its class' if path < 0 else path}")
        return folders[path]
    data = sample.get(ext)
    if data is None:
        raise Unlabelled(f"no .{ext} member")
    if path is None:
        try:
            value = bytes(data).decode("utf-8").strip()
        except UnicodeDecodeError:
            raise ValueError(f".{ext} holds {bytes(data[:20])!r}, not text") from None
        if not value:
            raise ValueError(f".{ext} is empty, not an integer or a class name")
    else:
        value = top = label_json(data)
        for part in path:
            if not isinstance(value, dict) or part not in value:
                raise Unlabelled(f".json has no {'.'.join(path)} field", hint=lambda top=top: json_hint(top))
            value = value[part]
        if value is None:
            raise Unlabelled(f".json {'.'.join(path)} is null")
        if isinstance(value, bool) or not isinstance(value, (int, str)) or value == "":
            raise ValueError(f".json {'.'.join(path)} is {cut(repr(value), 60)}, not an integer or a class name")
    if value == UNLABELLED or value == str(UNLABELLED):
        raise Unlabelled(f"{describe_label(rule)} is {UNLABELLED}, which marks a sample without a label")
    return value


def label_json(data):
    """A .json member's content, parsed; ValueError (one line) for one too large, too deeply
    nested or not JSON, checked before parsing where it can be."""
    if len(data) > MAX_LABEL_JSON:
        raise ValueError(f".json of {len(data)} bytes, more than the {MAX_LABEL_JSON} a label's .json may hold "
                         f"(pipeline.data.decoding.labelling.MAX_LABEL_JSON)")
    try:
        return json.loads(bytes(data))
    except RecursionError:
        raise ValueError(".json nested too deeply to read") from None
    except (ValueError, MemoryError, TypeError) as e:  # UnicodeDecodeError is a ValueError
        raise ValueError(f".json is not valid JSON ({cut(e, 80)})") from None


def json_fields(value, limit=1000):
    """(path, value) of a parsed .json's fields that hold anything but a non-empty object
    (path ("annotation", "category") for `annotation.category`), in document order, from at
    most `limit` fields visited."""
    out, todo = [], [((), value)] if isinstance(value, dict) else []
    while todo:
        path, v = todo.pop()
        if isinstance(v, dict) and (v or not path) and limit > 0:
            children = list(v.items())[:limit]
            limit -= len(children)
            todo.extend((path + (k,), w) for k, w in reversed(children))
        else:
            out.append((path, v))
    return out


def json_hint(value):
    """What a parsed .json holds (its field paths, cut to a line) and the --label-key that
    would read a label from it: a field named like a label (label, class, category, target)
    holding an integer or a name, else the first such field."""
    if not isinstance(value, dict):
        return f"it holds a JSON {type(value).__name__}, not an object with fields"
    fields = json_fields(value)
    if not fields:
        return "it holds no fields"
    shown = ", ".join(".".join(p) for p, _ in fields[:12])
    shown += f" and {len(fields) - 12} more" if len(fields) > 12 else ""
    usable = [p for p, v in fields if isinstance(v, (int, str)) and not isinstance(v, bool) and v != ""
              and all(part and "." not in part and ":" not in part for part in p)]
    best = next((p for p in usable if _LABEL_NAMES.search(p[-1])), usable[0] if usable else None)
    hint = f"; e.g. --label-key json:{'.'.join(best)}" if best else ""
    return f"it has {cut(shown, 300)}{cut(hint, 200)}"


def label_hint(sample):
    """One line on what a sample holds that could be its label: its members, the fields of its
    .json, and a --label-key that reads one (for errors about a sample without a label)."""
    have = sorted(k for k in sample if not k.startswith("__"))
    line = f"sample {cut(sample['__key__'])} has members {cut(', '.join('.' + e for e in have), 200) or 'none'}"
    rule = next((e for e in ("cls", "index", "txt") if sample.get(e) is not None), None)
    if rule:
        return f"{line}; e.g. --label-key {rule}"
    if sample.get("json") is not None:
        try:
            return f"{line}; its .json: {json_hint(label_json(sample['json']))}"
        except ValueError as e:
            return f"{line}; {e}"
    return line + ("; e.g. --label-key dir (its key's folder)" if "/" in sample["__key__"] else "")


def default_label(sample):
    """The label rule a sample's members suggest: .cls, .index, a .json class key (CLASS_KEYS),
    .txt, then the key's folder; None if none fits. The .json key comes before .txt as in
    indexing on first use (pipeline.writers.infer), so `make-shards --index` of a set with a
    caption and a {"class": ...} takes the same label."""
    for ext in ("cls", "index"):
        if ext in sample:
            return ext
    if "json" in sample:
        try:
            value = label_json(sample["json"])
        except ValueError:
            value = None
        key = json_class_key(value)
        if key:
            return f"json:{key}"
    if "txt" in sample:
        return "txt"
    return "dir" if "/" in sample["__key__"] else None


def json_class_key(doc):
    """The first of CLASS_KEYS a parsed .json holds as a label (an integer or a name, not a
    true/false, number, list or object), or None."""
    if not isinstance(doc, dict):
        return None
    return next((k for k in CLASS_KEYS if isinstance(doc.get(k), (int, str)) and not isinstance(doc[k], bool)), None)


def as_integer(value):
    """A raw label as an integer label, or None if it is a class name."""
    if isinstance(value, int):
        return value
    return int(value) if _INTEGER.match(value) else None


def as_name(value):
    return value if isinstance(value, str) else str(value)


def class_value(value):
    """A class label in the one form that indexing (with or without --fields, ahead or on first
    use) and the stream share: an int for an integer (a JSON integer, or text of ASCII digits with
    an optional sign, so '03' and '+3' are 3), else the name as written, stripped ('3.0', '\u0663'
    and 'cat' are names). ValueError (the value as written) for none: empty text, a JSON
    true/false, float, list, object."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if not isinstance(value, str):
        raise ValueError(f"{cut(json.dumps(value, ensure_ascii=False), 60)} is not an integer or a class name")
    text = value.strip()
    if not text:
        raise ValueError(f"{value!r} is empty, not an integer or a class name")
    return int(text) if _INTEGER.match(text) else text


def mixed_classes(labels):
    """A warning line when a label's values mix class names with integers (0..11 and 'cat'): every
    value is then a name, sorted as text ('10' before '2'), so the integers no longer index their
    classes; None when they do not mix."""
    numbers = sorted(v for v in labels if isinstance(v, int))
    if not numbers or len(numbers) == len(labels):
        return None
    name = next(v for v in labels if isinstance(v, str))
    return (f"the labels mix {len(numbers)} integer(s) (e.g. {numbers[0]}) with {len(labels) - len(numbers)} "
            f"class name(s) (e.g. {cut(repr(name), 40)}): all are taken as names, sorted as text ('10' before "
            f"'2'), so an integer is not its class index; give every class its name, or --classes FILE")


def label_of(sample, target, lookup=None):
    """The class index of a sample; Unlabelled or ValueError saying what is missing or wrong,
    whatever its label member holds."""
    try:
        return _label_of(sample, target, lookup)
    except ValueError:
        raise
    except CONTENT_ERRORS as e:
        raise ValueError(f"{describe_label(target.label)} unreadable ({type(e).__name__}: {cut(e, 80)})") from None


def _label_of(sample, target, lookup):
    ext, path = parse_label_key(target.label)
    if path is None and target.names is None and sample.get(ext) is not None:  # the common case: an integer member
        try:
            number = int(sample[ext])
        except (ValueError, TypeError):
            number = UNLABELLED
        if number != UNLABELLED:
            return class_index(number, target, lookup)
    value = raw_label(sample, target.label)
    if not target.names:
        number = as_integer(value)
        if number is None:
            raise ValueError(f"{describe_label(target.label)} is {cut(repr(as_name(value)), 80)}, not an integer")
        value = number
    return class_of(value, target, lookup)


def class_of(value, target, lookup=None):
    """A raw label's class index in its source, as the manifest maps it: by its class names, its
    label values, or as 0..classes-1. The default schema's labels and a schema's class field
    (pipeline.data.fields.schema) both come through here, so one raw label means one class
    wherever it is read. ValueError saying why a label has none."""
    if target.names:
        name = as_name(class_value(value))
        index = lookup.get(name) if lookup is not None else None
        if index is None:
            raise ValueError(f"class name {cut(repr(name), 80)} is not one of the source's {len(target.names)} classes")
        return index
    if isinstance(value, str):  # a schema's class field holding a name where the manifest has class ids
        raise ValueError(f"class name {cut(repr(value), 80)}, and the source's classes are ids "
                         f"0..{target.classes - 1}: index the set again (make-shards --index) to list its names")
    return class_index(value, target, lookup)


def class_index(value, target, lookup=None):
    """A label's class index in its source; ValueError saying why it has none."""
    if lookup is not None:
        if value not in lookup:
            raise ValueError(f"label {value} is not one of the source's {len(lookup)} label values")
        return lookup[value]
    if not 0 <= value < target.classes:
        raise ValueError(f"label {value} outside 0..{target.classes - 1}")
    return value
