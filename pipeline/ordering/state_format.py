"""The stream's state as it travels in checkpoints: written by `MixedStream.state_dict`,
read back here with every number checked (a checkpoint is input).

    {"version": 4, "sources": [names], "listings": [each source's shard-list digest], "seed",
     "epoch", "targets": [positions per source], "order": {"window_samples", "window_bytes", "resample"},
     "segment": {"world", "workers", "batch_size", "generation", "batches",
                 "before": [{"world", "workers", "batch_size", "done", "passed": [[pair, [per source]], ...]}]},
     "done": batches each rank made of the segment,
     "ranks": [{"rank", "passed": [[worker, [per source]], ...], "check"}]}

Nothing in it can be offered on its own: a segment lists no spans, only the worlds before it
and what each consumed (`before`), from which its spans are made again (deal.replay): they
are the complement of what the earlier segments read, whatever is edited. A pair's
positions are the samples its batches took (recomputed from `done`) plus the positions it
passed over without a sample (damage, a stage's drops), listed only where there were any.
Those have no bound but the range: a pair that passes over more than its run reads its
reserve, and past that later passes (plans.RunPlan), so a stage dropping most samples
makes any count. What ties them, and every other number, is `check` in each rank's entry,
a digest of its numbers and the rest of the state: an edited number, consistent with the
others or not, is refused (a digest, not a signature: whoever recomputes it is not stopped).
So a rank's entry is a few dozen bytes whatever the world, and a state is its segment once
plus those entries (`merge`).
"""
import functools
import hashlib
import json

from pipeline.errors import short
from pipeline.ordering import deal, order

VERSION = 4
MAX_WORLD = 1 << 16  # ranks a stream state may say it ran on (as a checkpoint's world)
MAX_WORKERS = 1 << 10  # loader workers per rank (as --workers)
MAX_DEALS = 1 << 12  # segments an epoch may have run before this one: each is a stop and a resume on another world
CHECK_CHARS = 16  # hex digits of a rank entry's check


def listing(source):
    """The digest of a source's shard list: its manifest's (names, sizes, sha256, counts), or
    for a source made without one, its shards' file names, sizes and counts (kept per source
    object: every state a stream writes or reads names it)."""
    if source.listing:
        return source.listing
    kept = _LISTINGS.get(id(source))
    if kept is None or kept[0] is not source:
        rows = [[u.rstrip("/").rsplit("/", 1)[-1], size, int(n)]
                for u, size, n in zip(source.urls, source.sizes or [None] * len(source.urls), source.counts)]
        if len(_LISTINGS) >= 64:
            _LISTINGS.clear()
        kept = _LISTINGS[id(source)] = (source, hashlib.sha256(json.dumps(rows).encode()).hexdigest())
    return kept[1]


_LISTINGS = {}  # id(source): (source, digest)


def encode(seg, targets, names, listings, seed, rank, done, passed, order_of):
    """One rank's state: the segment, the batches each rank made of it, and the positions this
    rank's workers passed over. passed: {worker: [per source]} (workers that passed none may be
    left out). `order_of`: the settings that decide which sample each position holds (the
    shuffle window, resampling), which must not change inside an epoch."""
    root = {"version": VERSION, "sources": list(names), "listings": list(listings), "seed": seed,
            "epoch": seg.epoch, "targets": [int(t) for t in targets], "order": dict(order_of),
            "segment": {"world": seg.world, "workers": seg.workers, "batch_size": seg.batch_size,
                        "generation": seg.generation, "batches": seg.batches,
                        "before": [{"world": w, "workers": k, "batch_size": b, "done": d,
                                    "passed": [[p, list(v)] for p, v in ps]} for w, k, b, d, ps in seg.history]},
            "done": int(done)}
    entry = {"rank": rank, "passed": [[int(w), [int(x) for x in v]] for w, v in sorted(passed.items()) if any(v)]}
    entry["check"] = check_of(root, entry)
    return dict(root, ranks=[entry])


def check_of(root, entry):
    """The digest a rank's entry carries: its own numbers and the rest of the state's."""
    body = {k: v for k, v in root.items() if k != "ranks"}, {k: v for k, v in entry.items() if k != "check"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:CHECK_CHARS]


