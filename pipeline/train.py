"""Train one model with DDP on the weighted mix of several shard streams.

    torchrun --nproc_per_node=2 -m pipeline.train \\
        --train mnist=shards/mnist-train.json --train cifar10=shards/cifar10-train.json \\
        --eval mnist=shards/mnist-test.json --eval cifar10=shards/cifar10-test.json --out runs/demo

The same options work under plain `python -m pipeline.train` (one process) and
multi-node torchrun. See README.md for recipes and what lands in --out.
"""
import argparse
import json
import math
import os
import resource
import shutil
import sys
import time
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from . import dist, stream
from .cli import Parser
from .model import Net, augment
from .shards import ShardError, write_json_atomic

CHECKPOINT_VERSION = 1


def parse_args(argv=None):
    p = Parser(prog="pipeline.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train", action="append", default=[], metavar="NAME=SPEC", required=True,
                   help="a training source: SPEC is a manifest, a folder or base URL (ending in /) holding "
                        "NAME-train.json, or a brace pattern of shards; local, http(s):// or pipe: (repeatable)")
    p.add_argument("--eval", action="append", default=[], metavar="NAME=SPEC",
                   help="test shards of a training source, evaluated after every epoch (repeatable)")
    p.add_argument("--weights", help="mixture weights, e.g. mnist=0.5,cifar10=0.5 (default: equal)")
    p.add_argument("--final-weights", help="weights for the last epoch; epochs in between interpolate linearly")
    p.add_argument("--epochs", type=int, default=30, help="epochs to train (default: 30)")
    p.add_argument("--epoch-samples", type=int,
                   help="samples per epoch over all ranks (default: all training samples in the manifests)")
    p.add_argument("--batch-size", type=int, default=256, help="samples per batch per rank (default: 256)")
    p.add_argument("--workers", type=int, default=8, help="DataLoader workers per rank (default: 8)")
    p.add_argument("--lr", type=float, default=0.1, help="peak SGD learning rate (default: 0.1)")
    p.add_argument("--weight-decay", type=float, default=5e-4, help="(default: 5e-4)")
    p.add_argument("--width", type=int, default=64, help="model width: 64 for GPUs, 16 for CPUs (default: 64)")
    p.add_argument("--flip", default="cifar10", help="sources to flip horizontally when augmenting "
                                                      "(comma-separated; default: cifar10; '' for none)")
    p.add_argument("--seed", type=int, default=0, help="seed of data order, model and augmentation (default: 0)")
    p.add_argument("--out", default="runs/latest", help="output folder (default: runs/latest)")
    p.add_argument("--resume", action="store_true", help="continue from --out/checkpoint.pt")
    p.add_argument("--overwrite", action="store_true", help="discard a previous run in --out")
    p.add_argument("--eval-only", action="store_true",
                   help="evaluate --out/checkpoint.pt on the --eval sources, write --out/eval.json, exit")
    p.add_argument("--record-keys", action="store_true",
                   help="write keys-rank<R>.txt: every training sample's key, in the order consumed")
    p.add_argument("--stop-after", type=int, metavar="K",
                   help="stop after K epochs of this invocation (e.g. to fit a time-limited job; --resume later)")
    p.add_argument("--log-every", type=int, default=50, help="steps between metrics lines (default: 50)")
    p.add_argument("--resample", action="store_true",
                   help="draw shards with replacement (endless-stream mode for corpora too big for full passes)")
    p.add_argument("--cache-dir", help="keep remote shards in this folder for later epochs")
    p.add_argument("--strict", action="store_true", help="stop at the first malformed sample instead of skipping it")
    p.add_argument("--shuffle-buffer", type=int, default=2000, help="samples in each shuffle buffer (default: 2000)")
    p.add_argument("--timeout", type=int, default=600,
                   help="seconds a rank waits for the others in a collective before the job fails (default: 600)")
    args = p.parse_args(argv)
    for name in ("epochs", "batch_size", "log_every", "shuffle_buffer"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.workers < 0 or (args.epoch_samples is not None and args.epoch_samples < 1):
        p.error("--workers must be >= 0 and --epoch-samples >= 1")
    args.train = parse_specs(p, "--train", args.train)
    args.eval = parse_specs(p, "--eval", args.eval)
    unknown = sorted(set(args.eval) - set(args.train))
    if unknown:
        p.error(f"--eval {', '.join(unknown)}: no --train source of that name")
    try:
        names = list(args.train)
        args.weights = stream.check_weights(stream.parse_weights(args.weights) if args.weights else
                                            dict.fromkeys(names, 1.0), names)
        args.final_weights = (stream.check_weights(stream.parse_weights(args.final_weights), names)
                              if args.final_weights else None)
    except ValueError as e:
        p.error(str(e))
    args.flip = [n for n in args.flip.split(",") if n]
    if args.resume and args.overwrite:
        p.error("--resume and --overwrite exclude each other")
    if args.eval_only and not args.eval:
        p.error("--eval-only needs at least one --eval source")
    return args


def parse_specs(p, flag, items):
    specs = {}
    for item in items:
        name, sep, spec = item.partition("=")
        if not sep or not name or not spec:
            p.error(f"{flag} {item!r}: expected NAME=SPEC, e.g. mnist=shards/mnist-train.json")
        if name in specs:
            p.error(f"{flag} {name} given twice")
        specs[name] = spec
    return specs


def weights_at(args, epoch):
    """The mixture for an epoch: --weights, moving linearly to --final-weights."""
    if args.final_weights is None or args.epochs == 1:
        w = args.weights
    else:
        t = epoch / (args.epochs - 1)
        w = [a + (b - a) * t for a, b in zip(args.weights, args.final_weights)]
    return dict(zip(args.train, w))


def prepare_out(args, topo):
    """Refuse to overwrite a previous run unless told; returns the checkpoint to resume, if any.

    After torchrun restarts a failed job (--max-restarts), the run in --out is this
    job's own: continue from its checkpoint, or start over if it never wrote one.
    """
    ckpt = os.path.join(args.out, "checkpoint.pt")
    previous = os.path.exists(os.path.join(args.out, "metrics.jsonl")) or os.path.exists(ckpt)
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0
    if args.resume or (restarted and os.path.exists(ckpt)):
        if not os.path.exists(ckpt):
            raise ValueError(f"--resume: no checkpoint at {ckpt}")
        return ckpt
    if previous and not (args.overwrite or restarted):
        raise ValueError(f"{args.out} holds a previous run; pass --resume to continue it or --overwrite to replace it")
    dist.barrier()  # every rank has looked before rank 0 clears the folder
    if topo.is_main:
        if previous:
            shutil.rmtree(args.out)
        os.makedirs(args.out, exist_ok=True)
    dist.barrier()
    return None


def save_checkpoint(path, state):
    """Write to a temporary name, load it back, then rename: a kill mid-save leaves the old one."""
    tmp = path + ".tmp"
    torch.save(state, tmp)
    torch.load(tmp, weights_only=True)
    os.replace(tmp, path)


def load_checkpoint(path, device):
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:  # a truncated or foreign file: say which
        first = (str(e).strip().splitlines() or [""])[0]
        raise ValueError(f"{path}: not a loadable checkpoint ({e.__class__.__name__}: {first})") from None
    if state.get("version") != CHECKPOINT_VERSION:
        raise ValueError(f"{path}: checkpoint version {state.get('version')}, expected {CHECKPOINT_VERSION}")
    return state


def lr_lambda(total_steps, warmup):
    """Linear warm-up, then cosine decay to zero."""
    def f(step):
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total_steps - warmup))))
    return f


