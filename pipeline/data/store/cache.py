"""The local copy of remote shards (`--cache-dir`, `--cache-size`), shared by every process
on a machine.

- A copy is used only if it still matches the current manifest: its size is compared
  before it is read and its sha256 while it is read, so a shard the server rebuilt (a
  new sha256 in a new manifest) is fetched again, with a warning, never used stale.
- A copy appears whole or not at all: it is written under a name of its own process
  and thread, checked against the manifest, then renamed into place.
- With a size, the least recently used copies are evicted to stay within it. Every
  use touches a copy's mtime; eviction runs under a lock file in the folder, before a
  new copy is written (to make room) and after it is renamed in. A reader holds its
  copy open, and a removed file stays readable through an open descriptor, so eviction
  never cuts a read short; a copy evicted before it is opened is a miss, fetched
  again. Downloads in flight may exceed the size briefly, by at most what they fetch.
- A cache that cannot be written (disk full, quota, file size limit, permissions)
  turns itself off for the rest of the process with one warning; reads go on from the
  network.
"""
import contextlib
import hashlib
import os
import re
import stat
import tempfile
import time
import warnings
from dataclasses import dataclass

from pipeline.errors import ShardError, redact
from pipeline.files import locked

LOCK = ".lock"
_OFF = set()  # folders this process stopped writing to (a full disk), each warned about once


@dataclass(frozen=True)
class Cache:
    """A cache folder and the most bytes it may hold (None: no bound)."""

    folder: str
    size: int = None

    def __post_init__(self):
        if self.size is not None and self.size < 1:
            raise ValueError(f"cache size {self.size}: at least 1 byte")


def of(cache):
    """A Cache from what callers pass as `cache_dir`: None, a folder (no bound) or a Cache."""
    if not cache or isinstance(cache, Cache):
        return cache or None
    return Cache(os.fspath(cache))


def path(cache_dir, url):
    """A file name under cache_dir derived from the URL that can't escape the folder, nor
    carry a signed URL's query (its signature) into a name that warnings print."""
    tail = re.sub(r"[^A-Za-z0-9_.-]", "_", url.split("?", 1)[0].rstrip("/ -").split("/")[-1])[-64:].lstrip(".")
    return os.path.join(cache_dir, f"{hashlib.sha256(url.encode()).hexdigest()[:16]}-{tail}")


class _Verified:
    """A cached copy read through a hash (when there is one to compare with), so that its end
    can say whether it matched."""

    def __init__(self, f, hashed):
        self.f, self.hash = f, hashlib.sha256() if hashed else None

    def read(self, n=-1):
        data = self.f.read(n)
        if self.hash:
            self.hash.update(data)
        return data

    def digest(self):
        while self.read(1 << 20):
            pass
        return self.hash.hexdigest()


MISS = object()


def read(cache, url, consume, nbytes, digest, timed=None):
    """consume(copy) on the cached copy of `url` if it matches `nbytes` and `digest`, else MISS
    (a copy that does not match is removed, with a warning). timed(file, path, size): the
    copy as a local read with a deadline (remote._Local)."""
    where = path(cache.folder, url)
    try:  # no link followed, and no FIFO waited on: a shared folder may hold anything
        f = os.fdopen(os.open(where, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK), "rb")
    except OSError:  # never cached, evicted a moment ago, a link, or unreadable: fetch it
        return MISS
    with f:
        st = os.fstat(f.fileno())
        size = st.st_size
        if not stat.S_ISREG(st.st_mode):
            return _stale(where, f, url, "not a regular file")
        if nbytes is not None and size != nbytes:
            return _stale(where, f, url, f"{size} bytes, the manifest says {nbytes}")
        _touch(where)
        stream = _Verified(timed(f, where, size) if timed else f, digest is not None)
        try:
            result = consume(stream)
        except ShardError:
            if digest is None or stream.digest() == digest:
                raise  # the copy is what the manifest lists: the shard itself is bad
            return _stale(where, f, url, "sha256 differs from the manifest")
        if digest is not None and stream.digest() != digest:
            return _stale(where, f, url, "sha256 differs from the manifest")
        return result


