"""Writing to a store (make_shards.py --out URL: pipeline.writers.publish and storelock): S3 by
requests of the project's own (pipeline.data.store.s3_write: the job's deadlines, an error
answer's body read to 64 KiB, bounded retries), the other stores through their fsspec client
(pipeline.data.store.storage)."""
import contextlib

from pipeline.data.store import remote, s3_write
from pipeline.data.store.storage import Missing, Unreachable, _call, filesystem, join, parse
from pipeline.errors import FetchError

S3 = ("s3", "s3a")  # written by pipeline.data.store.s3_write's own requests, the other stores through fsspec


def put(local_path, url, policy=None):
    """Upload a local file to a store URL (the file at a temporary key first would not make it
    safer: a store writes an object whole or not at all)."""
    base, _, name = url.rpartition("/")
    Writer(base, policy).put(local_path, name)


def exists(url, policy=None):
    loc = parse(url)
    try:
        if loc.scheme in S3:
            return s3_write.exists(loc, policy or remote.Policy())
        return bool(_call(loc, lambda: filesystem(loc).exists(loc.path)))
    except Missing:
        return False
    except Unreachable as e:
        raise FetchError(f"{loc.shown}: {e}") from None


class Writer:
    """Objects under one store prefix, written, moved and removed (listed by
    pipeline.data.store.listings): S3's by requests of our own under the job's `policy`
    (pipeline.data.store.s3_write: deadlines, error bodies read to a cap, bounded retries), the
    other stores' through one fsspec client: a client per call spends most of a small upload
    starting its session. Names are relative to the prefix; a failure is a FetchError naming
    the URL."""

    def __init__(self, prefix, policy=None):
        self.prefix, self.policy = prefix.rstrip("/"), policy
        self.loc = parse(self.prefix + "/")
        self.s3 = self.loc.scheme in S3
        self.fs = None if self.s3 else filesystem(self.loc)
        self.limits = policy or remote.Policy()

    def url(self, name):
        return join(self.prefix, name)

    def _do(self, name, what, fn, by_s3=None):
        """fn(the object's path in its store), or by_s3(its Location) for S3."""
        loc = parse(self.url(name))
        try:
            return by_s3(loc) if self.s3 else _call(loc, lambda: fn(loc.path))
        except (Missing, Unreachable) as e:
            raise FetchError(f"{loc.shown}: cannot {what}: {e}") from None

    def exists(self, name):
        try:
            return bool(self._do(name, "tell", self.fs and self.fs.exists, lambda loc: s3_write.exists(loc, self.limits)))
        except FetchError:
            return False

    def put(self, local_path, name):
        self._do(name, "write", lambda path: self.fs.put_file(local_path, path),
                 lambda loc: s3_write.put(loc, local_path, self.limits))

    def write_bytes(self, data, name):
        self._do(name, "write", lambda path: self.fs.pipe_file(path, data),
                 lambda loc: s3_write.put(loc, data, self.limits))

    def move(self, src, dst, size=None):
        """`src` becomes `dst` (a server-side copy, then `src` removed: a store has no rename);
        `size`: its bytes when known, which set an S3 copy's deadline."""
        target = parse(self.url(dst))
        self._do(src, f"copy to {dst}", lambda path: self.fs.copy(path, target.path),
                 lambda loc: s3_write.copy(loc, target, self.limits, size))
        self.remove(src)

    def remove(self, name):
        with contextlib.suppress(FetchError):
            self._do(name, "remove", self.fs and self.fs.rm_file, lambda loc: s3_write.delete(loc, self.limits))


def write_bytes(data, url):
    """Write `data` as the object at a store URL."""
    base, _, name = url.rpartition("/")
    Writer(base).write_bytes(data, name)
