"""What one invocation runs, in order, and the record it makes: the full benchmark (`run`),
or only --tar-format or --stages."""
import os
import sys
import time
from dataclasses import asdict

import torch

import bench_peers

from bench import jpeg, micro
from bench.host import git_state, host_facts
from bench.inputs import all_input_files, build_caption_webdataset, find_shards, make_corpus_10x, \
    make_synthetic_inputs, project_sources, warm_page_cache
from bench.memory import memory
from bench.methods import Setup, cifar10_arrays, throughput, tutorial_datasets
from bench.report import fmt_spread, log, report, write_record


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
                     "format; batches made by C's own collate and normalisation (pipeline.data.fields.batch.Layout) where "
                     "the library collates; every run's batches checked (shape, dtype, labels, share, no repeat).")
    if synthetic:
        notes.append("--synthetic: tiny generated inputs; figures only check that the benchmark runs.")
    return notes


def run_tar_format(args, mnist_root):
    rows = micro.tar_format(mnist_root)
    log(f"{'tar format':<24}{'samples':>8}{'MB':>7}{'webdataset samples/s':>26}{'pipeline.data.shards.read samples/s':>30}")
    for r in rows:
        log(f"{r['format']:<24}{r['samples']:>8}{r['bytes'] / 1e6:>7.1f}"
            f"{fmt_spread(r['webdataset_samples_per_s']):>26}{fmt_spread(r['pipeline_read_samples_per_s']):>30}")
    write_record(args.json, {"command": [os.path.basename(sys.executable), *sys.argv], "git": git_state(),
                             "tar_format": rows})
    return 0


def run_stages(args):
    rows = micro.stage_costs(repeats=args.repeats)
    log(f"medians [min-max] of {args.repeats} repeats")
    log(f"{'stage':<10}{'webdataset us/sample':>24}{'pipeline us/sample':>24}")
    for r in rows:
        log(f"{r['stage']:<10}{fmt_spread(r['webdataset_us_per_sample'], 3):>24}"
            f"{fmt_spread(r['pipeline_us_per_sample'], 3):>24}")
    switch = micro.thread_switch(repeats=args.repeats)
    log(f"\nnormalize: CPU us a 256-batch; CPU step: CPU ms a step of the trainer's model, batch 64, width 64; "
        f"the two of each pair alternated, torch threads {torch.get_num_threads()}")
    for r in switch:
        log(f"{r['what']:<32}{fmt_spread(r['cpu'], 1) + ' ' + r['unit']:>24}")
    write_record(args.json, {"command": [os.path.basename(sys.executable), *sys.argv], "git": git_state(),
                             "stages": rows, "thread_switch": switch})
    return 0


def run_jpeg(args, cifar_folder, work):
    rows = jpeg.run(cifar_folder, work, args.workers, args.repeats, args.jpeg_samples)
    jpeg.report(rows)
    write_record(args.json, {"command": [os.path.basename(sys.executable), *sys.argv], "git": git_state(),
                             "host": host_facts(), "jpeg": rows})
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
    if args.jpeg:
        return run_jpeg(args, cifar_folder, work)
    shard_dirs = find_shards(args, mnist_root, cifar_folder, work, maxcount=50 if args.synthetic else 500)
    os.makedirs(work, exist_ok=True)
    setup = Setup(mnist_root, cifar_folder, shard_dirs, cifar_root=args.cifar_root,
                  cifar_cache=os.path.join(work, "cifar10-train-uint8.npz"), batch_size=args.batch_size,
                  batches=args.samples // args.batch_size, world=args.world, rank=args.rank,
                  shuffle_buffer=args.shuffle_buffer)
    if "T" in args.methods and cifar_folder:
        setup.captions = os.path.join(work, "shards-captions")
        if not os.path.exists(os.path.join(setup.captions, "captions-train.json")):
            log(f"building the image-text set from the CIFAR10 JPEGs in {setup.captions} ...")
            build_caption_webdataset(cifar_folder, setup.captions, maxcount=50 if args.synthetic else 500)
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
    record["read_ceiling"] = [micro.read_ceiling(setup, enc) for enc in args.encoding]
    ceilings = {c["encoding"]: c["samples_per_s"]["median"] for c in record["read_ceiling"]}
    for e in record["throughput"]:
        enc = e["encoding"] or ("raw" if e["method"] in bench_peers.PEERS else None)  # peers hold raw's pixels
        if enc in ceilings:  # (the image-text set has no ceiling of its own)
            e["ceiling_share"] = e["samples_per_s"]["median"] / ceilings[enc]
            e["ceiling_share_cpu"] = e["samples_per_cpu_s"]["median"] / ceilings[enc]
    if "jpg" in args.encoding and cifar_folder:
        record["jpeg"] = jpeg.run(cifar_folder, work, args.workers, args.repeats, args.jpeg_samples)
    primary = args.encoding[0]
    if not args.skip_memory:
        setup.corpus10x = {primary: make_corpus_10x(shard_dirs[primary], os.path.join(work, f"corpus10x-{primary}"))}
        w = max(args.workers)
        log(f"memory: peak of the process tree, fresh process each, workers={w}, encoding {primary}")
        record["memory"] = memory(setup, primary, w)
    if args.profile:
        record["profile"] = micro.profile_c(setup, primary)
        if "C8" in args.methods:
            record["profile_c8"] = micro.profile_c(setup, primary, normalize=False)
    record["loadavg_at_end"] = os.getloadavg()
    report(record)
    if "jpeg" in record:  # its own table (bench.jpeg), after the rest
        jpeg.report(record["jpeg"])
    write_record(args.json, record)
    return 0
