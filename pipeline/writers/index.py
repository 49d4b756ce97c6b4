"""Indexing WebDatasets that other tools wrote, in place: a manifest for shards as they are.

    python tools/make_shards.py --index pets:train='/data/pets/train-{000000..000099}.tar' --out shards

Each shard is read once (in parallel): its samples counted, its bytes hashed, every
image's size and mode taken from its header and checked against `pipeline.data.decoding.image_caps`
(pixels at once, the aspect against the manifest's shape at the end), its pixels
decoded for the per-channel mean and std, every label read. Labels are where users keep them (a
label rule: .cls/.txt/.index, a .json field, the key's folder), integers or class
names; names map to indices by their sorted order, a --classes file or another
split's manifest (`pipeline.writers.classes`). The manifest then says where the shards are
(names relative to the manifest when they lie in its folder or below, else
absolute paths or URLs, or under --base-url), the most common image shape (or
--shape), the classes, how samples decode (image members, label rule) and that the
set was indexed, not built. Nothing is rewritten. Damage is an error here, not a
skip: a sample with no image member (or several, without --image-key), a malformed
or missing label (unless --skip-unlabelled), or an unreadable shard ends the index
with one line naming the shard and the sample. An image that cannot be decoded is the
exception (real sets hold a few): a damaged sample, kept as a position the stream skips
and counts, named in one warning line, up to a share of the set (pipeline.writers.damage).
"""
import collections
import hashlib
import os
import re
import sys
import urllib.parse

import numpy as np

from pipeline import cli
from pipeline.data.decoding import image_caps
from pipeline.data.store import listings, remote, storage
from pipeline.data.decoding.decode import IMAGE_EXTS, image_format
from pipeline.data.decoding.labelling import (LABEL_EXTS, Unlabelled, class_value, default_label,
                                              describe_label, label_hint, label_member, parse_label_key, raw_label)
from pipeline.errors import ShardError, redact
from pipeline.files import missing_folder, write_json_atomic
from pipeline.data.manifests.manifest import (FORMAT, NAME_RE, CLASSES_WHY, MAX_CLASSES, MAX_SIDE, check,
                                              image_shape, manifest_name, plain_relative)
from pipeline.data.manifests.locations import pipe_shard_name
from pipeline.data.manifests.patterns import expand_shards
from pipeline.data.shards.read import MAX_MEMBER, is_meta, iter_samples
from pipeline.data.fields.schema import Oversized
from pipeline.writers import damage
from pipeline.writers.fields import scan_fields, stat_pixels, summarise_fields, totals
from pipeline.writers.classes import resolve_classes
from pipeline.writers import publish
from pipeline.writers.shards import forked_imap, writing

SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz")
FOREIGN_EXTS = tuple(e for e in IMAGE_EXTS if e != "raw")  # raw pixels need a shape nobody but make_shards records


def expand(spec, policy=remote.Policy()):
    """A SPEC's shard URLs: a brace pattern (paths, http(s) URLs or pipe: commands), a glob of
    local or store shards (`train/*.tar`, matched in name order), or a folder (its *.tar,
    *.tar.gz and *.tgz files, sorted; a store's listed within `policy`'s limits). Raises
    ShardError when nothing matches."""
    if remote.kind(spec) == "file" and os.path.isdir(spec):
        found = os.listdir(spec)
        publish.refuse_cut_short(spec, found)  # a store build stopped while moving in, copied down
        urls = sorted(os.path.join(spec, f) for f in found if f.endswith(SHARD_SUFFIXES))
    elif remote.kind(spec) == "file" and missing_folder(spec):  # was "1 of 1 shard(s) do not exist, e.g. DIR/"
        raise ShardError(f"{spec}: no such folder")
    elif remote.kind(spec) == "store" and "{" not in spec and not spec.endswith(SHARD_SUFFIXES):
        found = listings.names(spec, policy)  # a prefix: the shards under it, read where they are
        publish.refuse_cut_short(spec, found)
        urls = [storage.join(spec, n) for n in found if n.endswith(SHARD_SUFFIXES)]
    else:
        urls = expand_shards(spec, policy)
        missing = [u for u in urls if remote.kind(u) == "file" and not os.path.exists(u)]
        if missing:
            raise ShardError(f"{spec}: {len(missing)} of {len(urls)} shard(s) do not exist, e.g. {missing[0]}")
    if not urls:
        raise ShardError(f"{spec}: no shards (*.tar, *.tar.gz, *.tgz) match")
    return urls


