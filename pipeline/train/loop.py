"""Train one model with DDP on the weighted mix of several shard streams.

    torchrun --nproc_per_node=2 -m pipeline.train --train mnist=shards/ --train cifar10=shards/ \\
        --eval mnist=shards/ --eval cifar10=shards/ --out runs/mnist-cifar10

Options: pipeline/train/options.py (`--help`). Per epoch: train on the mixed stream,
evaluate every --eval source exactly once over all ranks, write the checkpoint
(also every --checkpoint-every steps). A resumed run continues where the
checkpoint stopped, inside an epoch too, and on another number of ranks.

This module is the run from start to end (`train`) and the exit codes (`main`); each
part has a module of its own: schedule (learning rate), run (model, optimiser,
checkpoint), epoch (the steps of one epoch), evaluate, summary, outdir (--out) and
console (progress bar, error and warning lines).
"""
import contextlib
import json
import os
import re
import sys
import time

import torch

from pipeline import stream
from pipeline.data.store import remote
from pipeline.writers import autoindex
from pipeline.train import dist, guard, options, stop
from pipeline import cli
from pipeline.data.handover.workers import WorkerDied
from pipeline.errors import InputError
from pipeline.files import open_regular
from pipeline.train.console import mix_line, one_line, settings_line
from pipeline.train.epoch import train_epoch
from pipeline.train.evaluate import epoch_line, eval_loaders, evaluate, evaluate_only, memory_format
from pipeline.train.metrics import KeyLog, Metrics
from pipeline.train.outdir import Unstarted, check_out, prepare_out, record_job
from pipeline.train.run import NonFiniteLoss, Run, where
from pipeline.train.summary import write_summary


def http_check(topo, policy):
    """HEAD-check each http(s) shard once per job: every rank checks its share, then all
    ranks learn every verdict (one all_gather)."""
    def check(urls, sizes):
        mine = remote.head_check(urls[topo.rank::topo.world], sizes, policy=policy)
        found = dist.all_gather(mine)
        return [p for f in found for p in f[0]], [p for f in found for p in f[1]]
    return check


