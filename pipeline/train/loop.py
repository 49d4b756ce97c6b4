"""Train one model with DDP on the weighted mix of several shard streams.

    torchrun --nproc_per_node=2 -m pipeline.train --train mnist=shards/ --train cifar10=shards/ \\
        --eval mnist=shards/ --eval cifar10=shards/ --out runs/mnist-cifar10

Options: pipeline/train/options.py (`--help`). Per epoch: train on the mixed stream,
evaluate every --eval source exactly once over all ranks, write the checkpoint
(also every --checkpoint-every steps). A resumed run continues where the
checkpoint stopped, inside an epoch too, and on another number of ranks.
"""
import importlib
import json
import math
import os
import re
import resource
import shlex
import sys
import time
import warnings
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from pipeline.data import cache, order, remote, stream
from pipeline.train import checkpoint, dist, guard, options, prefetch, stop
from pipeline import cli
from pipeline.errors import InputError
from pipeline.files import write_json_atomic
from pipeline.train.metrics import KeyLog, Metrics, StepLog
from pipeline.train.model import Net, augment

BASE_BATCH = 256  # --lr is the rate for this global batch
PER_CLASS_MAX = 20  # sources with at most this many classes are evaluated per class (a confusion matrix each)
ORIGINS = {"synthetic": "synthetic look-alike data", "torchvision": "real data, torchvision files",
           "imagefolder": "real data, an ImageFolder", "index": "an indexed WebDataset"}


def learning_rate(args, global_batch, seen, total):
    """--lr scaled linearly to the global batch, warmed up linearly over max(10% of training,
    50 steps) but at most half of it, then cosine decay to zero.

    The floor of 50 steps is what lets a large batch start: 2 ranks x 256 (peak 0.2) over
    a 3.5-step warm-up sent the loss to 7 and ended at chance; with 50 steps it learned,
    and 2 ranks x 32 learned either way (docs/training.md, "Learning rate"). Counted in samples,
    not steps, so that a resume on another world size stays on schedule.
    """
    peak = args.lr * global_batch / BASE_BATCH
    warmup = max(1, min(total // 2, max(total // 10, 50 * global_batch)))
    if seen < warmup:
        return peak * (seen + global_batch) / (warmup + global_batch)
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, (seen - warmup) / max(1, total - warmup))))


def origin_label(source):
    return ORIGINS.get(source.origin.get("kind"), "origin not recorded")


def load_stages(names):
    """--sample-stage MODULE:FUNCTION -> the functions."""
    out = []
    for item in names:
        module, _, function = item.partition(":")
        try:
            fn = getattr(importlib.import_module(module), function)
        except Exception as e:  # noqa: BLE001 - whatever a user's module raises on import, in one line
            raise InputError(f"--sample-stage {item}: {e.__class__.__name__}: {e}") from None
        if not callable(fn):
            raise InputError(f"--sample-stage {item}: not a function")
        out.append(fn)
    return out


def http_check(topo, policy):
    """HEAD-check each http(s) shard once per job: every rank checks its share, then all
    ranks learn every verdict (one all_gather)."""
    def check(urls, sizes):
        mine = remote.head_check(urls[topo.rank::topo.world], sizes, policy=policy)
        found = dist.all_gather(mine)
        return [p for f in found for p in f[0]], [p for f in found for p in f[1]]
    return check


def autocast(device):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()


