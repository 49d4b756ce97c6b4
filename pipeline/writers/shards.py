"""Writing shards: USTAR tar files plus the manifest, merging parts, verifying.

A sample is two tar members, `<key>.png` (or `<key>.raw`, uint8 CHW pixels whose
shape the manifest records) and `<key>.cls` (the label as ASCII digits). Keys are
`<dataset>-<split>-<index>` with no dots: webdataset splits keys at the first dot.
A source of files (an image folder) also gets `NAME-SPLIT.files.tsv` beside the manifest,
each key and the file it was made from (`side_file`): the keys stay short, fixed-width and
tar-safe whatever the file names hold (no USTAR name limit, no dots, no escaping), and the
code that parses keys is untouched. With `skip_bad`, an image the source cannot read
(sources.BadImage) is left out and listed with its reason in `NAME-SPLIT.left-out.tsv`;
the manifest counts only what was written.

Shards are plain USTAR with integer mtimes. webdataset's own TarWriter writes a PAX
header per member because it passes float mtimes; every member then costs an extra
header, and reading it through tarfile costs twice as much (docs/benchmarks.md, "Tar format").

A rebuild is atomic for readers: every new shard and the new manifest are written under
temporary names (`*.tmp`) first, and only when all of them are complete (a full disk
fails here, and the temporary files are removed) is the old manifest removed, the new
shards renamed into place and the new manifest renamed last. So the old manifest and
its shards stay usable until the new set is complete, and a manifest's presence means
its set is complete. The folder may hold other people's files: a build replaces or
removes only files named by a manifest make_shards wrote for this data set and split
(`owned`), and its own temporary files; a file of the name it needs that no such
manifest names is refused, never overwritten. A folder is written by one writer at a
time (`writing`): two builds into one folder would write the same temporary names, and
both could report success over shards the other one cut short.

An object store (`--out s3://bucket/prefix`) gets the same promise through
pipeline.writers.publish.
"""
import contextlib
import hashlib
import io
import multiprocessing
import os
import re
import tarfile

import numpy as np

from pipeline import cli
from pipeline.data.decoding import png
from pipeline.errors import ShardError
from pipeline.files import Busy, locked, open_regular, read_json, write_json_atomic
from pipeline.data.manifests.manifest import FORMAT, NAME_RE, manifest_name, shard_name
from pipeline.writers.fields import captioned_fields
from pipeline.writers.sources import BadImage

ENCODINGS = ("png", "raw")
LOCK = ".make_shards.lock"  # held while a folder's shards or manifests are written; removed after


@contextlib.contextmanager
def writing(out):
    """Hold `out`'s writer lock, or raise ShardError at once if another process holds it."""
    os.makedirs(out, exist_ok=True)
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(locked(os.path.join(out, LOCK), wait=False))
        except Busy as e:
            raise ShardError(f"{out}: another make-shards is writing this folder ({e.strerror}); wait for it to finish "
                             f"or choose another --out") from None
        yield


# ---------------------------------------------------------------- writing


def encode_image(image, encoding):
    """uint8 CHW array -> bytes in the given encoding."""
    if encoding == "raw":
        return np.ascontiguousarray(image, dtype=np.uint8).tobytes()
    return png.encode(image)


def _add_member(tar, name, data):
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644
    info.uname = info.gname = ""
    tar.addfile(info, io.BytesIO(data))


def sample_key(name, split, i):
    """The key of source sample i: `<dataset>-<split>-<index>` (no dots, fixed width)."""
    return f"{name}-{split}-{i:07d}"


def write_shard(path, source, indices, encoding, rename=True, skip_bad=False):
    """Write one shard under a temporary name (`path`.tmp) and rename it when complete; with
    rename=False it stays under the temporary name (a build renames all at once).

    Returns its manifest entry (name, samples, bytes, sha256, per-channel pixel sums); with
    `skip_bad`, also `left_out`: [index, reason] of each image the source could not read,
    which is not written. On any error the temporary file is removed.
    """
    tmp = path + ".tmp"
    try:
        entry = _write_tar(tmp, source, indices, encoding, skip_bad)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    if rename:
        os.replace(tmp, path)
    return dict(entry, name=os.path.basename(path))


