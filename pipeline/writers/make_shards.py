"""Convert MNIST, CIFAR10 or any ImageFolder tree into WebDataset tar shards, or index
WebDatasets that other tools wrote, in place.

    python tools/make_shards.py --datasets mnist cifar10 --splits train test --root data --out shards
    python tools/make_shards.py --index pets:train='/data/pets/{000000..000099}.tar' --out shards
    python tools/make_shards.py --datasets mnist --out s3://bucket/shards     (any object store: docs/data.md)

See docs/data.md for the sample format and every option.
"""
import argparse
import collections
import errno
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import warnings

from pipeline.data.decoding import labelling
from pipeline.data.manifests import manifest
from pipeline.data.manifests import locations
from pipeline.data.store import remote, storage, writing
from pipeline.writers import damage, fields, index, publish, shards, sources, storelock  # noqa: E402
from pipeline.writers import verify
from pipeline.cli import Parser, add_io_options, check_io, io_limits, printable  # noqa: E402
from pipeline.errors import ShardError  # noqa: E402
from pipeline.files import new_folders, remove_empty  # noqa: E402
from pipeline.data.manifests.manifest import NAME_RE  # noqa: E402


def parse_args(argv):
    p = Parser(prog="make_shards", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--datasets", nargs="+", metavar="NAME",
      help="built-in data sets to convert: mnist, cifar10 (default: both, unless --imagefolder or --index is given)")
    a("--splits", nargs="+", default=["train", "test"], choices=["train", "test"], metavar="SPLIT",
      help="splits of the built-in data sets to convert: train, test (default: train test)")
    a("--root", default="data", metavar="DIR",
      help="torchvision data folder, holding MNIST/raw/ and cifar-10-batches-py/ (default: data)")
    a("--download", action="store_true", help="let torchvision download missing data sets into --root")
    a("--synthetic", action="store_true", help="write look-alike synthetic data, no files needed")
    a("--fallback-synthetic", action="store_true",
      help="use synthetic data for any built-in data set that cannot be loaded, saying so in one line")
    a("--cifar10-dir", metavar="DIR",
      help="CIFAR10 as image files: DIR/train/<class>/* and DIR/test/<class>/* (used in place of torchvision's)")
    a("--imagefolder", action="append", default=[], metavar="NAME:SPLIT=DIR",
      help="shard an ImageFolder tree (DIR/<class>/<image>) as data set NAME, split SPLIT (repeatable)")
    a("--holdout", type=int, metavar="N",
      help="split each --imagefolder into train and a test split of N held-out samples")
    sources.add_options(a)
    a("--index", action="append", default=[], metavar="NAME:SPLIT=SPEC",
      help="write a manifest for existing WebDataset shards without rewriting them; SPEC is a brace pattern "
           "(path, http(s) URL or pipe: command) or a folder of *.tar (repeatable)")
    a("--label-key", metavar="KEY",
      help="with --index: where the label is: cls, txt, index, json:FIELD (json:meta.label for a nested field), "
           "each an integer or a class name; dir (the key's last folder) or dir:K (its K-th folder, from 0) "
           "(default: from the first sample: .cls, .index, .json's label field, .txt, then the key's folder)")
    a("--image-key", metavar="EXT", help="with --index: the image member (jpg, rgb.png, input.jpg; default: the "
                                         "sample's one image member)")
    a("--shape", metavar="C,H,W", help="with --index or --imagefolder: the shape images are brought to (default "
      "with --index: the most common; with --imagefolder: the first image's, which every image must then match)")
    a("--classes", metavar="FILE", help="with --index: class names, one a line, in index order: the names the "
                                        "labels may hold, or the names of integer labels 0..N-1 "
                                        "(default: the sorted distinct labels)")
    a("--classes-from", metavar="MANIFEST", help="with --index: the classes of another split's manifest (the "
                                                 "training split's for a test split; automatic when both splits "
                                                 "of a data set are indexed in one command)")
    a("--skip-unlabelled", action="store_true", help="with --index: leave samples without a label (a missing "
                                                     "label member, or -1) out, counted, instead of stopping")
    a("--base-url", metavar="URL", help="with --index: the URL the shards' folder will be served from; the "
                                        "manifest then names the shards there")
    fields.add_options(a)
    damage.add_options(a)
    a("--limit", type=int, metavar="N", help="at most N samples per split (a seeded random subset)")
    a("--encoding", choices=shards.ENCODINGS, default="png",
      help="png: lossless, small (default); raw: uint8 pixels, the fastest to stream")
    a("--maxcount", type=int, default=500, metavar="N", help="samples per shard (default: 500)")
    a("--seed", type=int, default=0, metavar="N", help="seed of the sample order, >= 0 (default: 0)")
    a("--workers", type=int, default=os.cpu_count(), metavar="N", help="processes (default: all cores)")
    a("--part", metavar="I/N", help="write only part I of N of each split, I counting from 0 (0/3, 1/3, 2/3 on "
                                    "3 machines), then --merge")
    a("--merge", action="store_true", help="merge the part manifests under --out into one")
    a("--verify", action="store_true", help="check the shards under --out against their manifests, list every problem")
    a("--preview", metavar="MANIFEST", action="append", default=[],
      help="write a PNG grid of 64 samples of the shard set MANIFEST (e.g. shards/mnist-train.json) with their "
           "class names, as NAME-SPLIT-preview.png beside a local manifest (for a remote one in --out when given, "
           "else in a new temporary folder, never the current one; repeatable)")
    a("--out", metavar="DIR",
      help="output folder (default: shards), or an object-store prefix (s3://BUCKET/PREFIX, gs://, hf://...) the "
           "shards and manifests are uploaded to, each manifest last; one make-shards at a time writes a folder, a "
           "second one is refused")
    a("--quiet", action="store_true", help="no progress bars")
    io = p.add_argument_group("remote reads (--index and --verify of http(s), object-store and pipe: shards; as in the trainer)")
    add_io_options(io)
    args = p.parse_args(argv)
    check(p, args)
    return args


