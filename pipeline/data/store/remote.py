"""Reading bytes from wherever shards live: local files, http(s) URLs, pipe: commands and object
stores (pipeline.data.store.storage).

A remote read is bounded: every transfer has a total deadline (a base plus its
byte size at a minimum rate), so a server that drips one byte every few seconds
fails instead of hanging a rank that no collective timeout can reach (ranks
wait in their DataLoader, not in an all-reduce). The size is the job's to bound,
not the data's: the manifest's size, else the Content-Length the server announces
(else UNKNOWN_SIZE), never more than the job's ceiling (`Policy.max_bytes`; the command line's
--max-shard-bytes).
A server that announces another size than the manifest, or more than the
ceiling, fails the read at once, without retries (the stream skips it as a damaged
shard); a body that runs past either is cut off.

Every transient failure (refused or reset connections, socket timeouts, a body
shorter than its Content-Length, an HTTP 5xx, 408 or 429, a pipe's non-zero
exit, a missed deadline) is retried alike with doubling delays; any other 4xx
is permanent and fails at once. http(s) goes through urllib rather than
webdataset's curl pipe so that these cases can be told apart; the error then
says "HTTP Error 404" rather than "curl exit 22".

A remote shard is parsed while it streams in, hashed on the way, and checked
against its manifest's sha256 and size at the end; only then is a cached copy
renamed into place (see pipeline.data.store.cache).
"""
import dataclasses
import hashlib
import http.client
import os
import re
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from pipeline.data.store import cache as caching
from pipeline.data.store import storage
from pipeline.data.store import direct_read
from pipeline.errors import DigestError, FetchError, ShardError, cut, redact
from pipeline.files import open_regular
from pipeline.data.store.transports import Transient, _HTTP, _Pipe

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):")
UNKNOWN_SIZE = 16 << 20  # what the deadline assumes for a file of unknown size (a manifest)
MAX_DELAY = 60.0  # seconds: retry delays double up to this


def kind(url):
    """'http', 'pipe', 'store' (s3://, gs://, hf://, any fsspec protocol: pipeline.data.store.storage)
    or 'file'. Raises ShardError for any other scheme."""
    if url.startswith(("http://", "https://")):
        return "http"
    if url.startswith("pipe:"):
        return "pipe"
    if storage.scheme_of(url):
        return "store"
    m = _SCHEME.match(url)
    if m:
        raise ShardError(f"{cut(redact(url))}: {m[1]}: not a scheme this job reads; use a local path, http(s)://, "
                         f"s3://, gs://, hf:// (or another fsspec protocol), or pipe:COMMAND")
    return "file"


@dataclass(frozen=True)
class Policy:
    """How hard to try: `retries` after the first attempt, `delay` seconds before the first
    retry (doubling up to MAX_DELAY), `timeout` seconds for one socket operation, a deadline
    per transfer of `timeout` + its bytes at `min_rate` bytes a second, and `max_bytes`, the
    most a transfer may be (and so the longest its deadline may be). `max_source` names where
    that ceiling comes from in the message of a transfer refused for it (the command line
    fills it with its flag: pipeline.cli.io_limits)."""

    retries: int = 3
    delay: float = 1.0
    timeout: float = 30.0
    min_rate: float = 1 << 20
    max_bytes: int = 1 << 30
    max_source: str = dataclasses.field(default="Policy.max_bytes", compare=False)

    def __post_init__(self):
        if not (0 <= self.retries <= 1000 and 0 <= self.delay <= MAX_DELAY and 0 < self.timeout <= 86400
                and 0 < self.min_rate < float("inf") and 0 < self.max_bytes <= 1 << 60):
            raise ValueError(f"bad fetch policy {self}: retries 0..1000, delay 0..{MAX_DELAY:g}, timeout in (0, 86400], "
                             f"min_rate > 0 and finite, max_bytes 1..2**60")
        if self.deadline(self.max_bytes) > threading.TIMEOUT_MAX:
            raise ValueError(f"bad fetch policy {self}: a deadline of {self.deadline(self.max_bytes):g} s")

    def deadline(self, nbytes=None):
        """Seconds a transfer of `nbytes` (None: unknown) may take, never past max_bytes' worth."""
        return self.timeout + min(nbytes if nbytes is not None else UNKNOWN_SIZE, self.max_bytes) / self.min_rate

    def wait(self, attempt):
        """Seconds before retry number attempt + 1."""
        return min(self.delay * 2 ** min(attempt, 64), MAX_DELAY)


def permanent(error):
    """True for an HTTP client error that waiting won't fix (404, 403, ...), a redirect urllib
    could not follow (no Location, a loop), or a store's missing object, bucket or permission."""
    if isinstance(error, storage.Missing):
        return True
    return isinstance(error, urllib.error.HTTPError) and 300 <= error.code < 500 and error.code not in (408, 429)


