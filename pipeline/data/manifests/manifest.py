"""Manifests: what a shard set holds, where its shards are, and how to decode them.

A manifest `<dataset>-<split>.json` lists every shard (name, sample count, byte
size, sha256) with the image shape, class names, per-channel mean and std, how
samples decode (image extensions, label key) and where the data came from
(`origin`). make_shards writes them for shards it builds and for existing
WebDatasets it indexes in place; the stream sizes epochs and normalises images
from them.

A manifest is data, never code, and may come from anyone. Every field is
checked for type and range before use, and one rule says where a listed shard
may be:
- a plain relative name (`mnist-train-000001.tar`, `part/00012.tar`): a file
  beside the manifest, wherever the manifest is (a folder, a URL, or a file
  that a pipe: command prints, with the name substituted into that command);
  no `..`, no hidden segments, only letters, digits and `._+-` in each segment,
  and for local manifests nothing that resolves (through links) outside the
  manifest's folder;
- an absolute http(s) URL, for a manifest that points at shards elsewhere;
- an absolute path, in a local manifest only.
Anything else (`pipe:...`, `file:`, other schemes, `..`) is refused with one
line naming the manifest and the shard, before anything is opened or run.
"""
import collections
import math
import os
import re
import shlex
import urllib.parse
import warnings
from dataclasses import dataclass, field


from pipeline.data.store import find_manifest, remote, storage
from pipeline.data.decoding.decode import IMAGE_EXTS, Target, image_format
from pipeline.data.decoding.labelling import parse_label_key
from pipeline.data.fields.schema import Schema
from pipeline.errors import ShardError, redact
from pipeline.files import MAX_JSON, missing_folder, missing_line, no_manifest, parse_json, read_json
from pipeline.data.shards.read import INFLATE_RATIO, INFLATE_SLACK
from pipeline.data.manifests.patterns import expand_shards
from pipeline.data.manifests.locations import _beside, _normal, _once, listing_digest

FORMAT = "pipeline-shards/2"
FORMATS = ("pipeline-shards/1", FORMAT)  # /1: make_shards before origins and label keys; same fields otherwise
NAME_RE = re.compile(r"[A-Za-z0-9_]+\Z")  # \Z, not $: "$" also matches before a final newline
_SEGMENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*\Z")
_URL_SAFE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s\x00-\x1f\x7f]+\Z")
MIN_STD = 1e-6  # per channel, on 0..1 pixels: below it normalising multiplies by more than a million
MAX_STD = 1.0  # pixels in 0..1 have a std of at most 0.5; 1 admits a hand-written "scale only" (mean 0, std 1)
MAX_SIDE = 4096
MAX_CLASSES = 1 << 20
CLASSES_WHY = "the model has an output per class and every worker keeps the class list"  # why MAX_CLASSES


def manifest_name(dataset, split):
    return f"{dataset}-{split}.json"


def shard_name(dataset, split, index):
    return f"{dataset}-{split}-{index:06d}.tar"


@dataclass
class Source:
    """One data set split as the stream sees it: where its shards are, and what they hold."""

    name: str
    urls: list
    counts: list
    target: Target
    classes: list
    mean: list
    std: list
    sizes: list = None
    digests: list = None
    origin: dict = field(default_factory=dict)
    manifest: str = ""
    dataset: str = ""
    split: str = ""
    listing: str = ""  # listing_digest of its shards: what a checkpoint's fingerprint holds
    schema: object = None  # its fields (pipeline.data.fields.schema.Schema); None: image and label, as always

    @property
    def total(self):
        return sum(self.counts)

    @property
    def shape(self):
        return tuple(self.target.shape)

    @property
    def synthetic(self):
        return self.origin.get("kind") == "synthetic"


class NoManifest(ShardError):
    """The manifest a SPEC needs is not there (no file, HTTP 404, no such object): shards
    with no manifest, which pipeline.writers.autoindex indexes on first use."""