def train(args, topo, device, stopper=None, progress=None):
    """The run; `stopper`: the stop signals' StopRequest (None: no stop on a signal); `progress`:
    a dict where "began" is set once the job writes into --out (a failure after it is one to
    continue or start again from: main's say_resume)."""
    t0 = time.perf_counter()
    try:
        options.per_rank_batch(args, topo.world)  # --global-batch: each rank's share, now that the world is known
    except ValueError as e:
        raise InputError(str(e)) from None
    plan = check_out(args, topo)  # before any shard is indexed or read (--eval-only's checkpoint too)
    policy = remote.Policy(**cli.io_limits(args))
    check = http_check(topo, policy)
    found = dict(policy=policy, check_http=check, cache_dir=args.cache_dir, progress=topo.is_main)  # shards with no
    # manifest are indexed on first use, by the first rank to take the lock (pipeline.writers.autoindex)
    try:
        with alone(stopper, topo):  # a stalled manifest read no longer holds a stop signal
            train_sources = [autoindex.trainable(stream.resolve(n, spec, "train", **found))
                             for n, spec in args.train.items()]
            trained = {s.name: s for s in train_sources}  # an --eval indexed here takes its training source's classes
            eval_sources = [autoindex.trainable(stream.resolve(n, spec, "test", classes_from=trained.get(n), **found))
                            for n, spec in args.eval.items()]
    except stop.Interrupted as e:
        return unstarted(args, topo, e.signal)
    startup = {"resolve_s": round(time.perf_counter() - t0, 3), "torch_threads": torch.get_num_threads()}
    busy = dist.busy_line(torch.get_num_threads(), 0 if args.eval_only else args.workers)  # said once the run
    # will train or evaluate, as the settings line: not before a refusal that has nothing to do with it
    if topo.is_main:
        guard.warn_data(train_sources, eval_sources)
        guard.warn_loader_timeout(args, policy, train_sources + eval_sources)
    if args.decode_on == "device" and device.type != "cuda":  # what ran, in summary.json's config too
        if topo.is_main:
            print("pipeline-train: note: --decode-on device needs a GPU; this CPU run decodes on the host",
                  file=sys.stderr, flush=True)
        args.decode_on = "host"
    def start_loader(train_stream):
        """The memory check, then the loader's workers, started while the model is built: they fork
        before CUDA starts here and read the first batches meanwhile. On a GPU each batch arrives
        there (make_loader's device). record=False: the epoch records each batch as it trains it."""
        guard.check_memory(args, train_stream, len(eval_sources), device)  # before any loader starts or reads
        if args.eval_only:
            return None
        return stream.make_loader(train_stream, args.workers, record=False,
                                  device=device if device.type == "cuda" else None,
                                  decode=args.decode_on, memory_format=memory_format(args),
                                  timeout=args.loader_timeout or None).start()

    try:
        run = Run(args, topo, device, train_sources, eval_sources, policy=policy, started=t0, startup=startup,
                  before_model=start_loader)
    except InputError:
        raise
    except ValueError as e:  # the stream's checks of the options against the data (an epoch too short, ...)
        raise InputError(str(e)) from e
    if args.eval_only:
        note_busy(busy, topo)
        return evaluate_only(run)
    run.stopper = stopper
    try:
        ckpt = prepare_out(args, topo, plan, stopper)
    except Unstarted as e:  # a stop signal while the run got ready (shards indexed on first use, ...)
        return unstarted(args, topo, e.signal)
    changed = run.resume(ckpt) if ckpt else {}
    if ckpt and topo.is_main:
        saved = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(os.path.getmtime(ckpt)))
        print(f"resumed from {where(run)} (saved at {saved})", flush=True)
    done = ckpt and run.epoch >= args.epochs and not run.in_epoch
    # a run whose every epoch is saved but which has no summary.json stopped in its last evaluation (or
    # its summary): the resume finishes that, as rank 0 sees the folder (one answer for every rank)
    pending = bool(run.evals) and missing_eval(args, topo, run, ckpt)  # its saved epoch's evaluation is missing
    unfinished = done and (pending or not dist.all_gather(os.path.exists(os.path.join(args.out, "summary.json")))[0])
    if done and not unfinished:  # before anything in --out is written
        if topo.is_main:
            epochs = f"{args.epochs} epoch{'s' if args.epochs != 1 else ''}"
            print(f"nothing to do: the checkpoint in {args.out}/ has finished all {epochs}; raise "
                  f"--epochs to train further (its files are left as they were)", flush=True)
        return None
    if topo.is_main:
        record_job(args.out)  # a torchrun restart of this job takes the run over (outdir.prepare_out)
        print(settings_line(args, topo.world, device), flush=True)  # not for a run with nothing left to train
        print(mix_line(args, run, topo.world), flush=True)
    note_busy(busy, topo)
    if progress is not None:
        progress["began"] = True
    metrics = Metrics(os.path.join(args.out, "metrics.jsonl"), topo.is_main, resume_step=run.step if ckpt else None)
    if ckpt:  # where a resume began, on which world (the report marks it)
        metrics.log(kind="resumed", epoch=run.epoch + 1, step=run.step, world=topo.world, workers=args.workers,
                    channels_last=args.channels_last)  # free to change on resume, as the workers are
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
    loader = run.loader
    evals_from = eval_loaders(run)
    started = run.step
    resumed_from = {"epoch": run.epoch + 1, "step": run.step} if ckpt else None

    def budget(step):
        return args.stop_after_steps is not None and step - started >= args.stop_after_steps

    t_start, evals = time.time(), {}
    if run.evals and (unfinished or pending):  # the saved epoch's evaluation, which failed or was stopped (a
        # signal, a kill) after its checkpoint, or the summary after it
        if pending and topo.is_main:
            print(f"pipeline-train: note: epoch {run.epoch}'s evaluation is missing (it failed or was stopped after "
                  f"the epoch was saved): evaluating it now", file=sys.stderr, flush=True)
        try:
            with alone(stopper, topo):
                evals = evaluate(run, evals_from)
        except stop.Interrupted as e:  # still saved; the next --resume evaluates it
            run.stopping = e.signal
            metrics.log(kind="stopped", epoch=run.epoch, step=run.step, signal=e.signal.name)
            return write_summary(run, {}, t_start, resumed_from, False, train_sources)
        metrics.log(kind="eval", epoch=run.epoch, step=run.step, eval=evals)
        if topo.is_main:
            print(epoch_line(run.epoch - 1, args.epochs, evals), flush=True)
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
        run.epoch = epoch + 1
        run.save(keys)  # before the evaluation: one that fails (a test shard gone) keeps the epoch's training
        if run.evals:
            try:
                with alone(stopper, topo):  # a stalled test read no longer holds a stop signal
                    evals = evaluate(run, evals_from)
            except stop.Interrupted as e:  # the epoch is saved; --resume evaluates it (missing_eval)
                run.stopping, finished = e.signal, False
                metrics.log(kind="stopped", epoch=run.epoch, step=run.step, signal=e.signal.name)
                break
            except Exception:
                if topo.is_main:  # else a resume goes on with no word of the missing accuracy
                    one_line(f"pipeline-train: note: epoch {epoch + 1} is saved, its evaluation failed: "
                             "--resume evaluates it")
                raise
            metrics.log(kind="eval", epoch=epoch + 1, step=run.step, eval=evals)
            if topo.is_main:
                print(epoch_line(epoch, args.epochs, evals), flush=True)
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