class Metrics:
    """metrics.jsonl, written by rank 0 only; on resume, lines past the checkpoint are dropped."""

    def __init__(self, path, enabled, keep_before_epoch=None):
        self.path, self.enabled = path, enabled
        if enabled and keep_before_epoch is not None and os.path.exists(path):
            with open(path) as f:
                lines = [ln for ln in f if json.loads(ln)["epoch"] < keep_before_epoch]
            with open(path, "w") as f:
                f.writelines(lines)

    def log(self, **record):
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")


def evaluate(model, train_stream, sources, eval_loaders, device):
    """Exact per-source accuracy: every test sample counted once over all ranks.

    Ranks may hold different numbers of test batches, so the forward pass uses the
    plain module (DDP's forward can broadcast buffers, a collective) and only the
    final sums are all-reduced, once.
    """
    dist.sync_buffers(model)
    model.eval()
    sums = torch.zeros(len(sources), 4, dtype=torch.float64, device=device)  # count, correct, loss, skipped
    with torch.no_grad():
        for i, src in enumerate(sources):
            for batch in eval_loaders[i]:
                sums[i, 3] += batch["skipped"]
                if len(batch["label"]) == 0:
                    continue
                x, y, s = (batch[k].to(device, non_blocking=True) for k in ("image", "label", "source"))
                with autocast(device):
                    logits = model(train_stream.layout.normalize(x, s)).float()
                sums[i, 0] += len(y)
                sums[i, 1] += (logits.argmax(1) == y).sum()
                sums[i, 2] += F.cross_entropy(logits, y, reduction="sum")
    dist.all_reduce_sum(sums)
    model.train()
    out = {}
    for i, src in enumerate(sources):
        n, correct, loss, skipped = sums[i].tolist()
        out[src.name] = {"count": int(n), "correct": int(correct), "accuracy": correct / max(n, 1),
                         "loss": loss / max(n, 1), "skipped": int(skipped)}
    return out


