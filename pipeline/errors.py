"""The errors the data side raises; each message names what is wrong and where, and the
filters every printed line goes through (`printable`, which applies `redact` and `cut`).
It imports nothing from the project: every layer uses it."""
import os
import re
import sys
import sysconfig
import warnings

# where the frames a damage warning skips live: this package, and the loader plumbing that runs
# it (Python's own modules: threading, multiprocessing; torch's DataLoader)
_PLUMBING = (os.path.dirname(os.path.abspath(__file__)) + os.sep,
             os.path.realpath(sysconfig.get_paths()["stdlib"]) + os.sep, f"{os.sep}torch{os.sep}")
LINE_LIMIT = 600  # characters of one console line (`cut`): a name from a file may be a megabyte
NAME_LIMIT = 200  # characters of one name (a key, a class, a URL) quoted inside a message

# userinfo (`//user:password@host`) and the query parameters of signed URLs (S3/GCS presigned,
# CloudFront, Azure SAS, OAuth tokens) up to the ": " after a URL in a message: whoever reads a
# log must not be able to fetch with them
_USERINFO = re.compile(r"(//)([^/\s@:]*)(:[^/\s@]*)?@")
_SECRET_QUERY = re.compile(r"([?&;](?:[\w.-]*(?:signature|credential|token|secret|password|passwd|apikey|api_key)"
                           r"[\w.-]*|sig|key|policy|key-pair-id|auth|authorization)=)"
                           r"(?:[^&#\s'\":]|:(?!\s|$))*", re.IGNORECASE)


class InputError(ValueError):
    """Bad input the user can fix (a command line, a file, a checkpoint): the entry points
    print it as one line. Any other exception is a bug and keeps its traceback. A URL in its
    message is shown without its credentials (`redact`), wherever the message ends up."""

    def __init__(self, *args):
        super().__init__(*_redacted(args))


class ShardError(InputError):
    """A shard or manifest is missing, malformed, unsafe, or disagrees with its manifest."""


class FetchError(OSError):
    """Reading a URL failed for good: a permanent error (HTTP 404) or retries used up. Its
    message names the URL without its credentials (`redact`)."""

    def __init__(self, *args):
        super().__init__(*_redacted(args))


def _redacted(args):
    return [redact(a) if isinstance(a, str) else a for a in args]


class DigestError(ShardError):
    """A remote shard arrived whole but differs from its manifest (sha256 or size): none of
    it can be trusted."""


class Errors:
    """The one policy for damaged input on the data path, handed down the stages of a
    stream as webdataset hands down its handlers.

    "warn" (the default) skips a damaged sample or shard, counts what was lost and says
    so in one line; "skip" skips and counts quietly (the count still reaches each
    batch's `skipped` and the run's summary); "raise" stops at the first (--strict).
    """

    MODES = ("warn", "skip", "raise")

    def __init__(self, mode="warn"):
        if mode not in self.MODES:
            raise ValueError(f"error policy {mode!r}: one of {', '.join(self.MODES)}")
        self.mode, self.skipped = mode, 0

    @property
    def strict(self):
        return self.mode == "raise"

    def __call__(self, error, lost=1, said=None):
        """`lost` samples could not be used because of `error` (a message): raise it as a
        ShardError, or count them and, when warning, say `said` (default: the error)."""
        if self.mode == "raise":
            raise ShardError(error)
        self.skipped += lost
        if self.mode == "warn":
            _warn(said or error)

    def note(self, message):
        """Something worth a line that costs no sample (a count that differs from the manifest)."""
        if self.mode != "skip":
            _warn(message)


def _warn(message):
    """A damage line, shown (by Python's default display) at the user's line that read the
    batch: not at the stage that noticed it, a line of code that means nothing to a user."""
    warnings.warn(printable(message), stacklevel=_outside())  # keys and URLs come from files anyone can write


def _outside():
    """The stacklevel of _warn's first caller outside this package and the loader plumbing
    (_PLUMBING); the outermost frame where every one is inside (a worker's own loop)."""
    frame, level = sys._getframe(2), 2  # _warn's caller
    while frame.f_back is not None and any(p in os.path.realpath(frame.f_code.co_filename) for p in _PLUMBING):
        frame, level = frame.f_back, level + 1
    return level


def printable(text, limit=LINE_LIMIT):
    """One console line of `text`. Names and origins come from files anyone can write: a
    control character (an escape sequence, a carriage return) is shown as its escape instead
    of acting on the terminal, a line longer than `limit` is cut (`cut`, saying how much
    was left out: a class name or a member name may be a megabyte), and the credentials of
    any URL in it are redacted (`redact`). Every error and warning line goes through here."""
    return cut(redact(text), limit, _escaped)


def _escaped(text):
    return text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def redact(text):
    """`text` (a URL, or a message naming URLs) with its credentials replaced by `***`: the
    password of `user:password@` (a lone `token@` too) and the values of signing query
    parameters (X-Amz-Signature, X-Amz-Credential, Signature, sig, token, access_token, ...)."""
    text = _USERINFO.sub(lambda m: f"{m[1]}{m[2]}:***@" if m[3] is not None else f"{m[1]}***@", str(text))
    return _SECRET_QUERY.sub(r"\1***", text)


def redacted(value):
    """A JSON-like value (a run's config, a record) with `redact` applied to every string in it:
    what run files, checkpoints and summaries keep of the command line holds no credential."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {k: redacted(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redacted(v) for v in value]
    return value


def short(value, n=80, show=repr):
    """`value` as `show` shows it (a tensor by its shape), at most n characters and "..." after:
    a number or field from a checkpoint or stream state, quoted in an error line."""
    shape = getattr(value, "shape", None)
    text = f"a tensor of shape {list(shape)}" if shape is not None and hasattr(value, "dtype") else show(value)
    return text if len(text) <= n else text[:n] + "..."


def cut(text, limit=NAME_LIMIT, show=str):
    """`text` as `show` shows it, in at most about `limit` characters: a longer one keeps its
    start and its end (where a message says what to do) around a count of the characters left
    out. Only the kept ends go through `show`, so a megabyte costs no more than a line."""
    text = str(text)
    if len(text) <= limit:
        shown = show(text)
        if len(shown) <= limit:
            return shown
    head, tail = limit * 2 // 3, limit // 3
    first, last = show(text[:head])[:head], show(text[len(text) - tail:])[-tail:]
    return f"{first}... ({len(text) - head - tail} more characters) ...{last}"
