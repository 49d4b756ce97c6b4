"""Publishing a split built locally to an object store (`make-shards --out s3://bucket/prefix`),
with the promise a local --out has (pipeline.writers.shards): the split is built in a local
temporary folder as for a local --out, then every shard is uploaded under a temporary key
(`NAME.tmp-<pid>`), and only when all are there are they moved into place and the manifest
written, last. A failed or interrupted upload removes its temporary keys; before the first
move it has touched nothing else, after it the shards moved so far and the marker (below) are
left, which the error line says: the rerun takes them as its own and finishes the set, and
until then indexing the prefix is refused (refuse_cut_short). The same ownership rule holds
(a key of a needed name that no make_shards manifest of this split there names is refused),
shards whose bytes a store already holds under their name are not uploaded again, a build
stopped while it moved its shards in leaves a marker (`MOVING`) by which its rerun knows them,
and a lock key (pipeline.writers.storelock) keeps a second make_shards from writing the prefix
meanwhile.
"""
import json
import os
import re

from pipeline import cli
from pipeline.errors import FetchError, ShardError
from pipeline.files import MAX_JSON, parse_json, read_json
from pipeline.data.manifests.manifest import manifest_name
from pipeline.writers.shards import SIDE_FILES, shard_counts, side_changes, side_file


MOVING = ".moving"  # NAME-SPLIT.json.moving: the shards a store build moves into place, written before the first


class CutShort(ShardError):
    """A folder or prefix a store build was stopped in while it moved its shards into place."""


def refuse_cut_short(where, names):
    """Raise CutShort when the folder or store prefix `where`, whose entries are `names`, holds
    a build's MOVING marker: its shards are part moved into place and its manifest not yet
    written, so an index made of what is there (indexing on first use, --index) would be a
    smaller set read without a word. Its rerun finishes it."""
    marker = next((n for n in sorted(names) if n.endswith(".json" + MOVING)), None)
    if marker is not None:
        raise CutShort(f"{where}: holds {marker}: a make-shards build was cut short there while it moved its shards "
                       f"into place (some may be missing, no manifest yet); run that make-shards again to finish it, "
                       f"then read the set")


def store_owned(out, name, split, present):
    """(names, entries): the shard names the make_shards manifest of this split under the store
    prefix `out` lists, and its entries as name -> (bytes, sha256); empty when there is none,
    it is unreadable, or it indexed somebody else's shards. `present`: the names under `out`.
    The names also hold those of a build that was stopped (KILL, TERM, a lost node) while it
    moved its shards into place (`MOVING`): the moved ones are this tool's, not "an object
    this tool did not write" (its rerun refused them); they get no entry, so they are written again."""
    from pipeline.data.store import remote, storage

    shard = re.compile(rf"^{re.escape(name)}-{re.escape(split)}-\d+\.tar$")
    moving = _moving(out, manifest_name(name, split) + MOVING, present, shard)
    if manifest_name(name, split) not in present:
        return moving, {}
    url = storage.join(out, manifest_name(name, split))
    try:
        m = parse_json(remote.fetch(url, limit=MAX_JSON), url)
        if (m.get("origin") or {}).get("kind") == "index":
            return set(), {}
        entries = {s["name"]: (s.get("bytes"), s.get("sha256")) for s in m["shards"]
                   if isinstance(s.get("name"), str) and shard.match(s["name"])}
    except (ShardError, OSError, KeyError, TypeError, AttributeError):
        return moving, {}  # unreadable: it vouches for nothing
    return set(entries) | moving, entries


def _moving(out, marker, present, shard):
    """The shard names a stopped build's marker lists (those it moved in, and the set it replaced)."""
    from pipeline.data.store import remote, storage

    if marker not in present:
        return set()
    try:
        m = parse_json(remote.fetch(storage.join(out, marker), limit=MAX_JSON), marker)
        return {n for n in [*m["shards"], *m["replacing"]] if isinstance(n, str) and shard.match(n)}
    except (ShardError, OSError, KeyError, TypeError):
        return set()  # unreadable: it vouches for nothing


