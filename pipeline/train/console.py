"""The console: rank 0's progress bar, and error and warning lines that stay one line each.

Apart from the training because what reaches a terminal has rules of its own: ranks
and loader workers share one stderr, and a name read from a file may hold control
characters (cli.printable).
"""
import sys

from pipeline import cli
from pipeline.train.options import DEFAULT_MODEL
from pipeline.train.schedule import BASE_BATCH


def progress_bar(topo, total, desc, initial=0):
    """A tqdm bar on rank 0; the other ranks stay quiet.

    Without tqdm's monitor thread: it starts with the first bar and exits with the last,
    and a loader worker forked while a thread starts or exits can deadlock in
    os.fork() on Python 3.8-3.11 (CPython gh-112275: the child waits forever on the
    interpreter's HEAD_LOCK). That was this project's intermittent hang: rank 0 forking
    the evaluation loader's worker just as the epoch's bar closed (seen with gdb)."""
    if not topo.is_main:
        return None
    from tqdm import tqdm

    tqdm.monitor_interval = 0
    return cli.progress(total=total, initial=initial, desc=desc, unit="batch")


def settings_line(args, world, device):
    """The run's settings as its log should show them, printed once as training starts: the
    model, the batch per rank and per step, the loader workers, --channels-last and the device
    (summary.json's config holds every option, but a log is what is read first)."""
    model = f"{args.model} (width {args.width})" if args.model == DEFAULT_MODEL else args.model
    ranks, workers = "rank" + "s" * (world != 1), "worker" + "s" * (args.workers != 1)
    return (f"training {model} on {device}: batch {args.batch_size} a rank x {world} {ranks} = "
            f"{args.batch_size * world} samples a step, {args.workers} loader {workers} a rank, "
            f"channels-last {'on' if args.channels_last else 'off'}")


def mix_line(args, run, world):
    """The epoch as the run will read it, printed under the settings line: how many epochs of how
    many samples and steps, the peak learning rate as scaled to the step's samples (--lr is the
    rate for BASE_BATCH; newuser5 read the unscaled one as the rate used), and each source's weight with the samples it gives
    an epoch against those it has (equal weights over sources of unequal sizes read the smaller
    ones more than once an epoch, which only metrics.jsonl showed)."""
    from pipeline.ordering.order import apportion
    from pipeline.train.options import weights_at

    weights = weights_at(args, run.epoch)
    total = sum(weights.values())
    taken = apportion(run.stream.epoch_samples, [weights[s.name] for s in run.sources])
    mix = []
    for src, n in zip(run.sources, taken.tolist()):
        again = f", read {n / src.total:.1f} times" if n > src.total else ""
        mix.append(f"{src.name} {weights[src.name] / total:.2f} ({n:,} samples of its {src.total:,}{again})")
    step = args.batch_size * world
    line = (f"{args.epochs} epoch{'s' * (args.epochs != 1)} of {run.stream.epoch_samples:,} samples "
            f"({run.stream.batches_per_epoch:,} steps an epoch), peak lr {args.lr * step / BASE_BATCH:.3g} "
            f"(--lr {args.lr:g} x {step} samples a step / {BASE_BATCH}); mix {', '.join(mix)}")
    last = weights_at(args, args.epochs - 1)
    if last != weights:  # --final-weights: the mix moves, epoch by epoch
        end = sum(last.values())
        line += f"; moving to {', '.join(f'{n} {w / end:.2f}' for n, w in last.items())} by epoch {args.epochs}"
    return line


def one_line(text):
    """An error line in one write, so that the lines of ranks failing together under torchrun
    do not run into each other."""
    clear = "\r\x1b[K" if _is_terminal(sys.stderr) else ""  # off rank 0's progress bar, as warnings are
    sys.stderr.write(clear + cli.printable(text) + "\n")  # an error may quote a key or a name from a file
    sys.stderr.flush()


def one_line_warning(message, category, filename, lineno, line=None):
    """Warnings as the trainer's other lines read: what happened, without the file, line
    number and source line of the stage that noticed it. On a terminal the line first
    clears rank 0's progress bar (carriage return, erase line), which redraws below it on
    its next update: a loader worker or another rank can't reach that bar's
    tqdm.write, and its warning would otherwise start in the middle of the bar."""
    clear = "\r\x1b[K" if _is_terminal(sys.stderr) else ""
    return f"{clear}pipeline-train: warning: {cli.printable(message)}\n"


_is_terminal = cli._is_terminal