def eval_loaders(run, sources):
    """One loader per test source, made once: their workers persist between evaluations
    (at most 2 each, idle while training runs)."""
    return [stream.make_loader(run.stream.eval_stream(src), min(run.args.workers, 2)) for src in sources]


def autocast(device):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()


def peak_rss_mb():
    """Peak RSS of this process and of its largest finished child (DataLoader workers)."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return round((own + kids) / 1024, 1)


class Run:
    """Everything one training run holds: stream, model, optimiser, schedule."""

    def __init__(self, args, topo, device, train_sources):
        self.args, self.topo, self.device = args, topo, device
        self.stream = stream.MixedStream(
            train_sources, weights_at(args, 0), args.batch_size, topo, seed=args.seed,
            epoch_samples=args.epoch_samples, shuffle_buffer=args.shuffle_buffer, resample=args.resample,
            strict=args.strict, cache_dir=args.cache_dir, normalize=False)
        self.loader = stream.make_loader(self.stream, args.workers, pin_memory=device.type == "cuda")
        self.layout = self.stream.layout
        self.names = self.layout.names
        self.flip_ids = [self.layout.index(n) for n in args.flip if n in self.names]
        torch.manual_seed(args.seed)
        self.model = Net(self.layout.num_classes, args.width).to(device)
        self.ddp = (DDP(self.model, device_ids=[device.index] if device.type == "cuda" else None)
                    if topo.world > 1 else self.model)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=args.lr, momentum=0.9, nesterov=True,
                                   weight_decay=args.weight_decay)
        self.steps_per_epoch = self.stream.batches_per_epoch
        total = self.steps_per_epoch * args.epochs
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda(total, min(500, max(1, total // 10))))

    def state(self, epoch, history):
        return {"version": CHECKPOINT_VERSION, "world": self.topo.world, "model": self.model.state_dict(),
                "optimizer": self.opt.state_dict(), "scheduler": self.sched.state_dict(),
                "stream": {"epoch": epoch, "seed": self.args.seed}, "rng": torch.get_rng_state(),
                "history": json.dumps(history), "config": json.dumps(vars(self.args))}

    def load(self, state):
        """Restore from a checkpoint; returns (next epoch, history)."""
        if state["world"] != self.topo.world or state["stream"]["seed"] != self.args.seed:
            raise ValueError(f"the checkpoint was written with world size {state['world']} and seed "
                             f"{state['stream']['seed']}; resume with the same to continue the same stream")
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"].cpu())
        return state["stream"]["epoch"], json.loads(state["history"])

    def step(self, batch, gen):
        """One optimiser step; returns per-sample losses (detached) and source ids on the device."""
        x, y, s = (batch[k].to(self.device, non_blocking=True) for k in ("image", "label", "source"))
        x = augment(self.layout.normalize(x, s), s, self.flip_ids, gen)
        with autocast(self.device):
            losses = F.cross_entropy(self.ddp(x).float(), y, reduction="none")
        self.opt.zero_grad(set_to_none=True)
        losses.mean().backward()
        self.opt.step()
        self.sched.step()
        return losses.detach(), s


class StepLog:
    """Per-source loss, sample counts and skipped samples between two metrics lines.

    Sums stay on the device (no sync per step) and are all-reduced once per line.
    """

    def __init__(self, names, device):
        self.names, self.device = names, device
        self.sums = torch.zeros(len(names) + 1, 2, dtype=torch.float64, device=device)  # last row: skipped
        self.t = time.perf_counter()

    def add(self, losses, source, skipped):
        n = len(self.names)
        self.sums[:n, 0].index_add_(0, source, losses.double())
        self.sums[:n, 1] += torch.bincount(source, minlength=n)
        self.sums[n, 0] += skipped

    def flush(self):
        """All-reduce and reset; returns the fields of one metrics line."""
        dist.all_reduce_sum(self.sums)
        n = len(self.names)
        loss_sum, count = self.sums[:n, 0].tolist(), self.sums[:n, 1].tolist()
        skipped, total = int(self.sums[n, 0]), sum(count)
        dt = time.perf_counter() - self.t
        self.sums.zero_()
        self.t = time.perf_counter()
        return {"loss": {k: a / max(c, 1) for k, a, c in zip(self.names, loss_sum, count)},
                "samples_per_s": round(total / dt, 1),
                "share": {k: c / max(total, 1) for k, c in zip(self.names, count)}, "skipped": skipped}


def train_epoch(run, epoch, step, metrics, record_keys):
    """One epoch over the mixed stream; returns (step, per-rank facts of this epoch)."""
    args, topo = run.args, run.topo
    weights = weights_at(args, epoch)
    run.stream.set_epoch(epoch, weights)
    gen = torch.Generator().manual_seed(args.seed * 100003 + epoch * 1009 + topo.rank)
    log = StepLog(run.names, run.device)
    per_source = torch.zeros(len(run.names), dtype=torch.int64, device=run.device)
    keys, skipped, batches, wait, busy = [], 0, 0, 0.0, 0.0
    bar = progress(topo, run.steps_per_epoch, f"epoch {epoch + 1}/{args.epochs}")
    t0 = time.perf_counter()
    for batch in run.loader:  # its workers persist across epochs and pick up set_epoch
        t1 = time.perf_counter()
        wait += t1 - t0
        losses, source = run.step(batch, gen)
        step, batches, skipped = step + 1, batches + 1, skipped + batch["skipped"]
        per_source += torch.bincount(source, minlength=len(run.names))
        log.add(losses, source, batch["skipped"])
        if record_keys:
            keys.extend(batch["key"])
        if step % args.log_every == 0 or batches == run.steps_per_epoch:
            line = log.flush()
            if bar is not None:
                bar.set_postfix(loss=f"{sum(line['loss'][k] * line['share'][k] for k in run.names):.3f}")
            metrics.log(kind="train", epoch=epoch, step=step, lr=run.sched.get_last_lr()[0], weights=weights, **line)
        if bar is not None:
            bar.update(1)
        t0 = time.perf_counter()
        busy += t0 - t1
    if bar is not None:
        bar.close()
    return step, {"batches": batches, "per_source": per_source.cpu(), "skipped": skipped, "keys": keys,
                  "wait": wait, "busy": busy}


def gather_epoch(topo, names, facts, history):
    """Add one epoch's batches and samples per rank (and skipped samples) to the history."""
    table = torch.zeros(topo.world, len(names) + 2, dtype=torch.float64)  # batches, skipped, per source
    table[topo.rank, 0], table[topo.rank, 1] = facts["batches"], facts["skipped"]
    table[topo.rank, 2:] = facts["per_source"].double()
    dist.all_reduce_sum(table)
    history["batches_per_rank"].append([int(b) for b in table[:, 0].tolist()])
    history["samples_per_rank"].append({n: [int(v) for v in table[:, 2 + i].tolist()] for i, n in enumerate(names)})
    history["skipped"] = history.get("skipped", 0) + int(table[:, 1].sum())


