"""The stream's state as it travels in checkpoints: written by `MixedStream.state_dict`,
read back here with every number checked (a checkpoint is input).

    {"version": 3, "sources": [names], "seed", "epoch", "targets": [positions per source],
     "order": {"window_samples", "window_bytes", "resample"},
     "segment": {"generation", "world", "workers", "batch_size", "batches",
                 "spans": [[[start, length], ...] per source]},
     "ranks": [{"rank", "done": {worker: batches}, "positions": {worker: [per source]}}]}

One rank's state lists its own entry under "ranks"; the states of every rank, merged,
list them all (`merge`). Nothing else is saved: the segment and the positions are all
a stream needs to go on (pipeline.data.deal).
"""
from pipeline.data import deal, order

VERSION = 3
MAX_WORLD = 1 << 16  # ranks a stream state may say it ran on (as a checkpoint's world)
MAX_WORKERS = 1 << 10  # DataLoader workers per rank (as --workers)
MAX_SPANS = 1 << 20  # spans a segment may list per source: each re-deal adds at most one per old pair


def encode(seg, targets, names, seed, rank, done, positions, order_of):
    """One rank's state: the segment, and this rank's workers' batches and positions.
    `order_of`: the settings that decide which sample each position holds (the shuffle
    window, resampling), which must not change inside an epoch."""
    return {"version": VERSION, "sources": list(names), "seed": seed, "epoch": seg.epoch,
            "targets": [int(t) for t in targets], "order": dict(order_of),
            "segment": {"generation": seg.generation, "world": seg.world, "workers": seg.workers,
                        "batch_size": seg.batch_size, "batches": seg.batches,
                        "spans": [[[int(a), int(n)] for a, n in spans] for spans in seg.spans]},
            "ranks": [{"rank": rank, "done": {str(w): int(d) for w, d in done.items()},
                       "positions": {str(w): [int(x) for x in p] for w, p in positions.items()}}]}


def merge(state):
    """(root, ranks) of a loaded state: one root, or a list of roots (one per rank) that
    must agree on everything but their ranks."""
    roots = state if isinstance(state, list) else [state]
    if not roots or not all(isinstance(r, dict) for r in roots):
        raise ValueError("stream state: a mapping, or a non-empty list of per-rank mappings, expected")
    for r in roots:
        if r.get("version") != VERSION:
            raise ValueError(f"stream state version {_short(r.get('version'))}, expected {VERSION}")
        missing = [k for k in ("sources", "seed", "epoch", "targets", "order", "segment", "ranks") if k not in r]
        if missing:
            raise ValueError(f"stream state: field {missing[0]} missing")
        if not isinstance(r["ranks"], list) or not all(isinstance(x, dict) for x in r["ranks"]):
            raise ValueError("stream state ranks: a list of per-rank mappings expected")
    first = roots[0]
    for r in roots[1:]:
        for k in ("sources", "seed", "epoch", "targets", "order", "segment"):
            if r[k] != first[k]:
                raise ValueError(f"the ranks' stream states disagree on {k}")
    return first, [x for r in roots for x in r["ranks"]]


def _int(v, what, lo, hi):
    if type(v) is not int or not lo <= v <= hi:
        raise ValueError(f"stream state {what}: {_short(v)}; an integer in {lo}..{hi} expected")
    return v


def _ints(v, what, n, lo, hi):
    if not isinstance(v, list) or len(v) != n:
        raise ValueError(f"stream state {what}: a list of {n} integers expected")
    return [_int(x, what, lo, hi) for x in v]


def _spans(spans, target, source):
    """A source's spans: [start, length] pairs, in order, apart, inside 0..target."""
    if not isinstance(spans, list) or len(spans) > MAX_SPANS:
        raise ValueError(f"stream state spans of source {source}: a list of at most {MAX_SPANS} expected")
    out, end = [], -1
    for x in spans:
        if not isinstance(x, list) or len(x) != 2:
            raise ValueError(f"stream state spans of source {source}: [start, length] pairs expected")
        a, n = _int(x[0], f"spans of source {source}", 0, order.MAX_COUNT), _int(x[1], f"spans of source {source}",
                                                                                 1, order.MAX_COUNT)
        if a <= end or a + n > target:
            raise ValueError(f"stream state spans of source {source}: [{a}, {n}] overlaps the span before it or "
                             f"lies past the epoch's {target} positions")
        end = a + n - 1
        out.append((a, n))
    return tuple(out)


def _short(value, n=60):
    text = repr(value)
    return text if len(text) <= n else text[:n] + "..."


