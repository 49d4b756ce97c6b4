"""Checking written shards against their manifest (make_shards.py --verify): every shard's size and
sha256, in a folder or a store."""
import collections
import os

from pipeline.errors import FetchError, ShardError
from pipeline.files import read_json
from pipeline.data.manifests.manifest import check
from pipeline.data.shards.read import iter_samples
from pipeline.writers.shards import file_sha256


def verify(folder, policy=None, checked=None):
    """Re-check every manifest in `folder` against its shards: the manifest's fields, and
    each shard's presence, size, sha256 and sample count. Returns every problem found,
    one line each, across all manifests (an empty list: all is well). `checked`: a Counter
    given the manifests, shards and samples (by their manifests) it went through, for a line
    that says what an OK covers."""
    from pipeline.data.store import remote
    from pipeline.data.manifests.manifest import locate

    checked = collections.Counter() if checked is None else checked
    if remote.kind(folder) == "store":
        return _verify_store(folder, policy or remote.Policy(), checked)
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
        _count(checked, m)
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


def _count(checked, m):
    checked.update(manifests=1, shards=len(m["shards"]), samples=sum(s["samples"] for s in m["shards"]))


def _verify_store(prefix, policy, checked):
    """verify() for a store prefix: its manifests, each shard streamed once against its entry."""
    from pipeline.data.store import listings, storage
    from pipeline.data.manifests.manifest import load, locate

    try:
        manifests = [f for f in listings.names(prefix, policy) if f.endswith(".json") and ".part" not in f]
    except FetchError as e:
        return [str(e)]
    if not manifests:
        return [f"{prefix}: no manifests (*.json) found"]
    problems = []
    for mf in manifests:
        url = storage.join(prefix, mf)
        try:
            m = load(url, policy)
        except ShardError as e:
            problems.append(str(e))
            continue
        _count(checked, m)
        for s in m["shards"]:
            try:
                problem = _verify_shard(locate(url, s["name"]), s, policy)
            except ShardError as e:
                problem = str(e)
            if problem:
                problems.append(f"{mf}: {s['name']}: {problem}")
    return problems


def _verify_shard(url, entry, policy):
    from pipeline.data.store import remote

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
