"""The run's state: sources, stream, model, optimiser, where the run stands, and the
checkpoint that holds all of it (assembled here, restored here).

One class, because a checkpoint must save and restore the same fields: a field added to
`state()` and forgotten in `resume()` shows in one screen. The file format's checks
live in pipeline.train.checkpoint.
"""
import argparse
import json
import math
import os
import warnings
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from pipeline.ordering import order

from pipeline.data.store import cache
from pipeline.data.streams import stream
from pipeline.errors import InputError, redacted, short
from pipeline.train import checkpoint, dist, options
from pipeline.train.model import augment, build_model, input_shape, unused_parameters
from pipeline.train.usercode import user_function
from pipeline.train.schedule import BASE_BATCH, learning_rate


def load_stages(names):
    """--sample-stage MODULE:FUNCTION -> the functions."""
    return [user_function("--sample-stage", item) for item in names]


def autocast(device):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()


def sgd(model, args):
    """SGD with Nesterov momentum whose step is skipped on the device when its `found_inf` is set
    (the fused step reads it, as GradScaler's do): deciding needs no wait for the device. The
    momentum buffers start at zero, which is what SGD's first step makes of them (buf = grad,
    without dampening), so a first step that is skipped leaves no uninitialised buffer behind."""
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, nesterov=True,
                          weight_decay=args.weight_decay, fused=True)
    for p in model.parameters():
        opt.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return opt



