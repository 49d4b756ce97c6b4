"""Shards as webdataset users name them: globs, and the manifest that lists a folder's shards.

A user who indexed `WDS/train/` with `--out WDS` has `WDS/cifar10-train.json` naming
`train/*.tar`; giving the trainer `WDS/train/` (or a brace pattern or a glob of those shards)
then looked only inside `WDS/train/` and answered with an `--index` command to run again. The
manifest is looked for beside the shards and one folder above (`candidates`); which one
lists them is for `pipeline.data.manifests.manifest.resolve` to decide, by the shard names it lists.

Globs (`train/*.tar`, `shard-??.tar`, `part-[0-4].tar`) are what webdataset's own examples
write; braceexpand takes them as one file name. Here the wildcards of the file name are
matched against the folder's listing (a local folder's, or an object store's through
`pipeline.data.store.storage`), in name order.
"""
import fnmatch
import os
import re

from pipeline.data.store import listings, remote
from pipeline.errors import ShardError, cut, redact

SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz")
WILDCARD = re.compile(r"[*?[]")
MAX_CANDIDATES = 16  # manifests read to find one that lists a folder's shards: each may be tens of MB
_MANIFEST_NAME = re.compile(r"[A-Za-z0-9_]+-[A-Za-z0-9_]+\.json\Z")  # NAME-SPLIT.json, as make_shards names them


def is_glob(name):
    """True for a local or object-store shard name holding *, ? or [...] (never an http(s) URL,
    whose ? starts a query, nor a pipe: command)."""
    return bool(WILDCARD.search(name)) and remote.kind(name) in ("file", "store")


def globbed(pattern, policy=remote.Policy()):
    """The shards (*.tar, *.tar.gz, *.tgz) a glob matches, in name order; wildcards only in the
    file name, since one listing of one folder answers it (a store's within `policy`'s limits).
    ShardError when none match."""
    folder, slash, last = pattern.rpartition("/")
    if WILDCARD.search(folder):
        raise ShardError(f"{cut(redact(pattern))}: a wildcard in a folder's name; only the shards' file names may "
                         f"hold *, ? or [...] (or use a brace pattern, e.g. part{{0..9}}/*.tar)")
    if remote.kind(pattern) == "store":
        names = [(u.rpartition("/")[2], u) for u in listings.urls(folder + "/", SHARD_SUFFIXES, policy)]
    else:
        where = folder + slash if slash else ""
        try:
            names = [(f, where + f) for f in os.listdir(where or ".")]
        except OSError as e:
            raise ShardError(f"{cut(redact(pattern))}: cannot list {where or '.'}: {e.strerror or e}") from None
    hidden = last.startswith(".")
    found = sorted(url for f, url in names if fnmatch.fnmatchcase(f, last) and f.endswith(SHARD_SUFFIXES)
                   and (hidden or not f.startswith(".")))
    if not found:
        raise ShardError(f"{cut(redact(pattern))}: no shards (*.tar, *.tar.gz, *.tgz) match")
    return found


def candidates(folder, name, split):
    """Local manifests that may list the shards of `folder`: NAME-SPLIT.json in the folder and
    one folder above, then the other manifests of that split there (OTHER-SPLIT.json: the same
    shards indexed under another data set's name), in name order, at most MAX_CANDIDATES in all
    (a folder of many .json files is not read whole). Another split's manifest is never one:
    `--eval` given a folder that holds only the training manifest stays an error."""
    folder = os.path.normpath(folder)
    parent = os.path.dirname(folder) if os.path.basename(folder) not in ("", ".", "..") else None
    places = [folder] + ([parent or "."] if parent is not None else [])
    preferred = f"{name}-{split}.json"
    found = [os.path.join(p, preferred) for p in places]
    for place in places:
        try:
            names = sorted(os.listdir(place))
        except OSError:
            continue
        found += [os.path.join(place, f) for f in names
                  if _MANIFEST_NAME.match(f) and f.endswith(f"-{split}.json") and f != preferred]
    return [f for f in found if os.path.isfile(f)][:MAX_CANDIDATES]