def train(args, topo, device):
    train_sources = [stream.resolve(n, spec, "train") for n, spec in args.train.items()]
    eval_sources = [stream.resolve(n, spec, "test") for n, spec in args.eval.items()]
    ckpt_path = os.path.join(args.out, "checkpoint.pt") if args.eval_only else prepare_out(args, topo)
    run = Run(args, topo, device, train_sources)
    if args.eval_only:
        run.model.load_state_dict(load_checkpoint(ckpt_path, device)["model"])
        evals = evaluate(run.model, run.stream, eval_sources, eval_loaders(run, eval_sources), device)
        if topo.is_main:
            write_json_atomic(os.path.join(args.out, "eval.json"), {"eval": evals, "world_size": topo.world})
            print(", ".join(f"{k} {v['accuracy']:.4f} ({v['count']} samples)" for k, v in evals.items()))
        return evals

    start_epoch, history = 0, {"batches_per_rank": [], "samples_per_rank": []}
    if ckpt_path:
        start_epoch, history = run.load(load_checkpoint(ckpt_path, device))
    metrics = Metrics(os.path.join(args.out, "metrics.jsonl"), topo.is_main,
                      keep_before_epoch=start_epoch if ckpt_path else None)
    keys_file = os.path.join(args.out, f"keys-rank{topo.rank}.txt") if args.record_keys else None
    if keys_file:
        truncate_lines(keys_file, start_epoch * run.steps_per_epoch * args.batch_size)

    evals_from = eval_loaders(run, eval_sources)
    t_start, evals, wait, busy = time.time(), {}, 0.0, 0.0
    step = start_epoch * run.steps_per_epoch
    last = args.epochs if args.stop_after is None else min(args.epochs, start_epoch + args.stop_after)
    for epoch in range(start_epoch, last):
        step, facts = train_epoch(run, epoch, step, metrics, keys_file is not None)
        wait, busy = wait + facts["wait"], busy + facts["busy"]
        gather_epoch(topo, run.names, facts, history)
        if keys_file:
            with open(keys_file, "a") as f:
                f.write("\n".join(facts["keys"]) + "\n")
        if eval_sources:
            evals = evaluate(run.model, run.stream, eval_sources, evals_from, device)
            metrics.log(kind="eval", epoch=epoch, step=step, eval=evals)
            if topo.is_main:
                print(f"epoch {epoch + 1}: " + ", ".join(f"{k} {v['accuracy']:.4f}" for k, v in evals.items()),
                      flush=True)
        if topo.is_main:
            save_checkpoint(os.path.join(args.out, "checkpoint.pt"), run.state(epoch + 1, history))
        dist.barrier()

    summary = {
        "accuracy": {k: v["accuracy"] for k, v in evals.items()},
        "eval": evals,
        "epochs_done": len(history["batches_per_rank"]),
        "batches_per_rank_per_epoch": history["batches_per_rank"],
        "samples_per_source_per_rank": history["samples_per_rank"],
        "skipped_samples": history.get("skipped", 0),
        "wall_time_s": round(time.time() - t_start, 2),
        "data_wait_share": round(wait / max(wait + busy, 1e-9), 4),
        "peak_rss_mb_rank0": peak_rss_mb(),
        "restarts": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
        "resumed_from_epoch": start_epoch if ckpt_path else None,
        "world_size": topo.world,
        "device": str(device),
        "config": vars(args),
    }
    if topo.is_main:
        write_json_atomic(os.path.join(args.out, "summary.json"), summary)
        acc = ", ".join(f"{k} {v:.4f}" for k, v in summary["accuracy"].items()) or "no --eval sources"
        print(f"done in {summary['wall_time_s']:.0f} s: test accuracy {acc}; "
              f"metrics.jsonl, summary.json and checkpoint.pt are in {args.out}/", flush=True)
    return summary


def truncate_lines(path, n):
    """Keep the first n lines of a file (keys recorded past the resumed checkpoint go)."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = f.readlines()[:n]
    with open(path, "w") as f:
        f.writelines(lines)


def progress(topo, total, desc):
    """A tqdm bar on rank 0; the other ranks stay quiet."""
    if not topo.is_main:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="batch", dynamic_ncols=True, file=sys.stderr)


def main(argv=None):
    args = parse_args(argv)
    try:
        with dist.distributed(timeout_s=args.timeout) as (topo, device):
            train(args, topo, device)
    except (ValueError, ShardError, OSError) as e:
        # errors re-raised from a DataLoader worker carry its whole traceback: keep the last line
        print(f"pipeline.train: error: {str(e).strip().splitlines()[-1]}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("pipeline.train: interrupted; the last complete checkpoint stays in --out", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
