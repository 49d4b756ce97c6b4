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