class Run:
    """Everything one training run holds: sources, stream, model, optimiser, where it stands."""

    def __init__(self, args, topo, device, train_sources, eval_sources, *, policy, started, startup,
                 before_model=None):
        """policy: the remote reads' retries and deadlines; started: perf_counter() when the job
        began; startup: the start-up timings so far, which the first batch completes;
        before_model(stream): called once the stream is made and checked, before the model is
        built and CUDA starts (the trainer starts its loader's workers there); kept as `loader`."""
        self.args, self.topo, self.device = args, topo, device
        self.sources = train_sources
        self.stream = stream.MixedStream(
            train_sources, options.weights_at(args, 0), args.batch_size, topo, seed=args.seed,
            epoch_samples=args.epoch_samples, shuffle_buffer=args.shuffle_buffer, window_bytes=args.shuffle_window,
            fetch_ahead=args.fetch_ahead, resample=args.resample,
            strict=args.strict, on_error=args.on_error,
            cache_dir=args.cache_dir and cache.Cache(args.cache_dir, args.cache_size),
            policy=policy, normalize=False,
            sample_stages=load_stages(args.sample_stage))
        self.stream.set_workers(max(1, args.workers))  # before a resume: it decides same world or not
        self.evals = [self.stream.eval_stream(src) for src in eval_sources]  # class and shape checks, before --out
        self.loader = before_model(self.stream) if before_model else None
        self.layout = self.stream.layout
        self.names = self.layout.names
        self.flip_ids = [self.layout.index(n) for n in args.flip]
        torch.manual_seed(args.seed)
        model = build_model(args.model, self.layout.num_classes, input_shape(self.stream), args.width,
                            channels_last=getattr(args, "channels_last", False))  # before DDP wraps it
        unused = unused_parameters(model, input_shape(self.stream))
        if unused and topo.world > 1 and topo.rank == 0:
            warnings.warn(f"--model {args.model}: {len(unused)} parameter(s) get no gradient ({', '.join(unused[:3])}"
                          f"{', ...' if len(unused) > 3 else ''}): DDP looks for them every step "
                          f"(find_unused_parameters), which costs a pass over the graph")
        self.model = model.to(device)
        self.ddp = (DDP(self.model, device_ids=[device.index] if device.type == "cuda" else None,
                        find_unused_parameters=bool(unused)) if topo.world > 1 else self.model)
        self.buffers = list(self.model.buffers())  # e.g. BatchNorm's running stats: a skipped step leaves them too
        self.kept_buffers = [b.clone() for b in self.buffers]
        self.opt = sgd(self.model, args)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.flip_tensor = torch.tensor(self.flip_ids, dtype=torch.int64, device=device)  # made once: no copy a step
        self.one = torch.ones((), device=device)
        self.global_batch = topo.world * args.batch_size
        self.total = self.stream.epoch_samples * args.epochs
        self.fingerprint = checkpoint.fingerprint(args, train_sources, topo.world)
        self.epoch, self.step, self.seen = 0, 0, 0
        self.in_epoch = False  # stopped (or checkpointed) inside an epoch: the checkpoint's position.mid
        self.nonfinite = 0  # steps skipped for a non-finite loss (--max-nonfinite), over the whole run
        self.history = {"epochs": []}
        self.before_resume = None  # this epoch's tallies from a world size before the resume ("carried")
        self.unlogged = None  # the loss sums not yet in metrics.jsonl at the checkpoint ("log_sums")
        self.key_counts = []
        self.tally = self.new_tally()  # this rank's counters of the epoch ("facts" in the checkpoint)
        self.startup, self.t0 = startup, started
        self.stopper = None  # a stop.StopRequest while training
        self.stopping = None  # the stop signal all ranks agreed on, at a step or an epoch boundary

    def new_tally(self):
        # keys: the lines this rank added to its key log (--record-keys), which a checkpoint's key_counts must add up to
        return {"batches": 0, "samples": [0] * len(self.names), "skipped": 0, "wait": 0.0, "busy": 0.0, "keys": 0}

    def lr(self):
        return learning_rate(self.args, self.global_batch, self.seen, self.total)

    def step_once(self, batch, gen):
        """One optimiser step, decided on the device: returns the per-sample losses, the source ids
        and the step's `found` flag (1 where some rank's loss, or the summed gradients, were not
        finite; the weights and running stats were then left as they were, on every rank alike).
        Nothing here waits for the device: the host queues the next step while this one runs, and
        learns what happened when the step log is read (pipeline.train.metrics.StepLog.reduce)."""
        x, y, s = batch["image"], batch["label"], batch["source"]  # on the device (make_loader's device)
        x = augment(self.layout.normalize(x, s), s, self.flip_tensor, gen)
        for group in self.opt.param_groups:
            group["lr"] = self.lr()
        if self.buffers:  # (a model without buffers, e.g. no BatchNorm: the foreach call refuses empty lists)
            torch._foreach_copy_(self.kept_buffers, self.buffers)
        with autocast(self.device):
            losses = F.cross_entropy(self.ddp(x).float(), y, reduction="none")
        self.opt.zero_grad(set_to_none=True)
        # a rank whose loss is not finite makes every gradient of its own NaN, and DDP's all-reduce
        # carries that to every rank: all of them find it below and skip the step alike, with no
        # collective of ours and no wait for the device (torch.amp.GradScaler's check, on the sum)
        poison = torch.where(torch.isfinite(losses).all(), 1.0, math.nan)
        (losses.mean() * poison).backward()  # every rank, always: DDP's gradient all-reduce must not be left waiting
        found = torch.zeros((), device=self.device)
        torch._amp_foreach_non_finite_check_and_unscale_([p.grad for p in self.params if p.grad is not None],
                                                         found, self.one)
        self.opt.found_inf = found  # the fused step leaves weights and momentum alone where it is set
        self.opt.step()
        skip = found > 0
        for kept, b in zip(self.kept_buffers, self.buffers):  # the forward pass moved them
            b.copy_(torch.where(skip, kept, b))
        self.seen += self.global_batch
        self.step += 1
        return losses.detach(), s, found

    # ------------------------------------------------------------ checkpoints

    def state(self, keys, sums=None):
        """The checkpoint's content on rank 0, None on the other ranks (a collective: every rank
        calls it). Each rank's own part (its place in the stream, its tally, its key count)
        reaches rank 0 in one gather: only rank 0 writes the file. `sums`: the step log's
        partial sums, reduced (StepLog.reduce) just before."""
        keys.flush()
        own = self.stream.state_dict() if self.in_epoch else None
        # each rank sends its own entry of the stream state; the segment and the rest are rank 0's
        parts = dist.gather_to_main({"stream": own["ranks"][0] if own else None,
                                     "tally": self.tally if self.in_epoch else None, "keys": keys.count})
        sums = sums if sums is not None else [0.0] * (2 * len(self.names)) + [0]
        if parts is None:
            return None
        stream_states = [None] * len(parts)
        if self.in_epoch:  # one state: the segment once, every rank's entry (each checked against it on load)
            stream_states = dict(own, ranks=[p["stream"] for p in parts])
        tallies = [p["tally"] for p in parts]
        # the key lines of ranks a smaller world left out, carried: their logs stay whole if they come back
        counts = [p["keys"] for p in parts] + self.key_counts[len(parts):]
        return {"version": checkpoint.VERSION, "fingerprint": json.dumps(self.fingerprint),
                "model": self.model.state_dict(), "optimizer": self.opt.state_dict(),
                "rng": torch.get_rng_state(), "world": self.topo.world,
                "position": json.dumps({"epoch": self.epoch, "mid": self.in_epoch, "step": self.step,
                                        "seen": self.seen}),
                "nonfinite": json.dumps(self.nonfinite),
                "stream": json.dumps(stream_states), "facts": json.dumps(tallies),
                "carried": json.dumps(self.before_resume), "log_sums": json.dumps(sums),
                "key_counts": json.dumps(counts),
                "history": json.dumps(self.history), "config": json.dumps(redacted(vars(self.args)))}

    def save(self, keys, sums=None):
        state = self.state(keys, sums)
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
        batch = saved.get("batch_size")  # the checkpoint's own: its tallies count its batches
        batch = batch if type(batch) is int and 1 <= batch <= order.MAX_COUNT else args.batch_size
        limits = checkpoint.Limits(args.epochs, checkpoint.epoch_samples_of(saved, self.stream.epoch_samples),
                                   batch, len(self.names))
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
        self.epoch, self.in_epoch, self.step, self.seen = got["epoch"], got["mid"], got["step"], got["seen"]
        self.history, self.key_counts, self.nonfinite = got["history"], got["key_counts"], got["nonfinite"]
        notes = []
        if self.in_epoch:
            streams = got["stream"]
            notes += self._keep_mixture(streams, saved)
            self.stream.set_epoch(self.epoch, options.weights_at(args, self.epoch))
            dealt = self.stream.load_state_dict(streams)  # every field of the stream state checked
            if streams["segment"]["world"] != got["world"]:  # else some ranks would go on and the others refuse
                raise InputError(f"{path}: the stream state's segment ran on {streams['segment']['world']} ranks, the "
                                 f"checkpoint on {got['world']}; the checkpoint is damaged")
            tallies, before = got["facts"], got["carried"]
            made = {r["rank"]: streams["done"] for r in streams["ranks"]}
            counted = {r: f["batches"] for r, f in enumerate(tallies)}
            if made != counted:  # the stream's place and the run's counts must tell one story
                raise InputError(f"{path}: the stream state says the ranks made {short(made)} batches of this "
                                 f"epoch, the run counted {short(counted)}; the checkpoint is damaged")
            earlier = sum(r["done"] * r["world"] * r["batch_size"] for r in streams["segment"]["before"])
            carried = sum(sum(f["samples"]) for f in (before or {}).values())
            if earlier != carried:  # what earlier worlds read of this epoch, by the stream and by the run
                raise InputError(f"{path}: the stream state says earlier worlds read {earlier} samples of this epoch, "
                                 f"the run carried tallies of {carried}; the checkpoint is damaged")
            if not args.sample_stage:  # without stages that drop samples, only damage passes positions over:
                # each damaged position of a rank's runs is counted skipped by that rank, and only after
                # one does a pair read replacements (their damage passed over, not counted again)
                odd = {r: n for r, n in dealt["passed"].items() if (n > 0) != (tallies[r]["skipped"] > 0)
                       or tallies[r]["skipped"] > n}
                if odd:
                    r = next(iter(odd))
                    raise InputError(f"{path}: the stream state says rank {r} passed over {odd[r]} positions "
                                     f"without a sample, the run counted {tallies[r]['skipped']} skipped; the "
                                     f"checkpoint is damaged")
            if dealt["deal"] == "same":  # same world and workers
                self.tally, self.before_resume = tallies[self.topo.rank], before
            else:  # another world size: what the old ranks did this epoch is carried into the summary
                self.before_resume = _before_resume(tallies, before)
            self.unlogged = got["log_sums"]
        notes += self._schedule_moves(saved, got["world"], limits.batch_size)
        if self.topo.is_main:
            for line in notes:
                print(f"resume: {line}", flush=True)
        changed = {}
        if saved.get("weights") != self.fingerprint["weights"] or \
                saved.get("final_weights") != self.fingerprint["final_weights"]:
            changed["weights"] = _weights_change(args, saved, self.epoch + 1 if self.in_epoch else self.epoch)
        if data:
            changed["data"] = {name: {"from": was, "to": now} for name, (was, now) in data.items()}
        return changed

    def _keep_mixture(self, streams, saved):
        """The interrupted epoch goes on with the mixture it started with (its stream state's split
        of the epoch): new --weights, --final-weights or --epochs (which moves the interpolation)
        apply from the next epoch. Returns the line that says so, if they moved it."""
        args, epoch = self.args, self.epoch
        targets = streams.get("targets")
        now = [int(t) for t in order.apportion(self.stream.epoch_samples,
                                               list(options.weights_at(args, epoch).values()))]
        if not (isinstance(targets, list) and len(targets) == len(self.names)
                and all(type(t) is int and t >= 0 for t in targets) and sum(targets) > 0) or targets == now:
            return []  # (a malformed split is the stream's to refuse)
        kept = {n: t / sum(targets) for n, t in zip(self.names, targets)}
        args.kept_weights = {epoch: kept}
        was = (saved.get("schedule") or {}).get("epochs")
        why = [f"--epochs {was} -> {args.epochs}"] if was not in (None, args.epochs) else []
        why += ["--weights"] if saved.get("weights") != self.fingerprint["weights"] else []
        why += ["--final-weights"] if saved.get("final_weights") != self.fingerprint["final_weights"] else []
        return [f"epoch {epoch + 1} keeps the mixture it started with ({_mix(kept)}); "
                f"{' and '.join(why) or 'the new settings'} apply from epoch {epoch + 2} "
                f"({_mix(options.weights_at(args, epoch + 1)) if epoch + 1 < args.epochs else 'none left'})"]

    def _schedule_moves(self, saved, world, batch):
        """One line where the learning rate at the resumed step differs from what the checkpoint's run
        would have used: from, to, and why (the global batch, --lr, --epochs)."""
        was = saved.get("schedule") or {}
        lr, epochs = was.get("lr", self.args.lr), was.get("epochs", self.args.epochs)
        samples = was.get("samples", self.stream.epoch_samples)
        if not (isinstance(lr, (int, float)) and all(type(n) is int and n >= 1 for n in (epochs, samples))):
            return []
        old = learning_rate(argparse.Namespace(lr=lr), world * batch, self.seen, samples * epochs)
        new = self.lr()
        if math.isclose(old, new, rel_tol=1e-9, abs_tol=0.0):
            return []
        why = []
        if world * batch != self.global_batch:
            why.append(f"the global batch is {self.topo.world} x {self.args.batch_size} = {self.global_batch} samples, "
                       f"the checkpoint's {world} x {batch} = {world * batch} (--lr is the rate for "
                       f"{BASE_BATCH}; --global-batch {world * batch} keeps it)")
        if lr != self.args.lr:
            why.append(f"--lr {lr} -> {self.args.lr}")
        if epochs != self.args.epochs:
            why.append(f"--epochs {epochs} -> {self.args.epochs} stretches the schedule")
        if samples != self.stream.epoch_samples:
            why.append(f"an epoch is {self.stream.epoch_samples} samples, was {samples}")
        return [f"the learning rate at step {self.step} moves from {old:.6g} to {new:.6g}: {'; '.join(why)}"]


