"""Stopping on a scheduler's signal: finish the step, agree, checkpoint, say how to resume.

Schedulers stop jobs with a signal and a grace period (SLURM: SIGTERM, or SIGUSR1 with
`--signal`; torchrun forwards the SIGTERM or SIGINT it gets to every rank and kills them
30 s later, `--shutdown-timeout`). A signal only raises a flag here; the ranks add their
flags up in the all-reduce every step already does, so all of them stop after the same
step, even when a single rank got the signal, and write one mid-epoch checkpoint
together. A second signal ends the process at once, even inside a collective that waits for
a rank that is gone; but the same signal again within TWICE seconds is the same stop: a
scheduler that signals the whole group (scancel, timeout) reaches each rank twice, once
itself and once through torchrun, and a rank ended by the second left its peers in a
collective with a traceback and the epoch unsaved (the final hostile pass).

Exit code: torchrun has no convention for a clean, resumable stop: it counts any non-zero
exit of a worker as a failure (and restarts the group if `--max-restarts` allows) and ends
with a traceback of its own when it gets the signal itself. The trainer exits with
128 + the signal's number (143 for SIGTERM, 130 for SIGINT, 138 for SIGUSR1): what shells,
SLURM and Kubernetes report for a process ended by that signal, so a requeue script that
keys on 143 treats a clean stop and a hard kill (a second signal, the grace period over)
alike; both leave a complete checkpoint to resume from.

A stop that waits for a step can wait long: in a single process at `--workers 0` the step's
next batch is read in the trainer itself, and a read stalled inside its deadline (`--io-timeout`)
held a SIGTERM for 40 s, past torchrun's 30 s (hostileK 7). So while a single process waits for
its next batch, its start-up's reads (manifests, indexes made on first use) or its evaluation
(`interruptible`), the signal raises `Interrupted` there (PEP 475: a handler that
raises ends a blocking recv or lock wait), a BaseException that no `except Exception` on the way
takes for a read's failure; the batch not yet trained is dropped, and the stop checkpoints after
the last step trained (at start-up nothing was begun; an evaluation's epoch is saved before it). With several ranks it only notes the signal: another rank may already be
in the gradient all-reduce of the step that batch belongs to, and a rank that left it there would
leave it waiting.

Stdlib only: the command line checks `--stop-signals` before torch is imported.
"""
import contextlib
import os
import shlex
import signal
import sys
import time

DEFAULT = "TERM,INT,USR1"
# What schedulers and people send to ask for a stop. Others arrive on their own (CHLD when a
# pipe: command ends, WINCH, PIPE, CONT, the fault signals) or cannot be caught (KILL, STOP).
ALLOWED = ("TERM", "INT", "USR1", "USR2", "HUP", "QUIT", "XCPU")
TWICE = 2.0  # s: the same signal again this soon is the group's copy of the first, not a second request


def parse_signals(text):
    """'TERM,INT,USR1' (SIG prefix and case optional; '' for none) -> [Signals]; ValueError."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        name = part.upper().removeprefix("SIG")
        if name.isdigit() and int(name) in {int(getattr(signal, "SIG" + n)) for n in ALLOWED}:
            name = signal.Signals(int(name)).name.removeprefix("SIG")
        if name not in ALLOWED:
            raise ValueError(f"{part!r}: not a stop signal; choose from {','.join(ALLOWED)} (others arrive "
                             f"on their own, like CHLD when a pipe: command ends, or cannot be caught)")
        sig = getattr(signal.Signals, "SIG" + name)
        if sig not in out:
            out.append(sig)
    return out


class Interrupted(BaseException):
    """A stop signal that came while the trainer waited for its next batch
    (`StopRequest.interruptible`). A BaseException, as KeyboardInterrupt is: the reads' retry
    loops and every `except Exception` let it through."""

    def __init__(self, sig):
        super().__init__(sig.name)
        self.signal = sig


class StopRequest:
    """The stop signals' handlers while a training runs (a context manager that puts the
    previous ones back, or with `keep` leaves its own: the process's entry point, whose run is
    over and saved once it exits, so that a signal before the process ends is the first one
    and changes nothing, where the default action gave a finished run a death by signal).
    `vector()` is this process's vote, one slot per stop signal; `agreed(sums)` reads the
    ranks' summed votes: the signal all stop for, or None."""

    def __init__(self, signals, argv, keep=False):
        self.signals, self.argv, self.keep = list(signals), list(argv), keep
        self.got = None  # the first signal this process received
        self.pid = os.getpid()
        self.previous = {}
        self.waiting = False  # inside `interruptible`: the first signal raises Interrupted

    def __enter__(self):
        global _ACTIVE
        for sig in self.signals:
            self.previous[sig] = signal.signal(sig, self._handle)
        _ACTIVE = self
        return self

    def __exit__(self, *exc):
        global _ACTIVE
        _ACTIVE = None
        self.waiting = False
        if self.keep:
            return False
        for sig, old in self.previous.items():
            signal.signal(sig, old)
        return False

    def _handle(self, signum, frame):
        if os.getpid() != self.pid:  # a forked child: not ours
            return
        if self.got is None:
            self.got, self.at = signal.Signals(signum), time.monotonic()
            if self.waiting:
                self.waiting = False
                raise Interrupted(self.got)
            return
        if signum == self.got and time.monotonic() - self.at <= TWICE:  # the group's copy of the first
            return
        for sig in self.signals:  # a second signal ends the process at once
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    @contextlib.contextmanager
    def interruptible(self):
        """Wait here for the next batch: a stop signal raises `Interrupted` (one already noted
        too). Only where dropping what is being read loses nothing: a batch not yet trained."""
        self.waiting = True
        try:
            if self.got is not None:
                raise Interrupted(self.got)
            yield
        finally:
            self.waiting = False

    def vector(self):
        return [1.0 if self.got == sig else 0.0 for sig in self.signals]

    def agreed(self, sums):
        return next((sig for sig, n in zip(self.signals, sums) if n > 0), None)


