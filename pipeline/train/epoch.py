"""One epoch over the mixed stream: steps, metrics lines, key logs, mid-epoch checkpoints,
and the epoch's entry in the run's history.

Apart from the run's state (pipeline.train.run) so that the order of things within a
step, which a resume must reproduce exactly, reads top to bottom in one function.
"""
import sys
import time

import torch

from pipeline.ordering import order
from pipeline.train import dist, options
from pipeline.train.console import progress_bar
from pipeline.train.metrics import StepLog
from pipeline.train.run import NonFiniteLoss
from pipeline.train.stop import Interrupted


def train_epoch(run, loader, epoch, metrics, keys, budget):
    """One epoch (or its rest) over the mixed stream; returns False if --stop-after-steps or
    a stop signal (run.stopping) ended it early (a checkpoint was written).

    A step queues its work and goes on: the host reads the device only where the step log is
    reduced (`settle`: a metrics line every --log-every steps, a checkpoint, the epoch's last
    step), and that is where skipped steps are counted; the ranks agree on a stop signal a step
    after it came, on the CPU (dist.Votes)."""
    args, topo = run.args, run.topo
    weights = options.weights_at(args, epoch)
    resumed = run.in_epoch
    if not resumed:
        run.stream.set_epoch(epoch, weights)
        run.tally = run.new_tally()
    gen = torch.Generator()
    log = StepLog(run.names, run.device, topo.is_main)
    if resumed:
        log.restore(run.unlogged, topo.is_main)
    run.in_epoch = True
    left = run.stream.remaining()
    segment = run.stream.current()
    made = segment.batches - left  # this rank's batches of the segment before this pass
    done_before = run.tally["batches"]
    bar = progress_bar(topo, done_before + left, f"epoch {epoch + 1}/{args.epochs}", done_before)
    per_source = torch.zeros(len(run.names), dtype=torch.int64, device=run.device)  # where the batch is: no wait
    votes = dist.Votes()
    t0 = time.perf_counter()
    got = 0
    batches = iter(loader)  # on run.device already (make_loader's device); workers persist and pick up set_epoch
    try:  # the bar closes however the epoch ends: an error line after it must be the last line
        while (batch := next_batch(run, batches, due=got < left)) is not None:
            run.stream.record(batch["state"])  # this batch is trained now: the stream's place is after it
            t1 = time.perf_counter()
            run.startup.setdefault("first_batch_s", round(t1 - run.t0, 3))
            run.tally["wait"] += t1 - t0
            # augmentation keyed by the batch's place, as the data's order is: a resume on the same world
            # draws the same, and no two ranks or batches share a key
            gen.manual_seed(order.seed_of((order.AUGMENT, args.seed, epoch, segment.generation, topo.rank, made + got)))
            losses, source, found = run.step_once(batch, gen)
            got += 1
            run.tally["batches"] += 1
            run.tally["skipped"] += batch["skipped"]
            # bincount on CUDA reads its max
            per_source.index_add_(0, batch["source"], torch.ones_like(batch["source"]))
            log.add(run.step, losses, source, found)
            log.skipped += batch["skipped"]
            if args.record_keys:
                keys.add(epoch + 1, batch["key"])
                if "keys" in run.tally:  # (a tally from a checkpoint written before it counted them: unknown)
                    run.tally["keys"] += len(batch["key"])
            if bar is not None:
                bar.update(1)
            if run.stopper is not None and run.stopping is None:  # a step late, without waiting (dist.Votes)
                run.stopping = run.stopper.agreed(votes.cast(run.stopper.vector()) or [])
            last = got == left
            logged = run.step % args.log_every == 0 or last
            ending = budget(run.step) or run.stopping is not None
            saving = not last and (bool(args.checkpoint_every) and run.step % args.checkpoint_every == 0 or ending)
            if logged or saving:
                sums = settle(run, log, metrics, epoch)
                if logged:
                    line = log.line(sums)
                    if bar is not None:
                        bar.set_postfix(loss=f"{sum(line['loss'][k] * line['share'][k] for k in run.names):.3f}",
                                        refresh=False)  # drawn with the next update, at the bar's own pace
                    metrics.log(kind="train", epoch=epoch + 1, step=run.step, lr=run.opt.param_groups[0]["lr"],
                                weights=weights, **line)
                    sums = None
                if saving:
                    run.tally["samples"] = [a + b for a, b in zip(run.tally["samples"], per_source.tolist())]
                    per_source.zero_()
                    run.save(keys, sums)
                    if ending:
                        votes.drain()
                        return False
            t0 = time.perf_counter()
            run.tally["busy"] += t0 - t1
        votes.drain()
        if run.stopping is not None and got < left:  # a stop signal while the next batch was read (next_batch):
            # the checkpoint is after the last step trained, as a stop at that step writes it
            sums = settle(run, log, metrics, epoch)
            run.tally["samples"] = [a + b for a, b in zip(run.tally["samples"], per_source.tolist())]
            run.save(keys, sums)
            return False
    finally:
        if bar is not None:
            bar.close()
    run.tally["samples"] = [a + b for a, b in zip(run.tally["samples"], per_source.tolist())]
    gather_epoch(run, epoch)
    run.in_epoch = False
    return True


