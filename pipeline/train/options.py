"""The trainer's command line: every option checked before anything is read or written.

A bad value ends with one `pipeline-train: error: ...` line and exit code 2. Nothing here
imports torch, webdataset or numpy: `--help` and every command-line error answer at once
(tests/test_preempt.py checks that importing this module leaves torch out).
"""
import argparse
import math
import os
import sys

from pipeline.cli import Parser, add_io_options, byte_size, check_io
from pipeline.files import missing_folder, missing_line
from pipeline.ordering.weights import check_weights, parse_weights
from pipeline.errors import InputError
from pipeline.train import stop
from pipeline.train.modelnames import DEFAULT, check_name

MAX_TIMEOUT = 7 * 24 * 3600  # a week: more overflows torch's timeout deep in the process group set-up
DEFAULT_BATCH = 256  # --batch-size
DEFAULT_MODEL = DEFAULT  # --model: pipeline.train.model.Net

DESCRIPTION = """Train one model with DDP on the weighted mix of several shard streams.

    torchrun --nproc_per_node=2 -m pipeline.train \\
        --train mnist=shards/mnist-train.json --train cifar10=shards/cifar10-train.json \\
        --eval mnist=shards/mnist-test.json --eval cifar10=shards/cifar10-test.json --out runs/mnist-cifar10

The same options work under plain `python -m pipeline.train` (one process) and
multi-node torchrun. See docs/training.md for recipes and what lands in --out.
"""


