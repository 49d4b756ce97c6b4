"""The libraries a user would pick instead of this stream, doing bench_loader's job exactly.
A module of tools/bench_loader.py, not a program of its own: time the peers with

    pip install -e '.[bench]'     # litdata==0.2.76, mosaicml-streaming==0.13.0
    python tools/bench_loader.py --methods A C LitData Mosaic --encoding raw

LitData  litdata.optimize writes each source once (chunks of 64 MB, its default), then one
         StreamingDataset(shuffle=True) per source, CombinedStreamingDataset(weights=[.5, .5],
         iterate_over_all=False) and StreamingDataLoader.
Mosaic   streaming.MDSWriter writes each source once (shards of 64 MB, its default size_limit,
         no compression), then StreamingDataset(streams=[Stream(local=..., proportion=0.5), ...],
         shuffle=True (py1e, its default), batch_size=..., epoch_size=...) and a torch DataLoader.

What they store is what C reads from the raw shards: each sample's uint8 pixels as they are
(MNIST 1x28x28, CIFAR10 3x32x32, copied from the raw shards, in their shuffled order), as a
numpy leaf (LitData) and an `ndarray:uint8` column (Mosaic), plus its label, its position in its
source and the source's number (the mix needs to know it; C's batches carry it too). No encoded
image, so no peer decodes anything; that is the fair match to C/raw, which doesn't either.

Every peer's batch is made by the same collate function, run where the library runs its
collate (in its DataLoader workers): this project's `batch.Layout` pads MNIST around the
centre, repeats its grey channel and normalises each sample with its source's mean and std
from the raw shards' manifest, exactly as C does, bit for bit. So the figures compare what the
libraries do (storage, reading, shuffling, mixing, the hand-off from the workers), not
transforms. Each run's batches pass `Check`, or the run fails (a failed check is an error, not
a figure). The peers run as a single rank (bench_loader refuses --world > 1 for them).

Nothing here is imported by the tests' own data path, the demo or pipeline/: the libraries are
imported inside the functions that use them, so this module imports without them; so are numpy,
torch and the data path, so that bench_loader's command line (which lists PEERS) answers before
they load.
"""
import hashlib
import importlib.metadata
import importlib.util
import json
import multiprocessing
import os
import shutil

# method -> (module imported, distribution installed, the version the figures belong to)
PEERS = {"LitData": ("litdata", "litdata", "0.2.76"),
         "Mosaic": ("streaming", "mosaicml-streaming", "0.13.0")}


class CheckError(RuntimeError):
    """A peer's batches were not the benchmark's job: its figure would mean nothing."""


def missing(method):
    """None if the peer can run here, else the one line that says why not."""
    module, dist, _ = PEERS[method]
    if importlib.util.find_spec(module) is None:
        return f"{method}: {dist} is not installed (pip install -e '.[bench]')"
    try:  # a module of that name from elsewhere (a folder named streaming on the path) is not the peer
        importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return f"{method}: a module {module} is importable but {dist} is not installed (pip install -e '.[bench]')"
    return None


def version(method):
    """The installed version, and a note when it is not the one the figures belong to."""
    _, dist, pinned = PEERS[method]
    got = importlib.metadata.version(dist)
    return got if got == pinned else f"{got} (docs/benchmarks.md figures: {pinned})"


# ---------------------------------------------------------------- the check


class Check:
    """What every batch of a run must be, and what the run as a whole must be.

    Per batch: images float32 (B, 3, H, W), labels inside their source's range (MNIST 0-9,
    CIFAR10 10-19). Per run: the first source's share near `share` (within 0.01 plus four
    standard deviations of a binomial draw of that many samples), and no sample twice.
    """

    def __init__(self, batch_size, hw, class_counts, share=0.5):
        import numpy as np

        self.shape = (batch_size, 3, *hw)
        self.bounds = np.cumsum([0, *class_counts])
        self.share, self.ids, self.n, self.first = share, [], 0, 0

    def add(self, batch):
        import numpy as np
        import torch

        image, label, source, index = (batch[k] for k in ("image", "label", "source", "index"))
        if tuple(image.shape) != self.shape or image.dtype != torch.float32:
            raise CheckError(f"batch of {image.dtype} {tuple(image.shape)}; float32 {self.shape} expected")
        label, source, index = (np.asarray(x, np.int64) for x in (label, source, index))
        if not (len(label) == len(source) == len(index) == self.shape[0]):
            raise CheckError(f"{len(label)} labels, {len(source)} sources, {len(index)} indices "
                             f"for {self.shape[0]} images")
        if source.min() < 0 or source.max() >= len(self.bounds) - 1:
            raise CheckError(f"source {source.max()} outside 0..{len(self.bounds) - 2}")
        low, high = self.bounds[source], self.bounds[source + 1]
        bad = (label < low) | (label >= high)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise CheckError(f"label {label[i]} of source {source[i]} outside {low[i]}..{high[i] - 1}")
        self.ids.append(source * (1 << 40) + index)
        self.n += len(label)
        self.first += int((source == 0).sum())

    def done(self):
        import numpy as np

        if not self.n:
            raise CheckError("no batch at all")
        got = self.first / self.n
        tolerance = 0.01 + 4 * (self.share * (1 - self.share) / self.n) ** 0.5
        if abs(got - self.share) > tolerance:
            raise CheckError(f"first source's share {got:.3f} of {self.n} samples; {self.share} +- {tolerance:.3f} expected")
        ids = np.concatenate(self.ids)
        repeated = len(ids) - len(np.unique(ids))
        if repeated:
            raise CheckError(f"{repeated} of {self.n} samples delivered twice in one run")


