"""Brace patterns of shard names (`data-{000..099}.tar`): expanded within a count made before a
single name is, so a pattern of a billion names is refused, not built."""
import braceexpand as brace

from pipeline.data.store import find_manifest, remote
from pipeline.errors import ShardError


MAX_PATTERN = 1_000_000  # names a brace pattern may expand to; counted before a single one is made
MAX_NESTING = 32  # braces inside braces: each level is parsed again, by braceexpand as by the count


def expand_pattern(spec, limit=MAX_PATTERN):
    """The names a brace pattern expands to, as braceexpand makes them. ShardError when the
    pattern is malformed or names more than `limit`, found by counting first: braceexpand
    builds every range of a pattern in memory before it yields the first name, so
    '{0..999999999}' alone would cost gigabytes."""
    depth = deepest = 0
    for ch in spec:  # escaped braces count too: an over-estimate, never an under-estimate
        depth += (ch == "{") - (ch == "}")
        deepest = max(deepest, depth)
    if deepest > MAX_NESTING:
        raise ShardError(f"{spec[:200]}: brace pattern nested {deepest} deep, more than {MAX_NESTING}")
    try:
        n = _count(spec, limit)
    except ValueError as e:  # unbalanced braces, 5,000-digit range ends
        raise ShardError(f"{spec[:200]}: not a brace pattern ({e})") from None
    if n > limit:
        raise ShardError(f"{spec[:200]}: the brace pattern names more than {limit:,} shards, the most one may name; "
                         f"list the shards in a manifest instead")
    return list(brace.braceexpand(spec))


def expand_shards(spec, policy=remote.Policy()):
    """The shards a SPEC names: its brace pattern expanded (`expand_pattern`), then each local
    or object-store name holding a wildcard (`train/*.tar`) replaced by the shards it matches,
    in name order (`find_manifest.globbed`; a store's listing within `policy`'s limits)."""
    names = []
    for name in expand_pattern(spec):
        names += find_manifest.globbed(name, policy) if find_manifest.is_glob(name) else [name]
    if len(names) > MAX_PATTERN:
        raise ShardError(f"{spec[:200]}: the pattern names more than {MAX_PATTERN:,} shards, the most one may name; "
                         f"list the shards in a manifest instead")
    return names


def _count(pattern, limit):
    """How many names brace.parse_pattern makes (stopping early past `limit`); a part that
    makes no name counts as one, as braceexpand still builds every other part."""
    total, pos, start, depth, parts = 1, 0, 0, 0, []
    while pos < len(pattern):
        ch = pattern[pos]
        if ch == "\\":
            pos += 2
            continue
        if ch == "{":
            if depth == 0:
                start = pos
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                parts.append(_count_expression(pattern[start + 1:pos], limit))
                if max(parts[-1], 1) > limit:
                    return limit + 1
                total *= max(parts[-1], 1)
                if total > limit:
                    return limit + 1
        pos += 1
    if depth != 0:
        raise brace.UnbalancedBracesError(f"Unbalanced braces: '{pattern[:200]}'")
    return total


def _count_expression(expr, limit):
    m = brace.int_range_re.match(expr)
    if m:
        lo, hi, step = int(m[1]), int(m[2]), (int(m[3]) or 1) if m[3] else 1
        return abs(hi - lo) // step + 1
    m = brace.char_range_re.match(expr)
    if m:
        return len(brace.make_char_range(*m.groups()))
    items, pos, start, depth = [], 0, 0, 0
    while pos < len(expr):
        ch = expr[pos]
        if ch == "\\":
            pos += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(expr[start:pos])
            start = pos + 1
        pos += 1
    if depth != 0 or not items:  # not a sequence: braces kept as text around a pattern
        return _count(expr, limit)
    total = 0
    for item in items + [expr[start:]]:
        total += _count(item, limit)
        if total > limit:
            return limit + 1
    return total
