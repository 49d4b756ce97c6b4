"""Where samples come from before they become shards.

Every source is a small object with `name`, `split`, `classes`, `shape` (C, H, W),
`origin` (where its data came from, recorded in the manifest), `len()` and
`image(i)` / `label(i)`; images are uint8 numpy arrays in CHW order.
The torchvision data sets are loaded by torchvision itself; we only read its
already-decoded arrays instead of going through PIL one sample at a time.
"""
import collections
import os
import warnings

import numpy as np

SPLIT_SIZES = {"mnist": {"train": 60000, "test": 10000}, "cifar10": {"train": 50000, "test": 10000}}
SHAPES = {"mnist": (1, 28, 28), "cifar10": (3, 32, 32)}
CLASSES = {
    "mnist": [str(d) for d in range(10)],
    "cifar10": ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"],
}


class SourceError(ValueError):
    """Bad input data: the message says what is wrong and how to fix it."""


class BadImage(SourceError):
    """One file of an image folder that cannot be read as an image (damaged, not an image, too
    large): make-shards --skip-bad-images leaves it out, where every other SourceError stops."""


class ArraySource:
    """Samples held as one uint8 array (N, C, H, W) and a label array."""

    def __init__(self, name, split, images, labels, classes, origin=None):
        self.name, self.split, self.classes = name, split, list(classes)
        self.origin = origin or {"kind": "arrays"}
        self.images = images
        self.labels = np.asarray(labels, dtype=np.int64)
        self.shape = tuple(images.shape[1:])

    def __len__(self):
        return len(self.labels)

    def image(self, i):
        return self.images[i]

    def label(self, i):
        return int(self.labels[i])


def torchvision_source(name, split, root, download=False):
    """MNIST or CIFAR10 through torchvision; raises SourceError when the files are missing."""
    import torchvision

    cls = {"mnist": torchvision.datasets.MNIST, "cifar10": torchvision.datasets.CIFAR10}[name]
    try:
        ds = cls(root=root, train=(split == "train"), download=download)
    except (RuntimeError, AssertionError, ValueError, OSError) as e:  # not found, damaged, unreadable, no network
        if download:  # torchvision reads files it finds instead of downloading: either may have failed
            raise SourceError(f"{name} {split}: could not download to or read the files under {root!r}: "
                              f"{_gist(e)}") from None
        if isinstance(e, OSError):
            raise SourceError(f"{name} {split}: could not read the files under {root!r}: {_gist(e)}") from None
        hint = (" (pass --download to fetch it, --cifar10-dir DIR for a folder of its images, or "
                "--synthetic for look-alike data)" if name == "cifar10" else
                " (pass --download to fetch it, or --synthetic for look-alike data)")
        raise SourceError(f"{name} {split}: no usable data under {root!r}{hint}: {_gist(e)}") from None
    data = np.asarray(ds.data)
    images = data[:, None] if data.ndim == 3 else data.transpose(0, 3, 1, 2)  # MNIST NHW, CIFAR NHWC
    origin = {"kind": "torchvision", "dataset": cls.__name__, "root": os.path.abspath(root),
              "note": f"real {cls.__name__} {split} split, read by torchvision"}
    return ArraySource(name, split, np.ascontiguousarray(images), np.asarray(ds.targets), CLASSES[name], origin)


def _gist(error):
    """A multi-line error (torchvision's download failures list each mirror tried) as one
    line: its first line and its last, where the cause is."""
    lines = [" ".join(line.split()) for line in str(error).splitlines() if line.strip()]
    if not lines:  # a bare AssertionError from a damaged file
        return error.__class__.__name__
    return lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"