def checked(batches, n, check):
    """The first n batches of a loader, each checked, as bench_loader's batch counts; then the
    run's check. The loader's workers are shut down however the loop ends (a peer that has
    no exact epoch of its own computes at most its prefetched batches for nothing)."""
    it = iter(batches)
    try:
        for _ in range(n):
            batch = next(it)
            check.add(batch)
            yield len(batch["image"])
    finally:
        close = getattr(it, "close", None) or getattr(it, "_shutdown_workers", None)
        if close:
            close()
        del it
    check.done()


# ---------------------------------------------------------------- the one collate


class Collate:
    """Rows {image, label, index, source} -> a batch exactly as C's: `Layout.collate` places
    each source's uint8 images (padded, grey repeated) and offsets its labels, then
    `Layout.normalize`. A class, so that spawned or forked workers can take it."""

    def __init__(self, sources):
        from pipeline.data.fields.batch import Layout

        self.layout = Layout(sources)

    def __call__(self, rows):
        import numpy as np
        import torch

        from pipeline.data.fields.batch import NOTHING

        source = np.fromiter((int(r["source"]) for r in rows), np.int64, len(rows))
        parts = []
        for s in range(len(self.layout.sources)):
            mine = [r for r in rows if int(r["source"]) == s]
            if not mine:
                parts.append(NOTHING)
                continue
            parts.append(([int(r["index"]) for r in mine], np.stack([r["image"] for r in mine]),
                          np.fromiter((int(r["label"]) for r in mine), np.int64, len(mine))))
        batch = self.layout.collate(source, parts)
        return {"image": self.layout.normalize(batch["image"], batch["source"]),
                "label": torch.from_numpy(batch["label"]), "source": torch.from_numpy(batch["source"]),
                "index": torch.tensor(batch["key"], dtype=torch.int64)}


def make_check(srcs, setup):
    from pipeline.data.fields.batch import Layout

    layout = Layout(srcs)
    return Check(setup.batch_size, layout.hw, [len(s.classes) for s in srcs])


# ---------------------------------------------------------------- writing each format once


def raw_rows(spec):
    """The rows of one raw shard: (url, shape, source number, position of its first sample)."""
    import numpy as np

    from pipeline.data.shards import read
    from pipeline.files import open_regular

    url, shape, number, first = spec
    with open_regular(url) as f:
        for k, s in enumerate(read.iter_samples(f, want={"raw", "cls"})):
            yield {"image": np.frombuffer(s["raw"], np.uint8).reshape(shape).copy(), "label": int(s["cls"]),
                   "index": first + k, "source": number}


def shard_specs(src, number, folder):
    """One spec per raw shard, with where its samples start in the source (from the manifest)."""
    from pipeline.data.manifests import manifest

    m = manifest.load(os.path.join(folder, manifest.manifest_name(src.name, "train")))
    specs, first = [], 0
    for url, entry in zip(src.urls, m["shards"]):
        specs.append((url, tuple(src.shape), number, first))
        first += entry["samples"]
    return specs


def cached(work, kind, src, folder, write):
    """The folder of `kind` for this source, written once by `write(out)` and reused while the raw
    shards' manifest is the same (its digest is in the folder's name)."""
    from pipeline.data.manifests import manifest
    from pipeline.files import open_regular

    with open_regular(os.path.join(folder, manifest.manifest_name(src.name, "train"))) as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:12]
    out = os.path.join(work, "peers", f"{kind}-{src.name}-{digest}")
    if os.path.exists(os.path.join(out, "index.json")):
        return out
    part = out + ".part"
    shutil.rmtree(part, ignore_errors=True)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    write(part)
    shutil.rmtree(out, ignore_errors=True)
    os.rename(part, out)
    return out


