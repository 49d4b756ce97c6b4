"""Indexing WebDatasets that other tools wrote, in place: a manifest for shards as they are.

    python tools/make_shards.py --index pets:train='/data/pets/train-{000000..000099}.tar' --out shards

Each shard is read once (in parallel): its samples counted, its bytes hashed, every
image's size and mode taken from its header and checked against `pipeline.bounds`
(pixels at once, the aspect against the manifest's shape at the end), its pixels
decoded for the per-channel mean and std, every label parsed. The manifest then says where the
shards are (names relative to the manifest when they share its folder, else
absolute paths or URLs), the most common image shape (or --shape), the class
names (the sorted distinct labels, or --classes), how samples decode (image
extensions, label key) and that the set was indexed, not built. Nothing is
rewritten. Damage is an error here, not a skip: a sample with no image member,
a missing or non-integer label, or an unreadable shard ends the index with one
line naming the shard and the sample.
"""
import collections
import hashlib
import multiprocessing
import os
import re

import numpy as np

from . import bounds, remote
from .decode import IMAGE_EXTS, Target, image_of, label_of, open_image, parse_label_key, pixels_of
from .errors import ShardError
from .files import write_json_atomic
from .manifest import FORMAT, NAME_RE, MAX_SIDE, check, expand_pattern, manifest_name
from .read import iter_samples
from .shards import writing

SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz")
FOREIGN_EXTS = tuple(e for e in IMAGE_EXTS if e != "raw")  # raw pixels need a shape nobody but make_shards records
GREY_MODES = {"1", "L", "LA", "I", "I;16", "I;16B", "I;16L", "F"}
STAT_SIDE = 64  # images are decoded at most about this big for the mean and std (JPEG draft mode)


def expand(spec):
    """A SPEC's shard URLs: a brace pattern (paths, http(s) URLs or pipe: commands) or a folder
    (its *.tar, *.tar.gz and *.tgz files, sorted). Raises ShardError when nothing matches."""
    if remote.kind(spec) == "file" and os.path.isdir(spec):
        urls = sorted(os.path.join(spec, f) for f in os.listdir(spec) if f.endswith(SHARD_SUFFIXES))
    else:
        urls = expand_pattern(spec)
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


def scan_shard(url, label, policy=remote.Policy()):
    """One shard's facts: samples, bytes, sha256, image extensions and shapes, labels, pixel sums."""
    want = set(FOREIGN_EXTS) | ({parse_label_key(label)[0]} if label else {"cls", "txt", "index"})
    facts = {}

    def consume(stream):  # a retry after a broken transfer starts the counts over
        facts.update(url=url, samples=0, exts=collections.Counter(), shapes=collections.Counter(),
                     labels=collections.Counter(), rgb=np.zeros(7), grey=np.zeros(3), label=label,
                     wide=(0, None, 0, 0), tall=(0, None, 0, 0))
        h = _Hashing(stream)
        for sample in iter_samples(h, want, url):
            _scan_sample(sample, facts, url)
        h.rest()
        facts["bytes"], facts["sha256"] = h.bytes, h.hash.hexdigest()

    try:
        remote.read_url(url, consume, policy=policy)
    except ShardError as e:
        raise ShardError(str(e) if str(e).startswith(url) else f"{url}: {e}") from None
    except OSError as e:
        raise ShardError(f"{url}: unreadable ({e})") from None
    if facts["samples"] == 0:
        raise ShardError(f"{url}: no samples")
    return facts


def _scan_sample(sample, facts, url):
    from PIL import Image

    if facts["label"] is None:  # the first sample decides: .cls, .txt or .index, whichever it has
        facts["label"] = next((e for e in ("cls", "txt", "index") if e in sample), None)
        if facts["label"] is None:
            raise ShardError(f"{url}: sample {sample['__key__']}: no .cls, .txt or .index label member; "
                             f"name the label with --label-key (e.g. --label-key json:label)")
    target = Target((3, 1, 1), FOREIGN_EXTS, facts["label"], classes=1 << 62)
    try:
        ext, data = image_of(sample, target)
        value = label_of(sample, target)
    except ValueError as e:
        raise ShardError(f"{url}: sample {sample['__key__']}: {e}") from None
    try:
        img, orientation = open_image(data, ext)  # the pixel cap now; the shape's aspect once the shape is known
        mode = img.mode
        w, h = img.size if orientation < 5 else img.size[::-1]
        if ext in ("jpg", "jpeg"):
            img.draft("RGB", (STAT_SIDE, STAT_SIDE))
        elif max(w, h) > 2 * STAT_SIDE:
            img.thumbnail((STAT_SIDE, STAT_SIDE))
        rgb = pixels_of(img, 3).reshape(-1, 3) / 255.0
        grey = pixels_of(img, 1).ravel() / 255.0
    except ValueError as e:
        raise ShardError(f"{url}: sample {sample['__key__']}: {e}") from None
    except (OSError, SyntaxError, Image.DecompressionBombError) as e:
        raise ShardError(f"{url}: sample {sample['__key__']}: undecodable .{ext} image ({e})") from None
    facts["samples"] += 1
    facts["exts"][ext] += 1
    facts["shapes"][(1 if mode in GREY_MODES else 3, h, w)] += 1
    facts["labels"][value] += 1
    facts["rgb"] += [len(rgb), *rgb.sum(0), *(rgb * rgb).sum(0)]
    facts["grey"] += [len(grey), grey.sum(), (grey * grey).sum()]
    for side, ratio in (("wide", w / h), ("tall", h / w)):  # the most elongated images, checked against the shape
        if ratio > facts[side][0]:
            facts[side] = (ratio, sample["__key__"], w, h)