def _absent(error):
    """True for a read that failed because the file is not there (not for a server that fails)."""
    if isinstance(error, (FileNotFoundError, storage.Missing)):
        return True
    return re.search(r"\b(404|NoSuchKey|no such object)\b", str(error)) is not None


# ---------------------------------------------------------------- checking


def image_shape(shape):
    """Whether `shape` is an image shape a manifest may hold: [C, H, W] integers, C 1 or 3, sides
    1..MAX_SIDE (the manifest's check, indexing's and make-shards' --shape alike)."""
    return (len(shape) == 3 and all(isinstance(x, int) and not isinstance(x, bool) for x in shape)
            and shape[0] in (1, 3) and all(1 <= x <= MAX_SIDE for x in shape[1:]))


def check(m, where):
    """Raise ShardError naming `where` and the field unless `m` is a well-formed manifest."""
    def bad(path, problem):
        raise ShardError(f"{where}: field {path}: {problem}")

    def integer(x):
        return isinstance(x, int) and not isinstance(x, bool)

    if not isinstance(m, dict):
        raise ShardError(f"{where}: not a shard manifest (a JSON object is expected)")
    if "fields" in m:  # a set of any fields: what only image-and-label sets need is optional
        try:
            schema = Schema.from_json(m["fields"])
        except ValueError as e:
            bad("fields", str(e))
        m = dict(_field_defaults(schema), **m)
    if m.get("format") not in FORMATS:
        bad("format", f"{m.get('format')!r}; expected {FORMAT!r} (build or index the shards with make-shards)")
    for key in ("dataset", "split"):
        if not isinstance(m.get(key), str) or not NAME_RE.match(m[key]):
            bad(key, "letters, digits and _ expected")
    shards = m.get("shards")
    if not isinstance(shards, list) or not shards:
        bad("shards", "a non-empty list of {name, samples, bytes} objects expected")
    for i, s in enumerate(shards):
        if not isinstance(s, dict):
            bad(f"shards[{i}]", "an object expected")
        if not isinstance(s.get("name"), str) or not s["name"]:
            bad(f"shards[{i}].name", "a shard name expected")
        if not integer(s.get("samples")) or s["samples"] < 1:
            bad(f"shards[{i}].samples", f"{s.get('samples')!r}; a positive integer expected")
        if not integer(s.get("bytes")) or s["bytes"] < 1:
            bad(f"shards[{i}].bytes", f"{s.get('bytes')!r}; a positive integer expected")
        compressed = s["name"].lower().endswith((".gz", ".tgz"))
        room = s["bytes"] * INFLATE_RATIO + INFLATE_SLACK if compressed else s["bytes"]  # what the reader inflates at most
        if s["samples"] * 1024 > room:  # a sample is at least two members, each behind a 512-byte header
            bad(f"shards[{i}].samples", f"{s['samples']} samples cannot fit in {s['bytes']} bytes"
                + (" once inflated (pipeline.data.shards.read.INFLATE_RATIO)" if compressed else ""))
        if s.get("sha256") is not None and not (isinstance(s["sha256"], str) and re.fullmatch(r"[0-9a-f]{64}", s["sha256"])):
            bad(f"shards[{i}].sha256", "64 lowercase hex digits expected")
    shape = m.get("shape")
    if not (isinstance(shape, list) and image_shape(shape)):
        bad("shape", f"{shape!r}; [C, H, W] expected with C 1 or 3 and sides 1..{MAX_SIDE}")
    classes = m.get("classes")
    if isinstance(classes, list) and len(classes) > MAX_CLASSES:
        bad("classes", f"{len(classes)} classes, more than the {MAX_CLASSES} a manifest may hold "
                       f"(pipeline.data.manifests.manifest.MAX_CLASSES): {CLASSES_WHY}")
    if not (isinstance(classes, list) and (classes or "fields" in m) and all(isinstance(c, str) for c in classes)):
        bad("classes", "a non-empty list of class names expected")
    for key in ("mean", "std"):
        v = m.get(key)
        if not (isinstance(v, list) and len(v) == shape[0] and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                                   and math.isfinite(x) for x in v)):
            bad(key, f"{v!r}; {shape[0]} finite numbers expected")
    if not all(0 <= x <= 1 for x in m["mean"]):  # manifests hold statistics of pixels / 255
        bad("mean", f"{m['mean']}; every channel's mean must be within 0..1 (pixels are scaled to 0..1)")
    if not all(MIN_STD <= x <= MAX_STD for x in m["std"]):
        bad("std", f"{m['std']}; every channel's std must be within {MIN_STD}..{MAX_STD} (pixels are scaled to 0..1)")
    names = [s["name"] for s in shards]
    counts = collections.Counter(names)
    if len(counts) != len(names):
        twice = next(n for n in names if counts[n] > 1)  # counted once: a million names must not cost n² steps
        bad("shards", f"{twice!r} is listed more than once")
    exts = m.get("image_exts", [m.get("encoding")])
    if not (isinstance(exts, list) and exts and all(image_format(e) for e in exts)):
        bad("image_exts" if "image_exts" in m else "encoding",
            f"{exts!r}; extensions ending in one of {', '.join(IMAGE_EXTS)} expected")
    try:
        parse_label_key(m.get("label", "cls"))
    except (ValueError, AttributeError) as e:
        bad("label", str(e))
    for key in ("label_names", "skip_unlabelled"):
        if not isinstance(m.get(key, False), bool):
            bad(key, f"{m[key]!r}; true or false expected")
    if m.get("label_names") and (m.get("label_values") is not None or len(set(classes)) != len(classes)):
        bad("classes", "distinct class names expected when labels are names (and no label_values)")
    for i, s in enumerate(shards):
        if s.get("unlabelled") is not None and not (integer(s["unlabelled"]) and s["unlabelled"] >= 0):
            bad(f"shards[{i}].unlabelled", f"{s['unlabelled']!r}; a count expected")
    values = m.get("label_values")
    if values is not None and not (isinstance(values, list) and len(values) == len(classes)
                                   and all(integer(v) for v in values) and len(set(values)) == len(values)):
        bad("label_values", f"{len(classes)} distinct integers expected, one per class")
    if m.get("total") is not None and m["total"] != sum(s["samples"] for s in shards):
        bad("total", f"{m['total']!r}, but the shards add up to {sum(s['samples'] for s in shards)}")
    if not isinstance(m.get("origin", {}), dict):
        bad("origin", "an object expected")
    return m


