"""The loaders timed, A (the tutorial's), B (stock webdataset), C and C8 (this stream), and
`throughput`, which runs them and the peers interleaved by repeat.

Each `batches_*` function is a generator of per-batch sample counts for one run that ends
exactly after setup.batches batches, with its DataLoader workers shut down.
"""
import contextlib
import itertools
import os
import sys
from dataclasses import dataclass, field, replace

import numpy as np
import torch

import bench_peers
from pipeline import stream
from pipeline.ordering.topology import Topology

from bench.cpu import measure
from bench.inputs import NAMES, project_sources
from bench.report import log, spread

# The tutorial's constants (the usual published per-channel statistics).
TUTORIAL_NORM = {"mnist": ((0.1307,), (0.3081,)),
                 "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))}


@dataclass
class Setup:
    """Everything a loader needs; plain values, so a child process can get it as JSON."""

    mnist_root: str
    cifar_folder: str
    shards: dict                      # encoding -> folder with mnist-train.json, cifar10-train.json
    cifar_root: str = None            # a torchvision root holding cifar-10-batches-py, if there is one
    cifar_cache: str = None           # where the decoded --cifar-folder array is kept between processes
    corpus10x: dict = field(default_factory=dict)  # encoding -> folder of the 10x corpus
    peer_dirs: dict = field(default_factory=dict)  # peer -> its formatted copy of each source
    captions: str = None              # the image-text set's folder (method T), if measured
    batch_size: int = 256
    batches: int = 78                 # per run and rank
    world: int = 1
    rank: int = 0
    seed: int = 0
    shuffle_buffer: int = 1000

    @property
    def samples(self):
        return self.batches * self.batch_size


class Take(torch.utils.data.Sampler):
    """The first n indices of another sampler: the harness's cut-off for A's epoch, so its
    loaders end (and their workers exit) exactly at the benchmark's sample count."""

    def __init__(self, sampler, n):
        self.sampler, self.n = sampler, n

    def __iter__(self):
        return itertools.islice(iter(self.sampler), self.n)

    def __len__(self):
        return min(self.n, len(self.sampler))


def cifar10_arrays(setup):
    """CIFAR10's training set as torchvision's CIFAR10 holds it: (N, 32, 32, 3) uint8 and the
    labels. From cifar-10-batches-py when there is one, else the JPEG folder decoded once
    (kept in setup.cifar_cache, so fresh processes don't decode it again)."""
    import torchvision

    if setup.cifar_root:
        ds = torchvision.datasets.CIFAR10(setup.cifar_root, train=True)
        return ds.data, list(ds.targets)
    if setup.cifar_cache and os.path.exists(setup.cifar_cache):
        with np.load(setup.cifar_cache) as z:
            return z["data"], z["targets"].tolist()
    from PIL import Image

    samples = torchvision.datasets.ImageFolder(setup.cifar_folder).samples
    data = np.stack([np.asarray(Image.open(p).convert("RGB")) for p, _ in samples])
    targets = [t for _, t in samples]
    if setup.cifar_cache:
        np.savez(setup.cifar_cache, data=data, targets=np.array(targets))
    return data, targets


def in_memory_cifar10(data, targets, transform):
    """torchvision.datasets.CIFAR10 over arrays already in memory: its own __getitem__
    (Image.fromarray, then the transform), without reading or md5-checking pickles."""
    import torchvision

    ds = torchvision.datasets.CIFAR10.__new__(torchvision.datasets.CIFAR10)
    torchvision.datasets.VisionDataset.__init__(ds, root="", transform=transform)
    ds.train, ds.data, ds.targets = True, data, targets
    return ds


def tutorial_datasets(setup, copies=1):
    """A's datasets as the tutorial's users have them; copies > 1 concatenates separately loaded copies."""
    import torchvision
    from torchvision import transforms as T

    def tf(name):
        return T.Compose([T.ToTensor(), T.Normalize(*TUTORIAL_NORM[name])])

    def mnist():
        return torchvision.datasets.MNIST(setup.mnist_root, train=True, transform=tf("mnist"))

    data, targets = cifar10_arrays(setup)

    def cifar():
        return in_memory_cifar10(data.copy() if copies > 1 else data, list(targets), tf("cifar10"))

    if copies == 1:
        return [mnist(), cifar()]
    return [torch.utils.data.ConcatDataset([make() for _ in range(copies)]) for make in (mnist, cifar)]


def batches_a(datasets, setup, workers, epoch):
    """A: one DistributedSampler + DataLoader per dataset, half a batch each, zipped.

    MNIST stays 1x28x28 as in the tutorial (no padding to CIFAR's shape), which spares A
    work that B and C do.
    """
    from torch.utils.data import DataLoader, DistributedSampler

    half = setup.batch_size // 2
    iters = []
    for ds in datasets:
        sampler = DistributedSampler(ds, num_replicas=setup.world, rank=setup.rank, shuffle=True, seed=setup.seed)
        sampler.set_epoch(epoch)
        loader = DataLoader(ds, batch_size=half, sampler=Take(sampler, setup.batches * half), num_workers=workers)
        iters.append(iter(loader))
    for (xm, _), (xc, _) in zip(*iters):
        yield len(xm) + len(xc)
    for it in iters:  # zip stops at the first loader to end; end the other so its workers exit
        for x, _ in it:
            yield len(x)


def stock_transform(source, offset, hw):
    """B's per-sample map: ToTensor + Normalize (PNG via PIL; raw bytes via frombuffer), then
    grey -> 3 channels and zero padding to the common size, so `wds.batched` can stack a mix."""
    from torchvision import transforms as T

    normalize = T.Normalize(source.mean, source.std)
    to_tensor = T.ToTensor()
    c, h, w = source.shape
    top, left = (hw[0] - h) // 2, (hw[1] - w) // 2

    def transform(sample):
        img, cls = sample
        if isinstance(img, (bytes, bytearray)):
            x = torch.from_numpy(np.frombuffer(img, np.uint8).reshape(c, h, w).copy()).float().div_(255)
        else:
            x = to_tensor(img)
        x = normalize(x)
        if c == 1:
            x = x.expand(3, h, w)
        if (h, w) != hw:
            x = torch.nn.functional.pad(x, (left, hw[1] - w - left, top, hw[0] - h - top))
        return x, cls + offset

    return transform


def take_share(n):
    """Pipeline stage: this DataLoader worker's share of n batches (what with_epoch can't do,
    as it counts per worker); the shares add up to n over the workers."""

    def stage(src):
        info = torch.utils.data.get_worker_info()
        k, w = (info.id, info.num_workers) if info else (0, 1)
        yield from itertools.islice(src, n // w + (k < n % w))

    return stage


def batches_b(srcs, setup, workers, epoch):
    """B: stock webdataset over the same shard URLs C reads."""
    import webdataset as wds

    hw = (max(s.shape[1] for s in srcs), max(s.shape[2] for s in srcs))
    datasets, offset = [], 0
    for s in srcs:
        ds = (wds.WebDataset(s.urls, shardshuffle=100, nodesplitter=wds.split_by_node,
                             workersplitter=wds.split_by_worker, seed=setup.seed + epoch)
              .repeat()  # never run dry (RandomMix stops at the first exhausted source)
              .shuffle(setup.shuffle_buffer)
              .decode("pil")
              .to_tuple(s.target.image_exts[0], "cls")
              .map(stock_transform(s, offset, hw)))
        datasets.append(ds)
        offset += len(s.classes)
    mix = wds.RandomMix(datasets, [1.0] * len(datasets))
    pipe = wds.DataPipeline(mix, wds.batched(setup.batch_size, partial=False), take_share(setup.batches))
    # split_by_node reads RANK / WORLD_SIZE (no process group here); forked workers inherit them
    with environ(RANK=str(setup.rank), WORLD_SIZE=str(setup.world)):
        for images, _ in wds.WebLoader(pipe, batch_size=None, num_workers=workers):
            yield len(images)


@contextlib.contextmanager
def environ(**values):
    """Stock webdataset reads the rank from the environment: set it for B, restore after."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def batches_c(srcs, setup, workers, epoch, normalize=True):
    """C: this project's stream, equal weights, normalised float batches like A and B.
    With normalize=False (C8), the uint8 batches the trainer takes and normalises on its device."""
    ms = stream.MixedStream(srcs, {s.name: 1.0 for s in srcs}, setup.batch_size, Topology(setup.rank, setup.world),
                            seed=setup.seed, epoch_samples=setup.samples * setup.world,
                            shuffle_buffer=setup.shuffle_buffer, normalize=normalize)
    ms.set_epoch(epoch)
    for batch in stream.make_loader(ms, num_workers=workers):
        yield len(batch["image"])


def batches_t(src, setup, workers, epoch):
    """T: an image-text set through this stream, the fields its manifest records (a 32x32 image and
    a caption): what a sample of more than an image and a class costs, beside C8."""
    ms = stream.MixedStream([src], {src.name: 1.0}, setup.batch_size, Topology(setup.rank, setup.world),
                            seed=setup.seed, epoch_samples=setup.samples * setup.world,
                            shuffle_buffer=setup.shuffle_buffer)
    ms.set_epoch(epoch)
    for batch in stream.make_loader(ms, num_workers=workers):
        assert len(batch["caption"]) == len(batch["image"])
        yield len(batch["image"])


def check_a_fits(datasets, setup, worker_counts):
    """A reads each data set once (its loaders end with their epoch), so each rank's share of
    each must hold the run's half batches, the untimed first run's included; else one line
    (exit 2) naming the flags, not the RuntimeError of a run that delivered too few samples."""
    batches = max(setup.batches, 2, max(worker_counts))  # the untimed first run: see throughput
    need = batches * (setup.batch_size // 2)
    for name, ds in zip(NAMES, datasets):
        share = -(-len(ds) // setup.world)  # DistributedSampler pads each rank's share to this
        if share < need:
            sys.stderr.write(f"bench_loader: error: {name} holds {len(ds)} samples, {share} a rank at --world "
                             f"{setup.world}; A needs {need} ({batches} batches of {setup.batch_size // 2}): "
                             f"lower --samples or --world, or raise --synthetic-size\n")
            raise SystemExit(2)


def throughput(setup, encodings, worker_counts, repeats, methods=("A", "B", "C", "C8")):
    """All runs, interleaved by repeat so drift affects every method alike. The peers read
    the raw shards' pixels, so their ratios to B and C are to B/raw and C/raw.

    One short untimed run of each configuration comes first: it pays for one-off costs
    (lazy imports, PIL plugins, starting a forkserver) that an epoch of training doesn't.
    """
    a_data = tutorial_datasets(setup)
    check_a_fits(a_data, setup, worker_counts)
    srcs = {enc: project_sources(setup.shards[enc]) for enc in encodings}
    captions = stream.resolve("captions", setup.captions, "train") if setup.captions else None

    def plan(st, w, rep):
        out = [("A", None, lambda: batches_a(a_data, st, w, rep))]
        for enc in encodings:
            out.append(("B", enc, lambda enc=enc: batches_b(srcs[enc], st, w, rep)))
            out.append(("C", enc, lambda enc=enc: batches_c(srcs[enc], st, w, rep)))
            out.append(("C8", enc, lambda enc=enc: batches_c(srcs[enc], st, w, rep, normalize=False)))
        if st.captions:
            out.append(("T", "jpg+txt", lambda: batches_t(captions, st, w, rep)))
        for peer in st.peer_dirs:
            out.append((peer, None, lambda peer=peer: bench_peers.LOADERS[peer](
                srcs["raw"], st.peer_dirs[peer], st, w, rep)))
        return [p for p in out if p[0] in methods]

    warm = replace(setup, batches=max(2, max(worker_counts)))
    for w in worker_counts:
        for _, _, make in plan(warm, w, 0):
            measure(make(), warm.samples)
    runs = {}  # (method, encoding, workers) -> [run]
    for rep in range(repeats):
        for w in worker_counts:
            for method, enc, make in plan(setup, w, rep):
                r = measure(make(), setup.samples)
                runs.setdefault((method, enc, w), []).append(r)
                log(f"  repeat {rep + 1}/{repeats} workers {w} {method}{'/' + enc if enc else ''}: "
                    f"{r['samples_per_s']:9.0f} samples/s {r['samples_per_cpu_s']:9.0f} samples/cpu-s "
                    f"({r['busy_cores']:.2f} cores)")
    entries = []
    for (method, enc, w), rs in runs.items():
        entry = {"method": method, "encoding": enc, "workers": w, "runs": rs,
                 "samples_per_s": spread([r["samples_per_s"] for r in rs]),
                 "samples_per_cpu_s": spread([r["samples_per_cpu_s"] for r in rs]), "ratios": {}}
        pixels = enc or ("raw" if method in bench_peers.PEERS else None)  # the shards whose pixels it reads
        for base in ("A", "B", "C"):
            key = (base, None if base == "A" else pixels, w)
            if key in runs and method != base and (base == "A" or pixels):
                pairs = list(zip(rs, runs[key]))
                entry["ratios"][f"vs_{base}"] = {
                    m: spread([x[m] / y[m] for x, y in pairs]) for m in ("samples_per_s", "samples_per_cpu_s")}
        entries.append(entry)
    return entries
