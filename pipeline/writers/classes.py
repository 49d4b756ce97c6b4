"""A split's classes from its raw labels: integers, names sorted, --classes FILE, or another
split's manifest. One rule for every indexing path (`make-shards --index` with and without
--fields, indexing on first use), so the splits of one set agree on what each label means."""
import collections
import warnings

from pipeline.data.decoding.labelling import as_integer, as_name, mixed_classes
from pipeline.errors import ShardError
from pipeline.files import MAX_JSON, open_regular


def read_text(path, what):
    """A small UTF-8 text file named by a flag: one line, never a hang, for a FIFO, a
    device, something huge or not text."""
    try:
        with open_regular(path) as f:
            data = f.read(MAX_JSON + 1)
    except (OSError, ShardError) as e:
        raise ShardError(f"{what}: {getattr(e, 'strerror', None) or e}") from None
    if len(data) > MAX_JSON:
        raise ShardError(f"{what}: more than {MAX_JSON} bytes; a list of class names is far smaller")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ShardError(f"{what}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def resolve_classes(found, classes_file, classes_from):
    """(classes, label_values, label_names) from every shard's raw labels: integers as today
    (the sorted distinct values, or names from --classes for 0..N-1), class names mapped to
    indices by their sorted order, by --classes FILE, or by another split's manifest."""
    first = {}
    values = collections.Counter()
    for f in found:
        values += f["labels"]
        for v, k in f["first"].items():
            first.setdefault(v, (f["url"], k))
    integers = {v: as_integer(v) for v in values}
    names_given = None
    if classes_from is not None:
        where, m = classes_from
        if not m.get("label_names"):
            named = [v for v, i in integers.items() if i is None]
            if named:
                raise ShardError(_at(first, named[0], f"label {as_name(named[0])[:60]!r} is a class name, but the "
                                                      f"labels of {where} are integers"))
            known = m.get("label_values") or range(len(m["classes"]))
            outside = sorted({i for i in integers.values()} - set(known))
            if outside:
                v = next(v for v, i in integers.items() if i == outside[0])
                raise ShardError(_at(first, v, f"label {outside[0]} is not one of the {len(known)} labels of {where}"))
            return list(m["classes"]), m.get("label_values"), False
        names_given, source = list(m["classes"]), where
    elif classes_file:
        source = f"--classes {classes_file}"
        names_given = [ln.strip() for ln in read_text(classes_file, source).splitlines() if ln.strip()]
        if len(set(names_given)) != len(names_given):
            twice = next(n for n in names_given if names_given.count(n) > 1)
            raise ShardError(f"{source}: class name {twice!r} is listed twice")
        if all(i is not None for i in integers.values()):
            outside = sorted({i for i in integers.values() if not 0 <= i < len(names_given)})
            if outside:
                raise ShardError(f"{source}: {len(names_given)} names, but labels {outside[:5]} fall outside "
                                 f"0..{len(names_given) - 1}")
            return names_given, None, False
    elif all(i is not None for i in integers.values()):
        distinct = sorted(set(integers.values()))
        return [str(v) for v in distinct], None if distinct == list(range(len(distinct))) else distinct, False
    if names_given is None:
        mixed = mixed_classes(values)
        if mixed:
            warnings.warn(mixed, stacklevel=2)
        return sorted({as_name(v) for v in values}), None, True
    known = set(names_given)
    for v in values:
        if as_name(v) not in known:
            raise ShardError(_at(first, v, f"class name {as_name(v)[:60]!r} is not in {source}"))
    return names_given, None, True


def _at(first, value, problem):
    url, key = first[value]
    return f"{url}: sample {key}: {problem}"