def next_batch(run, batches, due):
    """The loader's next batch, or None at its end or, when a stop signal came while a single
    process waited for it (run.stopping is then set), None at once: a read stalled within its
    deadline no longer holds the stop (pipeline.train.stop). `due`: a batch is expected, so one
    being read is abandoned untrained; the pass's end is waited for."""
    stopper = run.stopper
    if stopper is None or not due or run.topo.world > 1:
        return next(batches, None)
    try:
        with stopper.interruptible():
            return next(batches, None)
    except Interrupted as e:
        run.stopping = e.signal
        return None


def settle(run, log, metrics, epoch):
    """Read what the steps since the last read left on the device (StepLog.reduce, one wait):
    the steps skipped for a non-finite loss are recorded (the run ends once more than
    --max-nonfinite were). Returns the reduced sums."""
    sums, skipped_steps, _ = log.reduce()
    for step, where in skipped_steps:
        skip_nonfinite(run, metrics, epoch, step, where)
    return sums


def skip_nonfinite(run, metrics, epoch, step, where):
    """A step whose loss was not finite (its weights were not updated): recorded in
    metrics.jsonl, and the end of the run once more than --max-nonfinite were skipped."""
    run.nonfinite += 1
    metrics.log(kind="nonfinite", epoch=epoch + 1, step=step, samples=where, skipped_steps=run.nonfinite)
    allowed = run.args.max_nonfinite
    what = (f"the loss is not finite for {', '.join(f'{n} ({c} of its samples)' for n, c in where.items())}"
            if where else "the gradients are not finite")
    if run.nonfinite > allowed:
        raise NonFiniteLoss(
            f"step {step} (epoch {epoch + 1}): {what}; the weights were not updated and any "
            f"checkpoint in {run.args.out}/ is from before it ({run.nonfinite} such step(s), --max-nonfinite "
            f"{allowed}; a lower --lr often helps)")
    if run.topo.is_main:
        print(f"step {step}: non-finite {'loss for ' + ', '.join(where) if where else 'gradients'}; step skipped "
              f"({run.nonfinite} of at most {allowed})", file=sys.stderr, flush=True)


def gather_epoch(run, epoch):
    """Add one epoch's batches and samples per rank (and skipped samples) to the history."""
    tallies = dist.all_gather(run.tally)
    entry = {"epoch": epoch + 1, "batches": {f"rank{r}": f["batches"] for r, f in enumerate(tallies)},
             "samples": {n: {f"rank{r}": f["samples"][i] for r, f in enumerate(tallies)}
                         for i, n in enumerate(run.names)},
             "skipped": sum(f["skipped"] for f in tallies)}
    if all("keys" in f for f in tallies):
        entry["keys"] = {f"rank{r}": f["keys"] for r, f in enumerate(tallies)}
    if run.before_resume:
        entry["before_resume"] = run.before_resume
        entry["skipped"] += sum(f.get("skipped", 0) for f in run.before_resume.values())
        run.before_resume = None
    run.history["epochs"].append(entry)
    run.history["wait"] = run.history.get("wait", 0.0) + tallies[0]["wait"]
    run.history["busy"] = run.history.get("busy", 0.0) + tallies[0]["busy"]