def transient(error):
    return not permanent(error) and isinstance(error, (OSError, http.client.HTTPException))


class _Checked:
    """A remote stream that hashes what passes through it (and copies it to a cache.Writer);
    `finish` drains the rest (tar padding after the end-of-archive block) and checks it."""

    def __init__(self, raw, url, digest, nbytes, policy, copy):
        self.raw, self.url, self.digest, self.nbytes, self.policy = raw, url, digest, nbytes, policy
        self.hash = hashlib.sha256() if digest else None
        self.got = 0
        self.copy = copy

    def read(self, n):
        data = self.raw.read(n)
        self.got += len(data)
        if self.nbytes is not None and self.got > self.nbytes:  # an endless body would fill the cache
            raise DigestError(f"more than the {self.nbytes} bytes the manifest says")
        if self.got > self.policy.max_bytes:
            raise ShardError(f"more than {self.policy.max_bytes} bytes, the most this job allows "
                             f"({self.policy.max_source})")
        if self.hash:
            self.hash.update(data)
        if self.copy:
            self.copy.write(data)
        return data

    def finish(self):
        while self.read(1 << 20):
            pass
        if self.nbytes is not None and self.got != self.nbytes:
            raise DigestError(f"{self.got} bytes, the manifest says {self.nbytes}")
        if self.hash and self.hash.hexdigest() != self.digest:
            raise DigestError("sha256 differs from the manifest")
        if self.copy:
            self.copy.commit()

    def close(self):
        self.raw.close()
        if self.copy:
            self.copy.abort()


def _open_raw(url, policy, nbytes, request=None):
    if request is not None:
        direct = request()
        return _HTTP(direct.url, policy, nbytes, direct=direct)
    where = kind(url)
    if where == "store":
        direct = direct_read.direct(url, policy.timeout)
        return _HTTP(direct.url, policy, nbytes, direct=direct) if direct else storage.Reader(url, policy.deadline(nbytes))
    return (_HTTP if where == "http" else _Pipe)(url, policy, nbytes)


def read_url(url, consume, *, policy=Policy(), nbytes=None, digest=None, cache_dir=None, request=None, until=None):
    """consume(stream) on the bytes at `url`; returns what it returns.

    A remote read is retried from the start after a transient error and checked
    against `nbytes` and `digest` (sha256) when given, and against the policy's
    max_bytes; a damaged copy raises ShardError, a read that keeps failing
    FetchError. With `cache_dir` (a folder, or a cache.Cache with a size), a remote
    file read once in full is kept there, and later reads use the copy while it
    matches `nbytes` and `digest` (see pipeline.data.store.cache), within a local file's
    deadline. Local files are read as they are (`make_shards.py --verify` checks
    them), through `open_local`.

    request: for a store request that `url` alone does not name (a page of a listing,
    pipeline.data.store.listings), a function giving each attempt's `direct_read.Direct`; `url` then
    only names it in messages. until: a time.monotonic() after which no retry starts (a
    listing's deadline in all): the last failure is then the error, as when retries run out.
    """
    if request is None and kind(url) == "file":
        with open_local(url, policy) as f:
            return consume(f)
    cache = caching.of(cache_dir)
    if cache:
        found = caching.read(cache, url, consume, nbytes, digest,
                             timed=lambda f, where, size: _Local(f, where, policy.deadline(size)))
        if found is not caching.MISS:
            return found
    for attempt in range(policy.retries + 1):
        stream = copy = None
        try:
            copy = caching.Writer(cache, url, nbytes) if cache else None
            stream = _Checked(_open_raw(url, policy, nbytes, request), url, digest, nbytes, policy, copy)
            copy = None
            result = consume(stream)
            stream.finish()
            return result
        except Exception as e:  # noqa: BLE001 - sorted into permanent, transient and the rest below
            if permanent(e):
                raise FetchError(f"{redact(url)}: {e}") from None
            if not transient(e):
                raise
            wait = policy.wait(attempt)
            late = until is not None and time.monotonic() + wait > until
            if attempt == policy.retries or late:
                raise FetchError(f"{redact(url)}: failed after {attempt + 1} attempts{' (no time left)' if late else ''}"
                                 f": {describe(e)}") from None
            warnings.warn(f"{redact(url)}: {describe(e)}; retrying in {wait:g} s", stacklevel=2)
            time.sleep(wait)
        finally:
            if stream is not None:
                stream.close()
            elif copy is not None:  # the connection failed before the stream took the copy over
                copy.abort()