def peak_rss_mb():
    """Peak RSS of this process and of its largest finished child (DataLoader workers)."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return round((own + kids) / 1024, 1)


class Run:
    """Everything one training run holds: sources, stream, model, optimiser, where it stands."""

    def __init__(self, args, topo, device, train_sources, eval_sources, *, policy, started, startup):
        """policy: the remote reads' retries and deadlines; started: perf_counter() when the job
        began; startup: the start-up timings so far, which the first batch completes."""
        self.args, self.topo, self.device = args, topo, device
        self.sources = train_sources
        self.stream = stream.MixedStream(
            train_sources, options.weights_at(args, 0), args.batch_size, topo, seed=args.seed,
            epoch_samples=args.epoch_samples, shuffle_buffer=args.shuffle_buffer, window_bytes=args.shuffle_window,
            resample=args.resample,
            strict=args.strict, on_error=args.on_error,
            cache_dir=args.cache_dir and cache.Cache(args.cache_dir, args.cache_size),
            policy=policy, normalize=False,
            sample_stages=load_stages(args.sample_stage))
        self.stream.set_workers(max(1, args.workers))  # before a resume: it decides same world or not
        self.evals = [self.stream.eval_stream(src) for src in eval_sources]  # class and shape checks, before --out
        self.layout = self.stream.layout
        self.names = self.layout.names
        self.flip_ids = [self.layout.index(n) for n in args.flip]
        torch.manual_seed(args.seed)
        self.model = Net(self.layout.num_classes, args.width).to(device)
        self.ddp = (DDP(self.model, device_ids=[device.index] if device.type == "cuda" else None)
                    if topo.world > 1 else self.model)
        self.buffers = list(self.model.buffers())  # BatchNorm's running stats: a skipped step leaves them too
        self.kept_buffers = [b.clone() for b in self.buffers]
        self.opt = torch.optim.SGD(self.model.parameters(), lr=args.lr, momentum=0.9, nesterov=True,
                                   weight_decay=args.weight_decay)
        self.global_batch = topo.world * args.batch_size
        self.total = self.stream.epoch_samples * args.epochs
        self.fingerprint = checkpoint.fingerprint(args, train_sources)
        self.epoch, self.step, self.seen, self.mid = 0, 0, 0, False
        self.nonfinite = 0  # steps skipped for a non-finite loss (--max-nonfinite), over the whole run
        self.history = {"epochs": []}
        self.carried = self.log_sums = None
        self.key_counts = []
        self.facts = self.new_facts()
        self.startup, self.t0 = startup, started
        self.stopper = None  # a stop.StopRequest while training
        self.stopping = None  # the stop signal all ranks agreed on, at a step or an epoch boundary

    def new_facts(self):
        return {"batches": 0, "samples": [0] * len(self.names), "skipped": 0, "wait": 0.0, "busy": 0.0}

    def lr(self):
        return learning_rate(self.args, self.global_batch, self.seen, self.total)

    def step_once(self, batch, gen):
        """One optimiser step; returns per-sample losses (detached) and source ids on the device,
        and per source the samples whose loss was not finite on any rank (then the weights
        were left as they were: every rank sees the same counts and skips the same step)."""
        x, y, s = prefetch.on_device(batch, self.device)
        x = augment(self.layout.normalize(x, s), s, self.flip_ids, gen)
        for group in self.opt.param_groups:
            group["lr"] = self.lr()
        torch._foreach_copy_(self.kept_buffers, self.buffers)
        with autocast(self.device):
            losses = F.cross_entropy(self.ddp(x).float(), y, reduction="none")
        self.opt.zero_grad(set_to_none=True)
        losses.mean().backward()  # every rank, always: DDP's gradient all-reduce must not be left waiting
        votes = self.stopper.vector() if self.stopper else []
        bad, stops = nonfinite_counts(losses.detach(), s, len(self.names), votes)
        if self.stopper and self.stopping is None:
            self.stopping = self.stopper.agreed(stops)
        if any(bad):
            torch._foreach_copy_(self.buffers, self.kept_buffers)  # the forward pass moved them
        else:
            self.opt.step()
        self.seen += self.global_batch
        self.step += 1
        return losses.detach(), s, bad

    # ------------------------------------------------------------ checkpoints

    def state(self, log, keys):
        """The checkpoint's content (a collective: every rank calls it, rank 0 keeps it)."""
        keys.flush()
        stream_states = dist.all_gather(self.stream.state_dict() if self.mid else None)
        if self.mid:  # one state: the segment once, every rank's place in it
            stream_states = dict(stream_states[0], ranks=[r for s in stream_states for r in s["ranks"]])
        facts = dist.all_gather(self.facts if self.mid else None)
        counts = dist.all_gather(keys.count)
        sums = log.shared(self.topo.is_main)
        return {"version": checkpoint.VERSION, "fingerprint": json.dumps(self.fingerprint),
                "model": self.model.state_dict(), "optimizer": self.opt.state_dict(),
                "rng": torch.get_rng_state(), "world": self.topo.world,
                "position": json.dumps({"epoch": self.epoch, "mid": self.mid, "step": self.step, "seen": self.seen}),
                "nonfinite": json.dumps(self.nonfinite),
                "stream": json.dumps(stream_states), "facts": json.dumps(facts),
                "carried": json.dumps(self.carried), "log_sums": json.dumps(sums), "key_counts": json.dumps(counts),
                "history": json.dumps(self.history), "config": json.dumps(vars(self.args))}

    def save(self, log, keys):
        state = self.state(log, keys)
        if self.topo.is_main:
            checkpoint.save(os.path.join(self.args.out, "checkpoint.pt"), state)
        dist.barrier()

    def resume(self, path):
        """Restore from a checkpoint, every field checked first (one line naming the first bad
        one); returns what changed on purpose: {"weights": ..., "data": ...}, each if it did.
        The checks raise ValueError; they come out as InputError (bad input, one line)."""
        try:
            return self._resume(path)
        except InputError:
            raise
        except ValueError as e:
            raise InputError(str(e)) from e

    def _resume(self, path):
        state = checkpoint.load(path, self.device)
        saved = checkpoint.fingerprint_of(state, path)
        args = self.args
        checkpoint.check_resume(saved, self.fingerprint, allow_weights=args.change_weights,
                                allow_data=args.change_data)
        limits = checkpoint.Limits(args.epochs, checkpoint.epoch_samples_of(saved, self.stream.epoch_samples),
                                   args.batch_size, len(self.names))
        got = checkpoint.trainer_state(state, path, limits)
        data = checkpoint.data_changes(saved, self.fingerprint)
        if checkpoint.legacy(saved) and self.topo.is_main:
            warnings.warn(f"{path}: written before checkpoints recorded their shard lists, so this resume cannot "
                          f"check that the sources hold the same shards", stacklevel=2)
        if data and got["mid"]:
            raise InputError(f"--change-data: the checkpoint stopped inside epoch {got['epoch'] + 1}; other data can "
                             f"only come in at an epoch boundary: finish that epoch on its own data first "
                             f"(--resume --stop-after 1), or start over with --overwrite")
        checkpoint.load_model(self.model, state, path)
        checkpoint.load_optimizer(self.opt, state, path)
        checkpoint.set_rng(state, path)
        self.epoch, self.mid, self.step, self.seen = got["epoch"], got["mid"], got["step"], got["seen"]
        self.history, self.key_counts, self.nonfinite = got["history"], got["key_counts"], got["nonfinite"]
        if self.mid:
            streams = got["stream"]
            self.stream.set_epoch(self.epoch, options.weights_at(args, self.epoch))
            dealt = self.stream.load_state_dict(streams)  # every field of the stream state checked
            facts, carried = got["facts"], got["carried"]
            made = {r["rank"]: sum(r["done"].values()) for r in streams["ranks"]}
            counted = {r: f["batches"] for r, f in enumerate(facts)}
            if made != counted:  # the stream's place and the run's counts must tell one story
                raise InputError(f"{path}: the stream state says the ranks made {_short(made)} batches of this "
                                 f"epoch, the run counted {_short(counted)}; the checkpoint is damaged")
            if dealt["deal"] == "same":  # same world and workers
                self.facts, self.carried = facts[self.topo.rank], carried
            else:  # another world size: what the old ranks did this epoch is carried into the summary
                self.carried = _merge_facts(facts, carried)
            self.log_sums = got["log_sums"]
        changed = {}
        if saved.get("weights") != self.fingerprint["weights"] or \
                saved.get("final_weights") != self.fingerprint["final_weights"]:
            changed["weights"] = {"from": saved.get("weights"), "to": self.fingerprint["weights"]}
        if data:
            changed["data"] = {name: {"from": was, "to": now} for name, (was, now) in data.items()}
        return changed