def _field_defaults(schema):
    """What a manifest of fields may leave out: the shape of its first image field (else 1x1x1),
    no classes, mid-grey statistics (used only where a source is read as image and label)."""
    image = next((c for c in schema.columns if c.kind == "image"), None)
    c = image.channels if image else 1
    return {"shape": [c, *image.size] if image else [1, 1, 1], "classes": [], "mean": [0.5] * c, "std": [0.25] * c,
            "image_exts": [image.members[0][0]] if image else ["png"]}


def schema_of(m):
    """The manifest's fields as a Schema, None for an image-and-label set."""
    return Schema.from_json(m["fields"]) if "fields" in m else None


def target_of(m):
    if "fields" in m:
        m = dict(_field_defaults(schema_of(m)), **m)
    return Target(tuple(m["shape"]), tuple(m.get("image_exts", [m.get("encoding")])), m.get("label", "cls"),
                  len(m["classes"]), tuple(m["label_values"]) if m.get("label_values") else None,
                  tuple(m["classes"]) if m.get("label_names") else None, bool(m.get("skip_unlabelled")))


# ---------------------------------------------------------------- locating


def locate(manifest_url, name):
    """Where a shard that the manifest at `manifest_url` names lives (see the module docstring)."""
    where = remote.kind(manifest_url)
    if name.startswith(("http://", "https://")) or storage.known_store(name):
        if not _URL_SAFE.match(name):
            raise ShardError(f"{manifest_url}: shard {name!r}: a URL with spaces or control characters")
        return name
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]+:", name):
        raise ShardError(f"{manifest_url}: shard {name!r}: a manifest may name plain files, absolute paths, "
                         f"http(s) URLs or object-store URLs (s3://...), never commands or other schemes")
    if name.startswith("/"):
        if where != "file":
            raise ShardError(f"{manifest_url}: shard {name!r}: an absolute path in a remote manifest; index the "
                             f"shards with --out set to their folder (or a folder above it), so that the manifest "
                             f"names them relative to itself, or with --base-url URL for shards served from URL")
        if any(p in ("..", ".") for p in name.split("/")) or "\x00" in name:
            raise ShardError(f"{manifest_url}: shard {name!r}: '..' or '.' in the path")
        return name
    if not plain_relative(name):
        raise ShardError(f"{manifest_url}: shard {name!r}: not a plain relative name (letters, digits and ._+- "
                         f"in each /-separated part, no '..', nothing hidden)")
    if where == "file":
        folder = os.path.dirname(manifest_url) or "."
        path = os.path.join(folder, name)
        real, top = os.path.realpath(path), os.path.realpath(folder)
        if os.path.exists(path) and not real.startswith(top.rstrip(os.sep) + os.sep):
            raise ShardError(f"{manifest_url}: shard {name!r} resolves to {real}, outside the manifest's folder")
        return path
    head, _, tail = manifest_url.rpartition(_manifest_file(manifest_url))
    quote = {"http": urllib.parse.quote, "store": str}.get(where, shlex.quote)
    return head + quote(name) + tail


