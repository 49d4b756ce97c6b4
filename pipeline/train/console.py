"""The console: rank 0's progress bar, and error and warning lines that stay one line each.

Apart from the training because what reaches a terminal has rules of its own: ranks
and loader workers share one stderr, and a name read from a file may hold control
characters (cli.printable).
"""
import sys

from pipeline import cli


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
    if _is_terminal(sys.stderr):
        return tqdm(total=total, initial=initial, desc=desc, unit="batch", dynamic_ncols=True, file=sys.stderr)
    return tqdm(total=total, initial=initial, desc=desc, unit="batch", ncols=100, mininterval=LOG_INTERVAL,
                file=_Lines(sys.stderr))


LOG_INTERVAL = 30.0  # seconds between a log file's progress lines


class _Lines:
    """tqdm's output for a log file: each redraw a line of its own. tqdm redraws in place
    with a carriage return and no newline, so a warning or an error written meanwhile (by a
    loader worker or another rank, which can't reach the bar) would continue the bar's
    line, and a search for lines starting "pipeline.train: warning" would miss it."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text):
        text = text.replace("\r", "").replace("\x1b[A", "").rstrip("\n")
        if text.strip():
            self.stream.write(text + "\n")

    def flush(self):
        self.stream.flush()


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
    return f"{clear}pipeline.train: warning: {cli.printable(message)}\n"


def _is_terminal(stream):
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # replaced by an object without it, or closed
        return False