class _Hashing:
    """Counts and hashes the bytes read through it: a shard's size and sha256 in the same pass."""

    def __init__(self, stream):
        self.stream, self.hash, self.bytes = stream, hashlib.sha256(), 0

    def read(self, n):
        data = self.stream.read(n)
        self.hash.update(data)
        self.bytes += len(data)
        return data

    def rest(self):
        while self.read(1 << 20):
            pass


class _Wanted:
    """The members an index copies out: every image member (any extension whose last part
    names an image format, `rgb.png` included) and the label members, or just the chosen ones."""

    def __init__(self, image_key, label):
        self.image_key = image_key
        member = label_member(label) if label else None
        self.labels = {member} if member else set() if label else set(LABEL_EXTS) | {"json"}

    def __contains__(self, ext):
        if ext in self.labels:
            return True
        return ext == self.image_key if self.image_key else image_format(ext) in FOREIGN_EXTS


def scan_shard(url, label, policy=remote.Policy(), image_key=None, skip_unlabelled=False, fields=None):
    """What a scan of one shard found: samples, bytes, sha256, image members and shapes, raw labels (with
    the first key of each), unlabelled samples left out, pixel sums. `fields`: a Schema whose fields
    every sample must hold (pipeline.writers.fields), in place of an image and a label."""
    scan = {}
    wanted, read_kw = _Wanted(image_key, label), {}
    if fields is not None:
        wanted, read_kw = fields.members, {"max_member": min(fields.max_member, MAX_MEMBER), "oversized": Oversized}

    def consume(stream):  # a retry after a broken transfer starts the counts over
        scan.update(url=url, samples=0, unlabelled=0, exts=collections.Counter(), shapes=collections.Counter(),
                     labels=collections.Counter(), first={}, rgb=np.zeros(7), grey=np.zeros(3), label=label,
                     image_key=image_key, skip_unlabelled=skip_unlabelled, wide=(0, None, 0, 0, None),
                     tall=(0, None, 0, 0, None), large=(0, None, 0, 0, None), fields=fields, held=collections.Counter(),
                    damaged=0, damage=[])
        h = _Hashing(stream)
        samples = iter_samples(h, wanted, url, **read_kw)
        for sample in samples:
            if is_meta(sample["__key__"]):  # a __meta__ sample describes the shard: not a sample to index
                continue
            try:
                if fields is not None:
                    scan_fields(sample, scan, url)
                else:
                    _scan_sample(sample, scan, url)
            except ShardError:  # a sample cut short by damage comes before the damage's error, the cause
                next(samples, None)
                raise
        h.rest()
        scan["bytes"], scan["sha256"] = h.bytes, h.hash.hexdigest()

    try:
        remote.read_url(url, consume, policy=policy)
    except ShardError as e:
        raise ShardError(str(e) if str(e).startswith(url) else f"{url}: {e}") from None
    except OSError as e:
        raise ShardError(f"{url}: unreadable ({e})") from None
    if scan["samples"] == 0:
        raise ShardError(f"{url}: no samples" + (f" ({scan['unlabelled']} unlabelled left out)"
                                                 if scan["unlabelled"] else ""))
    return scan