def merge(state):
    """(root, ranks) of a loaded state: one root, or a list of roots (one per rank) that
    must agree on everything but their ranks."""
    roots = state if isinstance(state, list) else [state]
    if not roots or not all(isinstance(r, dict) for r in roots):
        raise ValueError("stream state: a mapping, or a non-empty list of per-rank mappings, expected")
    for r in roots:
        if r.get("version") != VERSION:
            raise ValueError(f"stream state version {short(r.get('version'))}, expected {VERSION}")
        missing = [k for k in ("sources", "listings", "seed", "epoch", "targets", "order", "segment", "done", "ranks")
                   if k not in r]
        if missing:
            raise ValueError(f"stream state: field {missing[0]} missing")
        if not isinstance(r["ranks"], list) or not all(isinstance(x, dict) for x in r["ranks"]):
            raise ValueError("stream state ranks: a list of per-rank mappings expected")
    first = roots[0]
    for r in roots[1:]:
        for k in ("sources", "listings", "seed", "epoch", "targets", "order", "segment", "done"):
            if r[k] != first[k]:
                what = "how many batches were consumed" if k == "done" else k
                raise ValueError(f"the ranks' stream states disagree on {what}")
    return first, [x for r in roots for x in r["ranks"]]


def _int(v, what, lo, hi):
    if type(v) is not int or not lo <= v <= hi:
        raise ValueError(f"stream state {what}: {short(v, 60)}; an integer in {lo}..{hi} expected")
    return v


def _ints(v, what, n, lo, hi):
    if not isinstance(v, list) or len(v) != n:
        raise ValueError(f"stream state {what}: a list of {n} integers expected")
    return [_int(x, what, lo, hi) for x in v]


def _world(g, what):
    """(world, workers, batch_size) of a segment's record."""
    if not isinstance(g, dict):
        raise ValueError(f"stream state {what}: a mapping expected")
    return (_int(g.get("world"), f"{what} world", 1, MAX_WORLD), _int(g.get("workers"), f"{what} workers", 1, MAX_WORKERS),
            _int(g.get("batch_size"), f"{what} batch_size", 1, order.MAX_COUNT))


def _passed(v, what, n, sources):
    """A sparse list [[index, [per source]], ...] of indices 0..n-1, each once: {index: tuple}."""
    if not isinstance(v, list):
        raise ValueError(f"stream state {what}: a list of [index, [positions per source]] pairs expected")
    out = {}
    for x in v:
        if not isinstance(x, list) or len(x) != 2:
            raise ValueError(f"stream state {what}: [index, [positions per source]] pairs expected")
        i = _int(x[0], what, 0, n - 1)
        if i in out:
            raise ValueError(f"stream state {what}: {i} listed twice")
        out[i] = tuple(_ints(x[1], f"{what} of {i}", sources, 0, order.MAX_COUNT))
    return out


def _segment(g, got, epoch, seed, passes, sources):
    """The deal.Segment a state's `segment` makes: each earlier segment re-made from the one
    before it and what its ranks consumed, every count checked against the segment it counts."""
    if not isinstance(g, dict):
        raise ValueError("stream state segment: a mapping expected")
    return _made(json.dumps(g, sort_keys=True), tuple(got), epoch, seed, passes, sources)


@functools.lru_cache(maxsize=4)
def _made(text, got, epoch, seed, passes, sources):
    """(cached: the ranks of one process, or a simulation of thousands, load the same state)"""
    g = json.loads(text)
    before = g.get("before")
    if not isinstance(before, list) or len(before) > MAX_DEALS:
        raise ValueError(f"stream state segment before: a list of at most {MAX_DEALS} earlier segments expected")
    worlds = [_world(b, f"segment before[{i}]") for i, b in enumerate(before)] + [_world(g, "segment")]
    w, k, b = worlds[0]
    seg = deal.first(epoch, got, world=w, workers=k, batch_size=b, batches=sum(got) // (w * b), seed=seed,
                     passes=passes)
    for i, (rec, (w, k, b)) in enumerate(zip(before, worlds[1:])):
        what = f"segment before[{i}]"
        done = _int(rec.get("done"), f"{what} done", 0, seg.batches)
        passed = _passed(rec.get("passed"), f"{what} passed", seg.pairs, sources)
        seg = seg.after(done, passed, world=w, workers=k, batch_size=b)
    for field, want in (("generation", seg.generation), ("batches", seg.batches)):
        if _int(g.get(field), f"segment {field}", 0, order.MAX_COUNT) != want:
            raise ValueError(f"stream state segment {field}: {g[field]}, where its worlds and what they consumed "
                             f"make {want}")
    return seg