def check(p, args):
    if args.out is not None and not args.out.strip():  # "" wrote ./shards/ without a word
        p.error("--out: empty; name the folder (or s3://BUCKET/PREFIX) to write to, or leave --out out for shards/")
    args.out_given, args.out = args.out is not None, args.out or "shards"
    kind = out_kind(p, args.out)
    if kind in ("http", "pipe") and not args.preview:
        p.error(f"--out {printable(args.out)}: make-shards writes to a local folder or an object store (s3://, gs://, "
                f"hf://...), not to an http(s) URL or a command")
    args.store = kind == "store"
    args.part = parse_part(p, args.part)
    if args.store:
        args.out = args.out.rstrip("/")
        if args.merge or args.part != (0, 1):
            p.error(f"--out {args.out}: --part and --merge need a local --out; build and merge the parts in a local "
                    f"folder, or write the whole split to the store in one make-shards")
    p.at_least(args, {"limit": 1, "maxcount": 1, "seed": 0, "workers": 1, "holdout": 1})
    p.within(args, {"workers": (1, 1024)})  # each one a process
    check_io(p, args)
    if args.seed >= 2 ** 63:
        p.error(f"--seed {args.seed}: must be below 2**63")
    modes = [m for m in ("verify", "merge", "preview") if getattr(args, m)]
    if len(modes) > 1:
        p.error(f"--{' and --'.join(modes)} exclude each other")
    if args.holdout is not None and not args.imagefolder:
        p.error("--holdout applies to --imagefolder sources only")
    sources.check_options(p, args)
    index_only = ("label_key", "image_key", "classes", "classes_from", "skip_unlabelled", "base_url",
                  "fields", "max_damaged")
    if any(getattr(args, k) for k in index_only) and not args.index:
        p.error(f"{', '.join('--' + k.replace('_', '-') for k in index_only)} apply to --index only")
    if args.shape is not None and not (args.index or args.imagefolder or args.cifar10_dir):
        p.error("--shape applies to --index and --imagefolder only")
    fields.check_options(p, args, index_only[:2] + ("shape",) + index_only[2:5])
    if args.classes and args.classes_from:
        p.error("--classes and --classes-from exclude each other: give one")
    if args.index and (args.merge or args.part != (0, 1)):
        p.error("--index writes one manifest per split; --merge and --part do not apply")
    if args.datasets is None:
        args.datasets = [] if args.imagefolder or args.index or args.cifar10_dir else ["mnist", "cifar10"]
        if args.cifar10_dir and not args.imagefolder and not args.index:
            args.datasets = ["mnist"]
    for name in args.datasets:
        if name not in sources.SHAPES:
            p.error(f"unknown dataset {name!r}; built-in: mnist, cifar10 (use --imagefolder NAME:SPLIT=DIR for others)")
    if args.cifar10_dir:
        if "cifar10" in args.datasets:
            p.error("--cifar10-dir replaces --datasets cifar10: give one of them")
        for split in args.splits:
            if not os.path.isdir(os.path.join(args.cifar10_dir, split)):
                p.error(f"--cifar10-dir {args.cifar10_dir}: no {split}/ folder of class folders in it")
        args.imagefolder = [("cifar10", split, os.path.join(args.cifar10_dir, split)) for split in args.splits] + \
            [parse_pair(p, "--imagefolder", spec) for spec in args.imagefolder]
    else:
        args.imagefolder = [parse_pair(p, "--imagefolder", spec) for spec in args.imagefolder]
    args.index = [parse_pair(p, "--index", spec) for spec in args.index]
    if args.shape is not None:
        try:
            args.shape = [int(x) for x in args.shape.split(",")]
        except ValueError:
            args.shape = None
        if not args.shape or len(args.shape) != 3:
            p.error("--shape: expected C,H,W, e.g. 3,64,64")
        if not manifest.image_shape(args.shape):
            p.error(f"--shape {','.join(map(str, args.shape))}: C must be 1 or 3 and each side 1..{manifest.MAX_SIDE}")
    for flag, path, what in (("--classes", args.classes, "file"), ("--classes-from", args.classes_from, "manifest")):
        if path is not None and out_kind(p, path) != "file":
            continue  # a URL: read (with the job's deadlines) when it is used
        if path is not None and not os.path.isfile(path):  # a FIFO or a device is never opened: it could block
            p.error(f"{flag} {path}: " + (f"no such {what}" if not os.path.exists(path) else "not a regular file"))


