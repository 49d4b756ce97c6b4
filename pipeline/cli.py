"""Command-line plumbing shared by the entry points: the one-line error parser, byte sizes,
and the remote-read flags the trainer and `make_shards --index` share. It imports nothing
from `data`, `writers` or `train`: the flags fill the data path's limits
(`pipeline.data.store.remote.Policy(**io_limits(args))`), the caller builds them."""
import argparse
import difflib
import math
import re
import sys
import threading

from pipeline.errors import printable  # here for the entry points that print their own lines

_SIZE = re.compile(r"(\d+(?:\.\d+)?)([KMGT]?)(?:i?B)?\Z", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


CONSOLE = {"make_shards": "make-shards", "pipeline.train": "pipeline-train", "report": "pipeline-report"}


class Parser(argparse.ArgumentParser):
    """argparse that reports a bad command line in one line (no usage dump), exit code 2. A tool's
    usage and errors name its installed command (pyproject's scripts) however it was started
    (`python -m pipeline.train`, `tools/make_shards.py`): one program name a command, as in the
    lines it prints itself."""

    def __init__(self, *args, prog=None, **kwargs):
        super().__init__(*args, prog=CONSOLE.get(prog, prog), **kwargs)

    def error(self, message):
        message = printable(message + self._did_you_mean(message))  # it may echo the command line: one line
        sys.stderr.write(f"{self.prog}: error: {message} (see --help)\n")  # one write: ranks' lines don't interleave
        sys.stderr.flush()
        sys.exit(2)

    def _did_you_mean(self, message):
        """For an unrecognised flag, the option it most likely meant (`--trian`: `--train`)."""
        if not message.startswith("unrecognized arguments: "):
            return ""
        options = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
        for word in message.split(": ", 1)[1].split():
            if word == "--":  # what follows is a value, not a flag
                return ""
            if not word.startswith("--") or word.startswith("--no-"):  # --no-verify is no typo of --verify
                continue
            close = difflib.get_close_matches(word.split("=", 1)[0], options, n=1, cutoff=0.75)
            if close:
                return f"; did you mean {close[0]}?"
        return ""

    def at_least(self, args, lows):
        """One line for the first option below its minimum (None means not given)."""
        for name, low in lows.items():
            value = getattr(args, name)
            if value is not None and value < low:
                self.error(f"--{name.replace('_', '-')} must be at least {low}, got {value}")

    def within(self, args, ranges):
        """One line for the first option outside [low, high] or not finite (None means not given):
        a huge value would overflow a C timeout or timedelta deep inside the job."""
        for name, (low, high) in ranges.items():
            value = getattr(args, name)
            finite = not isinstance(value, float) or math.isfinite(value)  # ints of any size compare exactly
            if value is not None and not (finite and low <= value <= high):
                self.error(f"--{name.replace('_', '-')} must be a finite number from {_num(low)} to {_num(high)}, "
                           f"got {value}")


def _num(x):
    return str(x) if isinstance(x, int) else f"{x:g}"


def size(text):
    """'1048576', '64M', '10G', '1.5GiB' -> bytes (K, M, G, T are powers of 1024); ValueError otherwise."""
    m = _SIZE.match(text.strip())
    if not m or len(m[1]) > 30:  # 30 digits are far past any disk; more would overflow a float
        raise ValueError(f"{text!r}: expected a byte count such as 1048576, 512M or 10G")
    return int(float(m[1]) * _UNITS[m[2].upper()]) if "." in m[1] else int(m[1]) * _UNITS[m[2].upper()]


def byte_size(text):
    """argparse type for byte sizes: a bad one is argparse's one-line 'invalid byte_size value'."""
    try:
        return size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a byte count such as 1048576, 512M or 10G") from None


# Bounds of the I/O flags: past them a deadline or a backoff is no longer a deadline, and
# socket.settimeout, threading.Timer or time.sleep overflow.
IO_RANGES = {"io_timeout": (0.001, 3600.0), "min_rate": (0.001, 1e6), "retries": (0, 100),
             "max_shard_bytes": (1, 1 << 50)}


def add_io_options(p):
    """The flags that bound every remote read (see pipeline.data.store.remote.Policy, and io_limits)."""
    a = p.add_argument
    a("--io-timeout", type=float, default=30.0, metavar="S",
      help="seconds one network read may stall, and the base of each shard's deadline (default: 30)")
    a("--min-rate", type=float, default=1.0, metavar="MB_PER_S",
      help="a remote shard must arrive at this average rate or its fetch fails and is retried: its deadline is "
           "--io-timeout + its size at this rate (default: 1 MB/s)")
    a("--retries", type=int, default=3, metavar="N",
      help=f"retries of a failed remote read, 1, 2, 4 ... s apart, at most {MAX_DELAY:g} s (default: 3)")
    a("--max-shard-bytes", type=byte_size, default=1 << 30, metavar="BYTES",
      help="the largest shard this job reads (suffixes K, M, G, T): a manifest listing a larger one is refused, "
           "and no transfer's deadline exceeds --io-timeout + this size at --min-rate, whatever a manifest or "
           "server claims (default: 1G)")


MAX_DELAY = 60.0  # what --help says of the retry delays: pipeline.data.store.remote.MAX_DELAY (tests/test_limits.py)


def check_io(p, args):
    """Reject I/O flags out of range, or whose longest deadline no timer can hold (one line)."""
    p.within(args, IO_RANGES)
    deadline = args.io_timeout + args.max_shard_bytes / (args.min_rate * 1e6)  # remote.Policy.deadline(max_bytes)
    if deadline > threading.TIMEOUT_MAX:
        p.error(f"--max-shard-bytes {args.max_shard_bytes} at --min-rate {args.min_rate:g} MB/s gives a deadline of "
                f"{deadline:.3g} s; raise --min-rate or lower --max-shard-bytes")


def io_limits(args):
    """The I/O flags (checked by check_io) as the keyword arguments of the data path's limits:
    `pipeline.data.store.remote.Policy(**io_limits(args))`. A read past the ceiling names the flag."""
    return {"retries": args.retries, "timeout": args.io_timeout, "min_rate": args.min_rate * 1e6,
            "max_bytes": args.max_shard_bytes, "max_source": "--max-shard-bytes"}



LOG_INTERVAL = 30.0  # seconds between a log file's progress lines


def progress(**kw):
    """A tqdm bar on stderr: redrawn in place on a terminal; written to a log file (stderr not a
    terminal), a line of its own every LOG_INTERVAL seconds at most, since tqdm's carriage-return
    redraws made one line of a whole run there (a line that grew to megabytes)."""
    from tqdm import tqdm

    if _is_terminal(sys.stderr):
        return tqdm(dynamic_ncols=True, file=sys.stderr, **kw)
    return tqdm(ncols=100, mininterval=LOG_INTERVAL, file=_Lines(sys.stderr), **kw)


class _Lines:
    """tqdm's output for a log file: each redraw a line of its own. tqdm redraws in place
    with a carriage return and no newline, so a warning or an error written meanwhile (by a
    loader worker or another rank, which can't reach the bar) would continue the bar's
    line, and a search for lines starting "pipeline-train: warning" would miss it."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text):
        text = text.replace("\r", "").replace("\x1b[A", "").rstrip("\n")
        if text.strip():
            self.stream.write(text + "\n")

    def flush(self):
        self.stream.flush()


def _is_terminal(stream):
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # replaced by an object without it, or closed
        return False