def _write_tar(tmp, source, indices, encoding, skip_bad=False):
    c = source.shape[0]
    pix_sum, pix_sumsq = np.zeros(c), np.zeros(c)
    captions, longest, left_out = getattr(source, "captions", False), 0, []
    with open(tmp, "wb") as f:
        with tarfile.open(fileobj=f, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for i in indices:
                try:
                    image = source.image(i)
                except BadImage as e:
                    if not skip_bad:
                        raise
                    left_out.append([i, str(e)])
                    continue
                label = source.label(i)
                if tuple(image.shape) != tuple(source.shape):
                    raise ShardError(f"{source.name} {source.split} sample {i}: shape {image.shape}, "
                                     f"expected {source.shape}")
                key = sample_key(source.name, source.split, i)
                _add_member(tar, f"{key}.{encoding}", encode_image(image, encoding))
                _add_member(tar, f"{key}.cls", str(label).encode())
                if captions:
                    text = source.caption(i).encode()
                    _add_member(tar, f"{key}.txt", text)
                    longest = max(longest, len(text))
                x = image.reshape(c, -1).astype(np.float64) / 255.0
                pix_sum += x.sum(1)
                pix_sumsq += (x * x).sum(1)
    digest, size = file_sha256(tmp), os.path.getsize(tmp)
    return dict({"name": None, "samples": len(indices) - len(left_out), "bytes": size, "sha256": digest,
                 "pixel_sum": pix_sum.round(6).tolist(), "pixel_sumsq": pix_sumsq.round(6).tolist()},
                **({"caption_bytes": longest} if captions else {}), **({"left_out": left_out} if skip_bad else {}))


def file_sha256(path):
    h = hashlib.sha256()
    with open_regular(path) as f:  # verify may meet a FIFO under a shard's name
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


_SOURCE = None  # the source being written, inherited by forked writer processes


def _write_task(task):
    path, indices, encoding, skip_bad = task
    return write_shard(path, _SOURCE, indices, encoding, rename=False, skip_bad=skip_bad)


def plan_shards(n, maxcount, seed, limit=None, part=(0, 1)):
    """Seeded sample order cut into shards: [(shard_index, indices)], this part's only.

    Shuffling first matters: ImageFolder lists are sorted by class, and one-class
    shards defeat a streaming shuffle buffer.
    """
    order = np.random.default_rng(seed).permutation(n)
    if limit:
        order = order[:limit]
    chunks = [order[s:s + maxcount].tolist() for s in range(0, len(order), maxcount)]
    i, parts = part
    return [(k, idx) for k, idx in enumerate(chunks) if k % parts == i]


def forked_imap(fn, tasks, workers):
    """fn over tasks in `workers` forked processes, results in order. The pool ends with close() and
    join(), never terminate() but on a stop (Ctrl-C, or the trainer's stop signal: any BaseException
    but GeneratorExit): terminate() can kill a worker while it holds the result queue's lock, or
    miss one the pool was starting, and then waits for it for good (a hung --imagefolder build in
    CI; an --index of a test run's that never ended); but join() after a stop waited for every
    task queued, stalled reads and their retries too (an index on first use over HTTP, hostileP)."""
    pool = multiprocessing.get_context("fork").Pool(workers)
    try:
        yield from pool.imap(fn, tasks)
    except BaseException as e:
        if not isinstance(e, (Exception, GeneratorExit)):
            pool.terminate()
        raise
    finally:
        pool.close()
        pool.join()


def build(source, out, *, encoding="png", maxcount=500, seed=0, limit=None, workers=1, part=(0, 1),
          progress=True, say=None, skip_bad=False):
    """Write `source` as shards plus manifest under `out`; returns the manifest dict.

    With part=(i, n) only every n-th shard starting at i is written, under the same
    global names a whole build would use, and the manifest is a part manifest for
    `merge_parts`. A rebuild is atomic for readers and touches only files that a
    make_shards manifest of this split names (see the module's docstring); `say` gets
    one line saying what was replaced. `skip_bad`: an image the source cannot read is
    left out (the manifest counts what was written), listed in the left-out file and
    counted in a line to `say`. Raises ShardError for a needed name that holds a file no
    such manifest names, OSError when a write fails (nothing then changed).
    """
    if encoding not in ENCODINGS:
        raise ShardError(f"unknown encoding {encoding!r}; choose from {', '.join(ENCODINGS)}")
    if not NAME_RE.match(source.name):
        raise ShardError(f"dataset name {source.name!r}: use letters, digits and _ only (keys split at dots)")
    if maxcount < 1:
        raise ShardError(f"--maxcount must be at least 1, got {maxcount}")
    if len(source) == 0:
        raise ShardError(f"{source.name} {source.split}: no samples")
    with writing(out):
        return _build(source, out, encoding, maxcount, seed, limit, workers, part, progress,
                      say or (lambda line: None), skip_bad)


def _build(source, out, encoding, maxcount, seed, limit, workers, part, progress, say, skip_bad=False):
    name, split = source.name, source.split
    final = os.path.join(out, manifest_file(name, split, part))
    whole = os.path.join(out, manifest_name(name, split))
    owned, old = owned_shards(out, name, split)
    remove_own_temporaries(out, name, split)
    every = {shard_name(name, split, k) for k, _ in plan_shards(len(source), maxcount, seed, limit)}
    plan = plan_shards(len(source), maxcount, seed, limit, part)
    mine = [shard_name(name, split, k) for k, _ in plan]
    for f in mine:
        if os.path.lexists(os.path.join(out, f)) and f not in owned:
            raise ShardError(f"{os.path.join(out, f)} exists and no make-shards manifest of {name}-{split} in {out} "
                             f"names it: refusing to overwrite a file this tool did not write; move it away or "
                             f"choose another --out")
    tasks = [(os.path.join(out, f), idx, encoding, skip_bad) for f, (_, idx) in zip(mine, plan)]
    sides = {kind: side_file(final, kind) for kind in SIDE_FILES}
    temporaries = [t[0] + ".tmp" for t in tasks] + [final + ".tmp"] + [p + ".tmp" for p in sides.values()]
    try:
        entries = _run_tasks(source, tasks, workers, progress, f"{name}-{split}")
        left = {i: why for e in entries for i, why in e.pop("left_out", [])}
        mine, entries = _written(out, mine, entries, f"{name} {split}", len(left))
        manifest = {
            "format": FORMAT, "dataset": name, "split": split, "encoding": encoding,
            "image_exts": [encoding], "label": "cls", "origin": _origin(source, limit),
            "shape": list(source.shape), "classes": source.classes, "seed": seed, "maxcount": maxcount,
            "part": list(part) if part[1] > 1 else None,
            "shards": entries,
        }
        if getattr(source, "captions", False):  # image, label and caption: a schema's fields (pipeline.data.fields.schema)
            longest = max(e.pop("caption_bytes") for e in entries)
            manifest["fields"] = captioned_fields(encoding, source.shape, longest)
        manifest = finish_manifest(manifest)
        if part[1] > 1:  # names of the replaced set that the other parts will write: still ours when they do
            manifest["replaces"] = sorted((owned & every) - set(mine))
        written = _write_sides(sides, source, plan, left)
        write_json_atomic(final + ".tmp", manifest)  # the disk is full here, or never
    except BaseException:
        for t in temporaries:
            with contextlib.suppress(OSError):
                os.remove(t)
        raise
    for m in {final, whole}:  # the new set is complete: the old manifest goes, the shards and manifest come
        with contextlib.suppress(FileNotFoundError):
            os.remove(m)
    for f in mine:
        os.replace(os.path.join(out, f + ".tmp"), os.path.join(out, f))
    before = {kind for kind, path in sides.items() if os.path.exists(path)}
    for kind, path in sides.items():  # this build's, or none: an old one would name other samples
        if kind in written:
            os.replace(path + ".tmp", path)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
    os.replace(final + ".tmp", final)
    gone = remove_stale(out, owned - (every if part[1] > 1 else set(mine)))
    if old:
        counts = shard_counts(rewritten=len(owned & set(mine)), added=len(set(mine) - owned), removed=len(gone))
        side = side_changes({os.path.basename(p): k for k, p in sides.items()}, before, written)
        say(f"  replaced {', '.join(os.path.basename(m) for m in old)} in {out}/: {counts}{side}; no other file touched")
    if left:
        held = f", so {name}-{split} holds {manifest['total']} (--holdout drew its files before they were read)" \
            if "subset" in source.origin else ""
        say(f"  left out {len(left)} unreadable image(s) of {len(left) + manifest['total']} (--skip-bad-images)"
            f"{held}; each file and why: {sides['left-out']}")
    return manifest


SIDE_FILES = ("files", "left-out")  # NAME-SPLIT.files.tsv: key -> file; NAME-SPLIT.left-out.tsv: file, reason


def side_file(manifest_path, kind):
    """NAME-SPLIT.KIND.tsv beside the manifest NAME-SPLIT.json (or a part manifest's)."""
    return manifest_path[:-len(".json")] + f".{kind}.tsv"


def _written(out, names, entries, what, left):
    """The shards and entries that hold a sample: a shard all of whose images were left out is
    removed (a manifest lists no empty shard). ShardError when none is left."""
    kept = [(f, e) for f, e in zip(names, entries) if e["samples"]]
    for f, e in zip(names, entries):
        if not e["samples"]:
            with contextlib.suppress(OSError):
                os.remove(os.path.join(out, f + ".tmp"))
    if not kept:
        raise ShardError(f"{what}: none of its {left} image(s) could be read; nothing written")
    return [f for f, _ in kept], [e for _, e in kept]


def _write_sides(sides, source, plan, left):
    """The side files of this build, under temporary names: the key -> file table of a source of
    files, and the images left out with why. Returns the kinds written."""
    written = set()
    if hasattr(source, "file"):
        keys = sorted(i for _, idx in plan for i in idx if i not in left)
        _write_table(sides["files"] + ".tmp", ("key", "file"),
                     ((sample_key(source.name, source.split, i), source.file(i)) for i in keys))
        written.add("files")
    if left:
        _write_table(sides["left-out"] + ".tmp", ("file", "reason"),
                     ((source.file(i), why.split(": not a readable image: ", 1)[-1])
                      for i, why in sorted(left.items())))
        written.add("left-out")
    return written


def _write_table(path, header, rows):
    """Tab-separated rows under a header line; a tab, newline, carriage return or backslash in a
    field is written as \\t, \\n, \\r, \\\\ (one row a line whatever a file name holds), a name that
    is not UTF-8 as its own bytes."""
    def field(text):
        return text.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n").replace("\r", "\\r")

    with open(path, "w", encoding="utf-8", errors="surrogateescape", newline="\n") as f:
        f.write("\t".join(header) + "\n")
        for row in rows:
            f.write("\t".join(map(field, row)) + "\n")


def owned_shards(out, name, split):
    """(names, manifests): the shard names that make_shards manifests of this split in `out` (whole
    or part) list or replace, and those manifests' paths. Only plain names of make_shards' own
    pattern count, and never those of an indexed manifest: its shards are somebody else's."""
    pat = re.compile(rf"^{re.escape(name)}-{re.escape(split)}(\.part\d+of\d+)?\.json$")
    shard = re.compile(rf"^{re.escape(name)}-{re.escape(split)}-\d+\.tar$")
    names, found = set(), []
    for f in sorted(os.listdir(out)):
        if not pat.match(f):
            continue
        try:
            m = read_json(os.path.join(out, f))
            listed = [s["name"] for s in m["shards"]] + list(m.get("replaces") or [])
            if (m.get("origin") or {}).get("kind") == "index":
                continue
        except (ShardError, OSError, KeyError, TypeError, AttributeError):
            continue  # unreadable: it vouches for nothing
        names |= {n for n in listed if isinstance(n, str) and shard.match(n)}
        found.append(os.path.join(out, f))
    return names, found


def remove_own_temporaries(out, name, split):
    """The `.tmp` shards a killed build of this split left behind (make_shards' own names)."""
    sides = "|".join(re.escape(f"{k}.tsv") for k in SIDE_FILES)
    pat = re.compile(rf"^{re.escape(name)}-{re.escape(split)}(-\d+\.tar|(\.part\d+of\d+)?\.(json|{sides}))\.tmp$")
    for f in os.listdir(out):
        if pat.match(f):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(out, f))