def nonfinite_counts(losses, source, n, votes=()):
    """Per source, the samples of this step whose loss is not finite, summed over all ranks:
    the same list on every rank, so all of them skip a step or none does (one small
    all-reduce, and a wait for the device, per step). The ranks' stop votes (one slot per
    stop signal, see pipeline.train.stop) ride in the same all-reduce: returns (counts, the
    summed votes), and every rank learns after the same step that one of them got a signal."""
    bad = torch.zeros(n + len(votes), dtype=torch.float64, device=losses.device)
    bad.index_add_(0, source, (~torch.isfinite(losses)).double())
    if votes:
        bad[n:] = torch.tensor(votes, dtype=torch.float64)
    sums = dist.all_reduce_sum(bad).tolist()
    return [int(c) for c in sums[:n]], sums[n:]


class NonFiniteLoss(Exception):
    """The loss stopped being a number: the run stops rather than train on (exit code 3)."""


def _merge_facts(facts, carried):
    """Per-rank facts of the part of an epoch run on another world size, for the summary."""
    out = dict(carried or {})
    for r, f in enumerate(facts):
        out[f"before_resume_rank{r}"] = f
    return out


def prepare_out(args, topo):
    """Refuse to overwrite a previous run unless told; returns the checkpoint to resume, if any.

    After torchrun restarts a failed job (--max-restarts), the run in --out is this
    job's own: continue from its checkpoint, or start over if it never wrote one.
    """
    ckpt = os.path.join(args.out, "checkpoint.pt")
    previous = os.path.exists(os.path.join(args.out, "metrics.jsonl")) or os.path.exists(ckpt)
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0
    either = getattr(args, "resume_or_start", False)
    if args.resume or ((restarted or either) and os.path.exists(ckpt)):
        if not os.path.exists(ckpt):
            raise InputError(options.resume_error(args))
        return ckpt
    if previous and either and not (args.overwrite or restarted):  # an earlier run's files, not this job's
        raise InputError(guard.earlier_run(args.out, run_files(args.out, "--resume-or-start")))
    if previous and not (args.overwrite or restarted or either):
        raise InputError(f"{args.out} holds a previous run; pass --resume to continue it or --overwrite to replace it")
    why = ("--overwrite" if args.overwrite else "restarted without a checkpoint" if restarted else
           "--resume-or-start without a checkpoint" if either else "--out")
    # a run starts only in a folder that holds nothing but a run's files, so --overwrite can always clear it;
    # without a previous run or --overwrite, a run's stray files (a keys-rank0.txt) are left alone
    found = run_files(args.out, why) if os.path.isdir(args.out) else []
    doomed = found if previous or args.overwrite else []
    dist.barrier()  # every rank has looked before rank 0 clears the folder
    if topo.is_main:
        if doomed:
            print(f"{why}: deleting the previous run in {args.out}/: {', '.join(doomed)}", flush=True)
        for name in doomed:
            os.remove(os.path.join(args.out, name))
        os.makedirs(args.out, exist_ok=True)
    dist.barrier()
    return None


