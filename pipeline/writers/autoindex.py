"""Indexing on first use: a set of shards opened by its URL, with no manifest, is indexed once.

    resolve("cifar", "https://host/data/cifar-train-{000..099}.tar", "train")
    python -m pipeline.train --train cifar=/data/cifar/ ...      # no make-shards --index first

The exact epoch, the resume and the memory bound rest on knowing each shard's samples, so a
set still needs its manifest; `resolve` makes it when a pattern, glob, folder or store prefix
has none (manifest.NoManifest), with the indexer behind `make_shards --index`
(pipeline.writers.index), in parallel across the shards within the job's deadlines, with a
progress bar. The fields come from the members (pipeline.writers.infer) unless `fields` names
them; a set with an image and a class is also indexed as image and label, so the trainer
trains on it as on any indexed set.

Where: beside the shards (`FOLDER/.pipeline-index/`) when they are local files of one
writable folder, else in the cache folder (`cache_dir`, the trainer's --cache-dir; default
$PIPELINE_CACHE, else $XDG_CACHE_HOME/pipeline or ~/.cache/pipeline). Keyed by the listing:
each shard's name with its size and mtime (local), its Content-Length and ETag or
Last-Modified (http, one HEAD each), or its name alone (stores: a rewritten object under
the same name is not noticed; index it with --index). A changed set gets a new key, so it
is indexed again; an unchanged one is reused (a line says where, and how to index again) and no
shard is read, unless its index was
inferred by other rules than this version's (INFERENCE): it is made again. Several processes (the
ranks of a torchrun job) take a file lock on the key (pipeline.files.locked): the first
indexes, the others wait for it and read its result.
"""
import contextlib
import hashlib
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from pipeline.data.store import cache as caching
from pipeline.data.manifests import manifest
from pipeline.data.store import remote
from pipeline.data.store import transports
from pipeline.writers import infer, publish
from pipeline.errors import ShardError, redact
from pipeline.files import locked, read_json, write_json_atomic

INDEX_FOLDER = ".pipeline-index"
SAMPLES = infer.SAMPLES
# the rules an index made here was inferred by, kept in its origin: a cached index made by other rules
# is made again, as one whose shards changed (2: an integer .npy field is int64; 1, unstamped, made it
# float32, which refuses values past 2**24 until the cache is rebuilt). Bump it when infer's fields change.
INFERENCE = 2


class _Enough(Exception):
    """Raised inside a read to stop it once enough samples are in."""


def resolve(name, spec, split, *, policy=remote.Policy(), check_http=None, cache_dir=None, fields=None,
            progress=True, workers=None, classes_from=None):
    """manifest.resolve, indexing the shards SPEC names on first use when they have no manifest
    (see the module docstring). fields: a Schema (or a --fields spec) in place of the inferred
    fields of the same names, for an index made here (a set with a manifest keeps its own:
    pass schemas= to the stream for that). classes_from: the Source of another split of the set
    (the trainer's training source for an --eval of the same name), whose classes an index made
    here takes, so that a test split short of a class still matches the model's head. Returns the
    Source; ShardError (one line) as manifest.resolve."""
    from pipeline.writers import index as indexer

    try:
        return manifest.resolve(name, spec, split, policy=policy, check_http=check_http)
    except manifest.NoManifest as missing:
        if spec.endswith(".json"):
            raise
        if remote.kind(spec) == "http" and spec.endswith("/"):
            raise ShardError(f"{missing}; an http(s) folder cannot be listed, so its shards cannot be indexed on "
                             f"first use: give them as a brace pattern (e.g. {redact(spec)}train-{{000000..000099}}"
                             f".tar), or index them ahead with make-shards --index") from None
        try:
            urls = indexer.expand(spec, policy)
        except ShardError as e:  # no shards either
            if remote.kind(spec) == "file" and os.path.isdir(spec) and not isinstance(e, publish.CutShort):
                raise ShardError(f"{name}={redact(spec)}: no shards (*.tar, *.tar.gz) and no manifest "
                                 f"({manifest.manifest_name(name, split)}) in this folder") from None
            raise e from None  # what is wrong with the shards themselves (none there, some missing)
    folder = ensure(name, split, spec, urls, policy=policy, cache_dir=cache_dir, fields=fields, progress=progress,
                    workers=workers, classes_from=classes_from)
    # every http(s) shard answered a HEAD for the key just now, with the size the index holds
    return manifest.resolve(name, folder, split, policy=policy, check_http=lambda urls, sizes: ([], []))