def publish(stage, out, name, split, *, progress=True, say=None, policy=None):
    """Upload the split `build` wrote into the local folder `stage` to the store prefix `out`
    (see the module's docstring); returns the manifest. Raises ShardError for a needed key
    that holds an object no make_shards manifest of this split names, FetchError when an
    upload fails (its temporary keys are then removed; a failure once moving began says what
    it left and that a rerun finishes it). `policy`:
    the job's remote.Policy, which bounds the listing of `out`."""
    from pipeline.data.store import listings, remote, writing

    say = say or (lambda line: None)
    mname = manifest_name(name, split)
    manifest = read_json(os.path.join(stage, mname))
    store = writing.Writer(out, policy)
    present = set(listings.names(out, policy or remote.Policy()))
    owned, old = store_owned(out, name, split, present)
    ours = re.compile(rf"^{re.escape(name)}-{re.escape(split)}-\d+\.tar\.tmp-\d+$")
    for f in sorted(present):  # a killed run's temporaries (the marker says no run is writing now)
        if ours.match(f):
            store.remove(f)
    new = [s["name"] for s in manifest["shards"]]
    for f in new:
        if f in present and f not in owned:
            raise ShardError(f"{store.url(f)} exists and no make-shards manifest of {name}-{split} in {out} "
                             f"names it: refusing to overwrite an object this tool did not write; move it away or "
                             f"choose another --out")
    todo = [s for s in manifest["shards"]
            if not (s["name"] in present and old.get(s["name"]) == (s["bytes"], s["sha256"]))]
    tag = f".tmp-{os.getpid()}"
    pending = []  # temporary keys written and not yet moved into place
    moved = None  # the shards moved into place, once the marker is written
    bar = cli.progress(total=sum(s["bytes"] for s in todo), unit="B", unit_scale=True, desc=f"upload {name}-{split}",
                       disable=not progress)
    try:
        for s in todo:
            pending.append(s["name"] + tag)
            store.put(os.path.join(stage, s["name"]), pending[-1])
            bar.update(s["bytes"])
        bar.close()
        # before anything moves into place: what this build owns, should it be stopped while moving
        marker = os.path.join(stage, mname + MOVING)
        with open(marker, "w") as f:
            json.dump({"shards": new, "replacing": sorted(owned)}, f)
        store.put(marker, mname + MOVING)
        moved = []
        if old and any(s["name"] in owned for s in todo):  # its shards are about to change: it goes first
            store.remove(mname)
        sizes = {s["name"]: s["bytes"] for s in todo}
        while pending:
            store.move(pending[0], pending[0][:-len(tag)], sizes[pending[0][:-len(tag)]])
            moved.append(pending.pop(0)[:-len(tag)])
        store.put(os.path.join(stage, mname), mname)  # last: an object is written whole or not at all
        store.remove(mname + MOVING)
        sides, written = {os.path.basename(side_file(mname, k)): k for k in SIDE_FILES}, set()
        for side, kind in sides.items():  # the key -> file table, the images left out: beside the manifest, or none
            if os.path.exists(os.path.join(stage, side)):
                written.add(kind)
                store.put(os.path.join(stage, side), side)
            elif side in present:
                store.remove(side)
    except BaseException as e:
        bar.close()
        for t in pending:
            store.remove(t)
        if moved is not None and isinstance(e, FetchError):
            raise FetchError(f"{e}; left in {out}/: {len(moved)} of {len(todo)} shard(s) moved into place and "
                             f"{mname + MOVING}, no manifest yet (indexing them is refused): run the same make-shards "
                             f"again to finish it") from None
        raise
    gone = [f for f in sorted(owned - set(new)) if f in present]
    for f in gone:
        store.remove(f)
    if old:
        rewritten = len([s for s in todo if s["name"] in owned])
        counts = shard_counts(rewritten=rewritten, kept=len(manifest["shards"]) - len(todo),
                              added=len(todo) - rewritten, removed=len(gone))
        before = {kind for side, kind in sides.items() if side in present}
        say(f"  replaced {mname} in {out}/: {counts}{side_changes(sides, before, written)}; no other key touched")
    return manifest