def write_litdata(srcs, folder, work):
    """litdata.optimize over the raw shards, one input per shard, 64 MB chunks (its default)."""
    import litdata as ld

    def writer(number, src):
        def write(out):
            # optimize sets the process's multiprocessing start method to spawn (force=True) and leaves it so:
            # every DataLoader after it (B's, C's) would then spawn its workers. Put it back.
            method = multiprocessing.get_start_method(allow_none=True)
            try:
                ld.optimize(fn=raw_rows, inputs=shard_specs(src, number, folder), output_dir=out, chunk_bytes="64MB",
                            num_workers=1, verbose=False)
            finally:
                multiprocessing.set_start_method(method, force=True)
            with open(os.path.join(out, "index.json")) as f:
                if not json.load(f)["chunks"]:  # a worker that dies leaves an empty index, and optimize returns
                    raise RuntimeError(f"litdata.optimize wrote no chunk for {src.name} (see its worker's error above)")
        return write

    return [cached(work, "litdata", s, folder, writer(i, s)) for i, s in enumerate(srcs)]


def write_mosaic(srcs, folder, work):
    """streaming.MDSWriter: a uint8 ndarray column (dtype fixed, shape per sample, as the two
    sources share one schema), int64 label, index and source; no compression, 64 MB shards."""
    from streaming import MDSWriter

    columns = {"image": "ndarray:uint8", "label": "int64", "index": "int64", "source": "int64"}

    def writer(number, src):
        def write(out):
            with MDSWriter(out=out, columns=columns, compression=None, size_limit=1 << 26, progress_bar=False) as w:
                for spec in shard_specs(src, number, folder):
                    for row in raw_rows(spec):
                        w.write(row)
        return write

    return [cached(work, "mosaic", s, folder, writer(i, s)) for i, s in enumerate(srcs)]


# ---------------------------------------------------------------- the loaders


def litdata_batch_decode():
    """0 (one row deserialised at a time) unless LITDATA_BATCH_DECODE says otherwise ("auto" is
    LitData's default). Its default window of 256 rows is a defect with 2 DataLoader workers:
    two workers sharing one large chunk deserialise its windows many times over, and read far
    fewer samples per CPU-second than one (docs/benchmarks.md, "Where the peers' time
    goes", has the figures and the command). At 0 workers the two are alike."""
    value = os.environ.get("LITDATA_BATCH_DECODE", "0")
    return int(value) if value.lstrip("-").isdigit() else value


def batches_litdata(srcs, folders, setup, workers, epoch):
    """LitData's recommended path: StreamingDataset per source, CombinedStreamingDataset with
    the weights, StreamingDataLoader. It has no epoch of a given length, so the run takes the
    first setup.batches batches and shuts the workers down."""
    import litdata as ld

    seed = setup.seed + epoch
    datasets = [ld.StreamingDataset(f, shuffle=True, seed=seed, batch_decode=litdata_batch_decode()) for f in folders]
    # weights need iterate_over_all=False (LitData refuses both); the run ends long before a source runs out
    mix = ld.CombinedStreamingDataset(datasets, seed=seed, weights=[0.5, 0.5], iterate_over_all=False)
    # StreamingDataLoader rather than torch's: LitData's README asks for it with combined datasets
    loader = ld.StreamingDataLoader(mix, batch_size=setup.batch_size, num_workers=workers, collate_fn=Collate(srcs),
                                    drop_last=True)
    return checked(loader, setup.batches, make_check(srcs, setup))


def batches_mosaic(srcs, folders, setup, workers, epoch):
    """Mosaic's recommended path: one StreamingDataset over two Streams with proportions,
    shuffle=True, batch_size given to the dataset (it partitions by it); epoch_size makes the
    epoch exactly the run's samples, so its workers run out and exit on their own."""
    import torch
    from streaming import Stream, StreamingDataset

    streams = [Stream(local=f, proportion=0.5) for f in folders]  # local only: read in place, nothing copied
    # shuffle_algo stays py1e (the default its docs recommend for several streams); no persistent_workers, which
    # its FAQ suggests between epochs, as every method here makes its loader once per run
    ds = StreamingDataset(streams=streams, shuffle=True, shuffle_seed=setup.seed + epoch,
                          batch_size=setup.batch_size, epoch_size=setup.samples)
    loader = torch.utils.data.DataLoader(ds, batch_size=setup.batch_size, num_workers=workers,
                                         collate_fn=Collate(srcs), drop_last=True)
    return checked(loader, setup.batches, make_check(srcs, setup))


WRITERS = {"LitData": write_litdata, "Mosaic": write_mosaic}
LOADERS = {"LitData": batches_litdata, "Mosaic": batches_mosaic}


if __name__ == "__main__":  # run directly: say what it is and how to run the peers, rather than nothing
    import argparse

    argparse.ArgumentParser(prog="bench_peers", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    print("bench_peers is a module of tools/bench_loader.py: run python tools/bench_loader.py --methods A C LitData "
          "Mosaic --encoding raw (see --help)")