def _origin(source, limit):
    origin = dict(getattr(source, "origin", None) or {"kind": "unknown"})
    if limit and limit < len(source):
        origin["limit"] = f"a seeded subset of {limit} of these {len(source)} samples (--limit)"
    return origin


def manifest_file(dataset, split, part):
    """NAME-SPLIT.json, or a part's NAME-SPLIT.partIofN.json."""
    i, n = part
    return manifest_name(dataset, split) if n == 1 else f"{dataset}-{split}.part{i}of{n}.json"


def _run_tasks(source, tasks, workers, progress, desc):
    global _SOURCE
    _SOURCE = source
    bar = cli.progress(total=sum(len(t[1]) for t in tasks), unit="sample", desc=desc, disable=not progress)
    entries = []
    try:
        if workers > 1 and len(tasks) > 1:
            for entry in forked_imap(_write_task, tasks, workers):
                entries.append(entry)
                bar.update(entry["samples"] + len(entry.get("left_out", ())))
        else:
            for task in tasks:
                entries.append(_write_task(task))
                bar.update(len(task[1]))
    finally:
        bar.close()
        _SOURCE = None
    return entries


def finish_manifest(manifest):
    """Totals and per-channel mean/std from the per-shard pixel sums (in shard order)."""
    shards = manifest["shards"]
    total = sum(s["samples"] for s in shards)
    c, hw = manifest["shape"][0], manifest["shape"][1] * manifest["shape"][2]
    s = np.zeros(c)
    sq = np.zeros(c)
    for e in shards:
        s += e["pixel_sum"]
        sq += e["pixel_sumsq"]
    n = max(total * hw, 1)
    mean = s / n
    std = np.sqrt(np.maximum(sq / n - mean ** 2, 1e-12))
    manifest.update(total=total, mean=mean.round(6).tolist(), std=std.round(6).tolist())
    return manifest