def plain_relative(name):
    """True for a shard name taken as relative to its manifest: /-separated plain parts
    (letters, digits and ._+-, not starting with a dot), no '..', nothing hidden."""
    return all(_SEGMENT.match(p) and p not in (".", "..") for p in name.split("/"))


def _manifest_file(url):
    found = re.findall(r"[^/\s'\"]+\.json", url)
    if not found:
        raise ShardError(f"{url}: no NAME.json file name to replace with the shard names")
    return found[-1]


# ---------------------------------------------------------------- loading


def load(url, policy=remote.Policy()):
    """Read and check the manifest at a path, URL or pipe: command."""
    if remote.kind(url) == "file":
        if not os.path.exists(url):
            raise NoManifest(no_manifest(url))
        m = read_json(url)
    else:
        try:
            text = remote.fetch(url, policy=policy, limit=MAX_JSON, limit_name="the most a manifest may hold")
        except (OSError, ShardError) as e:  # ShardError: a body past MAX_JSON
            said, error = str(e), NoManifest if _absent(e) else ShardError
            if said.startswith((url, redact(url))):  # most read errors name the URL first: name it once
                raise error(f"cannot read manifest {said}") from None
            raise error(f"cannot read manifest {url}: {said}") from None
        m = parse_json(text, url)
    return check(m, url)


def _shards(name, spec, chosen, bad, what):
    """The line for the `bad` shards of those `spec` names (`chosen`; each bad one a URL, or a
    URL and ": its problem"): their count, what is wrong, and the first; when `spec` names one
    shard alone, its URL is the spec's and is written once (the line read `mnist=URL: 1 shard(s)
    not in MANIFEST, e.g. URL`)."""
    if len(chosen) == 1:
        said = bad[0].removeprefix(redact(chosen[0]) + ": ") if bad[0] != chosen[0] else what
        return f"{name}={spec}: {said}"
    return f"{name}={spec}: {len(bad)} shard(s) {what}, e.g. {bad[0]}"