class ImageFolderSource:
    """A torchvision ImageFolder tree. With `shape` (C, H, W) every image is decoded to it as the
    stream decodes an indexed image (`decode.decode_image`: upright by its EXIF orientation, grey,
    CMYK or palette brought to C channels, the shorter side resized and centre-cropped); without,
    every image, turned upright by its EXIF orientation, must match the first in size and mode, L
    or RGB, and is stored as it is. With
    captions, each image's caption is the .txt file beside it, and the folder may also be a flat
    one of image + .txt pairs (one class, "0"). Images are held to image_caps.CONVERSION: the
    user's own files, converted offline, not the stream's caps relative to the target.
    Folders whose name starts with "." are not classes (`_listed`); a class folder without an
    image is refused, naming it. `left_out` counts the files of the tree that are not taken
    (`_left_out`), each said in a line to `say`."""

    def __init__(self, name, split, root, captions=False, shape=None, say=None):
        if not os.path.isdir(root):
            raise SourceError(f"{name} {split}: {root!r} is not a directory")
        flat = captions and not any(e.is_dir() and not e.name.startswith(".") for e in os.scandir(root))
        classes, samples, hidden = _listed(root, flat)
        if not samples:
            raise SourceError(f"{name} {split}: {root!r} holds no images in ImageFolder layout (DIR/<class>/<image>)"
                              f"{' nor image + .txt pairs' if captions else ''}")
        empty = sorted(set(classes) - {classes[k] for _, k in samples})
        if empty:
            raise SourceError(f"{name} {split}: class folder(s) {', '.join(empty)} in {root!r} hold no image "
                              f"({' '.join(_image_exts())}); put images in them or move them out")
        self.name, self.split, self.classes = name, split, list(classes)
        self.samples, self.root = samples, root
        self.left_out = _left_out(root, samples, captions, flat)
        if say:
            for line in ([hidden_line(self, hidden)] if hidden else []) + left_out_lines(self):
                say(line)
        self.captions = captions  # each image's caption, the .txt file beside it (`caption`)
        self.origin = {"kind": "imagefolder", "root": os.path.abspath(root),
                       "note": f"images from an ImageFolder tree of {len(self.samples)} files"}
        self.target = None if shape is None else tuple(shape)  # each image decoded to it (`_open`)
        if self.target is not None:
            self.shape = self.target
            return
        first = self._open(0)
        self.mode, self.size = first.mode, first.size
        if self.mode not in ("L", "RGB"):
            raise SourceError(f"{self.samples[0][0]}: image mode {self.mode}; without --shape only L (grey) and "
                              f"RGB images are stored as they are: give --shape C,H,W to bring every image to C "
                              f"channels (1 or 3) and one size")
        self.shape = (1 if self.mode == "L" else 3, self.size[1], self.size[0])

    def _open(self, i):
        """The image upright, a PIL image opened by `decode.open_image` as the format its extension
        names (a .png that is really EPS would make PIL run Ghostscript) and its size checked before
        it is decoded (a WebP's canvas before libwebp allocates it); with a target shape, the CHW
        array `decode.decode_image` makes of it. A FIFO or device among the files is refused before
        it is opened."""
        from PIL import Image

        from pipeline.data.store import remote
        from pipeline.data.decoding import image_caps
        from pipeline.data.decoding.decode import decode_image, open_image
        from pipeline.data.decoding.pil_images import upright
        from pipeline.data.shards.read import MAX_MEMBER

        path = self.samples[i][0]
        ext = os.path.splitext(path)[1][1:].lower()  # one of torchvision's IMG_EXTENSIONS, all in IMAGE_EXTS
        try:
            with remote.open_local(path) as f:
                data = f.read(MAX_MEMBER + 1)
            if len(data) > MAX_MEMBER:
                raise ValueError(f"more than {MAX_MEMBER} bytes")
            with warnings.catch_warnings():  # PIL warns of what CONVERSION's cap, its own limit, refuses
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                if self.target is not None:  # --shape: decoded to it, as the stream decodes an indexed image
                    return decode_image(data, ext, self.target, caps=image_caps.CONVERSION)
                img, orientation = open_image(data, ext, caps=image_caps.CONVERSION)
                img.load()
        except (OSError, ValueError, Image.DecompressionBombError) as e:
            raise BadImage(f"{path}: not a readable image: {e}") from None
        return upright(img, orientation)  # as a viewer shows it, and as the stream and --shape decode it

    def __len__(self):
        return len(self.samples)

    def image(self, i):
        img = self._open(i)
        if self.target is not None:
            return img  # CHW of the target shape already
        if img.mode != self.mode or img.size != self.size:
            # grey only if both images named here are: a grey first image among colour ones is no reason to
            # turn every image grey (newuser5 4)
            c, (w, h) = 1 if self.mode == img.mode == "L" else 3, self.size
            raise SourceError(
                f"{self.samples[i][0]}: {img.mode} {img.size[0]}x{img.size[1]}, where the first image, "
                f"{self.samples[0][0]}, is {self.mode} {w}x{h}: without --shape every image is stored as it is "
                f"and must match it; give --shape C,H,W (e.g. --shape {c},{h},{w}) to bring every image to one")
        a = np.asarray(img, dtype=np.uint8)
        return a[None] if a.ndim == 2 else a.transpose(2, 0, 1)

    def label(self, i):
        return self.samples[i][1]

    def file(self, i):
        """Sample i's file, relative to the folder (the manifest's origin root)."""
        return os.path.relpath(self.samples[i][0], self.root)

    def caption(self, i):
        """The text of IMAGE.txt beside IMAGE.jpg (UTF-8, at most schema.MAX_TEXT bytes); one line
        naming the file when it is missing, too long or not text."""
        from pipeline.data.store import remote
        from pipeline.data.fields.schema import MAX_TEXT

        path = os.path.splitext(self.samples[i][0])[0] + ".txt"
        try:
            with remote.open_local(path) as f:
                data = f.read(MAX_TEXT + 1)
        except OSError as e:
            raise SourceError(f"{path}: no caption for {self.samples[i][0]} ({e.strerror or e}); --captions takes "
                              f"each image's caption from the .txt file beside it") from None
        if len(data) > MAX_TEXT:
            raise SourceError(f"{path}: a caption of more than {MAX_TEXT} bytes (pipeline.data.fields.schema.MAX_TEXT)")
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise SourceError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