def trainable(source):
    """A source indexed on first use as the image-and-label trainer reads it: without its
    inferred fields when it has a class (else as it is, and the trainer says it has none)."""
    import dataclasses

    if source.origin.get("inferred") and source.classes:
        return dataclasses.replace(source, schema=None)
    return source


def default_cache():
    """The cache folder when none is given: $PIPELINE_CACHE, else $XDG_CACHE_HOME/pipeline, else
    ~/.cache/pipeline."""
    if os.environ.get("PIPELINE_CACHE"):
        return os.environ["PIPELINE_CACHE"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pipeline")


def ensure(name, split, spec, urls, *, policy=remote.Policy(), cache_dir=None, fields=None, progress=True,
           workers=None, classes_from=None):
    """The folder holding NAME-SPLIT.json for the shards SPEC names (`urls`, as
    pipeline.writers.index.expand lists them): found by the listing's key, else made now (under
    a lock: one process indexes, the others wait for its result)."""
    from pipeline.data.fields.schema import parse_fields

    if isinstance(fields, str):
        try:
            fields = parse_fields(fields)
        except ValueError as e:
            raise ShardError(str(e)) from None
    classes = classes_from.classes if classes_from else None
    key = listing_key(name, split, urls, policy, fields, classes)
    set_prefix = f"{name}-{split}-{_set_digest(name, split, urls, fields, classes)}-"
    folder = os.path.join(home(urls, cache_dir), set_prefix + key)
    path = os.path.join(folder, manifest.manifest_name(name, split))
    if _current(path):
        if progress:  # one line a job (rank 0's): its new files were read or there are none
            print(f"{name}-{split}: reused the index made on first use, {path}: {_unchanged(urls)}; delete that "
                  f"file to index them again", file=sys.stderr, flush=True)
            _warn_sizes(name, split, read_json(path))  # as when it was made: a reused index resizes them as well
        return folder
    with contextlib.ExitStack() as held:
        try:
            os.makedirs(os.path.dirname(folder), exist_ok=True)
            held.enter_context(locked(folder + ".lock"))
        except OSError as e:
            raise ShardError(f"{name}={redact(spec)}: cannot keep its index in {os.path.dirname(folder)} "
                             f"({e.strerror or e}); give a writable --cache-dir (or $PIPELINE_CACHE)") from None
        if _current(path):  # another rank or job made it while this one waited
            return folder
        if os.path.exists(path):  # a cache: a truncated or broken index, or one by older rules, is made again
            why = "was made by older rules" if _readable(path) else "was unreadable"
            print(f"{name}-{split}: the cached index {path} {why}; indexing again", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        m, line = build(name, split, spec, urls, folder, policy=policy, fields=fields, progress=progress,
                        workers=workers, classes_from=classes_from)
        print(f"{name}-{split}: indexed on first use: {len(m['shards'])} shards, {m['total']:,} samples in "
              f"{time.monotonic() - t0:.1f} s; cached in {path} (reused until the shards change)",
              file=sys.stderr, flush=True)
        print(f"{name}-{split}: {line}", file=sys.stderr, flush=True)
        _warn_sizes(name, split, m)
        _prune(os.path.dirname(folder), set_prefix, os.path.basename(folder),
               current=lambda: listing_key(name, split, _listed(spec, policy), policy, fields, classes) == key)
    return folder


def _warn_sizes(name, split, m):
    """The line saying an index's images are of many sizes, each resized to the most common one."""
    from pipeline.writers.index import sizes_warning

    sizes = sizes_warning(m, "index them ahead with make-shards --index ... --shape C,H,W to choose it")
    if sizes:
        print(f"{name}-{split}: {sizes}", file=sys.stderr, flush=True)


def _unchanged(urls):
    """What a reused index's key found unchanged (`stamps`): local files by size and time, http(s)
    shards by size and version, the rest by name alone."""
    kinds, n = {remote.kind(u) for u in urls}, len(urls)
    if kinds == {"file"}:
        return f"the same {n} shard files, of the same sizes and times as when it was made"
    if kinds <= {"file", "http"}:
        return f"the same {n} shards, of the same sizes and versions as when it was made"
    return f"the same {n} shard names as when it was made (a shard rewritten under its name is not noticed)"


def _set_digest(name, split, urls, fields, classes):
    """8 hex digits naming the set by where its shards are (their folders), its fields and
    classes: the part of an index folder's name that stays when the shards change, so a stale
    index can be found (the spec as typed would not do: `web` and `web/` are one set)."""
    where = sorted({u.rsplit("/", 1)[0] for u in urls})
    text = json.dumps([name, split, where, fields.to_json() if fields is not None else None, classes])
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def _listed(spec, policy):
    """The shards SPEC names now (a shard added since the index began makes it stale too)."""
    from pipeline.writers import index as indexer

    try:
        return indexer.expand(spec, policy)
    except ShardError:
        return []


def _prune(where, prefix, keep, current):
    """The indexes of this set made before its shards changed: stale for good, so removed once
    the new one is made (the cache grew a folder a change); another set's, even of the same
    name, has another prefix. Only while this one's listing is still the set's (`current()`: a
    process that indexed a listing which changed meanwhile holds the stale one), and never one
    whose lock another process holds (it is being made or read). What cannot be removed stays,
    without a word."""
    import shutil

    stale = [e for e in os.listdir(where) if e.startswith(prefix) and e != keep and not e.endswith(".lock")]
    if not stale or not current():
        return
    for entry in stale:
        path = os.path.join(where, entry)
        with contextlib.suppress(OSError):  # Busy (held elsewhere) is an OSError
            with locked(path + ".lock", wait=False):
                shutil.rmtree(path, ignore_errors=True)


def _readable(path):
    """The index at `path` when it is there and reads as a manifest; None when it is missing,
    truncated or invalid (a write cut short, a disk that filled)."""
    try:
        return manifest.check(read_json(path), path)
    except (OSError, ValueError, ShardError):
        return None


def _current(path):
    """True when the index at `path` is readable and was inferred by this version's rules (INFERENCE)."""
    m = _readable(path)
    return m is not None and (m.get("origin") or {}).get("inference") == INFERENCE


def home(urls, cache_dir=None):
    """Where an index of these shards is kept: in the cache folder when one is given (`cache_dir`,
    else $PIPELINE_CACHE: the user chose it, say because the shards' folder is shared or
    read-only whatever os.access says); else beside the shards when they are local files of one
    writable folder; else the default cache folder."""
    given = caching.of(cache_dir)
    if given or os.environ.get("PIPELINE_CACHE"):
        return os.path.join(given.folder if given else default_cache(), "index")
    folders = {os.path.dirname(os.path.abspath(u)) for u in urls if remote.kind(u) == "file"}
    if len(folders) == 1 and len(urls) == sum(remote.kind(u) == "file" for u in urls):
        folder = folders.pop()
        if os.access(folder, os.W_OK):
            return os.path.join(folder, INDEX_FOLDER)
    return os.path.join(default_cache(), "index")


def listing_key(name, split, urls, policy=remote.Policy(), fields=None, classes=None):
    """16 hex digits of sha256 over the set's name, split, fields and classes asked for and each
    shard's stamp."""
    stamped = stamps(urls, policy)
    text = json.dumps([name, split, fields.to_json() if fields is not None else None, classes, stamped])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def stamps(urls, policy=remote.Policy(), threads=16):
    """[url, size, mtime or ETag] of each shard: stat for local files, a HEAD for http(s) URLs,
    the name alone for the rest."""
    def stamp(url):
        where = remote.kind(url)
        if where == "file":
            st = os.stat(url)
            return [os.path.abspath(url), st.st_size, st.st_mtime_ns]
        if where == "http":
            return [url, *_head(url, policy)]
        return [url]

    if sum(remote.kind(u) == "http" for u in urls) > 1:
        with ThreadPoolExecutor(threads) as pool:
            return list(pool.map(stamp, urls))
    return [stamp(u) for u in urls]


def _head(url, policy):
    """(Content-Length, ETag or Last-Modified) of an http(s) shard; ShardError when it is missing."""
    for attempt in range(policy.retries + 1):
        try:
            head = transports._HTTP(url, policy, 0, method="HEAD")
            try:
                h = head.resp.headers
                return h.get("Content-Length"), h.get("ETag") or h.get("Last-Modified")
            finally:
                head.close()
        except Exception as e:  # noqa: BLE001 - sorted as remote.head_check sorts them
            if remote.permanent(e) or not remote.transient(e) or attempt == policy.retries:
                why = "missing (HTTP 404)" if getattr(e, "code", None) == 404 else remote.describe(e)
                raise ShardError(f"{redact(url)}: {why}; its size and version, which the index records, cannot be "
                                 f"read") from None
            time.sleep(policy.wait(attempt))


def first_samples(url, policy=remote.Policy(), n=SAMPLES):
    """Up to n samples of the shard at `url`, read from its start (the rest is not read)."""
    from pipeline.data.shards.read import is_meta, iter_samples

    got = []

    def consume(stream):
        for sample in iter_samples(stream, None, url):
            if not is_meta(sample["__key__"]):
                got.append(sample)
            if len(got) >= n:
                raise _Enough

    try:
        remote.read_url(url, consume, policy=policy)
    except _Enough:
        pass
    except OSError as e:
        raise ShardError(f"{redact(url)}: unreadable ({e})") from None
    return got


def build(name, split, spec, urls, out, *, policy=remote.Policy(), fields=None, progress=True, workers=None,
          classes_from=None):
    """Index the shards into OUT/NAME-SPLIT.json with the inferred fields (and `fields` over
    them); a set with an image and a class as image and label too. Returns (manifest, the
    fields in one line)."""
    from pipeline.writers import index as indexer

    samples = first_samples(urls[0], policy)
    try:
        schema, label = infer.infer(samples)
    except ValueError as e:
        raise ShardError(f"{redact(urls[0])}: {e}") from None
    schema = infer.override(schema, fields)
    images = [c for c in schema.columns if c.kind == "image"]
    workers = workers or min(8, os.cpu_count() or 1, len(urls))
    kw = dict(workers=workers, policy=policy, progress=progress)
    m = None
    if label and len(images) == 1:
        given = (classes_from.manifest, manifest.load(classes_from.manifest, policy)) if classes_from else None
        m = indexer.index(name, split, spec, out, label=label, image_key=images[0].member, classes_from=given, **kw)
        if not given and not infer.looks_like_classes(m["classes"], m["total"]):
            # the first samples looked like classes, the whole set is free text: text, as infer makes it
            print(f"{name}-{split}: {label} looked like a class in the first {len(samples)} samples but holds "
                  f"{len(m['classes']):,} distinct values in {m['total']:,}: free text, indexed as text (no class)",
                  file=sys.stderr, flush=True)
            schema, label = infer.override(infer.infer(samples, classes=False)[0], fields), None
            m = None
    if m is not None:
        if m.get("label_values") not in (None, list(range(len(m["classes"])))):  # ids 5, 7: not indices 0..N-1
            schema = infer.ids_as_int(schema)
        c, h, w = m["shape"]
        image = images[0].to_json()
        image.update(size=[h, w], channels=c)
        m["fields"] = [image if f["name"] == image["name"] else f for f in schema.to_json()]
    else:
        m = indexer.index(name, split, spec, out, fields=schema, **kw)
    m["origin"].update(inferred=True, inference=INFERENCE)
    path = os.path.join(out, manifest.manifest_name(name, split))
    write_json_atomic(path, manifest.check(m, path))
    return read_json(path), infer.describe(manifest.schema_of(m), label)