def parse(argv=None):
    p = Parser(prog="pipeline.train", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--train", action="append", default=[], metavar="NAME=SPEC",  # required: checked after unknown flags
      help="a training source: SPEC is a manifest, a folder or base URL (ending in /) holding NAME-train.json, "
           "or a brace pattern of shards with NAME-train.json beside them; local, http(s)://, an object store "
           "(s3://, gs://, hf://: docs/stores.md) or pipe: (repeatable)")
    a("--eval", action="append", default=[], metavar="NAME=SPEC",
      help="test shards of a training source (NAME-test.json), evaluated after every epoch; SPEC as for --train "
           "(local, http(s)://, s3://, gs://, hf:// or pipe:) (repeatable)")
    a("--weights", metavar="NAME=W,...", help="mixture weights, e.g. mnist=0.5,cifar10=0.5 (default: equal)")
    a("--final-weights", metavar="NAME=W,...",
      help="weights for the last epoch; the epochs in between interpolate linearly (default: --weights throughout)")
    a("--change-weights", action="store_true",
      help="with --resume: allow --weights/--final-weights other than the checkpoint's (recorded in metrics.jsonl)")
    a("--change-data", action="store_true",
      help="with --resume: allow other shards behind a source's name than the checkpoint's, at an epoch boundary "
           "(recorded in metrics.jsonl)")
    a("--max-nonfinite", type=int, default=0, metavar="N",
      help="skip up to N steps whose loss is not finite (their weights are not updated) before the run stops "
           "(default: 0, stop at the first)")
    a("--epochs", type=int, default=30, metavar="N", help="epochs to train (default: 30)")
    a("--epoch-samples", type=int, metavar="N",
      help="samples per epoch over all ranks (default: all training samples in the manifests)")
    a("--batch-size", type=int, metavar="N", help="samples per batch per rank (default: 256)")
    a("--global-batch", type=int, metavar="N",
      help="samples per step over all ranks instead of --batch-size: each rank takes N / ranks (refused if that is "
           "not whole), so a resume on another number of ranks keeps the step's samples and the learning rate")
    a("--workers", type=int, default=8, metavar="N", help="loader workers per rank (default: 8)")
    a("--decode-on", choices=("host", "device"), default="host",
      help="where the training JPEGs of the batch's image size, upright, are decoded: in the loader's workers "
           "(host) or on the GPU after the hand-over (device: nvJPEG, one call a batch); others stay on the host. "
           "A CPU run decodes on the host (default: host)")
    a("--channels-last", action="store_true",
      help="image batches and the model in channels-last memory (torch.channels_last: the same (B, C, H, W) "
           "tensors, their bytes in height, width, channel order): decoded JPEGs reach the batch without a "
           "transpose to planes, and convolutions run in NHWC, the layout PyTorch recommends for CNNs on GPUs "
           "with mixed precision (which this trainer uses on a GPU); on a CPU it depends on the model "
           "(tools/bench_channels_last.py times yours). Off by default: a "
           "--model of your own that calls .view() on its input fails on such a batch (.reshape does not). A "
           "resumed run may add or drop it")
    a("--max-batch-memory", type=byte_size, metavar="BYTES",
      help="the most one rank's batches may take (suffixes K, M, G, T): the loader's queue of workers x 6 "
           "batches, the batch and its float copy, decoding, the shuffle windows and on a CPU the model's step, "
           "from --batch-size, the manifests' image shapes, --workers and --width; a job over it is refused "
           "before it reads (default: half of this machine's memory over the ranks torchrun starts on it)")
    a("--lr", type=float, default=0.1,
      help="peak SGD learning rate for a global batch of 256; the rate used is LR x global batch / 256, "
           "with global batch = ranks x --batch-size (or --global-batch), after a linear warm-up (default: 0.1)")
    a("--weight-decay", type=float, default=5e-4, help="L2 penalty on the weights, applied by SGD (default: 5e-4)")
    a("--model", default=DEFAULT_MODEL, metavar="NAME",
      help="the model: cnn (a small CNN, sized by --width), a torchvision classification model by name (resnet18, "
           "mobilenet_v3_small, ...; untrained), or MODULE:FUNCTION of your own, called as FUNCTION(num_classes, "
           "(C, H, W)) and returning a torch.nn.Module (see docs/training.md, 'The model'; default: cnn)")
    a("--width", type=int, default=64, metavar="N",
      help="width of the cnn model: 64 for GPUs, 16 for CPUs (default: 64)")
    a("--flip", metavar="NAMES",
      help="training sources to flip horizontally when augmenting, comma-separated (default: cifar10 if it is a "
           "source; '' for none: a flipped digit is another digit)")
    a("--seed", type=int, default=0, help="seed of data order, model and augmentation (default: 0)")
    a("--out", default="runs/latest", metavar="DIR", help="output folder (default: runs/latest)")
    a("--resume", action="store_true",
      help="continue from --out/checkpoint.pt (also on another number of ranks); an error if there is none")
    a("--resume-or-start", action="store_true",
      help="continue from --out/checkpoint.pt if there is one, else start afresh there (for jobs a scheduler "
           "requeues with the same command)")
    a("--stop-signals", default=stop.DEFAULT, metavar="SIGNALS",
      help=f"signals on which every rank finishes its step, the job writes a checkpoint, prints the command "
           f"that resumes it and exits with 128 + the signal's number (143 for TERM); a second signal ends it at "
           f"once; '' for none (default: {stop.DEFAULT})")
    a("--overwrite", action="store_true", help="discard a previous run in --out")
    a("--eval-only", action="store_true",
      help="evaluate --out/checkpoint.pt on the --eval sources, write --out/eval.json, exit")
    a("--record-keys", action="store_true",
      help="write keys-rank<R>.txt: every training sample's epoch and key, in the order consumed")
    a("--checkpoint-every", type=int, metavar="STEPS",
      help="also write the checkpoint every STEPS steps inside epochs (default: at the end of each epoch only)")
    a("--stop-after", type=int, metavar="K", help="stop after K epochs of this invocation (--resume later)")
    a("--stop-after-steps", type=int, metavar="K",
      help="stop cleanly after K steps of this invocation, with a checkpoint (--resume later)")
    a("--log-every", type=int, default=50, metavar="STEPS", help="steps between metrics lines (default: 50)")
    a("--resample", action="store_true",
      help="draw shards with replacement (endless-stream mode for corpora too big for full passes)")
    a("--cache-dir", metavar="DIR", help="keep remote shards in this folder for later epochs; ranks and jobs on one "
                                          "machine may share it")
    a("--cache-size", type=byte_size, metavar="BYTES",
      help="with --cache-dir: the most the folder holds (suffixes K, M, G, T); the least recently used shards are "
           "evicted (default: no bound)")
    a("--on-error", choices=("warn", "skip", "raise"),
      help="what a damaged sample or shard does: warn (skip it, count it, say so; the default), skip (skip and "
           "count quietly: the count still reaches the metrics and the summary), raise (stop the run)")
    a("--strict", action="store_true", help="stop at the first malformed sample: --on-error raise")
    a("--shuffle-buffer", type=int, default=10_000, metavar="N",
      help="samples a shuffle window holds: whole shards, in a seeded order, adding up to about N samples; a batch "
           "draws on every shard of its window, so shards written in class order still give mixed batches "
           "(default: 10000)")
    a("--shuffle-window", type=byte_size, default=256 << 20, metavar="BYTES",
      help="the most bytes a shuffle window holds, per source and loader worker, plus one shard (suffixes K, M, "
           "G; default: 256M)")
    a("--fetch-ahead", type=byte_size, default=64 << 20, metavar="BYTES",
      help="for shards read over HTTP or from an object store: the bytes of later shards each loader worker "
           "fetches per source while it reads the current window, 16 transfers at a time, so a store's latency "
           "is spent meanwhile; at least one shard, 0 for just that (suffixes K, M, G; default: 64M)")
    a("--slots", type=int, metavar="K", help=argparse.SUPPRESS)  # gone with the canonical slots; warned and ignored
    a("--sample-stage", action="append", default=[], metavar="MODULE:FUNCTION",
      help="a function of yours applied to every decoded training sample inside the workers, e.g. an "
           "augmentation (repeatable; see docs/training.md, 'Your own stage')")
    a("--timeout", type=int, default=600, metavar="S",
      help=f"seconds a rank waits for the others in a collective before the job fails, at most {MAX_TIMEOUT} "
           f"(default: 600)")
    add_io_options(p)
    # the loader's own limits (issue 53)
    a("--loader-timeout", type=float, default=600, metavar="S",
      help="seconds a loader worker may send nothing before the run ends with a line naming it and the resume "
           "command (a worker stuck in I/O otherwise hangs the run); 0: wait for ever (default: 600)")
    args, extra = p.parse_known_args(argv)
    if extra:
        spaced = _spaced(sys.argv[1:] if argv is None else list(argv), extra)
        if spaced:  # `--train mnist shards/`: argparse would only name shards/ as unrecognised
            flag, name, spec = spaced
            p.error(f"{flag} {name} {spec}: expected NAME=SPEC, e.g. {flag} {name}={spec} (no space around =)")
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    if not args.train:  # after the unknown flags: `--trian X` said only that --train was missing
        p.error("the following arguments are required: --train")
    check(p, args)
    return args