def missing_eval(args, topo, run, ckpt):
    """A resume from an epoch's end whose evaluation metrics.jsonl lacks (it failed, or a signal or
    a kill ended it: the checkpoint is written before it): rank 0's answer, for every rank."""
    if not ckpt or run.in_epoch or run.epoch < 1:
        return False
    found = False
    if topo.is_main:
        try:  # a FIFO or device in its place is refused in one line, as every file of the run folder is
            with open_regular(os.path.join(args.out, "metrics.jsonl")) as f:
                found = any(_eval_of(ln, run.epoch) for ln in f)
        except FileNotFoundError:  # no log: evaluate again, it costs one pass
            found = False
    return not dist.all_gather(found)[0]


def _eval_of(line, epoch):
    """Whether a metrics.jsonl line is the evaluation of `epoch`; a damaged line (cut, edited) is not."""
    try:
        record = json.loads(line)
    except ValueError:
        return False
    return isinstance(record, dict) and record.get("kind") == "eval" and record.get("epoch") == epoch


def alone(stopper, topo):
    """StopRequest.interruptible for a single process (a stop signal there raises Interrupted at
    once: a read stalled within --io-timeout no longer holds it), else nothing: with several ranks
    one that left would leave the others waiting in a collective (pipeline.train.stop)."""
    if stopper is None or not stopper.signals or topo.world > 1:
        return contextlib.nullcontext()
    return stopper.interruptible()


def unstarted(args, topo, sig):
    """A stop signal before the run began: --out untouched, said once."""
    if topo.is_main:
        print(f"pipeline-train: stopped by {sig.name} before the run began; {args.out}/ is left as it was",
              file=sys.stderr, flush=True)
    return {"stopped_by": sig.name}


def note_busy(busy, topo):
    """dist.busy_line's note, once a machine (local rank 0)."""
    if busy and topo.local_rank == 0:
        print(f"pipeline-train: note: {busy}", file=sys.stderr, flush=True)


_CLASS = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Za-z_]\w*(?:Error|Exception): ")  # a worker's "pkg.Class: "