def open_local(path, policy=Policy()):
    """A local regular file opened for reading, read within the same total deadline as a
    remote one (policy.deadline of its size on disk), so a network mount that drips fails
    instead of stalling a rank. Anything else is a ShardError before it is opened: opening a
    FIFO blocks until someone writes to it, /dev/zero never ends, a device may act on open. A file
    larger than the policy's max_bytes is refused before it is read, as a remote one is: a sparse
    file of a terabyte takes no disk and would be read (and hashed by --index) for the whole deadline."""
    f = open_regular(path)
    size = os.fstat(f.fileno()).st_size
    if size > policy.max_bytes:
        f.close()
        raise ShardError(f"{path}: {size} bytes, more than {policy.max_bytes} bytes, the most this job allows "
                         f"({policy.max_source})")
    return _Local(f, path, policy.deadline(size))


class _Local:
    """A local file whose reads, once they have taken longer than its deadline in all, raise
    FetchError. Only the time spent reading counts, not the consumer's between reads; it is
    checked between reads, since no timer can wake a read blocked in the kernel."""

    def __init__(self, f, path, limit):
        self.f, self.path, self.limit, self.spent = f, path, limit, 0.0

    def read(self, n=-1):
        return self._timed(self.f.read, n)

    def readinto(self, buffer):
        """Straight into `buffer` (a window's arena), as a file object's readinto."""
        return self._timed(self.f.readinto, buffer)

    def _timed(self, read, arg):
        if self.spent > self.limit:
            raise FetchError(f"{self.path}: not read within its {self.limit:.0f} s deadline")
        start = time.monotonic()
        data = read(arg)
        self.spent += time.monotonic() - start
        return data

    def close(self):
        self.f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def describe(error):
    """A one-line reason, naming the exception's class where its text alone says little."""
    text = " ".join(str(error).split())
    if text and isinstance(error, (Transient, urllib.error.URLError)):
        return text
    return f"{error.__class__.__name__}: {text}" if text else error.__class__.__name__


def fetch(url, *, policy=Policy(), nbytes=None, limit=None, limit_name="the limit for this file"):
    """All bytes at `url` (local, http(s) or pipe:), with retries and a deadline; ShardError
    past `limit` bytes (refused from the Content-Length when a server announces more)."""
    if limit is not None and limit < policy.max_bytes:
        policy = dataclasses.replace(policy, max_bytes=limit, max_source=limit_name)
    return read_url(url, lambda f: read_all(f, limit), policy=policy, nbytes=nbytes)


def read_all(stream, limit=None):
    """Everything left in a stream (local file or remote), refusing more than `limit` bytes.
    Read 16 MiB at a time: a shard that fits one read is kept as read, where the join of two
    parts copied it again (a 4.6 MB JPEG shard of 1,000 samples: 1 ms, a microsecond a sample)."""
    parts, got = [], 0
    while True:
        b = stream.read(1 << 24)
        if not b:
            return b"".join(parts)
        got += len(b)
        if limit is not None and got > limit:
            raise ShardError(f"more than {limit} bytes")
        parts.append(b)


def head_check(urls, sizes=None, *, policy=Policy(), threads=16):
    """A HEAD request per http(s) shard: returns (problems, resized), one line each.

    problems: shards that are missing ("missing (HTTP 404)"), fail ("server error 500"
    once the retries are used up) or can't be reached; resized: shards whose
    Content-Length differs from `sizes` (the manifest's), which may be damaged.
    Transient failures are retried like any read.
    """
    sizes = sizes or {}

    def check(url):
        shown = redact(url)
        for attempt in range(policy.retries + 1):
            try:
                head = _HTTP(url, policy, 0, method="HEAD")  # with a deadline: a dripping HEAD can't hold the job
                try:
                    length = head.resp.headers.get("Content-Length")
                finally:
                    head.close()
                if length and length.isdigit() and url in sizes and int(length) != sizes[url]:
                    return "resized", f"{shown}: the server has {int(length)} bytes, the manifest says {sizes[url]}"
                return None
            except Exception as e:  # noqa: BLE001
                if isinstance(e, storage.Missing):  # not an answer: a request that could not be made
                    return "problem", f"{shown}: {e}"
                if permanent(e):
                    return "problem", (f"{shown}: missing (HTTP 404)" if e.code == 404 else
                                       f"{shown}: HTTP {e.code} {' '.join(str(e.reason).split())}")  # urllib's redirect loop: 3 lines
                if not transient(e):
                    raise
                if attempt == policy.retries:
                    if isinstance(e, urllib.error.HTTPError):
                        return "problem", f"{shown}: server error {e.code} after {policy.retries + 1} attempts"
                    return "problem", f"{shown}: unreachable after {policy.retries + 1} attempts ({describe(e)})"
                time.sleep(policy.wait(attempt))

    with ThreadPoolExecutor(threads) as pool:
        found = [r for r in pool.map(check, urls) if r]
    return [m for k, m in found if k == "problem"], [m for k, m in found if k == "resized"]