def _spaced(argv, extra):
    """(flag, NAME, SPEC) where argv writes a source with a space around its '=' (`--train
    NAME SPEC`, `NAME =SPEC`, `NAME = SPEC`, `NAME= SPEC`) and what argparse left over is
    that SPEC; else None, and the leftovers are just unrecognised."""
    for i, token in enumerate(argv):
        for flag in ("--train", "--eval"):
            if token == flag:
                value, rest = (argv[i + 1], argv[i + 2:]) if i + 1 < len(argv) else ("", [])
            elif token.startswith(flag + "="):
                value, rest = token[len(flag) + 1:], argv[i + 1:]
            else:
                continue
            name = value[:-1] if value.endswith("=") else value
            if not name or "=" in name or name.startswith("-") or not rest or rest[0] not in extra:
                continue
            if value.endswith("="):
                spec = rest[0]
            elif rest[0] == "=":
                spec = rest[1] if len(rest) > 1 and rest[1] in extra else ""
            else:
                spec = rest[0][1:] if rest[0].startswith("=") else rest[0]
            if spec and not spec.startswith("-"):
                return flag, name, spec
    return None


def check(p, args):
    """Reject out-of-range values with one line each (p.error exits)."""
    p.at_least(args, {"epochs": 1, "batch_size": 1, "global_batch": 1, "log_every": 1, "shuffle_buffer": 1,
                      "workers": 0, "width": 1,
                      "epoch_samples": 1, "stop_after": 1, "stop_after_steps": 1, "checkpoint_every": 1, "timeout": 1,
                      "retries": 0, "max_nonfinite": 0})
    p.within(args, {"timeout": (1, MAX_TIMEOUT), "workers": (0, 1024)})
    p.at_least(args, {"shuffle_window": 1})
    if not (math.isfinite(args.loader_timeout) and 0 <= args.loader_timeout <= MAX_TIMEOUT):
        p.error(f"--loader-timeout {args.loader_timeout}: seconds between 0 (wait for ever) and {MAX_TIMEOUT}")
    if args.slots is not None:
        print("pipeline-train: --slots is no longer used (every world change is dealt exactly without it); ignored",
              file=sys.stderr)
    check_io(p, args)
    if args.batch_size is not None and args.global_batch is not None:
        p.error(f"--batch-size {args.batch_size} (per rank) and --global-batch {args.global_batch} (over all ranks) "
                f"exclude each other: give one")
    if args.global_batch is None and args.batch_size is None:
        args.batch_size = DEFAULT_BATCH
    if args.strict and args.on_error not in (None, "raise"):
        p.error(f"--strict stops at the first damage, --on-error {args.on_error} does not: give one of them")
    if args.cache_size is not None and args.cache_dir is None:
        p.error("--cache-size applies with --cache-dir only")
    p.at_least(args, {"cache_size": 1, "max_batch_memory": 1})
    if args.width > 1024:
        p.error(f"--width {args.width}: at most 1024")
    if not 0 <= args.seed < 2 ** 63:
        p.error(f"--seed {args.seed}: must be between 0 and 2**63 - 1")
    for name, positive in (("lr", True), ("weight_decay", False)):
        value = getattr(args, name)
        if not math.isfinite(value) or value < 0 or (positive and value == 0):
            p.error(f"--{name.replace('_', '-')} must be a finite number {'>' if positive else '>='} 0, got {value}")
    args.train = specs(p, "--train", args.train)
    args.eval = specs(p, "--eval", args.eval)
    names = list(args.train)
    unknown = sorted(set(args.eval) - set(names))
    if unknown:
        p.error(f"--eval {', '.join(unknown)}: no --train source of that name")
    try:
        args.weights = check_weights(parse_weights(args.weights) if args.weights else
                                     dict.fromkeys(names, 1.0), names)
        args.final_weights = (check_weights(parse_weights(args.final_weights), names)
                              if args.final_weights else None)
    except ValueError as e:
        p.error(str(e))
    try:
        stop.parse_signals(args.stop_signals)
    except ValueError as e:
        p.error(f"--stop-signals {e}")
    if args.flip is None:
        args.flip = [n for n in ("cifar10",) if n in names]
    else:
        args.flip = [n for n in args.flip.split(",") if n]
        unknown = sorted(set(args.flip) - set(names))
        if unknown:
            p.error(f"--flip {', '.join(unknown)}: no --train source of that name; sources are {', '.join(names)}")
    module, sep, function = args.model.partition(":")
    if sep and not (module and function) or not args.model.strip() or any(c.isspace() for c in args.model):
        p.error(f"--model {args.model!r}: expected a torchvision model's name (e.g. resnet18) or MODULE:FUNCTION, "
                f"e.g. my_models:make_model")
    try:
        check_name(args.model)  # here, before torch: a misspelt name answers at once
    except InputError as e:
        p.error(str(e))
    for stage in args.sample_stage:
        module, sep, function = stage.partition(":")
        if not (sep and module and function):
            p.error(f"--sample-stage {stage!r}: expected MODULE:FUNCTION, e.g. my_augment:jitter")
    if args.decode_on == "device" and args.sample_stage:
        p.error("--decode-on device leaves JPEGs encoded until the GPU, and --sample-stage needs their pixels: "
                "drop one of them")
    if args.resume and args.resume_or_start:
        p.error("--resume and --resume-or-start exclude each other")
    if (args.resume or args.resume_or_start) and args.overwrite:
        p.error(f"{'--resume' if args.resume else '--resume-or-start'} and --overwrite exclude each other")
    if args.change_weights and not (args.resume or args.resume_or_start):
        p.error("--change-weights only applies with --resume")
    if args.change_data and not (args.resume or args.resume_or_start):
        p.error("--change-data only applies with --resume")
    if args.eval_only and not args.eval:
        p.error("--eval-only needs at least one --eval source")
    if not args.out.strip():
        p.error("--out: empty; name the run's folder")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        p.error(f"--out {args.out}: exists and is not a folder")