def error_line(e):
    """The one line a failed run prints. A message that carries a traceback (an error re-raised
    from a loader worker, a stage's error quoting another tool's): its first line (what failed,
    where) and its last (how; alone, without its "pkg.Class: "); any other message whole, its lines joined
    (urllib's redirect loop says what and where in three)."""
    lines = [x.strip() for x in str(e).strip().splitlines()] or [""]
    if any("Traceback (most recent call last):" in x for x in lines):
        # what failed and where (the first line, unless the traceback starts the text) and how (the last)
        first = lines[0].replace("Traceback (most recent call last):", "").strip()
        last = _CLASS.sub("", lines[-1])
        line = f"{first} ... {lines[-1]}" if first and first != lines[-1] else last
    else:
        line = " ".join(lines)
        line = _CLASS.sub("", line)
    return line.replace(", and the next pass starts the workers again", "")  # this run makes no next pass


def main(argv=None, args=None, process=False):
    """The trainer's entry point; returns the exit code: 0 done (or stopped by
    --stop-after/--stop-after-steps), 2 bad input (one line), 3 a non-finite loss, 128 + N
    stopped by signal N with a checkpoint (pipeline.train.stop). Any other exception is a
    bug and keeps its traceback. `args`: already parsed from `argv` (python -m pipeline.train).
    process: the process ends with this run (its entry point), so the stop signals' handlers
    stay: a signal after the run, until the process ends, leaves its exit code as it is."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if args is None:
        args = options.parse(argv)
    dist.exit_with_launcher()
    stopper = stop.StopRequest([] if args.eval_only else stop.parse_signals(args.stop_signals), argv, keep=process)
    progress = {"began": False}
    try:
        with stopper, dist.distributed(timeout_s=args.timeout) as (topo, device), guard.out_lock(args.out, topo):
            summary = train(args, topo, device, stopper, progress)
    except (InputError, OSError) as e:
        one_line(f"pipeline-train: error: {error_line(e)}")  # bad input or the environment (disk, network)
        if isinstance(e, OSError) and not args.eval_only:  # bad input is fixed first: no command to repeat
            say_resume(args.out, argv, start_again=progress["began"])
        return 2
    except WorkerDied as e:  # killed (the OOM killer), or a crash in C: this run makes no next pass
        one_line(f"pipeline-train: error: {str(e).split('; the next pass')[0]}")
        say_resume(args.out, argv, start_again=progress["began"] and not args.eval_only)
        return 2
    except NonFiniteLoss as e:
        one_line(f"pipeline-train: error: {e}")
        return 3
    except KeyboardInterrupt:  # SIGINT left out of --stop-signals: every rank lands here, rank 0 says it
        if os.environ.get("RANK", "0") == "0":
            print(f"pipeline-train: interrupted; the last complete checkpoint stays in {args.out}/", file=sys.stderr)
        return 130
    finally:
        stop.end_children()
    if isinstance(summary, dict) and summary.get("stopped_by"):
        return stop.exit_code(signal_of(summary["stopped_by"]))
    return 0


def say_resume(out, argv, start_again=False):
    """After the environment failed (a store or a disk out, retries used up, a loader worker
    stuck or killed) the run's last checkpoint goes on once
    it is back, as after a scheduler's signal: say how, beside the error line (on each rank that
    failed: the others may be ended before they could say it). start_again: the run had begun
    (this job wrote into --out); where it wrote no checkpoint yet, say the command that starts
    it again: --resume-or-start, which starts over in a folder of a run that never saved one
    (outdir.never_saved)."""
    if os.path.isfile(os.path.join(out, "checkpoint.pt")):
        print(f"pipeline-train: the last checkpoint stays in {out}/; resume with: {stop.resume_command(argv)}",
              file=sys.stderr, flush=True)
    elif start_again:  # --resume would be refused without a checkpoint, a plain rerun by what --out holds
        again = stop.resume_command(argv)
        again = again[:-len("--resume")] + "--resume-or-start" if again.endswith(" --resume") else again
        print(f"pipeline-train: no checkpoint yet in {out}/; start again with: {again}", file=sys.stderr, flush=True)


def signal_of(name):
    import signal

    return signal.Signals[name]


if __name__ == "__main__":
    sys.exit(main())