RUN_FILE = re.compile(r"(metrics\.jsonl|summary\.json|checkpoint\.pt|eval\.json|report\.png|keys-rank\d+\.txt)"
                      r"(\.tmp)?\Z")  # what train, --eval-only and tools/report.py write into --out


def run_files(folder, why="--overwrite"):
    """The files of a previous run in `folder`, to delete; InputError if anything else is there
    (shards, manifests, folders, a mistyped --out): a run writes only into a folder of its own,
    and --overwrite deletes only what a run wrote."""
    names = sorted(n for n in os.listdir(folder) if n != guard.LOCK)  # the running trainer's own lock
    for name in names:
        path = os.path.join(folder, name)
        if not RUN_FILE.match(name) or os.path.islink(path) or not os.path.isfile(path):
            raise InputError(f"{why}: {folder} holds {name!r}, which no run of pipeline.train writes; "
                             f"nothing deleted (choose another --out, or empty the folder yourself)")
    return names


def evaluate(run, loaders):
    """Exact per-source accuracy: every test sample counted once over all ranks; per class
    too, with a confusion matrix, for sources of up to PER_CLASS_MAX classes.

    Ranks may hold different numbers of test batches, so the forward pass uses the
    plain module (DDP's forward can broadcast buffers, a collective) and only the
    final sums are all-reduced, once.
    """
    model, device = run.model, run.device
    dist.sync_buffers(model)
    model.eval()
    sums = torch.zeros(len(loaders), 4, dtype=torch.float64, device=device)  # count, correct, loss, skipped
    sizes = [len(ev.source.classes) for ev in run.evals]
    # rows: true class; columns: predicted class of the same source, the last one any other source's class
    confusions = [torch.zeros(k, k + 1, dtype=torch.float64, device=device) if k <= PER_CLASS_MAX else None
                  for k in sizes]
    with torch.no_grad():
        for i, loader in enumerate(loaders):
            offset, k = run.layout.offsets[run.layout.index(run.evals[i].source.name)], sizes[i]
            for batch in loader:
                sums[i, 3] += batch["skipped"]
                if len(batch["label"]) == 0:
                    continue
                x, y, s = prefetch.on_device(batch, device)
                with autocast(device):
                    logits = model(run.layout.normalize(x, s)).float()
                predicted = logits.argmax(1)
                sums[i, 0] += len(y)
                sums[i, 1] += (predicted == y).sum()
                sums[i, 2] += F.cross_entropy(logits, y, reduction="sum")
                if confusions[i] is not None:
                    column = predicted - offset
                    column = torch.where((column >= 0) & (column < k), column, k)
                    confusions[i] += torch.bincount((y - offset) * (k + 1) + column,
                                                    minlength=k * (k + 1)).view(k, k + 1).to(torch.float64)
    flat = torch.cat([sums.flatten()] + [c.flatten() for c in confusions if c is not None])
    dist.all_reduce_sum(flat)  # one collective for every count
    sums, at = flat[:sums.numel()].view_as(sums), sums.numel()
    for i, c in enumerate(confusions):
        if c is not None:
            confusions[i], at = flat[at:at + c.numel()].view_as(c), at + c.numel()
    model.train()
    out = {}
    for ev, row, confusion in zip(run.evals, sums.tolist(), confusions):
        n, correct, loss, skipped = row
        out[ev.source.name] = {"count": int(n), "correct": int(correct), "accuracy": correct / max(n, 1),
                               "loss": loss / max(n, 1), "skipped": int(skipped), "data": origin_label(ev.source),
                               "manifest": ev.source.manifest}
        if confusion is not None:
            counts = confusion.round().to(torch.int64).tolist()
            out[ev.source.name]["per_class"] = class_accuracies(ev.source.classes, counts)
            out[ev.source.name]["confusion"] = counts
    return out