def specs(p, flag, items):
    out = {}
    for item in items:
        name, sep, spec = item.partition("=")
        if not sep or not name or not spec:
            p.error(f"{flag} {item!r}: expected NAME=SPEC, e.g. mnist=shards/mnist-train.json")
        if name in out:
            p.error(f"{flag} {name} given twice")
        out[name] = spec
    return out


def per_rank_batch(args, world):
    """--batch-size from --global-batch over `world` ranks (once the world is known); ValueError in
    one line where it does not divide."""
    if args.global_batch is None:
        return args.batch_size
    if args.global_batch % world:
        near = [n * world for n in (args.global_batch // world, args.global_batch // world + 1) if n]
        raise ValueError(f"--global-batch {args.global_batch} does not divide over {world} ranks; give a multiple "
                         f"of {world} ({' or '.join(map(str, near))}), or --batch-size per rank")
    args.batch_size = args.global_batch // world
    return args.batch_size


def weights_at(args, epoch):
    """The mixture for an epoch: --weights, moving linearly to --final-weights; for an epoch a
    checkpoint stopped inside, the mixture it started with (`args.kept_weights`, set on resume:
    new --epochs or --weights apply from the next epoch)."""
    kept = getattr(args, "kept_weights", None) or {}
    if epoch in kept:
        return dict(kept[epoch])
    if args.final_weights is None or args.epochs == 1:
        w = args.weights
    else:
        t = epoch / (args.epochs - 1)
        w = [a + (b - a) * t for a, b in zip(args.weights, args.final_weights)]
    return dict(zip(args.train, w))


def resume_error(args):
    """The one-line error for --resume on a folder without a checkpoint, else None."""
    ckpt = os.path.join(args.out, "checkpoint.pt")
    if args.resume and not os.path.exists(ckpt):
        return (f"--resume: no checkpoint at {ckpt} (to start afresh where there is none, as a requeued job does, "
                f"pass --resume-or-start instead)")
    return None


def check_out(args):
    """Before torch is imported: --resume on a folder without a checkpoint, and a local folder
    SPEC that is not there (manifest.resolve says the same, 2 s later), end in one line, exit code 2."""
    message = resume_error(args) or next((missing_line(name, spec) for name, spec in
                                          [*args.train.items(), *args.eval.items()] if missing_folder(spec)), None)
    if message:
        Parser(prog="pipeline.train").error(message)