def out_kind(p, where):
    """remote.kind of --out (or another location flag), refusing what make_shards cannot write in one line."""
    try:
        kind = remote.kind(where)
    except ShardError as e:
        p.error(str(e))
    return kind


def parse_part(p, text):
    if text is None:
        return (0, 1)
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        p.error(f"--part {text!r}: expected I/N, e.g. 0/3")
    if not 0 <= i < n:
        p.error(f"--part {text!r}: need 0 <= I < N")
    return (i, n)


def parse_pair(p, flag, spec):
    """NAME:SPLIT=VALUE -> (name, split, value)."""
    name, sep, rest = spec.partition(":")
    split, sep2, value = rest.partition("=")
    if not (sep and sep2 and name and split and value):
        p.error(f"{flag} {spec!r}: expected NAME:SPLIT=..., e.g. pets:train=/data/pets/train")
    if not NAME_RE.match(name) or not NAME_RE.match(split):
        p.error(f"{flag} {spec!r}: NAME and SPLIT may hold letters, digits and _ only")
    return name, split, value


def load_sources(args):
    """Yield each source to write, falling back to synthetic data where asked."""
    for name in args.datasets:
        said = False
        for split in args.splits:
            if args.synthetic:
                yield sources.synthetic_source(name, split, seed=args.seed)
                continue
            try:
                yield sources.torchvision_source(name, split, args.root, download=args.download)
            except sources.SourceError as e:
                if not args.fallback_synthetic:
                    raise
                if not said:
                    why = printable(str(e)) if args.download else f"{name}: no real data under {args.root}/"
                    print(f"make-shards: {why}, writing SYNTHETIC look-alike data; for real data "
                          f"{sources.real_data_hint(name, args.download)}", file=sys.stderr)
                    said = True
                yield sources.synthetic_source(name, split, seed=args.seed)
    for name, split, folder in args.imagefolder:
        src = sources.ImageFolderSource(name, split, folder, captions=args.captions, shape=args.shape, say=print)
        if args.holdout:
            yield from sources.holdout(src, args.holdout, args.seed)
        else:
            yield src