_ACTIVE = None


def _block_in_child():
    """A process forked while a run is on (a loader worker) leaves the stop signals to
    the trainer: blocked there. torchrun signals each rank's whole process group (os.killpg),
    and a Ctrl-C reaches the terminal's process group, so without this the workers die
    under a trainer that is still finishing its step and writing its checkpoint (torch's
    worker handler ends a worker on a SIGTERM that is not from its parent). A worker with
    SIGTERM blocked no longer ends on DataLoader's own terminate(), so `end_children` kills
    what is left when the trainer ends."""
    if _ACTIVE is not None and _ACTIVE.signals:
        signal.pthread_sigmask(signal.SIG_BLOCK, _ACTIVE.signals)


def end_children():
    """Kill the multiprocessing children still alive at the trainer's end (workers that did
    not stop when their loader asked; SIGTERM is blocked in them) and the pipe: commands they
    started, so that Python's exit, which joins them, does not wait forever, and no command
    outlives the trainer. SIGCHLD's DataLoader handler goes first: it
    would report those deaths as a worker failure."""
    import multiprocessing

    from pipeline.data.store.transports import end_process

    children = multiprocessing.active_children()
    if not children:
        return
    previous = signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    try:
        for p in children:
            end_process(p)
    finally:
        signal.signal(signal.SIGCHLD, previous)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_block_in_child)


def ignore_at_exit(signals):
    """At the process's exit (its first atexit hook, which runs last): the stop signals ignored.
    Python puts the default action back as it tears itself down, after every atexit hook, and a
    signal then (torchrun's, a scheduler's, just after the run's "done" line) ended a finished,
    saved run by the signal (rc -15). Until then StopRequest(keep=True)'s handler stays: a first
    signal changes nothing, a second ends a stuck exit."""
    import atexit

    atexit.register(lambda: [signal.signal(sig, signal.SIG_IGN) for sig in signals])


def exit_code(sig):
    """128 + the signal's number, as for a process the signal ended (see the module's docstring)."""
    return 128 + int(sig)


def resume_command(argv):
    """The command that continues this run: the launcher's own command line under torchrun
    (the parent process, when its arguments end with this rank's), else `python -m
    pipeline.train`, with --resume added (unless --resume or --resume-or-start is there)
    and --overwrite taken out."""
    args = [a for a in argv if not (len(a) >= 4 and "--overwrite".startswith(a) and a.startswith("--ov"))]
    if not any(len(a) >= 5 and "--resume-or-start".startswith(a) for a in args):  # argparse takes abbreviations
        args.append("--resume")
    return shlex.join(launcher(argv) + args)


def launcher(argv):
    """The words before the trainer's arguments in the command that started this job."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        try:
            with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
                words = [w.decode(errors="replace") for w in f.read().split(b"\0")[:-1]]
        except OSError:
            words = []
        n = len(argv)
        if words and (n == 0 or words[-n:] == list(argv)) and len(words) > n:
            words = words[:len(words) - n]
            if len(words) > 1 and os.path.basename(words[1]) == "torchrun":
                words = words[1:]  # `python .../bin/torchrun ...` is what `torchrun ...` runs
            return words
        return ["torchrun", "...", "-m", "pipeline.train"]
    if os.path.basename(sys.argv[0] if sys.argv else "") == "pipeline-train":  # the installed command
        return ["pipeline-train"]
    return [sys.executable or "python", "-m", "pipeline.train"]