def class_accuracies(classes, confusion):
    """Per class, the share of its test samples predicted right; None (null in summary.json) for
    a class with no test samples: it was not measured, which 0 would misreport."""
    return {name: row[j] / sum(row) if sum(row) else None for j, (name, row) in enumerate(zip(classes, confusion))}


def per_class_lines(evals, digits=3):
    """'  NAME per class: airplane 0.950, cat n/a, ...' for each source evaluated per class
    (n/a: no test samples of that class)."""
    return [f"  {k} per class: " + ", ".join(f"{cli.printable(c)} {'n/a' if a is None else f'{a:.{digits}f}'}"
                                             for c, a in v["per_class"].items())
            for k, v in evals.items() if "per_class" in v]


def epoch_line(epoch, epochs, evals):
    """'epoch 1/2: mnist 0.9812 (shards/mnist-test.json, real data, torchvision files), ...': each
    accuracy says which data it was measured on, so a log read later needs no other file."""
    return f"epoch {epoch + 1}/{epochs}: " + ", ".join(f"{k} {v['accuracy']:.4f} ({v['manifest']}, {v['data']})"
                                                       for k, v in evals.items())


def eval_loaders(run):
    """One loader per test source, made once: their workers persist between evaluations
    (at most 2 each, idle while training runs)."""
    return [stream.make_loader(ev, min(run.args.workers, 2), pin_memory=run.device.type == "cuda") for ev in run.evals]


def progress_bar(topo, total, desc, initial=0):
    """A tqdm bar on rank 0; the other ranks stay quiet.

    Without tqdm's monitor thread: it starts with the first bar and exits with the last,
    and a DataLoader worker forked while a thread starts or exits can deadlock in
    os.fork() on Python 3.8-3.11 (CPython gh-112275: the child waits forever on the
    interpreter's HEAD_LOCK). That was this project's intermittent hang: rank 0 forking
    the evaluation loader's worker just as the epoch's bar closed (seen with gdb)."""
    if not topo.is_main:
        return None
    from tqdm import tqdm

    tqdm.monitor_interval = 0
    return tqdm(total=total, initial=initial, desc=desc, unit="batch", dynamic_ncols=True, file=sys.stderr)


def train_epoch(run, loader, epoch, metrics, keys, budget):
    """One epoch (or its rest) over the mixed stream; returns False if --stop-after-steps or
    a stop signal (run.stopping) ended it early (a checkpoint was written)."""
    args, topo = run.args, run.topo
    weights = options.weights_at(args, epoch)
    resumed = run.mid
    if not resumed:
        run.stream.set_epoch(epoch, weights)
        run.facts = run.new_facts()
    gen = torch.Generator()
    log = StepLog(run.names, run.device)
    if resumed:
        log.restore(run.log_sums, topo.is_main)
    run.mid = True
    left = run.stream.remaining()
    segment = run.stream.current()
    made = segment.batches - left  # this rank's batches of the segment before this pass
    done_before = run.facts["batches"]
    bar = progress_bar(topo, done_before + left, f"epoch {epoch + 1}/{args.epochs}", done_before)
    per_source = torch.zeros(len(run.names), dtype=torch.int64)
    t0 = time.perf_counter()
    got = 0
    for batch in prefetch.ahead(loader, run.device):  # workers persist across epochs and pick up set_epoch
        t1 = time.perf_counter()
        run.startup.setdefault("first_batch_s", round(t1 - run.t0, 3))
        run.facts["wait"] += t1 - t0
        counts = torch.bincount(batch["source"], minlength=len(run.names))  # on the CPU: no wait for the device
        # augmentation keyed by the batch's place, as the data's order is: a resume on the same world
        # draws the same, and no two ranks or batches share a key
        gen.manual_seed(order.seed_of((order.AUGMENT, args.seed, epoch, segment.generation, topo.rank, made + got)))
        losses, source, bad = run.step_once(batch, gen)
        got += 1
        run.facts["batches"] += 1
        run.facts["skipped"] += batch["skipped"]
        per_source += counts
        if any(bad):
            try:
                skip_nonfinite(run, metrics, epoch, bad)
            except NonFiniteLoss:
                if bar is not None:
                    bar.close()  # the error line starts a line of its own
                raise
        else:
            log.add(losses, source, counts, batch["skipped"])
        if args.record_keys:
            keys.add(epoch + 1, batch["key"])
        last = got == left
        if run.step % args.log_every == 0 or last:
            line = log.flush()
            if bar is not None:
                bar.set_postfix(loss=f"{sum(line['loss'][k] * line['share'][k] for k in run.names):.3f}")
            metrics.log(kind="train", epoch=epoch + 1, step=run.step, lr=run.opt.param_groups[0]["lr"],
                        weights=weights, **line)
        if bar is not None:
            bar.update(1)
        ending = budget(run.step) or run.stopping is not None
        if not last and (args.checkpoint_every and run.step % args.checkpoint_every == 0 or ending):
            run.facts["samples"] = [a + b for a, b in zip(run.facts["samples"], per_source.tolist())]
            per_source.zero_()
            run.save(log, keys)
            if ending:
                if bar is not None:
                    bar.close()
                return False
        t0 = time.perf_counter()
        run.facts["busy"] += t0 - t1
    if bar is not None:
        bar.close()
    run.facts["samples"] = [a + b for a, b in zip(run.facts["samples"], per_source.tolist())]
    gather_epoch(run, epoch)
    run.mid = False
    return True