def check_writable(out):
    os.makedirs(out, exist_ok=True)
    probe = os.path.join(out, f".write-test.{os.getpid()}.tmp")  # two runs at once must not remove each other's
    with open(probe, "w"):
        pass
    os.remove(probe)


def index_order(pairs):
    """The --index pairs with each data set's train split first, so that its other splits
    can take its classes."""
    return sorted(pairs, key=lambda p: (p[1] != "train",))


def place(out, name):
    """`name` in the folder or store prefix `out`."""
    return storage.join(out, name) if remote.kind(out) == "store" else os.path.join(out, name)


def run_index(args, stage=None):
    """Index each --index pair into --out; for a store --out the manifest is written in the local
    folder `stage` and uploaded (it names the shards as seen from --out)."""
    policy = remote.Policy(**io_limits(args))
    given = (args.classes_from, manifest.load(args.classes_from, policy)) if args.classes_from else None
    trained = {}  # data set -> (path, manifest) of its train split indexed in this command
    for name, split, spec in index_order(args.index):
        t0 = time.perf_counter()
        classes_from = given or (None if args.classes else trained.get(name))
        label = args.label_key or (classes_from[1]["label"] if classes_from else None)  # the same rule as there
        path = place(args.out, manifest.manifest_name(name, split))
        there = stage is None and os.path.isfile(path)  # a store's is not asked for: one request more to hang on
        m = index.index(name, split, spec, args.out, label=label, image_key=args.image_key,
                        shape=args.shape, classes_file=args.classes, classes_from=classes_from,
                        skip_unlabelled=args.skip_unlabelled, base_url=args.base_url, workers=args.workers,
                        policy=policy, progress=not args.quiet, stage=stage, fields=args.fields,
                        max_damaged=args.max_damaged)
        if stage is not None:
            writing.put(os.path.join(stage, manifest.manifest_name(name, split)), path, policy)
        if split == "train":
            trained[name] = (path, m)
        if args.fields is not None:
            print(f"indexed {name}-{split}: {counted(len(m['shards']), 'shard')}, {m['total']} samples, fields "
                  f"{fields.describe(m['fields'])}, in {time.perf_counter() - t0:.1f} s -> {path}")
            continue
        unlabelled = sum(s.get("unlabelled", 0) for s in m["shards"])
        print(f"indexed {name}-{split}: {counted(len(m['shards']), 'shard')}, {m['total']} samples"
              f"{f' ({unlabelled} unlabelled left out)' if unlabelled else ''}, images "
              f"{'x'.join(map(str, m['shape']))} (.{', .'.join(m['image_exts'])}), in "
              f"{time.perf_counter() - t0:.1f} s -> {path}")
        print(f"  labels: {label_words(m)}" + (f", as in {classes_from[0]}" if classes_from else ""))
        if there:
            print(f"  replaced the manifest that was there before: {path}")
        if classes_from and classes_from is given and given[1]["dataset"] != name:
            print(printable(f"  warning: --classes-from {given[0]} is data set {given[1]['dataset']!r}, not {name!r}: "
                            f"its classes were used; check that it is this data set's training manifest"))
        twice = locations.repeated((s["name"], s.get("sha256")) for s in m["shards"])
        if twice:
            print(printable(f"  warning: {len(twice)} shard(s) hold the same bytes (sha256) as another, e.g. "
                            f"{twice[0][1]} = {twice[0][0]}: each epoch would read them twice; leave the copies "
                            f"out of {spec}"))
        text = index.free_text(m)
        if text:
            print(printable(text))
        sizes = index.sizes_warning(m) if args.shape is None else None
        if sizes:
            print(f"  {sizes}")
        if split != "train" and not classes_from:
            mismatch = classes_hint(args.out, name, m)
            if mismatch:
                print(mismatch)
        if remote.kind(spec) == "pipe":
            print(f"  the shards are read through a command: put {name}-{split}.json beside them and train with "
                  f"--train {name}='<the same command, reading {name}-{split}.json>'")
    return 0


def counted(n, word):
    """'1 shard', '2 shards'."""
    return f"{n} {word}{'' if n == 1 else 's'}"