def check_extremes(found, shape):
    """The most elongated images of every shard against the manifest's shape (bounds.check):
    ShardError naming the shard and the sample of the first that the trainer would refuse."""
    for f in found:
        for side in ("wide", "tall"):
            _, key, w, h = f[side]
            if key is not None:
                try:
                    bounds.check(w, h, shape)
                except ValueError as e:
                    raise ShardError(f"{f['url']}: sample {key}: {e}") from None


def _scan_task(task):
    return scan_shard(*task)


def index(name, split, spec, out, *, label=None, shape=None, classes_file=None, workers=1, policy=remote.Policy(),
          progress=True):
    """Index the shards SPEC names as data set NAME, split SPLIT; writes and returns OUT/NAME-SPLIT.json
    (under the folder's writer lock, see shards.writing)."""
    if not NAME_RE.match(name) or not NAME_RE.match(split):
        raise ShardError(f"--index {name}:{split}: NAME and SPLIT may hold letters, digits and _ only")
    if label is not None:
        try:
            parse_label_key(label)
        except ValueError as e:
            raise ShardError(str(e)) from None
    urls = expand(spec)
    names = [shard_location(u, out) for u in urls]
    with writing(out):
        return _index(name, split, spec, out, urls, names, label, shape, classes_file, workers, policy, progress)


def _index(name, split, spec, out, urls, names, label, shape, classes_file, workers, policy, progress):
    from tqdm import tqdm

    tasks = [(u, label, policy) for u in urls]
    found = []
    bar = tqdm(total=len(urls), unit="shard", desc=f"index {name}-{split}", disable=not progress, dynamic_ncols=True)
    try:
        if workers > 1 and len(urls) > 1:
            with multiprocessing.get_context("fork").Pool(min(workers, len(urls))) as pool:
                for facts in pool.imap(_scan_task, tasks):
                    found.append(facts)
                    bar.update(1)
        else:
            for task in tasks:
                found.append(_scan_task(task))
                bar.update(1)
    finally:
        bar.close()
    labels = {f["label"] for f in found}
    if len(labels) > 1:
        raise ShardError(f"{spec}: shards label their samples differently ({', '.join(sorted(labels))}); "
                         f"choose one with --label-key")
    manifest = summarise(name, split, spec, found, names, labels.pop(), shape, classes_file)
    check_extremes(found, manifest["shape"])
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, manifest_name(name, split))
    write_json_atomic(path, check(manifest, path))
    return manifest


def shard_location(url, out):
    """How the manifest in `out` names a shard: relative when they share the folder, else
    an absolute path or URL; for a pipe: command, the shard's file name (the manifest must
    then be placed beside the shards and read through the same command)."""
    kind = remote.kind(url)
    if kind == "http":
        return url
    if kind == "pipe":
        found = re.findall(r"[^/\s'\"]+\.(?:tar\.gz|tgz|tar)\b", url)
        if not found:
            raise ShardError(f"{url}: no shard file name (*.tar, *.tar.gz, *.tgz) in the command")
        return found[-1]
    path = os.path.abspath(url)
    if os.path.dirname(path) == os.path.abspath(out):
        return os.path.basename(path)
    return path


def summarise(name, split, spec, found, names, label, shape, classes_file):
    """The manifest from every shard's facts."""
    shapes = collections.Counter()
    exts = collections.Counter()
    values = collections.Counter()
    rgb, grey = np.zeros(7), np.zeros(3)
    for f in found:
        shapes += f["shapes"]
        exts += f["exts"]
        values += f["labels"]
        rgb += f["rgb"]
        grey += f["grey"]
    if shape is None:
        (c, h, w), _ = shapes.most_common(1)[0]
        shape = [c, h, w]
    if not (len(shape) == 3 and shape[0] in (1, 3) and all(1 <= x <= MAX_SIDE for x in shape[1:])):
        raise ShardError(f"--shape {shape}: C,H,W expected with C 1 or 3 and sides 1..{MAX_SIDE}")
    distinct = sorted(values)
    if classes_file:
        with open(classes_file) as f:
            classes = [ln.strip() for ln in f if ln.strip()]
        outside = [v for v in distinct if not 0 <= v < len(classes)]
        if outside:
            raise ShardError(f"--classes {classes_file}: {len(classes)} names, but labels {outside[:5]} fall outside "
                             f"0..{len(classes) - 1}")
        label_values = None
    else:
        classes = [str(v) for v in distinct]
        label_values = None if distinct == list(range(len(distinct))) else distinct
    if shape[0] == 3:
        n, s, sq = rgb[0], rgb[1:4], rgb[4:7]
    else:
        n, s, sq = grey[0], grey[1:2], grey[2:3]
    mean = s / max(n, 1)
    std = np.sqrt(np.maximum(sq / max(n, 1) - mean ** 2, 1e-12))
    manifest = {
        "format": FORMAT, "dataset": name, "split": split, "encoding": exts.most_common(1)[0][0],
        "image_exts": [e for e, _ in exts.most_common()], "label": label,
        "origin": {"kind": "index", "spec": spec, "note": "an existing WebDataset, indexed in place, not rewritten",
                   "image_shapes": len(shapes), "most_common_shape": list(shapes.most_common(1)[0][0])},
        "shape": list(shape), "classes": classes,
        "shards": [{"name": n_, "samples": f["samples"], "bytes": f["bytes"], "sha256": f["sha256"]}
                   for n_, f in zip(names, found)],
        "total": sum(f["samples"] for f in found),
        "mean": mean.round(6).tolist(), "std": std.round(6).tolist(),
    }
    if label_values is not None:
        manifest["label_values"] = label_values
    return manifest