def check(root, ranks, *, names, listings, seed, targets, passes, order_of):
    """A loaded state, every number checked against the stream's sources, their shards, seed,
    epoch and order settings and against the others (a checkpoint is input): ValueError
    naming the first that is off. Returns (segment, a deal.Segment; done, the batches each
    rank made of it; the ranks whose entries it holds; {pair: positions of each source it
    passed over without a sample}, pairs that passed none left out; whether it was saved
    at its epoch's end). A state saved at its
    epoch's end says nothing about the next epoch, whose weights, order and data may differ."""
    S = len(names)
    if root["sources"] != names or root["seed"] != seed:
        raise ValueError(f"the stream state is for sources {short(root['sources'], 60)} with seed "
                         f"{short(root['seed'], 60)}; this stream has {names} with seed {seed}")
    epoch = _int(root["epoch"], "epoch", 0, order.MAX_COUNT)
    got = _ints(root["targets"], "targets", S, 0, order.MAX_COUNT)
    if not isinstance(root["order"], dict):
        raise ValueError("stream state order: a mapping expected")
    if not isinstance(root["listings"], list) or len(root["listings"]) != S or \
            not all(isinstance(x, str) for x in root["listings"]):
        raise ValueError(f"stream state listings: one shard-list digest per source ({S}) expected")
    if not _claims_end(root):  # checked in full below; the likelier mistake is named first
        _check_same_epoch(root, got, targets, order_of, names, listings)
    seg = _segment(root["segment"], got, epoch, seed, tuple(passes), S)
    done = _int(root["done"], "done", 0, seg.batches)
    if 1 < len(ranks) != seg.world:  # one rank's own state (same world), or every rank's
        raise ValueError(f"stream state: {len(ranks)} ranks' states for a segment of {seg.world} ranks")
    ranks_seen, passed = set(), {}
    for r in ranks:
        rank = _int(r.get("rank"), "rank", 0, seg.world - 1)
        if rank in ranks_seen:
            raise ValueError(f"stream state: rank {rank} appears twice")
        mine = {rank + w * seg.world: v for w, v in _passed(r.get("passed"), f"rank {rank} passed", seg.workers,
                                                             S).items()}
        if r.get("check") != check_of(root, r):
            raise ValueError(f"stream state rank {rank}: its check {short(r.get('check'))} does not match its "
                             f"numbers: the state was edited or damaged (state_dict() writes it whole); resume "
                             f"from an unedited one")
        ranks_seen.add(rank)
        passed.update(mine)
    ended = done == seg.batches
    if not ended:  # (already checked where the state claimed no end)
        _check_same_epoch(root, got, targets, order_of, names, listings)
    return seg, done, ranks_seen, passed, ended


def positions(seg, done, passed, rank):
    """{worker: positions of each source read} of a rank's workers once each rank made `done`
    batches: what their batches took, and what they passed over (`passed`, by pair)."""
    return {w: [int(t) + int(n) for t, n in zip(seg.taken(rank + w * seg.world, done),
                                                passed.get(rank + w * seg.world, (0,) * len(seg.spans)))]
            for w in range(seg.workers)}


@functools.lru_cache(maxsize=4)
def redeal(seg, done, passed, world, workers, batch_size):
    """seg.after, kept for the next call with the same state (every rank of a world loads the
    same; passed: sorted (pair, counts) pairs)."""
    return seg.after(done, dict(passed), world=world, workers=workers, batch_size=batch_size)


def _claims_end(root):
    """Whether a state says its ranks made all of its segment's batches (its numbers unchecked)."""
    try:
        return root["done"] == root["segment"]["batches"]
    except (TypeError, KeyError):
        return False


def _check_same_epoch(root, got, targets, order_of, names, listings):
    """A state inside an epoch goes on only with the epoch's own split, order settings and shards."""
    if got != [int(t) for t in targets]:
        raise ValueError(f"the stream state's epoch splits its samples {got} between the sources, this "
                         f"stream {[int(t) for t in targets]}: the weights or the epoch's samples changed inside "
                         f"an epoch; change them at an epoch boundary (a stream made with other weights than the saved epoch "
                         f"ran: set_epoch(E, that epoch's weights) before load_state_dict)")
    if root["order"] != dict(order_of):
        said = ", ".join(f"{k} {short(root['order'].get(k))}" for k in order_of)
        raise ValueError(f"the interrupted epoch ran with {said}; this stream has "
                         f"{', '.join(f'{k} {v}' for k, v in order_of.items())}: which sample each position holds "
                         f"would change (--shuffle-buffer, --shuffle-window, --resample); change them at an epoch "
                         f"boundary")
    for name, was, now in zip(names, root["listings"], listings):
        if was != now:
            raise ValueError(f"the stream state was saved over other shards of source {name} (shard list "
                             f"{short(was, 12)}, this stream's {now[:12]}): which sample each position holds "
                             f"differs, so going on would read some samples twice and others never; finish the "
                             f"epoch on the shards it began with, or start it over")