def _scan_sample(sample, scan, url):
    key = sample["__key__"]
    if scan["label"] is None:  # the first sample decides
        scan["label"] = default_label(sample)
        if scan["label"] is None:
            none = ("no .cls, .txt or .index member, no \"label\", \"class\" or \"cls\" field in its .json"
                    if "json" in sample else "no .cls, .txt, .index or .json label member")
            raise ShardError(f"{url}: {none} and no folder in its key: {label_hint(sample)}; name the label with "
                             f"--label-key")
    images = [e for e in sample if not e.startswith("__") and image_format(e) in FOREIGN_EXTS and sample[e] is not None]
    if scan["image_key"]:
        images = [e for e in images if e == scan["image_key"]]
    elif len(images) > 1:
        raise ShardError(f"{url}: sample {key} has {len(images)} image members ({', '.join('.' + e for e in images)}); "
                         f"choose one with --image-key (e.g. --image-key {images[0]})")
    try:
        value = raw_label(sample, scan["label"])
    except Unlabelled as e:
        member = label_member(scan["label"])
        if member and member not in sample and not scan["skip_unlabelled"] and not scan["samples"]:
            raise ShardError(wrong_label_key(url, sample, scan["label"], member)) from None
        if scan["skip_unlabelled"]:
            scan["unlabelled"] += 1
            return
        raise ShardError(f"{url}: sample {key} has no label ({e}); pass --skip-unlabelled to leave such samples "
                         f"out (they are counted), or choose the label with --label-key") from None
    except ValueError as e:
        raise ShardError(f"{url}: sample {key}: {e}") from None
    try:
        value = class_value(value)  # '03' and '+3' are the class 3, as the stream and --fields read them
    except ValueError as e:
        raise ShardError(f"{url}: sample {key}: {describe_label(scan['label'])}: {e}") from None
    if not images:
        have = sorted(k for k in sample if not k.startswith("__"))
        wanted = f".{scan['image_key']}" if scan["image_key"] else f"image member (.{', .'.join(FOREIGN_EXTS)})"
        raise ShardError(f"{url}: sample {key}: no {wanted} (has {have or 'nothing'})")
    ext = images[0]
    got = damage.decoded(scan, key, ext, lambda: stat_pixels(sample[ext], ext))  # None: a damaged sample, counted
    if got is None:
        return
    (h, w), is_grey, rgb, grey = got
    scan["samples"] += 1
    scan["exts"][ext] += 1
    scan["shapes"][(1 if is_grey else 3, h, w)] += 1
    scan["labels"][value] += 1
    scan["first"].setdefault(value, key)
    scan["rgb"] += [len(rgb), *rgb.sum(0), *(rgb * rgb).sum(0)]
    scan["grey"] += [len(grey), grey.sum(), (grey * grey).sum()]
    scale = image_caps.REDUCED.get(image_format(ext), 1)
    decoded = -(-w // scale) * -(-h // scale)
    for side, ratio in (("wide", w / h), ("tall", h / w), ("large", decoded)):  # checked against the shape
        if ratio > scan[side][0]:  # the most elongated images, the one of most pixels as decoded
            scan[side] = (ratio, key, w, h, image_format(ext))


def wrong_label_key(url, sample, label, member):
    """The error for a --label-key whose member the shard's first sample lacks: what the
    samples have instead, and the rule they suggest."""
    have = sorted(k for k in sample if not k.startswith("__"))
    # by name only: the members this rule did not ask for were not read
    hint = next((h for m, h in (("cls", "cls"), ("index", "index"), ("json", "json:label"), ("txt", "txt"))
                 if m in have and m != member), "dir" if "/" in sample["__key__"] else None)
    return (f"{url}: no member {member!r} in sample {sample['__key__']} (--label-key {label}); it has: "
            f"{', '.join(have) or 'nothing'}; choose the label with --label-key"
            + (f" (e.g. --label-key {hint})" if hint else " (cls, txt, index, json:FIELD or dir)"))


def check_extremes(found, shape):
    """The most elongated images of every shard and its largest as decoded against the manifest's
    shape (image_caps.check): ShardError naming the shard and the sample of the first that the
    trainer would refuse."""
    for f in found:
        for side in ("wide", "tall", "large"):
            _, key, w, h, ext = f[side]
            if key is not None:
                try:
                    image_caps.check(w, h, shape, ext)
                except ValueError as e:
                    raise ShardError(f"{f['url']}: sample {key}: {e}") from None


def _scan_task(task):
    url, label, policy, image_key, skip_unlabelled, fields = task
    return scan_shard(url, label, policy, image_key, skip_unlabelled, fields)


def index(name, split, spec, out, *, label=None, image_key=None, shape=None, classes_file=None, classes_from=None,
          skip_unlabelled=False, base_url=None, workers=1, policy=remote.Policy(), progress=True, stage=None,
          fields=None, max_damaged=None):
    """Index the shards SPEC names as data set NAME, split SPLIT; writes and returns OUT/NAME-SPLIT.json.

    stage: a local folder the manifest is written to instead, for an OUT that is a store
    prefix (make_shards uploads it there): the manifest still names the shards as seen from
    OUT, relative to it when they lie under it.

    classes_from: (path, manifest) of another split of the same data set, whose classes this
    one must use (names mapping to the same indices); base_url: the URL the shards' folder
    will be served from, for a manifest naming them there. fields: a Schema
    (pipeline.data.fields.schema): every sample's fields are checked against it and the manifest
    records it (`fields`), in place of a label rule and classes. max_damaged: the share of
    samples whose image cannot be decoded the index takes as damaged (pipeline.writers.damage;
    default MAX_DAMAGED). Written under the folder's writer lock (see shards.writing)."""
    if not NAME_RE.match(name) or not NAME_RE.match(split):
        raise ShardError(f"--index {name}:{split}: NAME and SPLIT may hold letters, digits and _ only")
    if label is not None:
        try:
            parse_label_key(label)
        except ValueError as e:
            raise ShardError(str(e)) from None
    image_key = image_key.lstrip(".").lower() if image_key else None
    if image_key is not None and (image_format(image_key) not in FOREIGN_EXTS):
        raise ShardError(f"--image-key {image_key}: an image member's extension ending in one of "
                         f"{', '.join(FOREIGN_EXTS)} expected (e.g. jpg, rgb.png, input.jpg)")
    urls = expand(spec, policy)
    names = shard_locations(urls, out, base_url)
    if remote.kind(out) == "store":
        local = [n for n, u in zip(names, urls) if remote.kind(u) == "file"]
        if local:
            raise ShardError(f"--out {out}: a manifest in a store cannot name local files ({local[0]}); upload the "
                             f"shards under {out}/ and index them there, or give a local --out")
        if stage is None:
            raise ShardError(f"--out {out}: a store prefix; the manifest is written to a local stage and uploaded")
    with writing(stage or out):
        return _index(name, split, spec, stage or out, urls, names, label, image_key, shape, classes_file, classes_from,
                      skip_unlabelled, workers, policy, progress, fields, max_damaged)


def _index(name, split, spec, out, urls, names, label, image_key, shape, classes_file, classes_from, skip_unlabelled,
           workers, policy, progress, fields=None, max_damaged=None):
    tasks = [(u, label, policy, image_key, skip_unlabelled, fields) for u in urls]
    found = []
    bar = cli.progress(total=len(urls), unit="shard", desc=f"index {name}-{split}", disable=not progress)
    try:
        if workers > 1 and len(urls) > 1:
            for scan in forked_imap(_scan_task, tasks, min(workers, len(urls))):
                found.append(scan)
                bar.update(1)
        else:
            for task in tasks:
                found.append(_scan_task(task))
                bar.update(1)
    except ShardError as e:  # from a worker it chains the worker's traceback: the line alone is the error
        raise ShardError(str(e)) from None
    finally:
        bar.close()
    warning = damage.damage_check(found, spec, f"{name}-{split}", max_damaged)
    if fields is not None:
        manifest = summarise_fields(name, split, spec, found, names, fields, classes_from)
        if warning:
            print(warning, file=sys.stderr, flush=True)
        os.makedirs(out, exist_ok=True)
        path = os.path.join(out, manifest_name(name, split))
        write_json_atomic(path, check(manifest, path))
        return manifest
    labels = {f["label"] for f in found}
    if len(labels) > 1:
        raise ShardError(f"{spec}: shards label their samples differently ({', '.join(sorted(labels))}); "
                         f"choose one with --label-key")
    manifest = summarise(name, split, spec, found, names, labels.pop(), shape, classes_file, classes_from)
    check_extremes(found, manifest["shape"])
    if skip_unlabelled:
        manifest["skip_unlabelled"] = True
    if warning:
        print(warning, file=sys.stderr, flush=True)
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, manifest_name(name, split))
    write_json_atomic(path, check(manifest, path))
    return manifest