def skip_nonfinite(run, metrics, epoch, bad):
    """A step whose loss was not finite (its weights were not updated): recorded in
    metrics.jsonl, and the end of the run once more than --max-nonfinite were skipped."""
    run.nonfinite += 1
    where = {n: c for n, c in zip(run.names, bad) if c}
    metrics.log(kind="nonfinite", epoch=epoch + 1, step=run.step, samples=where, skipped_steps=run.nonfinite)
    allowed = run.args.max_nonfinite
    if run.nonfinite > allowed:
        raise NonFiniteLoss(
            f"step {run.step} (epoch {epoch + 1}): the loss is not finite for "
            f"{', '.join(f'{n} ({c} of its samples)' for n, c in where.items())}; the weights were not updated and any "
            f"checkpoint in {run.args.out}/ is from before it ({run.nonfinite} such step(s), --max-nonfinite "
            f"{allowed}; a lower --lr often helps)")
    if run.topo.is_main:
        print(f"step {run.step}: non-finite loss for {', '.join(where)}; step skipped "
              f"({run.nonfinite} of at most {allowed})", file=sys.stderr, flush=True)


def gather_epoch(run, epoch):
    """Add one epoch's batches and samples per rank (and skipped samples) to the history."""
    facts = dist.all_gather(run.facts)
    entry = {"epoch": epoch + 1, "batches": {f"rank{r}": f["batches"] for r, f in enumerate(facts)},
             "samples": {n: {f"rank{r}": f["samples"][i] for r, f in enumerate(facts)} for i, n in enumerate(run.names)},
             "skipped": sum(f["skipped"] for f in facts)}
    if run.carried:
        entry["before_resume"] = run.carried
        entry["skipped"] += sum(f.get("skipped", 0) for f in run.carried.values())
        run.carried = None
    run.history["epochs"].append(entry)
    run.history["wait"] = run.history.get("wait", 0.0) + facts[0]["wait"]
    run.history["busy"] = run.history.get("busy", 0.0) + facts[0]["busy"]


def evaluate_only(run):
    path = os.path.join(run.args.out, "checkpoint.pt")
    if not os.path.exists(path):
        raise InputError(f"--eval-only: no checkpoint at {path}")
    try:
        state = checkpoint.load(path, run.device)
        checkpoint.check_resume(checkpoint.fingerprint_of(state, path), run.fingerprint,
                                only=checkpoint.MODEL_FIELDS, what="--eval-only")
        checkpoint.load_model(run.model, state, path)
    except InputError:
        raise
    except ValueError as e:  # the checkpoint's checks: a bad file, not a bug
        raise InputError(str(e)) from e
    evals = evaluate(run, eval_loaders(run))
    if run.topo.is_main:
        write_json_atomic(os.path.join(run.args.out, "eval.json"), {"eval": evals, "world_size": run.topo.world})
        print(", ".join(f"{k} {v['accuracy']:.4f} ({v['count']} samples, {v['data']})" for k, v in evals.items()))
        for line in per_class_lines(evals):
            print(line)
    return evals