def check(root, ranks, *, names, seed, targets, passes, order_of, epoch_samples=None):
    """(the loaded segment, a deal.Segment; per rank, the positions its workers passed over
    without a sample; whether it was saved at its epoch's end), every number checked against
    the stream's sources, seed, epoch and order settings and against the others (a
    checkpoint is input): ValueError naming the first that is off. A state saved at its
    epoch's end says nothing about the next epoch, whose weights and order may differ."""
    S = len(names)
    if root["sources"] != names or root["seed"] != seed:
        raise ValueError(f"the stream state is for sources {_short(root['sources'])} with seed "
                         f"{_short(root['seed'])}; this stream has {names} with seed {seed}")
    epoch = _int(root["epoch"], "epoch", 0, order.MAX_COUNT)
    got = _ints(root["targets"], "targets", S, 0, order.MAX_COUNT)
    if not isinstance(root["order"], dict):
        raise ValueError("stream state order: a mapping expected")
    if not _claims_end(root["segment"], ranks):  # checked in full below; the likelier mistake is named first
        _check_same_epoch(root, got, targets, order_of)
    g = root["segment"]
    if not isinstance(g, dict):
        raise ValueError("stream state segment: a mapping expected")
    fields = {"generation": (0, order.MAX_COUNT), "world": (1, MAX_WORLD), "workers": (1, MAX_WORKERS),
              "batch_size": (1, order.MAX_COUNT), "batches": (0, order.MAX_COUNT)}
    v = {k: _int(g.get(k), f"segment {k}", *b) for k, b in fields.items()}
    spans = g.get("spans")
    if not isinstance(spans, list) or len(spans) != S:
        raise ValueError(f"stream state segment spans: one list per source ({S}) expected")
    checked = tuple(_spans(x, t, i) for i, (x, t) in enumerate(zip(spans, got)))
    seg = deal.Segment(epoch, v["generation"], v["world"], v["workers"], v["batch_size"], v["batches"],
                       checked, seed, tuple(passes))
    # what each segment is made to be: an epoch's first its whole targets in batches of its
    # world, a re-dealt one all its spans hold
    if seg.generation == 0:
        whole = tuple(((0, int(t)),) if t else () for t in got)
        if seg.spans != whole or seg.batches != sum(got) // (seg.world * seg.batch_size):
            raise ValueError(f"stream state segment: an epoch's first segment holds every position of its targets "
                             f"in {sum(got) // (seg.world * seg.batch_size)} batches a rank; this one "
                             f"{seg.batches} batches over other spans")
    elif seg.batches * seg.world * seg.batch_size > int(seg.left().sum()):
        raise ValueError(f"stream state segment: {seg.batches} batches of {seg.world} x {seg.batch_size} "
                         f"samples, more than its spans hold ({int(seg.left().sum())})")
    elif seg.batches != int(seg.left().sum()) // (seg.world * seg.batch_size):
        raise ValueError(f"stream state segment: {seg.batches} batches, where its spans make "
                         f"{int(seg.left().sum()) // (seg.world * seg.batch_size)} of {seg.world} x {seg.batch_size}")
    if 1 < len(ranks) != seg.world:  # one rank's own state (same world), or every rank's
        raise ValueError(f"stream state: {len(ranks)} ranks' states for a segment of {seg.world} ranks")
    seen, done = set(), {}
    for r in ranks:
        rank = _int(r.get("rank"), "rank", 0, seg.world - 1)
        if rank in seen:
            raise ValueError(f"stream state: rank {rank} appears twice")
        seen.add(rank)
        done[rank] = _check_done(seg, r)
    if len({sum(d) for d in done.values()}) != 1:
        raise ValueError(f"the ranks' stream states disagree on how many batches were consumed "
                         f"({sorted({sum(d) for d in done.values()})})")
    ended = sum(next(iter(done.values()))) == seg.batches
    if not ended:  # (already checked where the state claimed no end)
        _check_same_epoch(root, got, targets, order_of)
    passed = {r["rank"]: _check_positions(seg, r, done[r["rank"]], S) for r in ranks}
    return seg, passed, ended


def _claims_end(segment, ranks):
    """Whether a state says every rank made all of its segment's batches (its numbers unchecked)."""
    try:
        return all(sum(r["done"].values()) == segment["batches"] for r in ranks)
    except (TypeError, KeyError, AttributeError):
        return False


def _check_same_epoch(root, got, targets, order_of):
    """A state inside an epoch goes on only with the epoch's own split and order settings."""
    if got != [int(t) for t in targets]:
        raise ValueError(f"the stream state's epoch splits its samples {got} between the sources, this "
                         f"stream {[int(t) for t in targets]}: the weights or the epoch's samples changed inside "
                         f"an epoch; change them at an epoch boundary")
    if root["order"] != dict(order_of):
        said = ", ".join(f"{k} {_short(root['order'].get(k))}" for k in order_of)
        raise ValueError(f"the interrupted epoch ran with {said}; this stream has "
                         f"{', '.join(f'{k} {v}' for k, v in order_of.items())}: which sample each position holds "
                         f"would change (--shuffle-buffer, --shuffle-window, --resample); change them at an epoch "
                         f"boundary")


def _check_done(seg, r):
    """One rank's batches per worker: one entry each, within its share, made in turn."""
    keys = [str(w) for w in range(seg.workers)]
    for part in ("done", "positions"):
        if not isinstance(r.get(part), dict) or sorted(r[part]) != sorted(keys):
            raise ValueError(f"stream state rank {r['rank']} {part}: one entry per worker 0..{seg.workers - 1}")
    done = [_int(r["done"][k], f"rank {r['rank']} done[{k}]", 0, seg.worker_batches(int(k))) for k in keys]
    if max(done) - min(done) > 1:
        raise ValueError(f"stream state rank {r['rank']} done {done}: workers make batches in turn")
    return done

def _check_positions(seg, r, done, sources):
    """One rank's positions: no fewer than the samples its workers took, no more than
    their runs hold on top (positions passed over: damage, samples a stage dropped)."""
    keys = [str(w) for w in range(seg.workers)]
    quotas = seg.quotas()
    passed = 0
    for k, d in zip(keys, done):
        pair = r["rank"] + int(k) * seg.world
        got = _ints(r["positions"][k], f"rank {r['rank']} positions[{k}]", sources, 0, order.MAX_COUNT)
        taken = seg.choices(pair).taken(d * seg.batch_size)
        for s, (p, t, q) in enumerate(zip(got, taken, quotas[pair])):
            if not t <= p <= t + q:
                raise ValueError(f"stream state rank {r['rank']} worker {k} source {s}: {p} positions read, "
                                 f"but its {d} batches took {int(t)} samples of a run of {int(q)}")
            passed += int(p - t)
    return passed
