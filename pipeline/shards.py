"""The shard format: writing USTAR tar shards with a manifest, reading them back, verifying.

A sample is two tar members, `<key>.png` (or `<key>.raw`, uint8 CHW pixels whose
shape the manifest records) and `<key>.cls` (the label as ASCII digits). Keys are
`<dataset>-<split>-<index>` with no dots: webdataset splits keys at the first dot.

Shards are plain USTAR with integer mtimes. webdataset's own TarWriter writes a PAX
header per member because it passes float mtimes; every member then costs an extra
header, and reading it goes through tarfile's slow PAX path (see ../shared/NOTES.md).

A manifest `<dataset>-<split>.json` lists every shard with its sample count, byte
size, sha256 and pixel sums. It is written last and atomically, and removed before a
rebuild starts, so its presence means the shard set is complete.
"""
import hashlib
import io
import json
import multiprocessing
import os
import re
import tarfile

import numpy as np

from . import png

FORMAT = "pipeline-shards/1"
ENCODINGS = ("png", "raw")
NAME_RE = re.compile(r"^[A-Za-z0-9_]+$")
MAX_MEMBER = 64 << 20  # a member claiming more is corrupt or hostile, not an image


class ShardError(ValueError):
    """A shard or manifest is missing, malformed or disagrees with its manifest."""


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


def shard_name(dataset, split, index):
    return f"{dataset}-{split}-{index:06d}.tar"


def manifest_name(dataset, split):
    return f"{dataset}-{split}.json"


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
    os.makedirs(out, exist_ok=True)
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
        "shape": list(source.shape), "classes": source.classes, "seed": seed, "maxcount": maxcount,
        "part": list(part) if part[1] > 1 else None,
        "shards": entries,
    }
    manifest = finish_manifest(manifest)
    write_json_atomic(final, manifest)
    if part[1] == 1:
        remove_stale(out, manifest)
    return manifest


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


def write_json_atomic(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise ShardError(f"{path}: no such manifest") from None
    except json.JSONDecodeError as e:
        raise ShardError(f"{path}: not valid JSON ({e})") from None


# ---------------------------------------------------------------- reading

ZERO_BLOCK = bytes(512)


def iter_members(stream, chunk=1 << 20, max_member=MAX_MEMBER):
    """Yield (name, data) for each regular file in a tar stream.

    A lean USTAR parser: 512-byte header, name, octal size, skip padding. Python's
    tarfile costs ~100 us a member; this is what makes the loader fast. Directories,
    links and PAX/GNU extension records are skipped. Raises ShardError on a header
    that is not USTAR, a bad size or one over `max_member`, or a stream that ends
    before the end-of-archive block (a truncated shard).
    """
    buf, pos = b"", 0
    while True:
        if len(buf) - pos < 512:
            buf, pos = buf[pos:] + _read(stream, chunk), 0
            if len(buf) < 512:  # a tar ends with a zero block; ending elsewhere, even between members, is truncation
                raise ShardError("truncated tar header" if buf.strip(b"\0") else
                                 "tar ends without its end-of-archive block (truncated)")
        header = buf[pos:pos + 512]
        if header == ZERO_BLOCK:
            return
        if header[257:262] != b"ustar":
            raise ShardError(f"not a USTAR tar header at byte offset {pos}")
        name = header[:100].split(b"\0", 1)[0]
        if header[345] != 0:
            name = header[345:500].split(b"\0", 1)[0] + b"/" + name
        field = header[124:136]
        try:
            size = max_member + 1 if field[0] & 0x80 else int(field.strip(b"\0 ") or b"0", 8)
        except ValueError:
            size = -1
        if size < 0:  # a negative size would step the parser backwards, looping forever
            raise ShardError(f"bad size field {field!r} for member {name!r}")
        if size > max_member:
            raise ShardError(f"member {name.decode(errors='replace')!r} claims {size} bytes (limit {max_member})")
        end = pos + 512 + ((size + 511) & ~511)
        while len(buf) < end:
            more = _read(stream, max(chunk, end - len(buf)))
            if not more:
                raise ShardError(f"truncated member {name.decode(errors='replace')!r}")
            buf, end, pos = buf[pos:] + more, end - pos, 0
        if header[156] in (48, 0):  # b"0" or NUL: regular file
            yield name.decode("utf-8", "replace"), buf[pos + 512:pos + 512 + size]
        pos = end


def _read(stream, n):
    """Read up to n bytes, looping over short reads from pipes."""
    parts, got = [], 0
    while got < n:
        b = stream.read(n - got)
        if not b:
            break
        parts.append(b)
        got += len(b)
    return b"".join(parts)


def iter_samples(members, url=None):
    """Group consecutive members with the same key into sample dicts (webdataset's layout)."""
    sample = None
    for name, data in members:
        dot = name.find(".", name.rfind("/") + 1)  # 'dir/a-b-1.png' -> key 'dir/a-b-1', ext 'png'
        key, ext = (name, "") if dot < 0 else (name[:dot], name[dot + 1:])
        if sample is None or sample["__key__"] != key:
            if sample is not None:
                yield sample
            sample = {"__key__": key, "__url__": url}
        sample[ext] = data
    if sample is not None:
        yield sample


# ---------------------------------------------------------------- verifying


def verify(folder):
    """Re-check every manifest in `folder` against its shards; returns a list of problems."""
    problems = []
    manifests = sorted(f for f in os.listdir(folder) if f.endswith(".json") and ".part" not in f)
    if not manifests:
        return [f"{folder}: no manifests (*.json) found"]
    for mf in manifests:
        m = read_json(os.path.join(folder, mf))
        if m.get("format") != FORMAT:
            problems.append(f"{mf}: not a {FORMAT} manifest")
            continue
        for s in m["shards"]:
            path = os.path.join(folder, s["name"])
            if not os.path.exists(path):
                problems.append(f"{s['name']}: missing")
            elif os.path.getsize(path) != s["bytes"]:
                problems.append(f"{s['name']}: {os.path.getsize(path)} bytes, manifest says {s['bytes']}")
            elif file_sha256(path) != s["sha256"]:
                problems.append(f"{s['name']}: sha256 differs from the manifest")
            else:
                try:
                    with open(path, "rb") as f:
                        n = sum(1 for _ in iter_samples(iter_members(f)))
                except ShardError as e:
                    n = f"unreadable ({e})"
                if n != s["samples"]:
                    problems.append(f"{s['name']}: {n} samples, manifest says {s['samples']}")
    return problems