SYSTEM_FILES = frozenset({".ds_store", "thumbs.db", "desktop.ini"})  # a file manager's, not the user's data


def _image_exts():
    import torchvision

    return torchvision.datasets.folder.IMG_EXTENSIONS


def _listed(root, flat):
    """(classes, samples, hidden) of an image folder, as torchvision's ImageFolder lists them
    (classes the sorted folders of `root`, samples (path, class index) in its order) but for
    folders whose name starts with "." at any depth (.git, .ipynb_checkpoints: a tool's, never a
    class), listed apart as `hidden`, relative to root. `flat`: the files of root, one class "0"."""
    hidden = []

    def walk(top):  # os.walk, following links as ImageFolder does, without the hidden folders
        for folder, dirs, files in os.walk(top, followlinks=True):
            hidden.extend(os.path.relpath(os.path.join(folder, d), root) for d in dirs if d.startswith("."))
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            yield folder, files

    exts = _image_exts()
    if flat:
        hidden.extend(e.name for e in os.scandir(root) if e.is_dir())
        return ["0"], [(os.path.join(root, f), 0) for f in sorted(os.listdir(root)) if f.lower().endswith(exts)], \
            sorted(hidden)
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    hidden.extend(c for c in classes if c.startswith("."))
    classes = [c for c in classes if not c.startswith(".")]
    samples = [(os.path.join(folder, f), k) for k, c in enumerate(classes)
               for folder, files in sorted(walk(os.path.join(root, c))) for f in sorted(files)
               if f.lower().endswith(exts)]
    return classes, samples, sorted(hidden)


def _left_out(root, samples, captions, flat=False):
    """{extension: count} of the files in the class folders of `root` that are not among
    `samples` (ImageFolder takes only its IMG_EXTENSIONS: a .gif, .heic or .avif photo is passed
    by without a word), captions (.txt) aside with `captions`, '' for a file without an
    extension; and under None, the files outside any class folder (in `root` itself). Hidden
    folders and a file manager's files (SYSTEM_FILES) are not counted."""
    taken = {p for p, _ in samples}  # the listing's paths: os.path.join of root and os.walk's, as here
    counts = collections.Counter()
    for folder, dirs, files in os.walk(root, followlinks=True):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for f in files:
            ext = os.path.splitext(f)[1].lower()
            if os.path.join(folder, f) in taken or f.lower() in SYSTEM_FILES or captions and ext == ".txt":
                continue
            counts[None if folder == root and not flat else ext] += 1
    return dict(counts)


def hidden_line(source, hidden):
    """One line naming the hidden folders an image folder's listing passed by."""
    from pipeline.cli import printable

    shown = ", ".join(hidden[:5]) + (f" and {len(hidden) - 5} more" if len(hidden) > 5 else "")
    return printable(f"{source.name}-{source.split}: note: left out {len(hidden)} hidden folder(s) in {source.root} "
                     f"({shown}): a folder whose name starts with \".\" is a tool's, not a class")


def left_out_lines(source):
    """The lines naming the files of an image folder its listing left out: those outside any
    class folder, and the others by extension."""
    from pipeline.cli import printable

    counts = dict(source.left_out)
    outside = counts.pop(None, 0)
    head = f"{source.name}-{source.split}: warning:"
    lines = [f"{head} {outside} file(s) in {source.root} outside any class folder left out (ImageFolder layout: "
             f"DIR/<class>/<image>)"] if outside else []
    if counts:
        by_ext = ", ".join(f"{e or '(no extension)'} {k}" for e, k in sorted(counts.items(),
                                                                            key=lambda x: (-x[1], x[0])))
        lines.append(f"{head} {sum(counts.values())} file(s) in {source.root} left out ({by_ext}): ImageFolder takes "
                     f"only {' '.join(_image_exts())}; convert such photos to one of those first (e.g. .png) to "
                     f"include them")
    return [printable(line) for line in lines]