def resolve(name, spec, split, *, policy=remote.Policy(), check_http=None):
    """Turn a command line's NAME=SPEC into a Source. Raises ShardError naming what is wrong.

    SPEC is a manifest (a path, an http(s) URL or a pipe: command printing it), a
    folder or base URL (ending in /) holding `NAME-SPLIT.json`, or a brace pattern or glob
    of shards with `NAME-SPLIT.json` beside them. A local folder or pattern without it takes
    the manifest beside the shards or one folder above that lists them all (`_lister`).
    Shards that are local must exist; http(s) shards are checked by
    `check_http(urls, sizes) -> (problems, resized)` (default: a HEAD request each, see
    remote.head_check).
    """
    pattern = within = None
    if remote.kind(spec) == "store" and "{" not in spec and not spec.endswith((".json", ".tar", ".tar.gz", ".tgz")):
        spec += "/"  # a prefix is a folder, as a local folder is with or without its '/'
    if spec.endswith(".json"):
        url = spec
    elif spec.endswith("/") or (remote.kind(spec) == "file" and os.path.isdir(spec)):
        url = spec.rstrip("/") + "/" + manifest_name(name, split)
        if remote.kind(spec) == "file" and os.path.isdir(spec) and not os.path.exists(url):
            tars = sorted(os.path.join(spec, f) for f in os.listdir(spec) if f.endswith(find_manifest.SHARD_SUFFIXES))
            url, within = _lister(name, split, tars, policy) if tars else (url, None)
        if remote.kind(spec) == "file":
            _check_folder(name, split, spec, url)
    else:
        if remote.kind(spec) == "file" and missing_folder(spec):  # neither a manifest nor a shard pattern
            raise ShardError(missing_line(name, spec))
        pattern = expand_shards(spec)
        url = _beside(pattern[0], manifest_name(name, split))
        if remote.kind(url) == "file" and not os.path.exists(url):
            url = _lister(name, split, pattern, policy)[0]
        if remote.kind(url) == "file" and not os.path.exists(url):
            raise NoManifest(f"{name}={spec}: no manifest {url} beside these shards; index them in place with: "
                             f"make-shards --index {shlex.quote(f'{name}:{split}={spec}')} "
                             f"--out {shlex.quote(os.path.dirname(url) or '.')}")
    m = load(url, policy)
    if m["dataset"] != name:
        warnings.warn(f"{name}={redact(spec)}: the manifest describes data set {m['dataset']!r}, not {name!r}", stacklevel=2)
    located = [locate(url, s["name"]) for s in m["shards"]]
    _once(located, f"{url}: field shards")
    listed = dict(zip(located, m["shards"]))
    if within is not None:  # a folder's shards in a manifest above it, in the manifest's order
        chosen = [u for u in listed if _normal(u) in within]
    elif pattern is None:
        chosen = list(listed)
    else:
        chosen = [_normal(u) for u in pattern]
        by_normal = {_normal(u): u for u in listed}
        unknown = [u for u in chosen if u not in by_normal]
        if unknown:
            raise ShardError(_shards(name, spec, chosen, unknown, f"not in {url}"))
        chosen = [by_normal[u] for u in chosen]
        _once(chosen, f"{name}={spec}: the pattern")
    entries = [listed[u] for u in chosen]
    huge = next((e for e in entries if e["bytes"] > policy.max_bytes), None)
    if huge:
        raise ShardError(f"{name}={spec}: shard {huge['name']}: {huge['bytes']} bytes in {url}, more than "
                         f"--max-shard-bytes {policy.max_bytes}; raise it if the shards really are that large")
    missing = [u for u in chosen if remote.kind(u) == "file" and not os.path.exists(u)]
    if missing:
        raise ShardError(_shards(name, spec, chosen, missing, "missing"))
    resized = [f"{u}: {os.path.getsize(u)} bytes, the manifest says {e['bytes']}" for u, e in zip(chosen, entries)
               if remote.kind(u) == "file" and os.path.getsize(u) != e["bytes"]]
    http = [u for u in chosen if remote.kind(u) == "http"]
    if http:
        sizes = {u: e["bytes"] for u, e in zip(chosen, entries)}
        problems, more = (check_http or (lambda us, sz: remote.head_check(us, sz, policy=policy)))(http, sizes)
        if problems:
            raise ShardError(_shards(name, spec, chosen, problems, "unavailable"))
        resized += more
    if resized:
        warnings.warn(f"{name}={redact(spec)}: {len(resized)} shard(s) differ in size from the manifest, e.g. {resized[0]}; "
                      f"they may be damaged (damage is skipped and counted; check with make-shards --verify)",
                      stacklevel=2)
    return Source(name, chosen, [e["samples"] for e in entries], target_of(m), list(m["classes"]),
                  list(m["mean"]), list(m["std"]), [e["bytes"] for e in entries], [e.get("sha256") for e in entries],
                  dict(m.get("origin") or {}), url, m["dataset"], m["split"], listing_digest(entries), schema_of(m))


