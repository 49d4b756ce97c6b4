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
  C  this project: pipeline.data.streams.stream.resolve + MixedStream(normalize=True) + make_loader.
  C8 the same with normalize=False: uint8 batches, as the trainer takes them (it normalises
     on its device). "consumer us/sample": the consuming process's own CPU a sample (all its
     threads, not its workers'): what caps one rank whatever its workers (--handover times the
     hand-over alone).
  T  this stream over an image-text set: the CIFAR10 JPEGs as they are, each with a caption
     (`.txt`), written by wds.ShardWriter and indexed with the fields image (32x32) and caption:
     a sample of more than an image and a class, beside C8 (uint8 images too); only when
     --methods names it.
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
import json
import os
import shutil
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_peers and the package bench/, its parts

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
    p.add_argument("--methods", nargs="+", choices=("A", "B", "C", "C8", "T", *bench_peers.PEERS),
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
    p.add_argument("--stores", action="store_true",
                   help="only read the same mnist shards from local files, HTTP, a local S3-compatible server and "
                        "that server behind 50 ms of latency (tools/bench/stores.py; --synthetic or --shards DIR)")
    p.add_argument("--jpeg", action="store_true",
                   help="only the JPEG path: the stream at each --workers count, NCHW and channels-last batches, beside "
                        "each bare decoder, on the "
                        "--cifar-folder JPEGs (32x32) and on them made 500x375 for a 224x224 target "
                        "(tools/bench/jpeg.py; also run by the full benchmark when jpg is among --encoding)")
    p.add_argument("--jpeg-samples", type=int, nargs=2, default=[20000, 1000], metavar=("SMALL", "LARGE"),
                   help="with --jpeg (or jpg among --encoding): images of the small and the large set "
                        "(default: 20000 1000)")
    p.add_argument("--handover", action="store_true",
                   help="only time the hand-over from workers that do no work: the consuming process's own CPU a "
                        "batch through torch's DataLoader and through pipeline.data.handover.loader; then the stream (C, C8) "
                        "at 0 and N workers through a loop that keeps nothing and one that keeps each batch's labels "
                        "(tools/bench/handover.py; N: --workers' largest count, --batch-size, --repeats)")
    p.add_argument("--torch-threads", type=int, metavar="N",
                   help="torch.set_num_threads(N) in the benchmarking process (default: torch's own choice; "
                        "A's and B's per-sample torch calls use them; C normalises in one "
                        "thread either way)")
    p.add_argument("--work-dir",
                   help="built shards and the 10x corpus go here (default: bench-out); with --synthetic, in a "
                        "temporary folder inside it (default: the system's), removed at the end")
    p.add_argument("--json", help="where to write the JSON record: every run's figures, the commit, the host (CPU "
                                   "identity, threads), each run's stolen CPU share (default: bench-out/bench.json; "
                                   "with --stages bench-out/stages.json, with --tar-format bench-out/tar-format.json)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return args
    args.temp_parent, args.work_dir = args.work_dir, args.work_dir or "bench-out"
    if args.json is None:
        args.json = os.path.join("bench-out", "stages.json" if args.stages else "stores.json" if args.stores else
                                 "jpeg.json" if args.jpeg else
                                 "handover.json" if args.handover else
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
    if args.stores and not (args.synthetic or args.shards):
        p.error("--stores reads --shards DIR (its mnist-train.json) or --synthetic shards")
    if args.jpeg and not (args.synthetic or args.cifar_folder):
        p.error("--jpeg reads the --cifar-folder JPEGs (or --synthetic ones)")
    if not args.synthetic and not args.stages and not args.stores and not args.handover and not args.jpeg and \
            not (args.mnist_root and (args.cifar_folder or args.tar_format)):
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

import torch  # noqa: E402

from bench import memory, suite  # noqa: E402
from bench.proc import proc_kib, tree_pids  # noqa: E402,F401  (tools/rehearsal.py measures its runs with these)


def main(argv=None):
    args = parse_args(argv)
    if args.child:
        return memory.child_main(json.loads(args.child))
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    if args.stores:
        from bench import stores
        return stores.main(args)
    if args.handover:
        from bench import handover
        from bench.host import git_state
        from bench.report import write_record
        result = handover.run(max(max(args.workers), 1), batch=args.batch_size, repeats=args.repeats)
        write_record(args.json, {"command": [os.path.basename(sys.executable), *sys.argv], "git": git_state(),
                                 "handover": result})
        return 0
    if not args.synthetic:
        return suite.run(args, args.work_dir)
    if args.temp_parent:  # a folder its caller removes, should this process be killed before its `finally` ran
        os.makedirs(args.temp_parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="bench-loader-", dir=args.temp_parent)
    try:
        return suite.run(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