def train(args, topo, device, stopper=None):
    """The run; `stopper`: the stop signals' StopRequest (None: no stop on a signal)."""
    t0 = time.perf_counter()
    policy = cli.policy_of(args)
    check = http_check(topo, policy)
    train_sources = [stream.resolve(n, spec, "train", policy=policy, check_http=check) for n, spec in args.train.items()]
    eval_sources = [stream.resolve(n, spec, "test", policy=policy, check_http=check) for n, spec in args.eval.items()]
    startup = {"resolve_s": round(time.perf_counter() - t0, 3), "torch_threads": torch.get_num_threads()}
    if topo.is_main:
        guard.warn_data(train_sources, eval_sources)
    try:
        run = Run(args, topo, device, train_sources, eval_sources, policy=policy, started=t0, startup=startup)
        guard.check_memory(args, run.stream, len(eval_sources))  # before any loader starts or reads
    except InputError:
        raise
    except ValueError as e:  # the stream's checks of the options against the data (an epoch too short, ...)
        raise InputError(str(e)) from e
    if args.eval_only:
        return evaluate_only(run)
    run.stopper = stopper
    ckpt = prepare_out(args, topo)
    changed = run.resume(ckpt) if ckpt else {}
    if ckpt and topo.is_main:
        saved = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(os.path.getmtime(ckpt)))
        print(f"resumed from {where(run)} (saved at {saved})", flush=True)
    metrics = Metrics(os.path.join(args.out, "metrics.jsonl"), topo.is_main, resume_step=run.step if ckpt else None)
    if "weights" in changed:
        metrics.log(kind="weights_changed", epoch=run.epoch + 1, step=run.step, **changed["weights"])
    if "data" in changed:
        metrics.log(kind="data_changed", epoch=run.epoch + 1, step=run.step, sources=changed["data"])
    keys = KeyLog(args.out, topo.rank, keep=(run.key_counts[topo.rank] if topo.rank < len(run.key_counts) else 0)
                  if ckpt else None)
    if ckpt and topo.is_main:
        from pipeline.train.metrics import truncate_keys

        for r in range(topo.world, len(run.key_counts)):  # key logs of ranks this world no longer has
            truncate_keys(os.path.join(args.out, f"keys-rank{r}.txt"), run.key_counts[r])
    loader = stream.make_loader(run.stream, args.workers, pin_memory=device.type == "cuda")
    evals_from = eval_loaders(run)
    started = run.step
    resumed_from = {"epoch": run.epoch + 1, "step": run.step} if ckpt else None

    def budget(step):
        return args.stop_after_steps is not None and step - started >= args.stop_after_steps

    t_start, evals = time.time(), {}
    if ckpt and run.epoch >= args.epochs and not run.mid:
        if topo.is_main:
            epochs = f"{args.epochs} epoch{'s' if args.epochs != 1 else ''}"
            print(f"nothing to do: the checkpoint in {args.out}/ has finished all {epochs}; raise "
                  f"--epochs to train further (summary.json is left as it was)", flush=True)
        return None
    last_epoch = args.epochs if args.stop_after is None else min(args.epochs, run.epoch + args.stop_after)
    finished = True
    while run.epoch < last_epoch:
        epoch = run.epoch
        if not train_epoch(run, loader, epoch, metrics, keys, budget):
            finished = False
            metrics.log(kind="stopped", epoch=epoch + 1, step=run.step,
                        **({"signal": run.stopping.name} if run.stopping else {}))
            break
        keys.flush()
        if run.evals:
            evals = evaluate(run, evals_from)
            metrics.log(kind="eval", epoch=epoch + 1, step=run.step, eval=evals)
            if topo.is_main:
                print(epoch_line(epoch, args.epochs, evals), flush=True)
        run.epoch = epoch + 1
        run.save(StepLog(run.names, run.device), keys)
        if stopper and run.stopping is None:  # a signal during the epoch's last step, evaluation or save
            run.stopping = stopper.agreed(dist.all_reduce_sum(torch.tensor(stopper.vector(), dtype=torch.float64)))
        if run.stopping is not None and run.epoch < args.epochs:
            metrics.log(kind="stopped", epoch=run.epoch, step=run.step, signal=run.stopping.name)
            break
        run.stopping = None  # the run is over anyway
        if budget(run.step):
            break
    finished = finished and run.epoch >= args.epochs
    return write_summary(run, evals, t_start, resumed_from, finished, train_sources)


def where(run):
    """'epoch E, step S' inside an epoch, 'the end of epoch E, step S' between two (E from 1)."""
    return f"epoch {run.epoch + 1}, step {run.step}" if run.mid else f"the end of epoch {run.epoch}, step {run.step}"


