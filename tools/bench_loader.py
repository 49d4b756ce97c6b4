"""Benchmark this stream against the tutorial's loaders, stock webdataset and the peers (LitData,
Mosaic Streaming), feeding MNIST + CIFAR10 to one model on the same data in one run.

    python tools/bench_loader.py --mnist-root MNIST_ROOT --cifar-folder CIFAR_JPEG_TRAIN_DIR \\
        --shards RAW_SHARDS --shards PNG_SHARDS --json bench-out/bench.json

  A  the seed tutorial as its users run it: torchvision's map-style MNIST and CIFAR10, each
     holding its split as one uint8 array in memory and doing Image.fromarray + ToTensor +
     Normalize per sample (torchvision's own __getitem__), one DistributedSampler and
     DataLoader each, the two loaders zipped. CIFAR10 comes from cifar-10-batches-py under
     --cifar-root when given; else the --cifar-folder JPEGs are decoded once, before any
     timing, into the same array torchvision would hold.
  B  stock webdataset over the same shards as C: WebDataset per source (tarfile reading,
     .decode("pil"), .to_tuple, .map(transform)), wds.RandomMix, wds.batched, wds.WebLoader.
  C  this project: pipeline.data.stream.resolve + MixedStream(normalize=True) + make_loader.
  C8 the same with normalize=False: uint8 batches, as the trainer takes them (it normalises
     on its device).
  LitData, Mosaic  the libraries a user would pick instead (LitData 0.2.76, Mosaic Streaming
     0.13.0; `pip install -e '.[bench]'`), each over the raw shards' pixels written once in its
     own format under --work-dir, with its batches checked; see tools/bench_peers.py. A peer
     that is not installed is skipped with one line (an error if --methods names it).

Shard encodings: raw and png (make_shards), and jpg: MNIST (JPEG-encoded) and the CIFAR10
JPEG files as they are, written by wds.ShardWriter (a PAX header per member) and indexed in
place with pipeline.writers.index, i.e. somebody else's JPEG WebDataset.

Every run delivers the same number of samples (--samples, rounded down to whole batches)
and then ends: each loader is made finite at exactly that count, so DataLoader workers run
out and exit, and no prefetched batch is computed for nothing. CPU time is that of the
whole process tree: getrusage(RUSAGE_SELF) + getrusage(RUSAGE_CHILDREN) for this process
and the children it has reaped, plus /proc/<pid>/stat (own + reaped children's time) of
every descendant still there, such as a forkserver that starts and reaps the workers
(see `tree_cpu`). "samples/cpu-s" is samples per second of that CPU time, i.e. samples/s
per busy core. Ratios to A pair runs of the same repeat, so drift on a shared machine hits
both sides of a ratio alike.

Peak memory is the largest sum over the process tree (main + DataLoader workers) of VmRSS,
sampled every 50 ms from outside, in a fresh process per measurement. Forked workers share
the parent's pages, which VmRSS counts once per process; the sum of Pss (shared pages split
between their users) is reported beside it. The 10x corpus for B and C is the 1x shard set
listed ten times under new shard names (hard links to the same files, manifest totals x10);
for A it is ten separately loaded copies of each torchvision dataset in a ConcatDataset.

--synthetic makes tiny inputs in the real formats (MNIST IDX files, a JPEG ImageFolder tree,
shards built from them) in a temporary folder, so the test suite can run everything in seconds.
"""
import argparse
import contextlib
import cProfile
import gc
import glob
import itertools
import json
import os
import pstats
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from pipeline.cli import Parser  # noqa: E402
from pipeline.writers import shards  # noqa: E402  (numpy, not torch)
import bench_peers  # noqa: E402  (imports no peer library, nor torch: they load where a peer runs)