def _weights_change(args, saved, first):
    """The weights_changed record: the mixture the checkpoint's settings give epoch `first` (the
    first the new settings govern: an interrupted epoch keeps the mixture it started with) and the
    one this run gives it, as that epoch's train lines carry it; with no epoch left, the last
    epoch's, and "from_epoch" null. Weights of a damaged checkpoint that make no schedule are
    named as saved."""
    epoch = min(first, args.epochs - 1)
    was = saved.get("weights")
    final, epochs = saved.get("final_weights"), (saved.get("schedule") or {}).get("epochs")
    if _weight_list(was, len(args.train)) and (final is None or _weight_list(final, len(args.train))) \
            and type(epochs) is int and epochs >= 1:
        was = _schedule_at(was, final, epochs, args.train, epoch)
    return {"from": was, "to": _schedule_at(args.weights, args.final_weights, args.epochs, args.train, epoch),
            "from_epoch": epoch + 1 if first < args.epochs else None}


def _schedule_at(weights, final, epochs, names, epoch):
    """The weights a --weights/--final-weights/--epochs schedule gives `epoch` (options.weights_at,
    without a resumed epoch's kept mixture), rounded as the fingerprint rounds them."""
    plan = argparse.Namespace(weights=weights, final_weights=final, epochs=epochs, train=names)
    return [round(w, 12) for w in options.weights_at(plan, epoch).values()]


