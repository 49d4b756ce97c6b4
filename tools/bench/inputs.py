"""The benchmark's inputs: tiny synthetic MNIST and CIFAR10 in their real formats, the shards of
each encoding (built with pipeline.writers, or a JPEG WebDataset written by wds.ShardWriter),
and the 10x corpus the memory runs stream."""
import glob
import os
import shutil

import numpy as np

from pipeline.data.manifests import manifest
from pipeline.data.streams import stream
from pipeline.errors import ShardError
from pipeline.files import write_json_atomic
from pipeline.writers import shards, sources

from bench.report import log

NAMES = ("mnist", "cifar10")


def make_synthetic_inputs(folder, n_mnist=1200, n_cifar=1200):
    """Tiny MNIST IDX files (torchvision layout) and a CIFAR10-like JPEG ImageFolder tree.

    The pixels are noise: only the formats and the per-sample work matter here.
    """
    from PIL import Image

    rng = np.random.default_rng(0)
    raw = os.path.join(folder, "MNIST", "raw")
    os.makedirs(raw)
    for prefix, n in (("train", n_mnist), ("t10k", 100)):
        images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, n, dtype=np.uint8)
        with open(os.path.join(raw, f"{prefix}-images-idx3-ubyte"), "wb") as f:
            f.write((0x803).to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in (n, 28, 28)))
            f.write(images.tobytes())
        with open(os.path.join(raw, f"{prefix}-labels-idx1-ubyte"), "wb") as f:
            f.write((0x801).to_bytes(4, "big") + n.to_bytes(4, "big") + labels.tobytes())
    cifar = os.path.join(folder, "cifar10-jpg", "train")
    for name in sources.CLASSES["cifar10"]:
        os.makedirs(os.path.join(cifar, name))
        for i in range(-(-n_cifar // 10)):  # at least n_cifar in all
            pixels = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(os.path.join(cifar, name, f"{i:04d}.jpg"), quality=90)
    return folder, cifar


def shard_encoding(folder):
    """The encoding of the train shards in `folder`, or None if it lacks either manifest."""
    try:
        found = {manifest.load(os.path.join(folder, manifest.manifest_name(n, "train")))["encoding"]
                 for n in NAMES}
    except ShardError:
        return None
    return found.pop() if len(found) == 1 else None


def build_shards(mnist_root, cifar_folder, out, encoding, maxcount):
    """Shard MNIST train and the CIFAR10 JPEG tree with pipeline.writers.shards (as tools/make_shards.py does),
    or, for jpg, as a JPEG WebDataset written by another tool and indexed in place."""
    if encoding == "jpg":
        return build_jpeg_webdataset(mnist_root, cifar_folder, out, maxcount)
    for src in (sources.torchvision_source("mnist", "train", mnist_root),
                sources.ImageFolderSource("cifar10", "train", cifar_folder)):
        shards.build(src, out, encoding=encoding, maxcount=maxcount, workers=os.cpu_count() or 1, progress=False)
    return out


def build_jpeg_webdataset(mnist_root, cifar_folder, out, maxcount):
    """MNIST as grey JPEGs (quality 95) and the CIFAR10 JPEG files byte for byte, in shuffled
    order, written by wds.ShardWriter, then indexed with pipeline.writers.index (no rewrite)."""
    import io

    import torchvision
    import webdataset as wds
    from PIL import Image

    from pipeline.writers import index

    os.makedirs(out, exist_ok=True)
    mnist = torchvision.datasets.MNIST(mnist_root, train=True)
    cifar = torchvision.datasets.ImageFolder(cifar_folder).samples
    rng = np.random.default_rng(0)
    for name, n in (("mnist", len(mnist)), ("cifar10", len(cifar))):
        with wds.ShardWriter(os.path.join(out, f"{name}-train-%06d.tar"), maxcount=maxcount, verbose=0) as sink:
            for i in rng.permutation(n).tolist():
                if name == "mnist":
                    buf = io.BytesIO()
                    Image.fromarray(mnist.data[i].numpy()).save(buf, format="JPEG", quality=95)
                    jpg, label = buf.getvalue(), int(mnist.targets[i])
                else:
                    with open(cifar[i][0], "rb") as f:
                        jpg, label = f.read(), cifar[i][1]
                sink.write({"__key__": f"{name}/{i:07d}", "jpg": jpg, "cls": str(label).encode()})
        count = len(glob.glob(os.path.join(out, f"{name}-train-*.tar")))
        index.index(name, "train", os.path.join(out, f"{name}-train-{{000000..{count - 1:06d}}}.tar"), out,
                    workers=os.cpu_count() or 1, progress=False)
    return out


def build_caption_webdataset(cifar_folder, out, maxcount):
    """The CIFAR10 JPEG files as they are, each with a caption (`.txt`) and its class (`.cls`),
    written by wds.ShardWriter and indexed in place with the fields image (32x32) and caption:
    an image-text set, as img2dataset writes them, for method T."""
    import torchvision
    import webdataset as wds

    from pipeline.data.fields.schema import parse_fields
    from pipeline.writers import index

    os.makedirs(out, exist_ok=True)
    cifar = torchvision.datasets.ImageFolder(cifar_folder)
    with wds.ShardWriter(os.path.join(out, "captions-train-%06d.tar"), maxcount=maxcount, verbose=0) as sink:
        for i in np.random.default_rng(0).permutation(len(cifar.samples)).tolist():
            path, label = cifar.samples[i]
            with open(path, "rb") as f:
                sink.write({"__key__": f"captions/{i:07d}", "jpg": f.read(), "cls": str(label).encode(),
                            "txt": f"a small photo of a {cifar.classes[label]}, number {i}".encode()})
    count = len(glob.glob(os.path.join(out, "captions-train-*.tar")))
    index.index("captions", "train", os.path.join(out, f"captions-train-{{000000..{count - 1:06d}}}.tar"), out,
                workers=os.cpu_count() or 1, progress=False,
                fields=parse_fields("image:image=jpg,size=32x32,fit=resize caption:text=txt"))
    return out


def make_corpus_10x(folder, out):
    """The 1x train shards listed ten times: hard links under new shard names plus a manifest.

    Streaming memory must not depend on how big the corpus is, only the shard list does;
    repeating the files gives a 10x corpus without writing 10x the bytes. (Hard links, not
    symbolic ones: a manifest's shards may not resolve outside its folder.)
    """
    if shard_encoding(out):
        return out
    os.makedirs(out, exist_ok=True)
    for name in NAMES:
        m = manifest.load(os.path.join(folder, manifest.manifest_name(name, "train")))
        entries = []
        for k in range(10 * len(m["shards"])):
            entry = dict(m["shards"][k % len(m["shards"])])
            target = os.path.join(folder, entry["name"])
            entry["name"] = manifest.shard_name(name, "train", k)
            link = os.path.join(out, entry["name"])
            if os.path.lexists(link):
                os.remove(link)
            try:
                os.link(target, link)
            except OSError:  # another file system
                shutil.copyfile(target, link)
            entries.append(entry)
        m = dict(m, shards=entries, total=sum(e["samples"] for e in entries))
        write_json_atomic(os.path.join(out, manifest.manifest_name(name, "train")), m)
    return out


def warm_page_cache(paths):
    """Read files once so the first timed run doesn't pay for the disk."""
    for path in paths:
        with open(path, "rb") as f:
            while f.read(1 << 22):
                pass


def project_sources(folder):
    return [stream.resolve(name, folder, "train") for name in NAMES]


def find_shards(args, mnist_root, cifar_folder, work, maxcount):
    """encoding -> shard folder: the --shards folders, else shards built under `work`."""
    found = {}
    for folder in args.shards:
        enc = shard_encoding(folder)
        if enc is None:
            log(f"bench_loader: {folder}: no mnist-train.json + cifar10-train.json of one encoding; ignored")
        else:
            found.setdefault(enc, folder)
    shard_dirs = {}
    for enc in args.encoding:
        if enc not in found:
            found[enc] = os.path.join(work, f"shards-{enc}")
            if shard_encoding(found[enc]) != enc:
                log(f"building {enc} shards from the inputs in {found[enc]} ...")
                build_shards(mnist_root, cifar_folder, found[enc], enc, maxcount)
        shard_dirs[enc] = found[enc]
    return shard_dirs


def all_input_files(setup):
    raw = os.path.join(setup.mnist_root, "MNIST", "raw")
    import torchvision

    return ([os.path.join(raw, f) for f in os.listdir(raw)]
            + ([p for p, _ in torchvision.datasets.ImageFolder(setup.cifar_folder).samples] if setup.cifar_folder else [])
            + [u for d in setup.shards.values() for s in project_sources(d) for u in s.urls]
            + [os.path.join(d, f) for dirs in setup.peer_dirs.values() for d in dirs for f in os.listdir(d)])