def parse_args(argv):
    """The command line, checked before torch loads (the `__main__` block parses it first), so
    --help and a bad flag answer at once."""
    p = Parser(prog="bench_loader", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mnist-root", help="torchvision root holding MNIST/raw (e.g. data, as make_shards --root)")
    p.add_argument("--cifar-folder",
                   help="ImageFolder tree of the CIFAR10 training JPEGs: DIR/<class>/*.jpg, e.g. CIFAR10_JPEGS/train")
    p.add_argument("--cifar-root", help="torchvision root holding cifar-10-batches-py: A then reads CIFAR10 exactly as "
                                        "the tutorial does (default: the --cifar-folder JPEGs, decoded once)")
    p.add_argument("--shards", action="append", default=[], metavar="DIR",
                   help="folder with mnist-train.json and cifar10-train.json shards (repeatable, one per encoding); "
                        "encodings with no folder are built from the inputs under --work-dir")
    p.add_argument("--encoding", nargs="+", choices=(*shards.ENCODINGS, "jpg"), default=["raw", "png", "jpg"],
                   help="shard encodings for B and C: raw and png as make_shards writes them, jpg a JPEG WebDataset "
                        "written by wds.ShardWriter and indexed (default: raw png jpg; the first is used for memory "
                        "and --profile)")
    p.add_argument("--methods", nargs="+", choices=("A", "B", "C", "C8", *bench_peers.PEERS),
                   help="loaders to time (default: all, the peers where installed; A is always run, as the "
                        "baseline of the ratios; LitData and Mosaic need raw among --encoding)")
    p.add_argument("--synthetic", action="store_true",
                   help="tiny generated inputs in a temporary folder; no data needed")
    p.add_argument("--synthetic-size", type=int, default=1200, metavar="N",
                   help="with --synthetic: training samples of each data set (default: 1200)")
    p.add_argument("--samples", type=int,
                   help="samples per run, rounded down to whole batches (default: 60000, about half an epoch of "
                        "MNIST + CIFAR10, so per-epoch worker start-up counts as in training; with --synthetic, "
                        "what its data sets hold, at most 60000)")
    p.add_argument("--batch-size", type=int, default=256,
                   help="samples per batch; A loads half from each loader (default: 256)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each configuration (default: 3)")
    p.add_argument("--workers", type=int, nargs="+", default=[0, 2], help="DataLoader worker counts (default: 0 2)")
    p.add_argument("--world", type=int, default=1, help="simulated world size (default: 1)")
    p.add_argument("--rank", type=int, default=0, help="simulated rank (default: 0)")
    p.add_argument("--shuffle-buffer", type=int, default=1000, help="sample shuffle buffer of B and C (default: 1000)")
    p.add_argument("--skip-memory", action="store_true", help="skip the peak-memory measurements")
    p.add_argument("--profile", action="store_true", help="also cProfile C, and C8 if measured (workers=0)")
    p.add_argument("--tar-format", action="store_true",
                   help="only compare PAX (wds.TarWriter) and USTAR (pipeline.writers.shards) tars of 10,000 MNIST samples")
    p.add_argument("--stages", action="store_true",
                   help="only time the stages written here against webdataset's (shuffle and RandomMix, per "
                        "sample) and normalize's switch to one torch thread")
    p.add_argument("--torch-threads", type=int, metavar="N",
                   help="torch.set_num_threads(N) in the benchmarking process (default: torch's own choice; "
                        "A's and B's per-sample torch calls use them; C normalises in one "
                        "thread either way)")
    p.add_argument("--work-dir", default="bench-out",
                   help="built shards and the 10x corpus go here (default: bench-out)")
    p.add_argument("--json", help="where to write the JSON record: every run's figures, the commit, the host (CPU "
                                   "identity, threads), each run's stolen CPU share (default: bench-out/bench.json; "
                                   "with --stages bench-out/stages.json, with --tar-format bench-out/tar-format.json)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return args
    if args.json is None:
        args.json = os.path.join("bench-out", "stages.json" if args.stages else
                                 "tar-format.json" if args.tar_format else "bench.json")
    if args.batch_size < 2 or args.batch_size % 2:
        p.error("--batch-size must be even and at least 2 (A loads half a batch from each data set)")
    if args.samples is None:  # the tutorial's loaders (A) read each data set once a run
        fits = args.synthetic_size // max(args.world, 1) * 2 // args.batch_size * args.batch_size - args.batch_size
        args.samples = min(60000, fits) if args.synthetic else 60000
    if args.samples < args.batch_size:
        p.error(f"--samples must be at least one batch ({args.batch_size})")
    if args.repeats < 1 or any(w < 0 for w in args.workers):
        p.error("--repeats must be >= 1 and --workers >= 0")
    if not 0 <= args.rank < args.world:
        p.error(f"--rank {args.rank} outside --world {args.world}")
    if not args.synthetic and not args.stages and not (args.mnist_root and (args.cifar_folder or args.tar_format)):
        p.error("give --mnist-root and --cifar-folder, or --synthetic")
    args.skipped = choose_peers(p, args)
    if "A" not in args.methods:
        args.methods = ["A", *args.methods]
    if args.torch_threads is not None and args.torch_threads < 1:
        p.error("--torch-threads must be at least 1")
    return args


def choose_peers(p, args):
    """Settle which peers run: by default those installed, each other one skipped with a line
    (returned); one that --methods names and can't run is an error."""
    explicit = args.methods is not None
    if not explicit:
        args.methods = ["A", "B", "C", "C8", *bench_peers.PEERS]
    skipped = []
    for peer in [m for m in args.methods if m in bench_peers.PEERS]:
        why = bench_peers.missing(peer)
        if why is None and "raw" not in args.encoding:
            why = f"{peer}: reads the raw shards' pixels; add raw to --encoding"
        if why is None and args.world != 1:
            why = f"{peer}: runs as a single rank only (--world 1)"
        if why is None:
            continue
        if explicit:
            p.error(why)
        args.methods.remove(peer)
        skipped.append(why + "; skipped")
    return skipped


if __name__ == "__main__":
    parse_args(sys.argv[1:])

import numpy as np  # noqa: E402
import torch  # noqa: E402

from pipeline.data import manifest, read, stream  # noqa: E402
from pipeline.writers import sources  # noqa: E402
from pipeline.errors import ShardError  # noqa: E402
from pipeline.files import write_json_atomic  # noqa: E402
from pipeline.data.topology import Topology  # noqa: E402

NAMES = ("mnist", "cifar10")
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
    batch_size: int = 256
    batches: int = 78                 # per run and rank
    world: int = 1
    rank: int = 0
    seed: int = 0
    shuffle_buffer: int = 1000

    @property
    def samples(self):
        return self.batches * self.batch_size


def log(msg):
    print(msg, flush=True)


# ---------------------------------------------------------------- inputs


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


# ---------------------------------------------------------------- the three loaders
# Each `batches_*` function is a generator of per-batch sample counts for one run that
# ends exactly after setup.batches batches, with its DataLoader workers shut down.


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


def project_sources(folder):
    return [stream.resolve(name, folder, "train") for name in NAMES]


def batches_c(srcs, setup, workers, epoch, normalize=True):
    """C: this project's stream, equal weights, normalised float batches like A and B.
    With normalize=False (C8), the uint8 batches the trainer takes and normalises on its device."""
    ms = stream.MixedStream(srcs, {s.name: 1.0 for s in srcs}, setup.batch_size, Topology(setup.rank, setup.world),
                            seed=setup.seed, epoch_samples=setup.samples * setup.world,
                            shuffle_buffer=setup.shuffle_buffer, normalize=normalize)
    ms.set_epoch(epoch)
    for batch in stream.make_loader(ms, num_workers=workers):
        yield len(batch["image"])


# ---------------------------------------------------------------- measuring


def cpu_seconds():
    """(this process, all threads; its children that have been waited for) user + system CPU."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime


CLK_TCK = os.sysconf("SC_CLK_TCK")


def proc_stat(pid):
    """(state, utime + stime + cutime + cstime in seconds) from /proc/<pid>/stat; None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return None
    return fields[0], sum(int(x) for x in fields[11:15]) / CLK_TCK


def tree_cpu():
    """(this process, the rest of its tree): CPU seconds used so far by the whole process tree.

    A process that exits and is waited for adds its own and its reaped children's time to
    its parent's "children" counters. So this process's getrusage(SELF) + getrusage(CHILDREN),
    plus, for every descendant still present (zombies included), its own time and its reaped
    children's, counts every process exactly once, whoever starts the DataLoader workers:
    forked from here (we reap them) or from a forkserver (it reaps them and lives on).
    """
    (me, kids), rest = cpu_seconds(), 0.0
    for pid in tree_pids(os.getpid())[1:]:
        st = proc_stat(pid)
        rest += st[1] if st else 0.0
    return me, kids + rest


def settle(timeout=10.0):
    """Wait while any descendant is a zombie (exited, not yet reaped); returns the descendants.

    A zombie's time has not yet moved to its parent's counters; reading the tree while it
    is reaped could count it twice or not at all. DataLoader has joined its workers when a
    run ends (the forkserver reaps before it reports the exit), so this returns at once.
    """
    deadline = time.time() + timeout
    while True:
        pids = tree_pids(os.getpid())[1:]
        if all((proc_stat(p) or ("X",))[0] != "Z" for p in pids) or time.time() > deadline:
            return pids
        time.sleep(0.02)


def child_pids(pid):
    """Direct children of pid, zombies included.

    /proc/<pid>/task/*/children exists only on kernels built with CONFIG_PROC_CHILDREN; where
    it is missing, the tree would look empty and DataLoader workers' CPU time would go
    uncounted (a with-workers loader would look several times cheaper than it is), so the
    parent pid of every /proc/<n>/stat is read instead.
    """
    files = glob.glob(f"/proc/{pid}/task/*/children")
    if not files:
        return [n for n, ppid in all_parents() if ppid == pid]
    kids = []
    for path in files:
        try:
            with open(path) as f:
                kids += [int(x) for x in f.read().split()]
        except OSError:
            pass
    return kids


def all_parents():
    """(pid, parent pid) of every process in /proc; field 4 of stat, after the parenthesised name."""
    out = []
    for path in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(path) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        out.append((int(path.split("/")[2]), int(fields[1])))
    return out


def tree_pids(pid):
    """pid and all its descendants, parents before children."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo += child_pids(p)
    return out


def host_ticks(text=None, cpus=None):
    """{cpu: (stolen, busy)} clock ticks so far of the CPUs this process may run on (`cpus`, by
    default its affinity), from /proc/stat's cpuN lines; None where they cannot be read. On a
    virtual machine, time the hypervisor gave those CPUs to others is steal; where it is not
    accounted as such it lands in the processes' own CPU time, and every samples/cpu-s figure
    drops with it. Busy is user, nice, system, irq and softirq (guest time is already inside
    user and nice); idle and iowait are left out, so an idle CPU does not dilute it. A line
    without the steal column (kernels before 2.6.11) gives no reading: 0 would be made up."""
    try:
        if text is None:
            with open("/proc/stat") as f:
                text = f.read(1 << 20)
        cpus = set(os.sched_getaffinity(0)) if cpus is None else set(cpus)
        found = {}
        for line in text.splitlines():
            name, *fields = line.split() or [""]
            number = name[3:]
            if not (name.startswith("cpu") and number.isascii() and number.isdigit() and int(number) in cpus):
                continue
            t = [int(x) for x in fields[:8]]
            if len(t) < 8 or min(t) < 0 or int(number) in found:
                return None
            found[int(number)] = (t[7], t[0] + t[1] + t[2] + t[5] + t[6])
    except (OSError, ValueError):
        return None
    return found or None


def steal_ticks(before, after):
    """(stolen, busy) ticks between two `host_ticks`, over the CPUs both saw; None when it cannot
    be told: no reading, no CPU in common, or a CPU's counter that went back."""
    if before is None or after is None:
        return None
    common = before.keys() & after.keys()
    deltas = [(after[c][0] - before[c][0], after[c][1] - before[c][1]) for c in common]
    if not deltas or any(d < 0 for pair in deltas for d in pair):
        return None
    return sum(d[0] for d in deltas), sum(d[1] for d in deltas)


def steal_fields(before, after):
    """A run's `steal_share` (stolen / (stolen + busy); None when no tick passed or it cannot be
    told) and the ticks behind it, for pooling over runs."""
    ticks = steal_ticks(before, after)
    if ticks is None or sum(ticks) == 0:
        return {"steal_share": None, "steal_ticks": ticks and ticks[0], "busy_ticks": ticks and ticks[1]}
    return {"steal_share": ticks[0] / sum(ticks), "steal_ticks": ticks[0], "busy_ticks": ticks[1]}


def measure(batches, expected):
    """Run one generator of batch sizes to its end; wall time, CPU time of the tree, samples/s,
    and the share of this process's CPUs' busy time meanwhile that was stolen (`host_ticks`)."""
    gc.collect()
    settle()
    ticks0 = host_ticks()  # outside the timed window: reading /proc/stat is not the run's work
    (m0, r0), t0 = tree_cpu(), time.perf_counter()
    n = sum(batches)
    wall = time.perf_counter() - t0
    helpers = settle()  # what outlives the run, e.g. a forkserver or multiprocessing's resource tracker
    m1, r1 = tree_cpu()
    ticks1 = host_ticks()
    if n != expected:
        raise RuntimeError(f"run delivered {n} samples, expected {expected}")
    cpu = (m1 - m0) + (r1 - r0)
    return {"samples": n, "wall_s": round(wall, 4), "cpu_s": round(cpu, 4), "cpu_main_s": round(m1 - m0, 4),
            "cpu_workers_s": round(r1 - r0, 4), "samples_per_s": n / wall, "samples_per_cpu_s": n / cpu,
            "busy_cores": cpu / wall, "processes_left": len(helpers), **steal_fields(ticks0, ticks1)}


def spread(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


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

    def plan(st, w, rep):
        out = [("A", None, lambda: batches_a(a_data, st, w, rep))]
        for enc in encodings:
            out.append(("B", enc, lambda enc=enc: batches_b(srcs[enc], st, w, rep)))
            out.append(("C", enc, lambda enc=enc: batches_c(srcs[enc], st, w, rep)))
            out.append(("C8", enc, lambda enc=enc: batches_c(srcs[enc], st, w, rep, normalize=False)))
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


# ---------------------------------------------------------------- memory


def peak_memory(setup, method, encoding, scale, workers):
    """Run one loader in a fresh process; the largest sum of VmRSS (and of Pss) over its tree."""
    spec = {"setup": asdict(setup), "method": method, "encoding": encoding, "scale": scale, "workers": workers}
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak_rss = peak_pss = 0
    while proc.poll() is None:
        rss = pss = 0
        for pid in tree_pids(proc.pid):
            rss += proc_kib(f"/proc/{pid}/status", "VmRSS:")
            pss += proc_kib(f"/proc/{pid}/smaps_rollup", "Pss:")
        peak_rss, peak_pss = max(peak_rss, rss), max(peak_pss, pss)
        time.sleep(0.05)
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"memory run {method} {encoding} x{scale} failed:\n{err[-3000:]}")
    result = json.loads(out.strip().splitlines()[-1])
    return {"peak_rss_mib": peak_rss / 1024, "peak_pss_mib": peak_pss / 1024, **result}


def proc_kib(path, key):
    """A 'Key:   123 kB' value from a /proc file, 0 if the process is gone."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def child_main(spec):
    """Inside the fresh process: build the method's data at the given scale, stream, report."""
    setup = Setup(**spec["setup"])
    method, scale, workers = spec["method"], spec["scale"], spec["workers"]
    t0 = time.perf_counter()
    if method == "baseline":  # imports only: what every process tree starts from
        import torchvision  # noqa: F401
        import webdataset  # noqa: F401
        n = 0
    elif method == "A":
        n = sum(batches_a(tutorial_datasets(setup, copies=scale), setup, workers, 0))
    else:
        folder = setup.shards[spec["encoding"]] if scale == 1 else setup.corpus10x[spec["encoding"]]
        srcs = project_sources(folder)
        make = batches_b if method == "B" else batches_c
        n = sum(make(srcs, setup, workers, 0))
    print(json.dumps({"samples": n, "seconds": round(time.perf_counter() - t0, 2)}))
    return 0


def memory(setup, encoding, workers):
    entries = []
    base = peak_memory(setup, "baseline", None, 1, 0)
    log(f"  baseline (imports only): {base['peak_rss_mib']:.0f} MiB RSS")
    for method in ("A", "B", "C"):
        enc = None if method == "A" else encoding
        one, ten = (peak_memory(setup, method, enc, s, workers) for s in (1, 10))
        entry = {"method": method, "encoding": enc, "workers": workers, "scale_1x": one, "scale_10x": ten,
                 "ratio_10x_1x": ten["peak_rss_mib"] / one["peak_rss_mib"],
                 "ratio_10x_1x_pss": ten["peak_pss_mib"] / one["peak_pss_mib"] if one["peak_pss_mib"] else None}
        log(f"  {method}: 1x {one['peak_rss_mib']:.0f} MiB, 10x {ten['peak_rss_mib']:.0f} MiB RSS "
            f"(x{entry['ratio_10x_1x']:.2f})")
        entries.append(entry)
    return {"baseline": base, "entries": entries}


# ---------------------------------------------------------------- profile and ceiling


def profile_c(setup, encoding, top=15, normalize=True):
    """cProfile of one C run (C8 with normalize=False) in this process (workers=0): the
    functions holding the time."""
    srcs = project_sources(setup.shards[encoding])
    prof = cProfile.Profile()
    prof.enable()
    n = sum(batches_c(srcs, setup, 0, 0, normalize=normalize))
    prof.disable()
    stats = pstats.Stats(prof)
    rows = []
    for (path, line, func), (cc, nc, tt, ct, _) in stats.stats.items():
        if path == "~":
            where = func
        else:
            where = f"{os.path.relpath(path, ROOT) if path.startswith(ROOT) else short(path)}:{line}({func})"
        rows.append({"function": where, "calls": nc, "tottime_s": round(tt, 4), "cumtime_s": round(ct, 4)})
    rows.sort(key=lambda r: -r["tottime_s"])
    return {"method": "C" if normalize else "C8", "encoding": encoding, "samples": n,
            "total_s": round(stats.total_tt, 3), "top": rows[:top]}


def short(path):
    parts = path.split(os.sep)
    return os.sep.join(parts[-2:]) if "site-packages" in parts or "lib" in parts else path


def read_ceiling(setup, encoding, repeats=3):
    """Samples/s of nothing but reading every train shard's bytes (page cache); counts from manifests."""
    srcs = project_sources(setup.shards[encoding])
    paths = [u for s in srcs for u in s.urls]
    total = sum(s.total for s in srcs)
    nbytes = sum(os.path.getsize(p) for p in paths)
    warm_page_cache(paths)
    runs = []
    for _ in range(repeats):
        ticks0 = host_ticks()
        c0, t0 = sum(tree_cpu()), time.perf_counter()
        warm_page_cache(paths)
        wall, cpu = time.perf_counter() - t0, sum(tree_cpu()) - c0
        runs.append({"wall_s": wall, "cpu_s": cpu, "samples_per_s": total / wall,
                     **steal_fields(ticks0, host_ticks())})
    return {"encoding": encoding, "samples": total, "bytes": nbytes, "runs": runs,
            "samples_per_s": spread([r["samples_per_s"] for r in runs]),
            "mb_per_s": statistics.median(nbytes / 1e6 / r["wall_s"] for r in runs)}


def tar_format(mnist_root, n=10000, repeats=3):
    """The same MNIST samples (png) as webdataset's TarWriter writes them (a PAX header per
    member, float mtimes) and as pipeline.writers.shards writes them (plain USTAR): file size, and
    samples/s read by stock webdataset (tarfile) and by `read.iter_samples`, no decoding."""
    import webdataset as wds

    src = sources.torchvision_source("mnist", "train", mnist_root)
    n = min(n, len(src))
    tmp = tempfile.mkdtemp(prefix="bench-tar-")
    try:
        ustar = os.path.join(tmp, "ustar.tar")
        shards.write_shard(ustar, src, range(n), "png")
        pax = os.path.join(tmp, "pax.tar")
        with wds.TarWriter(pax) as w:
            for i in range(n):
                w.write({"__key__": f"mnist-train-{i:07d}", "png": shards.encode_image(src.image(i), "png"),
                         "cls": str(src.label(i)).encode()})

        def stock(path):
            return sum(1 for _ in wds.WebDataset(path, shardshuffle=False, empty_check=False))

        def lean(path):
            with open(path, "rb") as f:
                return sum(1 for _ in read.iter_samples(f))

        rows = []
        for fmt, path in (("pax (wds.TarWriter)", pax), ("ustar (pipeline.writers.shards)", ustar)):
            row = {"format": fmt, "samples": n, "bytes": os.path.getsize(path)}
            warm_page_cache([path])
            for reader, count in (("webdataset", stock), ("pipeline_read", lean)):
                rates = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    got = count(path)
                    rates.append(got / (time.perf_counter() - t0))
                    if got != n:
                        raise RuntimeError(f"{fmt}: {reader} read {got} samples, expected {n}")
                row[f"{reader}_samples_per_s"] = spread(rates)
            rows.append(row)
        return rows
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def stage_costs(n=200_000, repeats=3):
    """Per-sample cost of two of the stages written here rather than taken from webdataset
    (tar reading, the third, is measured by `tar_format`): the shuffle (wds.shuffle's buffer
    of 1000, against one seeded permutation per window of 1000) and the mix (wds.RandomMix,
    one draw per sample, against pipeline.data.deal.Choices taking a batch of 256 sources
    at once from an exact, seeded mix)."""
    import random

    import webdataset as wds

    from pipeline.data.deal import Choices

    samples = [{"__key__": str(i)} for i in range(n)]

    def wds_shuffle():
        return sum(1 for _ in wds.filters._shuffle(iter(samples), 1000, 1000, rng=random.Random(0)))

    def window_shuffle():
        rng, k = np.random.default_rng(0), 0
        for start in range(0, n, 1000):
            k += len([samples[start + i] for i in rng.permutation(min(1000, n - start)).tolist()])
        return k

    def wds_mix():
        mix = wds.RandomMix([itertools.repeat(samples[0]), itertools.repeat(samples[1])], [0.5, 0.5])
        return sum(1 for _ in itertools.islice(iter(mix), n))

    def our_mix():
        mix = Choices([n // 2, n - n // 2], (0,))
        return sum(len(mix.take(at, at + 256)) for at in range(0, n - 255, 256))

    rows = []
    for stage, theirs, ours in (("shuffle", wds_shuffle, window_shuffle), ("mix", wds_mix, our_mix)):
        row = {"stage": stage}
        for who, fn in (("webdataset", theirs), ("pipeline", ours)):
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                k = fn()
                times.append((time.perf_counter() - t0) / k * 1e6)
            row[f"{who}_us_per_sample"] = spread(times)
        rows.append(row)
    return rows


def thread_switch(repeats=5, normalizes=200, steps=5):
    """Why `Layout.normalize` runs torch in one thread: CPU us to normalise a 256-batch with
    numpy (its route before) and with torch switched to one thread and back (torch in all its
    threads looks cheap in this tight loop, but in the stream its idle threads spin between
    batches: C/raw's figure shows it); and ms of CPU for one CPU training step of the
    trainer's model at batch 64, with and without that switch before it (the switch was
    thought to clear oneDNN's caches)."""
    from pipeline.data.batch import one_torch_thread, by_numpy, by_torch
    from pipeline.train.model import Net

    rng = np.random.default_rng(0)
    image = torch.from_numpy(rng.integers(0, 256, (256, 3, 32, 32), dtype=np.uint8))
    source = torch.from_numpy(rng.integers(0, 2, 256))
    scale, shift = torch.rand(2, 3, 1, 1) / 64, torch.rand(2, 3, 1, 1)

    def numpy_route():
        by_numpy(torch.empty(image.shape), image, scale[source], shift[source])

    def one_thread():
        by_torch(torch.empty(image.shape), image, scale[source], shift[source])

    torch.manual_seed(0)
    net = Net(20)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    x, y = torch.randn(64, 3, 32, 32), torch.randint(0, 20, (64,))

    def step(switch):
        if switch:
            with one_torch_thread():
                pass
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()

    pairs = ((("normalize, numpy", numpy_route), ("normalize, torch one thread", one_thread), normalizes, 1e6, "us"),
             (("CPU step", lambda: step(False)), ("CPU step after a switch", lambda: step(True)), steps, 1e3, "ms"))
    rows = []
    for first, second, k, unit, label in pairs:
        for _, fn in (first, second):  # warm up, then alternate the two, so a drifting machine moves both alike
            for _ in range(3):
                fn()
        times = {first[0]: [], second[0]: []}
        for _ in range(repeats):
            for name, fn in (first, second):
                c0 = time.process_time()
                for _ in range(k):
                    fn()
                times[name].append((time.process_time() - c0) / k * unit)
        rows += [{"what": name, "cpu": spread(times[name]), "unit": label} for name in times]
    return rows


def decoder_choice(setup, n=2000, repeats=3):
    """Per-image cost of the JPEG decoders pipeline.data.decode chooses between, on the CIFAR10
    JPEGs: at their own size (libjpeg-turbo through torchvision.io against PIL), and made 4x
    larger for a 32x32 target (libjpeg-turbo, then a resize, against PIL's draft mode)."""
    import io

    import torchvision
    from PIL import Image

    from pipeline.data import decode

    paths = [p for p, _ in torchvision.datasets.ImageFolder(setup.cifar_folder).samples[:n]]
    small = []
    for p in paths:
        with open(p, "rb") as f:
            small.append(f.read())
    large = []
    for d in small[:n // 10]:
        buf = io.BytesIO()
        Image.open(io.BytesIO(d)).convert("RGB").resize((128, 128), Image.BILINEAR).save(buf, "JPEG", quality=90)
        large.append(buf.getvalue())

    def turbo(datas, shape):
        for d in datas:
            decode.fit(decode._torchvision_jpeg(d, 3, decode.jpeg_size(d)), shape)

    def pil_plain(datas, shape):
        for d in datas:
            decode.fit(np.asarray(Image.open(io.BytesIO(d)).convert("RGB")), shape)

    def pil_draft(datas, shape):
        for d in datas:
            decode.fit(decode._pil(d, "jpg", shape), shape)

    rows = []
    for size, datas in (("32x32 -> 32x32", small), ("128x128 -> 32x32", large)):
        for name, fn in (("torchvision.io.decode_jpeg", turbo), ("PIL", pil_plain), ("PIL draft", pil_draft)):
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn(datas, (3, 32, 32))
                times.append((time.perf_counter() - t0) / len(datas) * 1e6)
            chosen = (name == "torchvision.io.decode_jpeg") == (size == "32x32 -> 32x32") and name != "PIL"
            rows.append({"images": size, "decoder": name, "us_per_image": spread(times), "chosen": chosen})
    return rows


# ---------------------------------------------------------------- report


def fmt_spread(s, digits=0):
    return f"{s['median']:,.{digits}f} [{s['min']:,.{digits}f}-{s['max']:,.{digits}f}]"


def table(entries):
    """One row per loader and worker count: medians with [min-max] over the repeats."""
    def ratio(e, base, metric):
        r = e["ratios"].get(f"vs_{base}", {}).get(metric)
        return fmt_spread(r, 2) if r else "-"

    head = (f"{'workers':>7} {'loader':<7} {'samples/s':>24} {'x A':>17} {'samples/cpu-s':>24} {'x A':>17}"
            f" {'x B':>17} {'x C':>17}  cores  ceiling share")
    lines = [head, f"{'':>7} {'':<7} {'':>24} {'(samples/s)':>17} {'(per busy core)':>24} {'(per core)':>17}"
                   f" {'(per core)':>17} {'(per core)':>17}        /s  /cpu-s"]
    order = {"LitData": 0, "Mosaic": 1, "A": 2, "B": 3, "C": 4, "C8": 5}
    for e in sorted(entries, key=lambda e: (e["workers"], e["encoding"] or "", order[e["method"]])):
        name = e["method"] + (f"/{e['encoding']}" if e["encoding"] else "")
        cores = statistics.median(r["busy_cores"] for r in e["runs"])
        lines.append(f"{e['workers']:>7} {name:<7} {fmt_spread(e['samples_per_s']):>24} "
                     f"{ratio(e, 'A', 'samples_per_s'):>17} {fmt_spread(e['samples_per_cpu_s']):>24} "
                     f"{ratio(e, 'A', 'samples_per_cpu_s'):>17} {ratio(e, 'B', 'samples_per_cpu_s'):>17} "
                     f"{ratio(e, 'C', 'samples_per_cpu_s'):>17}  {cores:.2f}"
                     + (f"  {e['ceiling_share']:4.1%}  {e['ceiling_share_cpu']:5.1%}" if "ceiling_share" in e else ""))
    lines.append("A: the tutorial's torchvision loaders; B: stock webdataset (wds.RandomMix); C, C8: this stream, "
                 "float and uint8 batches; LitData, Mosaic: those libraries over the raw pixels (x B, x C: to B/raw, "
                 "C/raw)")
    return "\n".join(lines)


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


def describe(setup, synthetic):
    """What the figures were measured on, for the output and the record."""

    mnist_n = len(tutorial_datasets(setup)[0])
    cifar_n = len(cifar10_arrays(setup)[1])
    where = f"cifar-10-batches-py under {setup.cifar_root}" if setup.cifar_root else \
        f"the {cifar_n} JPEG files of {setup.cifar_folder}, decoded once before timing"
    totals = ", ".join(f"{enc}: {d} {({s.name: s.total for s in project_sources(d)})}"
                       for enc, d in setup.shards.items())
    notes = [
        f"A: torchvision MNIST ({mnist_n} train samples, {setup.mnist_root}) and torchvision CIFAR10 over one uint8 "
        f"array of {cifar_n} images ({where}); Image.fromarray + ToTensor + Normalize per sample, as torchvision does.",
        f"B and C read the same shards: {totals}.",
        "A keeps MNIST at 1x28x28 and draws two half batches (tutorial style); B and C pad it to 3x32x32 "
        "and mix both sources in every batch.",
        "CPU = the whole process tree's user+system time around each run (getrusage SELF+CHILDREN plus /proc of "
        "live descendants); every run ends with its workers exited and reaped.",
    ]
    if setup.peer_dirs:
        notes.append(f"{', '.join(setup.peer_dirs)}: the raw shards' uint8 pixels, written once in each library's "
                     "format; batches made by C's own collate and normalisation (pipeline.data.batch.Layout) where "
                     "the library collates; every run's batches checked (shape, dtype, labels, share, no repeat).")
    if synthetic:
        notes.append("--synthetic: tiny generated inputs; figures only check that the benchmark runs.")
    return notes


def all_input_files(setup):
    raw = os.path.join(setup.mnist_root, "MNIST", "raw")
    import torchvision

    return ([os.path.join(raw, f) for f in os.listdir(raw)]
            + ([p for p, _ in torchvision.datasets.ImageFolder(setup.cifar_folder).samples] if setup.cifar_folder else [])
            + [u for d in setup.shards.values() for s in project_sources(d) for u in s.urls]
            + [os.path.join(d, f) for dirs in setup.peer_dirs.values() for d in dirs for f in os.listdir(d)])


def write_record(path, record):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_json_atomic(path, record)
    log(f"wrote {path}")


def run_tar_format(args, mnist_root):
    rows = tar_format(mnist_root)
    log(f"{'tar format':<24}{'samples':>8}{'MB':>7}{'webdataset samples/s':>26}{'pipeline.data.read samples/s':>30}")
    for r in rows:
        log(f"{r['format']:<24}{r['samples']:>8}{r['bytes'] / 1e6:>7.1f}"
            f"{fmt_spread(r['webdataset_samples_per_s']):>26}{fmt_spread(r['pipeline_read_samples_per_s']):>30}")
    write_record(args.json, {"command": [os.path.basename(sys.executable), *sys.argv], "git": git_state(),
                             "tar_format": rows})
    return 0


def run_stages(args):
    rows = stage_costs(repeats=args.repeats)
    log(f"medians [min-max] of {args.repeats} repeats")
    log(f"{'stage':<10}{'webdataset us/sample':>24}{'pipeline us/sample':>24}")
    for r in rows:
        log(f"{r['stage']:<10}{fmt_spread(r['webdataset_us_per_sample'], 3):>24}"
            f"{fmt_spread(r['pipeline_us_per_sample'], 3):>24}")
    switch = thread_switch(repeats=args.repeats)
    log(f"\nnormalize: CPU us a 256-batch; CPU step: CPU ms a step of the trainer's model, batch 64, width 64; "
        f"the two of each pair alternated, torch threads {torch.get_num_threads()}")
    for r in switch:
        log(f"{r['what']:<32}{fmt_spread(r['cpu'], 1) + ' ' + r['unit']:>24}")
    write_record(args.json, {"command": [os.path.basename(sys.executable), *sys.argv], "git": git_state(),
                             "stages": rows, "thread_switch": switch})
    return 0


def run(args, work):
    if args.synthetic:
        mnist_root, cifar_folder = make_synthetic_inputs(work, args.synthetic_size, args.synthetic_size)
    else:
        mnist_root, cifar_folder = args.mnist_root, args.cifar_folder
    if args.tar_format:
        return run_tar_format(args, mnist_root)
    if args.stages:
        return run_stages(args)
    shard_dirs = find_shards(args, mnist_root, cifar_folder, work, maxcount=50 if args.synthetic else 500)
    os.makedirs(work, exist_ok=True)
    setup = Setup(mnist_root, cifar_folder, shard_dirs, cifar_root=args.cifar_root,
                  cifar_cache=os.path.join(work, "cifar10-train-uint8.npz"), batch_size=args.batch_size,
                  batches=args.samples // args.batch_size, world=args.world, rank=args.rank,
                  shuffle_buffer=args.shuffle_buffer)
    for line in args.skipped:
        log(line)
    peers = [m for m in args.methods if m in bench_peers.PEERS]
    srcs = project_sources(setup.shards["raw"]) if peers else []
    for peer in peers:
        log(f"{peer} {bench_peers.version(peer)}: its format of the raw shards, written once, under {work}/peers")
        setup.peer_dirs[peer] = bench_peers.WRITERS[peer](srcs, setup.shards["raw"], work)
    notes = describe(setup, args.synthetic)
    for n in notes:
        log("note: " + n)
    warm_page_cache(all_input_files(setup))
    record = {"command": [os.path.basename(sys.executable), *sys.argv], "notes": notes, "git": git_state(),
              "config": {**asdict(setup), "samples": setup.samples, "repeats": args.repeats,
                         "workers": args.workers, "encodings": args.encoding, "synthetic": args.synthetic,
                         "torch_threads": torch.get_num_threads(),
                         "peers": {m: bench_peers.version(m) for m in peers}, "peers_skipped": args.skipped},
              "host": host_facts()}
    log(f"throughput: {setup.samples} samples per run, batch {setup.batch_size}, rank {setup.rank} of "
        f"{setup.world}, {args.repeats} repeat(s)")
    t0 = time.perf_counter()
    record["throughput"] = throughput(setup, args.encoding, args.workers, args.repeats, args.methods)
    record["throughput_seconds"] = round(time.perf_counter() - t0, 1)
    record["read_ceiling"] = [read_ceiling(setup, enc) for enc in args.encoding]
    ceilings = {c["encoding"]: c["samples_per_s"]["median"] for c in record["read_ceiling"]}
    for e in record["throughput"]:
        enc = e["encoding"] or ("raw" if e["method"] in bench_peers.PEERS else None)  # peers hold raw's pixels
        if enc:
            e["ceiling_share"] = e["samples_per_s"]["median"] / ceilings[enc]
            e["ceiling_share_cpu"] = e["samples_per_cpu_s"]["median"] / ceilings[enc]
    if "jpg" in args.encoding and cifar_folder:
        record["decoders"] = decoder_choice(setup)
    primary = args.encoding[0]
    if not args.skip_memory:
        setup.corpus10x = {primary: make_corpus_10x(shard_dirs[primary], os.path.join(work, f"corpus10x-{primary}"))}
        w = max(args.workers)
        log(f"memory: peak of the process tree, fresh process each, workers={w}, encoding {primary}")
        record["memory"] = memory(setup, primary, w)
    if args.profile:
        record["profile"] = profile_c(setup, primary)
        if "C8" in args.methods:
            record["profile_c8"] = profile_c(setup, primary, normalize=False)
    record["loadavg_at_end"] = os.getloadavg()
    report(record)
    write_record(args.json, record)
    return 0


def main(argv=None):
    args = parse_args(argv)
    if args.child:
        return child_main(json.loads(args.child))
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    if not args.synthetic:
        return run(args, args.work_dir)
    tmp = tempfile.mkdtemp(prefix="bench-loader-")
    try:
        return run(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def host_facts():
    """What makes A's figure move between machines of one kind: A is many tiny torch calls per
    sample, so its speed follows torch's thread pools (each call may wake them) and the BLAS
    and OpenMP variables that size them, and the CPU a process may use (affinity, cgroup
    quota) rather than the host's core count; the with-workers figures also depend on seeing
    the workers at all (/proc/<pid>/task/*/children, or the ppid scan that replaces it). The
    CPU's identity (`cpu_identity`) and the steal each run records may tell a slower machine from
    slower code when two records are compared."""
    def cgroup_quota():
        try:
            with open("/sys/fs/cgroup/cpu.max") as f:
                quota, period = f.read().split()
            return None if quota == "max" else round(int(quota) / int(period), 2)
        except (OSError, ValueError):
            return None
    env = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "KMP_AFFINITY", "OMP_PROC_BIND")
    return {"cpus": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)), "cgroup_cpus": cgroup_quota(),
            "torch_threads": torch.get_num_threads(), "torch_interop_threads": torch.get_num_interop_threads(),
            "env": {k: os.environ.get(k) for k in env},
            "proc_children": bool(glob.glob(f"/proc/{os.getpid()}/task/*/children")),
            "loadavg_at_start": os.getloadavg(), "torch": torch.__version__, "python": sys.version.split()[0],
            **cpu_identity()}


CPU_FIELDS = ("model name", "vendor_id", "cpu family", "model", "stepping", "microcode", "cache size",
              "CPU implementer", "CPU part", "CPU variant", "CPU revision")  # x86's, then ARM's; not the moving clock


def cpu_identity(text=None, max_khz=None):
    """{"cpu": the first processor's CPU_FIELDS found in /proc/cpuinfo, as text, plus its
    highest clock in kHz from cpufreq where the kernel gives one}; an empty dict where nothing
    can be read. The model name alone ("AMD EPYC") does not tell two hosts apart; the family,
    model, stepping, microcode and cache, or ARM's implementer and part, may."""
    found = {}
    try:
        if text is None:
            with open("/proc/cpuinfo", errors="replace") as f:
                text = f.read(1 << 16)
    except OSError:
        text = ""
    for line in text.replace("\r\n", "\n").split("\n\n")[0].splitlines():
        name, _, value = line.partition(":")
        if name.strip() in CPU_FIELDS and value.strip():
            found.setdefault(name.strip(), value.strip())
    try:
        if max_khz is None:
            with open("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq") as f:
                max_khz = f.read()
        if int(max_khz) > 0:
            found["max kHz"] = str(int(max_khz))
    except (OSError, ValueError):
        pass
    return {"cpu": found}


def git_state():
    """The commit and any uncommitted change under pipeline/ or tools/: the figures belong to that
    code, and to the harness that measured them."""
    def git(*a):
        try:
            return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        except OSError:
            return ""
    return {"commit": git("rev-parse", "HEAD"),
            "dirty": git("status", "--porcelain", "--untracked-files=no", "--", "pipeline", "tools").splitlines()}


def report(record):
    """The table, then memory, profile and ceiling as far as they were measured."""
    h = record["host"]
    log(f"\nhost: {h['cpus']} cpus, affinity {h['affinity']}, cgroup quota {h['cgroup_cpus']}, torch threads "
        f"{h['torch_threads']} (+{h['torch_interop_threads']} interop), "
        f"{'/proc children' if h['proc_children'] else 'ppid scan'}"
        + "".join(f", {k}={v}" for k, v in h["env"].items() if v is not None))
    cpu = h.get("cpu", {})
    log("cpu: " + (", ".join(f"{k} {v}" for k, v in cpu.items()) or "?"))
    runs = [r for e in record["throughput"] for r in e["runs"]]
    told = [r for r in runs if r.get("steal_share") is not None]
    stolen, busy = sum(r["steal_ticks"] for r in told), sum(r["busy_ticks"] for r in told)
    log(f"steal: {len(told)} of {len(runs)} runs could tell" + (
        f"; {stolen} of their {stolen + busy} busy and stolen ticks on this process's CPUs were stolen "
        f"({stolen / (stolen + busy) * 100:.1f}%)" if told else ""))
    log("\n" + table(record["throughput"]))
    if "memory" in record:
        base = record["memory"]["baseline"]["peak_rss_mib"]
        log(f"\npeak memory of the process tree (MiB; baseline imports-only {base:.0f} RSS)")
        log(f"{'loader':<8}{'RSS 1x':>9}{'RSS 10x':>9}{'10x/1x':>8}{'PSS 1x':>9}{'PSS 10x':>9}{'10x/1x':>8}")
        for e in record["memory"]["entries"]:
            name = e["method"] + (f"/{e['encoding']}" if e["encoding"] else "")
            one, ten = e["scale_1x"], e["scale_10x"]
            pss_ratio = f"{e['ratio_10x_1x_pss']:.2f}" if e["ratio_10x_1x_pss"] else "-"
            log(f"{name:<8}{one['peak_rss_mib']:>9.0f}{ten['peak_rss_mib']:>9.0f}{e['ratio_10x_1x']:>8.2f}"
                f"{one['peak_pss_mib']:>9.0f}{ten['peak_pss_mib']:>9.0f}{pss_ratio:>8}")
    for c in record.get("read_ceiling", []):
        log(f"read ceiling ({c['encoding']} shards, page cache): {fmt_spread(c['samples_per_s'])} samples/s, "
            f"{c['mb_per_s']:,.0f} MB/s")
    if "decoders" in record:
        log("\nJPEG decoders, us an image (median [min-max]); * = what pipeline.data.decode uses")
        for r in record["decoders"]:
            log(f"  {r['images']:<18} {r['decoder']:<28} {fmt_spread(r['us_per_image'], 1):>22} "
                f"{'*' if r['chosen'] else ''}")
    for prof in (record[k] for k in ("profile", "profile_c8") if k in record):
        log(f"\nprofile of {prof.get('method', 'C')}/{prof['encoding']}, workers=0, {prof['samples']} samples, "
            f"{prof['total_s']} s (under cProfile)\n{'tottime':>8} {'cumtime':>8} {'calls':>9}  function")
        for r in prof["top"]:
            log(f"{r['tottime_s']:>8.3f} {r['cumtime_s']:>8.3f} {r['calls']:>9}  {r['function']}")


if __name__ == "__main__":
    sys.exit(main())