def shard_locations(urls, out, base_url=None):
    """How the manifest in `out` names each shard (see shard_location); with base_url, local
    shards are named by their path under their common folder, appended to base_url."""
    if base_url is None:
        return [shard_location(u, out) for u in urls]
    if not re.match(r"https?://[^\s\x00-\x1f\x7f]+\Z", base_url):
        raise ShardError(f"--base-url {base_url!r}: an http(s) URL expected (e.g. https://HOST/data/)")
    local = [os.path.abspath(u) for u in urls if remote.kind(u) == "file"]
    if len(local) != len(urls):
        raise ShardError("--base-url names where local shards will be served; these shards are not local files")
    root = os.path.commonpath([os.path.dirname(p) for p in local])
    return [base_url.rstrip("/") + "/" + urllib.parse.quote(os.path.relpath(p, root).replace(os.sep, "/"))
            for p in local]


def shard_location(url, out):
    """How the manifest in `out` names a shard: relative when it lies in that folder or below
    (so the folder can be served as it is), else an absolute path or URL; for a pipe:
    command, the shard's file name (the manifest must then be placed beside the shards and
    read through the same command)."""
    kind = remote.kind(url)
    if kind == "store":  # relative to a manifest written under the same prefix, else the URL itself
        base = str(out).rstrip("/") + "/"
        rel = url[len(base):] if url.startswith(base) else None
        return rel if rel and plain_relative(rel) else url
    if kind == "http":
        return url
    if kind == "pipe":
        return pipe_shard_name(url)
    path = os.path.abspath(url)
    top = os.path.realpath(out)
    real = os.path.realpath(path)
    if real.startswith(top.rstrip(os.sep) + os.sep):
        rel = os.path.relpath(path, os.path.abspath(out)).replace(os.sep, "/")
        if plain_relative(rel) and os.path.realpath(os.path.join(out, rel)) == real:
            return rel
    return path


