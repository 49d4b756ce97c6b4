"""A contact sheet of a shard set: a PNG grid of samples as the stream decodes them, each
captioned underneath with its class name, under a title saying which data set, split and origin
they are. It is the quickest check that shards hold what their manifest says (the right
classes on the right pictures, grey kept grey) and that look-alike synthetic data is
never taken for the real thing.

matplotlib is imported only when a sheet is drawn.
"""
import math
import textwrap

import numpy as np

from pipeline.data.manifests import manifest
from pipeline.data.streams import stages
from pipeline.data.streams import reading
from pipeline.data.streams import plans
from pipeline.figures import new_figure, plain


CELL = 1.3  # inches per sample


def samples(manifest_path, n, seed):
    """(source, keys, images, labels, skipped) for up to n samples, read the way the
    trainer reads them. The seed picks which shards come first (a seeded shuffle of the
    shard list), so only the few shards that n samples need are read, even of a large set."""
    m = manifest.load(manifest_path)
    src = manifest.resolve(m["dataset"], manifest_path, m["split"])
    urls = [src.urls[i] for i in np.random.default_rng(seed).permutation(len(src.urls))]
    reader = reading.Reader(src)
    stream = stages.SourceStream(plans.OncePlan(urls), reader, shuffle=False)
    keys, images, labels = stream.take(n)
    return src, keys, images, labels, reader.errors.skipped


def origin_text(origin):
    """Where the data came from; synthetic data says so first and loudly."""
    origin = origin if isinstance(origin, dict) else {}
    kind = str(origin.get("kind", "not recorded"))
    details = "; ".join(str(origin[k]) for k in ("note", "dataset", "subset") if origin.get(k))
    if kind == "synthetic":  # its note says what it is: the head says it loudly instead of twice
        return "SYNTHETIC: " + details if details else "SYNTHETIC look-alike data"
    head = f"origin: {kind}"
    return f"{head}: {details}" if details else head


def class_name(classes, label):
    return classes[label] if 0 <= label < len(classes) else f"label {label}"


def _show(ax, image):
    """Grey images in grey (a colormap would invent colours), RGB as it is."""
    if image.shape[0] == 1:
        ax.imshow(image[0], cmap="gray", vmin=0, vmax=255, interpolation="nearest")
    else:
        ax.imshow(np.transpose(image, (1, 2, 0)), interpolation="nearest")


def build_figure(manifest_path, n=64, seed=0):
    """The sheet as a figure (see `preview`)."""
    if n < 1:
        raise ValueError(f"n={n}: at least one sample expected")
    src, keys, images, labels, skipped = samples(manifest_path, n, seed)
    cols = max(1, math.ceil(math.sqrt(len(keys))))
    rows = max(1, math.ceil(len(keys) / cols))
    width = max(6.0, cols * CELL)
    origin = textwrap.wrap(origin_text(src.origin)[:400], int(width * 11)) or [""]
    top = 0.6 + 0.2 * len(origin)  # inches above the grid: the title, then the origin
    fig = new_figure(width, rows * CELL + top)
    for i in range(rows * cols):
        ax = fig.add_subplot(rows, cols, i + 1)
        ax.set_axis_off()
        if i < len(keys):
            _show(ax, images[i])
            ax.set_title(plain(class_name(src.classes, int(labels[i])), limit=24), fontsize=7, y=-0.16)  # under it
    head = f"{src.dataset or src.name} / {src.split}: {len(keys)} of {src.total} samples, shape {list(src.shape)}"
    if skipped:
        head += f", {skipped} damaged sample(s) skipped"
    if not keys:
        head += " (no readable samples)"
    height = fig.get_figheight()
    fig.suptitle(plain(head, limit=300), fontsize=11, y=1 - 0.1 / height, va="top")
    fig.text(0.5, 1 - 0.4 / height, "\n".join(plain(line) for line in origin), ha="center", va="top", fontsize=10,
             color="red" if src.synthetic else "black", fontweight="bold" if src.synthetic else "normal")
    fig.subplots_adjust(left=0.02, right=0.98, bottom=0.2 / height, top=1 - top / height, hspace=0.35)
    return fig


def preview(manifest_path, out_png, n=64, seed=0):
    """Write a PNG grid of up to n samples of the shard set a manifest describes; returns
    out_png. Raises ShardError (one line) for a manifest or shards that cannot be read."""
    build_figure(manifest_path, n, seed).savefig(out_png, format="png")
    return out_png