def _stale(where, f, url, why):
    warnings.warn(f"{redact(url)}: the cached copy {where} no longer matches the manifest ({why}; rebuilt on the "
                  f"server?); fetching it again", stacklevel=3)
    with contextlib.suppress(OSError):
        if os.stat(where).st_ino == os.fstat(f.fileno()).st_ino:  # not a good copy another process just put there
            os.remove(where)
    return MISS


def _touch(where):
    """Mark a copy as just used. time_ns, not the kernel's clock, which ticks every few ms:
    two uses inside one tick would tie."""
    now = time.time_ns()
    with contextlib.suppress(OSError):  # recency is a hint: a copy of another user's stays as it is
        os.utime(where, ns=(now, now))


class Writer:
    """The copy of one transfer, written as it streams in; a no-op once the cache is off.

    write() as bytes arrive, commit() once they are checked, abort() otherwise. An
    OSError while writing turns the cache off (one warning) instead of failing the read.
    """

    def __init__(self, cache, url, nbytes):
        self.cache, self.final, self.out, self.tmp, self.written = cache, path(cache.folder, url), None, None, 0
        if cache.folder in _OFF or (cache.size is not None and nbytes is not None and nbytes > cache.size):
            return  # off, or a shard larger than the whole cache: read through
        try:
            os.makedirs(cache.folder, exist_ok=True)
            if cache.size is not None and nbytes is not None:
                make_room(cache, nbytes)
            fd, self.tmp = tempfile.mkstemp(prefix=f"{os.path.basename(self.final)}.{os.getpid()}.", suffix=".tmp",
                                            dir=cache.folder)  # a name of its own, created exclusively
            self.out = open(fd, "wb")
        except OSError as e:
            self._off(e)

    def write(self, data):
        if self.out is not None:
            try:
                self.out.write(data)
                self.written += len(data)
            except OSError as e:
                self._off(e)

    def commit(self):
        if self.out is None:
            return
        try:
            self.out.close()
            self.out = None
            os.replace(self.tmp, self.final)
            self.tmp = None
            _touch(self.final)
            if self.cache.size is not None:
                with locked(os.path.join(self.cache.folder, LOCK)):
                    if self.written > self.cache.size:  # a size nobody announced, past the bound
                        with contextlib.suppress(FileNotFoundError):  # evicted by another process already
                            os.remove(self.final)
                    evict(self.cache, self.cache.size, keep=self.final)
        except OSError as e:
            self._off(e)

    def abort(self):
        if self.out is not None:
            with contextlib.suppress(OSError):
                self.out.close()
            self.out = None
        if self.tmp is not None:
            with contextlib.suppress(OSError):
                os.remove(self.tmp)
            self.tmp = None

    def _off(self, error):
        self.abort()
        if self.cache.folder not in _OFF:
            _OFF.add(self.cache.folder)
            warnings.warn(f"--cache-dir {self.cache.folder}: cannot write ({error.strerror or error}); reading "
                          f"remote shards without the cache from now on", stacklevel=4)


def make_room(cache, nbytes):
    """Evict until a copy of `nbytes` fits within the cache's size."""
    with locked(os.path.join(cache.folder, LOCK)):
        evict(cache, cache.size - nbytes)


def evict(cache, budget, keep=None):
    """Remove the least recently used complete copies until the folder holds at most `budget`
    bytes (call with the lock held). Partial copies count but stay, unless their writer is gone."""
    copies, total = [], 0
    for entry in os.scandir(cache.folder):
        if entry.name.startswith("."):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        if entry.name.endswith(".tmp"):
            if _orphan(entry.name):
                with contextlib.suppress(OSError):
                    os.remove(entry.path)
                continue
        elif entry.path != keep:
            copies.append((st.st_mtime_ns, entry.path, st.st_size))
        total += st.st_size
    for _, victim, nbytes in sorted(copies):
        if total <= budget:
            break
        with contextlib.suppress(FileNotFoundError):
            os.remove(victim)
        total -= nbytes
    return total


def _orphan(name):
    """A partial copy whose writing process no longer runs (killed mid-transfer)."""
    m = re.search(r"\.(\d+)\.[^.]+\.tmp\Z", name)
    if not m:
        return False
    try:
        os.kill(int(m[1]), 0)
    except ProcessLookupError:
        return True
    except (OSError, OverflowError):
        return False
    return False