def classes_hint(out, name, m):
    """A warning line when a split indexed on its own has other classes than the training split
    beside it (the trainer refuses that pair), with the flag that makes them one."""
    train = place(out, manifest.manifest_name(name, "train"))
    try:
        if not (writing.exists(train) if remote.kind(out) == "store" else os.path.isfile(train)):
            return None
        classes = manifest.load(train)["classes"]
    except (ShardError, OSError):
        return None
    if list(classes) == list(m["classes"]):
        return None
    return (f"  warning: {len(m['classes'])} classes here, {len(classes)} other ones in {train}: the trainer refuses "
            f"this pair; index this split again with --classes-from {train}")


def label_words(m):
    """`.json field "label", 10 class names`: what a manifest's labels are, in words."""
    rule = labelling.describe_label(m["label"])
    n = len(m["classes"])
    if m.get("label_names"):
        return f"{rule}, {n} class names"
    return f"{rule}, integers, {n} classes"


def run_preview(args):
    from pipeline.writers.preview import preview

    temporary = None
    for path in args.preview:
        m = manifest.load(path)
        if remote.kind(path) == "file":
            folder = os.path.dirname(path) or "."
        elif args.out_given and not args.store:
            folder = args.out
        else:  # the default --out, shards/, is relative to wherever the command runs
            folder = temporary = temporary or tempfile.mkdtemp(prefix="make_shards-preview-")
        os.makedirs(folder, exist_ok=True)
        out = preview(path, os.path.join(folder, f"{m['dataset']}-{m['split']}-preview.png"))
        print(f"wrote {out}")
    return 0


def run(args):
    if args.preview:
        return run_preview(args)
    if args.verify:
        checked = collections.Counter()
        problems = verify.verify(args.out, remote.Policy(**io_limits(args)), checked)
        for line in problems:
            print(f"FAIL {line}")
        what = (f"{checked['manifests']} manifest(s), {checked['shards']} shard(s), {checked['samples']} sample(s): "
                f"each shard's size, sha256 and sample count against its manifest")
        print(f"verify {args.out}: {'OK' if not problems else f'{len(problems)} problem(s)'}; checked {what}")
        return 1 if problems else 0
    if args.store:
        return run_store(args)
    made = new_folders(args.out)  # a failed run takes back the folders it made, as far as they are empty
    try:
        check_writable(args.out)
        code = write(args)
    except BaseException:
        remove_empty(made)
        raise
    if code:
        remove_empty(made)
    return code


def run_store(args):
    """Everything built or indexed in a local temporary folder, as for a local --out, then
    uploaded to the store prefix --out (publish.publish: the manifest last)."""
    stage = tempfile.mkdtemp(prefix="make_shards-stage-")
    try:
        with storelock.store_writing(args.out, remote.Policy(**io_limits(args)), say=print):
            return write(args, stage)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def write(args, stage=None):
    """Index, merge or build into --out, or through the local folder `stage` into a store --out."""
    if args.index:
        run_index(args, stage)
        if not args.datasets and not args.imagefolder:
            return 0
    if args.merge:
        for name, split in [(n, s) for n in args.datasets for s in args.splits] + [  # an image folder's own split(s)
                (n, s) for n, given, _ in args.imagefolder for s in (("train", "test") if args.holdout else (given,))]:
            m = shards.merge_parts(args.out, name, split)
            print(f"merged {name}-{split}: {counted(len(m['shards']), 'shard')}, {m['total']} samples")
        return 0
    rows, t_all = [], time.perf_counter()
    try:
        _build_all(args, stage, rows)
    except BaseException:
        if rows:  # the splits before the failure were written whole: say so, or the set looks untouched
            print(f"make-shards: before the error below, wrote {', '.join(r[6] for r in rows)} in "
                  f"{args.out}; the split(s) after them were not written", file=sys.stderr, flush=True)
        raise
    print(f"{'split':<20}{'shards':>8}{'samples':>10}{'MB':>9}{'seconds':>9}{'samples/s':>11}  data")
    for name, n, total, size, dt, kind, _ in rows:
        print(f"{name:<20}{n:>8}{total:>10}{size / 1e6:>9.1f}{dt:>9.1f}{total / dt:>11.0f}  {kind}")
    print(done_line(rows, args.out, time.perf_counter() - t_all))
    return 0