FREE_TEXT_WORDS, FREE_TEXT_CHARS = 5, 40  # a median class name this long reads as a sentence, not a class


def sizes_warning(m, flag="give the size to train at with --shape C,H,W"):
    """A warning line when no image size is most of an indexed set's images: every image is then
    resized to the most common one, which may be a size few of them have (None otherwise)."""
    origin = m.get("origin", {})
    if origin.get("most_common_images", 0) * 2 >= origin.get("images", 0):
        return None
    return (f"warning: images of {origin['image_shapes']} sizes, and the most common "
            f"({'x'.join(map(str, m['shape']))}) only {origin['most_common_images']} of {origin['images']}: every "
            f"image is resized to it; {flag}, or read the images at their own sizes with --fields "
            f"(docs/data.md, Fields)")


def free_text(m):
    """A warning line when an indexed set's labels look like free text, not classes: names
    most of them distinct (as many as half the samples), or long (a median of FREE_TEXT_WORDS
    words or FREE_TEXT_CHARS characters: captions one a class, say). Such a set indexed as
    image and label would train on its captions as classes; --fields reads them as text."""
    names = m["classes"] if m.get("label_names") else []
    if not names:
        return None
    words = sorted(len(n.split()) for n in names)[len(names) // 2]
    chars = sorted(len(n) for n in names)[len(names) // 2]
    distinct = len(names) * 2 > m["total"] >= 20
    if not (distinct or words >= FREE_TEXT_WORDS or chars >= FREE_TEXT_CHARS):
        return None
    why = "most of them distinct" if distinct else f"a median of {words} words, {chars} characters"
    label = describe_label(m["label"])
    member = "txt" if m["label"].startswith("dir") else m["label"]  # where the text is (a folder's name is none)
    return (f"  warning: the labels ({label}) look like free text, not classes: {len(names)} names for {m['total']} "
            f"samples, {why}, e.g. {names[len(names) // 2][:60]!r}; they are indexed as classes. To read them as "
            f"text, index with --fields (e.g. --fields 'image:image={m['image_exts'][0]},size="
            f"{m['shape'][1]}x{m['shape'][2]} caption:text={member}' and a class field, "
            f"label:class=MEMBER, to train on); to take another label, --label-key")


def summarise(name, split, spec, found, names, label, shape, classes_file, classes_from=None):
    """The manifest from every shard's scan."""
    shapes, exts, rgb, grey = totals(found)
    if shape is None:
        (c, h, w), _ = shapes.most_common(1)[0]
        shape = [c, h, w]
    if not image_shape(shape):
        raise ShardError(f"--shape {shape}: C,H,W expected with C 1 or 3 and sides 1..{MAX_SIDE}")
    classes, label_values, label_names = resolve_classes(found, classes_file, classes_from)
    if len(classes) > MAX_CLASSES:  # else check() would call the list malformed
        raise ShardError(f"{spec}: {len(classes)} distinct labels ({describe_label(label)}), more than the "
                         f"{MAX_CLASSES} classes a manifest may hold: {CLASSES_WHY}; if the label is an ID or a "
                         f"caption, not a class, choose another with --label-key")
    if shape[0] == 3:
        n, s, sq = rgb[0], rgb[1:4], rgb[4:7]
    else:
        n, s, sq = grey[0], grey[1:2], grey[2:3]
    mean = s / max(n, 1)
    std = np.sqrt(np.maximum(sq / max(n, 1) - mean ** 2, 1e-12))
    image_exts = [e for e, _ in exts.most_common()]
    manifest = {
        "format": FORMAT, "dataset": name, "split": split, "encoding": image_format(image_exts[0]),
        "image_exts": image_exts, "label": label,
        "origin": {"kind": "index", "spec": redact(spec), "note": "an existing WebDataset, indexed in place, not rewritten",
                   "image_shapes": len(shapes), "most_common_shape": list(shapes.most_common(1)[0][0]),
                   "most_common_images": shapes.most_common(1)[0][1], "images": sum(shapes.values())},
        "shape": list(shape), "classes": classes,
        "shards": [dict({"name": n_, "samples": f["samples"], "bytes": f["bytes"], "sha256": f["sha256"]},
                        **({"unlabelled": f["unlabelled"]} if f["unlabelled"] else {}))
                   for n_, f in zip(names, found)],
        "total": sum(f["samples"] for f in found),
        "mean": mean.round(6).tolist(), "std": std.round(6).tolist(),
    }
    if label_names:
        manifest["label_names"] = True
    if label_values is not None:
        manifest["label_values"] = label_values
    return manifest
