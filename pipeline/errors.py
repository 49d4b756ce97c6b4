"""The errors the data side raises; each message names what is wrong and where."""


class InputError(ValueError):
    """Bad input the user can fix (a command line, a file, a checkpoint): the entry points
    print it as one line. Any other exception is a bug and keeps its traceback."""


class ShardError(InputError):
    """A shard or manifest is missing, malformed, unsafe, or disagrees with its manifest."""


class FetchError(OSError):
    """Reading a URL failed for good: a permanent error (HTTP 404) or retries used up."""


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
    import warnings

    from pipeline.cli import printable  # here: cli imports the data path, which imports this module

    warnings.warn(printable(message), stacklevel=4)  # keys and URLs come from files anyone can write
