"""Writing shards: USTAR tar files plus the manifest, merging parts, verifying.

A sample is two tar members, `<key>.png` (or `<key>.raw`, uint8 CHW pixels whose
shape the manifest records) and `<key>.cls` (the label as ASCII digits). Keys are
`<dataset>-<split>-<index>` with no dots: webdataset splits keys at the first dot.

Shards are plain USTAR with integer mtimes. webdataset's own TarWriter writes a PAX
header per member because it passes float mtimes; every member then costs an extra
header, and reading it through tarfile costs twice as much (docs/benchmarks.md, "Tar format").

The manifest (see pipeline.data.manifest) is written last and atomically, and removed
before a rebuild starts, so its presence means the shard set is complete. A folder
is written by one writer at a time (`writing`): two builds into one folder would
write the same temporary names, and both could report success over shards the
other one cut short.
"""
import contextlib
import hashlib
import io
import multiprocessing
import os
import re
import tarfile

import numpy as np

from pipeline.data import png
from pipeline.errors import ShardError
from pipeline.files import Busy, locked, read_json, write_json_atomic
from pipeline.data.manifest import FORMAT, NAME_RE, check, manifest_name, shard_name
from pipeline.data.read import iter_samples

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
            raise ShardError(f"{out}: another make_shards is writing this folder ({e.strerror}); wait for it to finish "
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


def write_shard(path, source, indices, encoding):
    """Write one shard under a temporary name and rename it when complete.

    Returns its manifest entry (name, samples, bytes, sha256, per-channel pixel sums).
    """
    c = source.shape[0]
    pix_sum, pix_sumsq = np.zeros(c), np.zeros(c)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        with tarfile.open(fileobj=f, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for i in indices:
                image, label = source.image(i), source.label(i)
                if tuple(image.shape) != tuple(source.shape):
                    raise ShardError(f"{source.name} {source.split} sample {i}: shape {image.shape}, "
                                     f"expected {source.shape}")
                key = f"{source.name}-{source.split}-{i:07d}"
                _add_member(tar, f"{key}.{encoding}", encode_image(image, encoding))
                _add_member(tar, f"{key}.cls", str(label).encode())
                x = image.reshape(c, -1).astype(np.float64) / 255.0
                pix_sum += x.sum(1)
                pix_sumsq += (x * x).sum(1)
    digest, size = file_sha256(tmp), os.path.getsize(tmp)
    os.replace(tmp, path)
    return {"name": os.path.basename(path), "samples": len(indices), "bytes": size, "sha256": digest,
            "pixel_sum": pix_sum.round(6).tolist(), "pixel_sumsq": pix_sumsq.round(6).tolist()}


def file_sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


_SOURCE = None  # the source being written, inherited by forked writer processes


def _write_task(task):
    path, indices, encoding = task
    return write_shard(path, _SOURCE, indices, encoding)


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


def build(source, out, *, encoding="png", maxcount=500, seed=0, limit=None, workers=1, part=(0, 1),
          progress=True):
    """Write `source` as shards plus manifest under `out`; returns the manifest dict.

    With part=(i, n) only every n-th shard starting at i is written, under the same
    global names a whole build would use, and the manifest is a part manifest for
    `merge_parts`. A rebuild removes the old manifest first and stale shards last.
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
        return _build(source, out, encoding, maxcount, seed, limit, workers, part, progress)


def _build(source, out, encoding, maxcount, seed, limit, workers, part, progress):
    final = os.path.join(out, _manifest_file(source.name, source.split, part))
    whole = os.path.join(out, manifest_name(source.name, source.split))
    for old in {final, whole}:  # a part rewrites shards that a whole manifest may list
        if os.path.exists(old):
            os.remove(old)
    plan = plan_shards(len(source), maxcount, seed, limit, part)
    tasks = [(os.path.join(out, shard_name(source.name, source.split, k)), idx, encoding) for k, idx in plan]
    entries = _run_tasks(source, tasks, workers, progress, f"{source.name}-{source.split}")
    manifest = {
        "format": FORMAT, "dataset": source.name, "split": source.split, "encoding": encoding,
        "image_exts": [encoding], "label": "cls", "origin": _origin(source, limit),
        "shape": list(source.shape), "classes": source.classes, "seed": seed, "maxcount": maxcount,
        "part": list(part) if part[1] > 1 else None,
        "shards": entries,
    }
    manifest = finish_manifest(manifest)
    write_json_atomic(final, manifest)
    if part[1] == 1:
        remove_stale(out, manifest)
    return manifest


def _origin(source, limit):
    origin = dict(getattr(source, "origin", None) or {"kind": "unknown"})
    if limit and limit < len(source):
        origin["limit"] = f"a seeded subset of {limit} of these {len(source)} samples (--limit)"
    return origin


def _manifest_file(dataset, split, part):
    i, n = part
    return manifest_name(dataset, split) if n == 1 else f"{dataset}-{split}.part{i}of{n}.json"


def _run_tasks(source, tasks, workers, progress, desc):
    from tqdm import tqdm

    global _SOURCE
    _SOURCE = source
    bar = tqdm(total=sum(len(t[1]) for t in tasks), unit="sample", desc=desc, disable=not progress,
               dynamic_ncols=True)
    entries = []
    try:
        if workers > 1 and len(tasks) > 1:
            with multiprocessing.get_context("fork").Pool(workers) as pool:
                for entry in pool.imap(_write_task, tasks):
                    entries.append(entry)
                    bar.update(entry["samples"])
        else:
            for task in tasks:
                entries.append(_write_task(task))
                bar.update(entries[-1]["samples"])
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
    merged = dict(loaded[0], part=None)
    merged["shards"] = sorted((e for m in loaded for e in m["shards"]), key=lambda e: e["name"])
    merged = finish_manifest({k: v for k, v in merged.items() if k not in ("total", "mean", "std")})
    write_json_atomic(os.path.join(out, manifest_name(dataset, split)), merged)
    for p in parts:
        os.remove(os.path.join(out, p[2]))
    remove_stale(out, merged)
    return merged


def remove_stale(out, manifest):
    """Delete shards of this dataset and split that the manifest does not list."""
    pat = re.compile(rf"^{re.escape(manifest['dataset'])}-{re.escape(manifest['split'])}-\d+\.tar(\.tmp)?$")
    keep = {s["name"] for s in manifest["shards"]}
    for f in os.listdir(out):
        if pat.match(f) and f not in keep:
            os.remove(os.path.join(out, f))


# ---------------------------------------------------------------- verifying


def verify(folder, policy=None):
    """Re-check every manifest in `folder` against its shards: the manifest's fields, and
    each shard's presence, size, sha256 and sample count. Returns every problem found,
    one line each, across all manifests (an empty list: all is well)."""
    from pipeline.data import remote
    from pipeline.data.manifest import locate

    if not os.path.isdir(folder):
        return [f"{folder}: no such folder"]
    problems = []
    manifests = sorted(f for f in os.listdir(folder) if f.endswith(".json") and ".part" not in f)
    if not manifests:
        return [f"{folder}: no manifests (*.json) found"]
    for mf in manifests:
        path = os.path.join(folder, mf)
        try:
            m = check(read_json(path), path)
        except ShardError as e:
            problems.append(str(e))
            continue
        for s in m["shards"]:
            try:
                url = locate(path, s["name"])
            except ShardError as e:
                problems.append(str(e))
                continue
            problem = _verify_shard(url, s, policy or remote.Policy())
            if problem:
                problems.append(f"{mf}: {s['name']}: {problem}")
    return problems


def _verify_shard(url, entry, policy):
    from pipeline.data import remote

    local = remote.kind(url) == "file"
    if local:
        if not os.path.exists(url):
            return "missing"
        if os.path.getsize(url) != entry["bytes"]:
            return f"{os.path.getsize(url)} bytes, the manifest says {entry['bytes']}"
        if entry.get("sha256") and file_sha256(url) != entry["sha256"]:
            return "sha256 differs from the manifest"
    try:
        n = remote.read_url(url, lambda f: sum(1 for _ in iter_samples(f, set())), policy=policy,
                            nbytes=None if local else entry["bytes"], digest=None if local else entry.get("sha256"))
    except (ShardError, OSError) as e:
        return f"unreadable ({e})"
    if n != entry["samples"]:
        return f"{n} samples, the manifest says {entry['samples']}"
    return None