def merge_parts(out, dataset, split):
    """Merge the part manifests of a split built with --part into one manifest.

    Raises ShardError if a part is missing or two parts disagree on how they were built.
    """
    with writing(out):
        return _merge_parts(out, dataset, split)


def _merge_parts(out, dataset, split):
    pat = re.compile(rf"^{re.escape(dataset)}-{re.escape(split)}\.part(\d+)of(\d+)\.json$")
    parts = sorted((int(m[1]), int(m[2]), f) for f in os.listdir(out) if (m := pat.match(f)))
    if not parts:
        raise ShardError(f"no part manifests {dataset}-{split}.partIofN.json under {out}")
    n = parts[0][1]
    if sorted(p[0] for p in parts) != list(range(n)) or any(p[1] != n for p in parts):
        raise ShardError(f"{dataset}-{split}: have parts {[f'{p[0]}of{p[1]}' for p in parts]}, need 0..{n - 1} of {n}")
    loaded = [read_json(os.path.join(out, p[2])) for p in parts]
    keys = ("encoding", "shape", "classes", "seed", "maxcount")
    if any(tuple(m[k] for k in keys) != tuple(loaded[0][k] for k in keys) for m in loaded):
        raise ShardError(f"{dataset}-{split}: parts were built with different settings ({', '.join(keys)})")
    mine, _ = owned_shards(out, dataset, split)
    merged = dict(loaded[0], part=None)
    merged.pop("replaces", None)
    merged["shards"] = sorted((e for m in loaded for e in m["shards"]), key=lambda e: e["name"])
    merged = finish_manifest({k: v for k, v in merged.items() if k not in ("total", "mean", "std")})
    whole = os.path.join(out, manifest_name(dataset, split))
    _merge_sides(whole, [os.path.join(out, p[2]) for p in parts])
    write_json_atomic(whole, merged)
    for p in parts:
        os.remove(os.path.join(out, p[2]))
        for kind in SIDE_FILES:
            with contextlib.suppress(FileNotFoundError):
                os.remove(side_file(os.path.join(out, p[2]), kind))
    remove_stale(out, mine - {s["name"] for s in merged["shards"]})
    return merged