def _build_all(args, stage, rows):
    """Each source's split built (and, for a store, published) in turn, a row of the table each."""
    for src in load_sources(args):
        print(f"{src.name}-{src.split}: {sources.describe(src.origin)}", flush=True)
        t0 = time.perf_counter()
        say = lambda line: print(line, flush=True)  # noqa: E731
        m = shards.build(src, stage or args.out, encoding=args.encoding, maxcount=args.maxcount, seed=args.seed,
                         limit=args.limit, workers=args.workers, part=args.part, progress=not args.quiet, say=say,
                         skip_bad=args.skip_bad_images)
        if stage is not None:
            publish.publish(stage, args.out, src.name, src.split, progress=not args.quiet, say=say,
                           policy=remote.Policy(**io_limits(args)))
            for s in m["shards"]:  # uploaded: the stage need not hold every split at once
                os.remove(os.path.join(stage, s["name"]))
        dt = time.perf_counter() - t0
        rows.append((f"{src.name}-{src.split}", len(m["shards"]), m["total"],
                     sum(s["bytes"] for s in m["shards"]), dt, src.origin.get("kind"),
                     shards.manifest_file(src.name, src.split, args.part)))


def done_line(rows, out, seconds):
    """The last line: what was written, where, and how long it all took."""
    n, total, size = sum(r[1] for r in rows), sum(r[2] for r in rows), sum(r[3] for r in rows)
    names = ", ".join(r[6] for r in rows)
    return (f"done in {seconds:.1f} s: wrote manifests and shards of {len(rows)} split(s) to {out}/ "
            f"({counted(n, 'shard')}, {total} samples, {size / 1e6:.1f} MB); manifests: {names or 'none'}")


FULL = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EROFS)  # a write refused for room or rights: say where


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's stop, `kill`), raised in the main process as Ctrl-C is, so that
    what a build holds is let go on the way out: a store --out's temporary keys and lock."""


def _terminate(signum, frame):
    if os.getpid() == _MAIN[0] and _MAIN[1] is None:  # the first: the build lets go of what it holds
        _MAIN[1] = time.monotonic()
        raise Terminated()
    if os.getpid() != _MAIN[0] or time.monotonic() - _MAIN[1] > TWICE:  # a forked worker (its parent cleans up)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # or a later stop: the process ends at once
        os.kill(os.getpid(), signal.SIGTERM)


_MAIN = [None, None]  # the build's process, when its first SIGTERM came
TWICE = 2.0  # s: timeout(1) signals the process, then its group: a second this soon (killed 2 in 10) is the same stop


def main(argv=None):
    args = parse_args(argv)
    _MAIN[:] = [os.getpid(), None]
    here = threading.current_thread() is threading.main_thread()  # else main() runs in a test's thread
    previous = signal.signal(signal.SIGTERM, _terminate) if here else None
    formatwarning, warnings.formatwarning = warnings.formatwarning, _one_line_warning
    try:
        return run(args)
    except (sources.SourceError, ShardError, OSError) as e:
        where = f" (writing in {args.out})" if isinstance(e, OSError) and not e.filename and e.errno in FULL else ""
        where = "; --skip-bad-images leaves such files out" if isinstance(e, sources.BadImage) else where
        print(f"make-shards: error: {printable(e)}{where}", file=sys.stderr)  # it may quote a key from a shard
        return 2
    except KeyboardInterrupt as e:
        print(f"make-shards: {'stopped by SIGTERM' if isinstance(e, Terminated) else 'interrupted'}; no manifest "
              f"was written for the unfinished split" + (" (its temporary keys and the prefix's lock were removed)"
                                                         if args.store else ""), file=sys.stderr)
        return 143 if isinstance(e, Terminated) else 130
    finally:
        warnings.formatwarning = formatwarning
        if here:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def _one_line_warning(message, category, filename, lineno, line=None):
    """A warning as the tool's other lines read (not Python's two lines with the file of the stage that said it)."""
    return f"make-shards: warning: {printable(message)}\n"


if __name__ == "__main__":
    sys.exit(main())