def write_summary(run, evals, t_start, resumed_from, finished, sources):
    args, topo = run.args, run.topo
    wait, busy = run.history.get("wait", 0.0), run.history.get("busy", 0.0)
    if run.mid:  # stopped inside an epoch: its share of waiting counts too
        wait, busy = wait + run.facts["wait"], busy + run.facts["busy"]
    summary = {
        "data": {s.name: {"origin": origin_label(s), "synthetic": s.synthetic, "manifest": s.manifest,
                          "train_samples": s.total} for s in sources},
        "accuracy": {k: v["accuracy"] for k, v in evals.items()},
        "per_class_accuracy": {k: v["per_class"] for k, v in evals.items() if "per_class" in v},
        "eval": evals,
        "epochs_done": len(run.history["epochs"]),
        "steps_done": run.step,
        "finished": finished,
        "epochs": run.history["epochs"],
        "skipped_samples": sum(e["skipped"] for e in run.history["epochs"]),
        "nonfinite_steps": run.nonfinite,
        "wall_time_s": round(time.time() - t_start, 2),
        "data_wait_share": round(wait / max(wait + busy, 1e-9), 4),
        "startup": run.startup,
        "peak_rss_mb_rank0": peak_rss_mb(),
        "restarts": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
        "resumed_from": resumed_from,
        "stopped_by": run.stopping.name if run.stopping else None,
        "world_size": topo.world,
        "global_batch": run.global_batch,
        "peak_lr": args.lr * run.global_batch / BASE_BATCH,
        "device": str(run.device),
        "config": vars(args),
    }
    if topo.is_main and run.stopping:
        write_json_atomic(os.path.join(args.out, "summary.json"), summary)
        print(f"stopped at {where(run)}; checkpoint saved in {args.out}/; resume with: "
              f"{stop.resume_command(run.stopper.argv)}", flush=True)
    elif topo.is_main:
        write_json_atomic(os.path.join(args.out, "summary.json"), summary)
        acc = ", ".join(f"{k} {v['accuracy']:.4f} ({v['data']})" for k, v in evals.items()) or \
            ("no evaluation in this invocation" if run.evals else "no --eval sources")
        state = "done" if finished else \
            f"stopped at step {run.step}, epoch {run.epoch + (1 if run.mid else 0)} of {args.epochs} (continue with --resume)"
        tested = f"test accuracy {acc}" if evals else acc
        print(f"{state} in {summary['wall_time_s']:.0f} s; {tested}\n" +
              "".join(line + "\n" for line in per_class_lines(evals)) +
              f"metrics.jsonl, summary.json and checkpoint.pt are in {args.out}/; "
              f"pictures: {shlex.quote(sys.executable)} tools/report.py {shlex.quote(str(args.out))}", flush=True)
    return summary


def one_line(text):
    """An error line in one write, so that the lines of ranks failing together under torchrun
    do not run into each other."""
    sys.stderr.write(cli.printable(text) + "\n")  # an error may quote a key or a name from a file
    sys.stderr.flush()


def one_line_warning(message, category, filename, lineno, line=None):
    """Warnings as the trainer's other lines read: what happened, without the file, line
    number and source line of the stage that noticed it. On a terminal the line first
    clears rank 0's progress bar (carriage return, erase line), which redraws below it on
    its next update: a DataLoader worker or another rank can't reach that bar's
    tqdm.write, and its warning would otherwise start in the middle of the bar."""
    clear = "\r\x1b[K" if _is_terminal(sys.stderr) else ""
    return f"{clear}pipeline.train: warning: {cli.printable(message)}\n"


def _is_terminal(stream):
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # replaced by an object without it, or closed
        return False


def main(argv=None, args=None):
    """The trainer's entry point; returns the exit code: 0 done (or stopped by
    --stop-after/--stop-after-steps), 2 bad input (one line), 3 a non-finite loss, 128 + N
    stopped by signal N with a checkpoint (pipeline.train.stop). Any other exception is a
    bug and keeps its traceback. `args`: already parsed from `argv` (python -m pipeline.train)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if args is None:
        args = options.parse(argv)
    dist.exit_with_launcher()
    stopper = stop.StopRequest([] if args.eval_only else stop.parse_signals(args.stop_signals), argv)
    try:
        with stopper, dist.distributed(timeout_s=args.timeout) as (topo, device), guard.out_lock(args.out, topo):
            summary = train(args, topo, device, stopper)
    except (InputError, OSError) as e:
        # bad input or the environment (disk, network); errors re-raised from a DataLoader worker
        # carry its whole traceback in their message: keep the last line
        one_line(f"pipeline.train: error: {str(e).strip().splitlines()[-1]}")
        return 2
    except NonFiniteLoss as e:
        one_line(f"pipeline.train: error: {e}")
        return 3
    except KeyboardInterrupt:  # SIGINT left out of --stop-signals: every rank lands here, rank 0 says it
        if os.environ.get("RANK", "0") == "0":
            print(f"pipeline.train: interrupted; the last complete checkpoint stays in {args.out}/", file=sys.stderr)
        return 130
    finally:
        stop.end_children()
    if isinstance(summary, dict) and summary.get("stopped_by"):
        return stop.exit_code(signal_of(summary["stopped_by"]))
    return 0


def signal_of(name):
    import signal

    return signal.Signals[name]


if __name__ == "__main__":
    sys.exit(main())


def _short(value, n=80):
    text = repr(value)
    return text if len(text) <= n else text[:n] + "..."