def _merge_sides(whole, part_manifests):
    """Each side file of the whole split: its parts' rows under one header (none if no part has one)."""
    for kind in SIDE_FILES:
        found = [side_file(m, kind) for m in part_manifests if os.path.exists(side_file(m, kind))]
        target = side_file(whole, kind)
        if not found:
            with contextlib.suppress(FileNotFoundError):
                os.remove(target)
            continue
        with open(target + ".tmp", "wb") as f:
            for n, path in enumerate(found):
                with open(path, "rb") as part:
                    lines = part.readlines()
                f.writelines(lines if n == 0 else lines[1:])
        os.replace(target + ".tmp", target)


def remove_stale(out, names):
    """Delete the shards `names` (ones an old manifest of ours listed and the new one does not);
    returns those that were there."""
    gone = []
    for f in sorted(names):
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(out, f))
            gone.append(f)
    return gone


def shard_counts(rewritten, kept=0, removed=0, added=0):
    """'3 shards rewritten, 1 shard added, 2 shards deleted (no longer listed)': what a rebuild did
    to the shards of the set it replaced, its zero parts left out."""
    parts = [(rewritten, "rewritten"), (kept, "kept as they were"), (added, "added"),
             (removed, "deleted (no longer listed)")]
    said = [f"{n} shard{'s' if n != 1 else ''} {what}" for n, what in parts if n]
    return ", ".join(said) or "no shard changed"


def side_changes(names, before, written):
    """'; p-train.files.tsv rewritten, p-train.left-out.tsv deleted': what a rebuild did to the side
    files (`names`: file name -> kind) that were there (`before`) or that it wrote (`written`)."""
    said = [f"{n} {'rewritten' if k in before else 'written'}" if k in written else f"{n} deleted"
            for n, k in names.items() if k in written or k in before]
    return "; " + ", ".join(said) if said else ""