def _lister(name, split, shards, policy):
    """(url, the shards as listed) of the first local manifest of SPLIT beside `shards` (local
    paths of one folder) or one folder above that lists every one of them (find_manifest.candidates,
    NAME-SPLIT.json first), else (the manifest beside them, None). A candidate that is no
    manifest, or names shards it may not, is passed over: it is not the one asked for."""
    wanted = {_normal(u) for u in shards}
    beside = os.path.join(os.path.dirname(shards[0]), manifest_name(name, split))
    if remote.kind(shards[0]) != "file" or len({os.path.dirname(u) for u in wanted}) != 1:
        return beside, None
    for url in find_manifest.candidates(os.path.dirname(shards[0]), name, split):
        try:
            listed = {_normal(locate(url, s["name"])) for s in load(url, policy)["shards"]}
        except ShardError:
            continue
        if wanted <= listed:
            return url, wanted
    return beside, None


def _check_folder(name, split, folder, url):
    """A local folder given as SPEC: one line for a folder that is not there, the manifests it
    holds when NAME-SPLIT's is not among them, and for shards with no manifest at all the
    exact command that indexes them in place."""
    if not os.path.isdir(folder):
        raise ShardError(f"{name}={folder}: no such folder")
    if os.path.exists(url):
        return
    names = os.listdir(folder)
    others = sorted(f for f in names if f.endswith(".json"))
    if others:  # an indexed folder, of other data sets or splits: say which, not how to index it again
        raise ShardError(f"{name}={folder}: no manifest {url}; the folder holds {len(others)} other(s): "
                         f"{', '.join(others[:5])}{', ...' if len(others) > 5 else ''}")
    tars = sorted(f for f in names if f.endswith((".tar", ".tar.gz", ".tgz")))
    parent, here = os.path.split(os.path.abspath(folder))
    other = {"train": "test", "test": "train"}.get(here)
    if tars and other and os.path.isdir(os.path.join(parent, other)) and any(
            f.endswith((".tar", ".tar.gz", ".tgz")) for f in os.listdir(os.path.join(parent, other))):
        top = os.path.dirname(folder.rstrip("/")) or "."  # train/ and test/ side by side: index them together
        raise NoManifest(f"{name}={folder}: no manifest {url}, but {len(tars)} shard(s) ({tars[0]}, ...) and a "
                         f"{other}/ folder of shards beside it; index both splits in one command, so that they share "
                         f"classes: "
                         f"make-shards --index {shlex.quote(f'{name}:train={top}/train')} --index "
                         f"{shlex.quote(f'{name}:test={top}/test')} --out {shlex.quote(top)}, then give "
                         f"{name}={top}/ to --train and --eval")
    if tars:
        where = folder.rstrip("/") or "/"
        raise NoManifest(f"{name}={folder}: no manifest {url}, but {len(tars)} shard(s) ({tars[0]}, ...); index them "
                         f"in place with: make-shards --index "
                         f"{shlex.quote(f'{name}:{split}={where}')} --out {shlex.quote(where)}")