def add_options(a):
    """make_shards' --skip-bad-images."""
    a("--skip-bad-images", action="store_true",
      help="with --imagefolder: leave out images that cannot be read (damaged, not an image, too large), counted "
           "and listed with their reasons in NAME-SPLIT.left-out.tsv beside the manifest, instead of stopping")


def check_options(p, args):
    """--skip-bad-images refused (p.error, one line) where no image folder is converted."""
    if args.skip_bad_images and not (args.imagefolder or args.cifar10_dir):
        p.error("--skip-bad-images applies to --imagefolder (and --cifar10-dir) sources only")


class SyntheticSource:
    """Look-alike data made offline: ten classes, each a faint blurry pattern over a
    shared background, seen through strong noise and a random shift, so a small CNN
    learns it well above chance but not at once. Sample i depends only on
    (seed, name, split, i)."""

    def __init__(self, name, split, n, shape, seed=0):
        self.name, self.split, self.shape = name, split, tuple(shape)
        self.classes = CLASSES.get(name, [f"class{i}" for i in range(10)])
        self.origin = {"kind": "synthetic", "note": "synthetic look-alike data made offline, not real images"}
        self.n, self.seed = n, seed
        self._tag = sum(map(ord, name))  # stable across processes, unlike hash()
        rng = np.random.default_rng((seed, self._tag))
        c, h, w = self.shape
        coarse = rng.uniform(0, 1, size=(10, c, h // 4 + 1, w // 4 + 1))
        self.templates = np.kron(coarse, np.ones((1, 1, 4, 4)))[:, :, :h, :w]
        self.common = self.templates.mean(0)  # what all classes share; only the rest tells them apart
        self.labels = np.random.default_rng((seed, self._tag, split == "train")).integers(0, 10, n)

    def __len__(self):
        return self.n

    def image(self, i):
        rng = np.random.default_rng((self.seed, self._tag, self.split == "train", i))
        dy, dx = rng.integers(-3, 4, size=2)
        t = np.roll(self.templates[self.labels[i]], (dy, dx), axis=(1, 2))
        x = 0.2 * t + 0.3 * self.common + 0.5 * rng.uniform(0, 1, size=self.shape)
        return (x * 255).astype(np.uint8)

    def label(self, i):
        return int(self.labels[i])


def synthetic_source(name, split, limit=None, seed=0):
    """Synthetic stand-in for a named data set, with its real shape and split size."""
    n = SPLIT_SIZES.get(name, {}).get(split, 10000)
    return SyntheticSource(name, split, min(n, limit) if limit else n, SHAPES.get(name, (3, 32, 32)), seed)


class Subset:
    """Part of another source under another split name (e.g. a held-out test split)."""

    def __init__(self, base, indices, split):
        self.base, self.indices, self.split = base, list(indices), split
        self.name, self.classes, self.shape = base.name, base.classes, base.shape
        self.captions = getattr(base, "captions", False)
        self.origin = dict(base.origin, subset=f"{len(self.indices)} of {len(base)} samples, as split {split}")

    def __len__(self):
        return len(self.indices)

    def image(self, i):
        return self.base.image(self.indices[i])

    def label(self, i):
        return self.base.label(self.indices[i])

    def caption(self, i):
        return self.base.caption(self.indices[i])

    def file(self, i):
        return self.base.file(self.indices[i])


def holdout(source, n, seed=0):
    """Split a source into (train, test) subsets with n seeded random samples held out."""
    if not 0 < n < len(source):
        raise SourceError(f"--holdout {n}: must be between 1 and {len(source) - 1} for {source.name}")
    order = np.random.default_rng((seed, 1)).permutation(len(source))
    return Subset(source, sorted(order[n:]), "train"), Subset(source, sorted(order[:n]), "test")


def real_data_hint(name, downloading=False):
    fetch = "" if downloading else ", or pass --download (make demo DOWNLOAD=1)"
    if name == "mnist":
        return f"put MNIST/raw/ under --root (make demo DATA=DIR){fetch}"
    return f"put cifar-10-batches-py/ under --root (make demo DATA=DIR){fetch}, or give --cifar10-dir DIR with " \
           "train/ and test/ class folders of images (make demo CIFAR10_DIR=DIR)"


def describe(origin):
    """One line saying where a split's data came from."""
    kind = origin.get("kind")
    if kind == "synthetic":
        return "SYNTHETIC look-alike data, not real images"
    if kind == "torchvision":
        return f"real {origin['dataset']} from torchvision files under {origin['root']}"
    if kind == "imagefolder":
        return f"real images from the ImageFolder {origin['root']}" + (f" ({origin['subset']})" if "subset" in
                                                                       origin else "")
    return origin.get("note", "origin not recorded")