def _weight_list(w, n):
    return isinstance(w, list) and len(w) == n and all(type(x) in (int, float) for x in w)


def _mix(weights):
    return ", ".join(f"{n} {w:.4g}" for n, w in weights.items())


class NonFiniteLoss(Exception):
    """The loss stopped being a number: the run stops rather than train on (exit code 3)."""


def _before_resume(tallies, before):
    """Per-rank tallies of the part of an epoch run on another world size, for the summary;
    `before`: those of still earlier world sizes, which a rank's tally adds to (two re-deals in
    an epoch each count)."""
    out = dict(before or {})
    for r, f in enumerate(tallies):
        key = f"before_resume_rank{r}"
        if key in out:
            g = out[key]
            f = {"batches": g["batches"] + f["batches"], "samples": [a + b for a, b in zip(g["samples"], f["samples"])],
                 "skipped": g["skipped"] + f["skipped"], "wait": g["wait"] + f["wait"], "busy": g["busy"] + f["busy"],
                 **({"keys": g["keys"] + f["keys"]} if "keys" in g and "keys" in f else {})}
        out[key] = f
    return out


def where(run):
    """'epoch E, step S' inside an epoch, 'the end of epoch E, step S' between two (E from 1)."""
    if run.in_epoch:
        return f"epoch {run.epoch + 1}, step {run.step}"
    return f"the end of epoch {run.epoch}, step {run.step}"


