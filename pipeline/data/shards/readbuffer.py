"""One window's raw shards in one buffer, and its images gathered straight from there.

A window of raw shards was read shard by shard into bytes, its images then copied
into one array (a pass over every image), and each batch copied its rows out of that
array. Read one after another into an `Arena`, the shards' images stay where they
were read, and a batch gathers its rows from there in one numpy take (`Rows.take`):
a pass over the images fewer (docs/benchmarks.md, "Where the raw path's time goes").
"""
import numpy as np

from pipeline.errors import ShardError

CHUNK = 4 << 20  # what the buffer grows by at least, and the most one read() of a stream asks for
MIN_ROOM = 64 << 10  # less room than this left, and the buffer grows


class Arena:
    """A buffer the shards of one window are read into, one after another.

    A Reader keeps one and empties it for each window (`clear`), so its pages are not
    faulted in again: a source's chain takes every row of a window before it reads the
    next, and `Rows` of an earlier window refuse to be taken. Sizes from manifests are
    claims: they size the first room, the buffer grows past them, and one shard never
    takes more than the `limit` its read is given. Growing copies what was read, so a
    shard is known by its offsets, never by a view."""

    def __init__(self):
        self.buf, self.used, self.window = np.empty(0, np.uint8), 0, 0

    def clear(self, capacity=0):
        """Empty, for a new window, with room for `capacity` bytes. A buffer more than twice
        what both the last window used and `capacity` need is made anew at that size, so
        one large window does not hold its memory for the rest of the run."""
        need = max(int(capacity), self.used) + MIN_ROOM
        self.used, self.window = 0, self.window + 1
        if not need <= len(self.buf) <= 2 * need:
            self.buf = np.empty(need, np.uint8)

    def read(self, stream, limit):
        """Everything left in `stream` (`readinto` where it has one, else `read`), appended;
        returns (start, end), its offsets here. ShardError past `limit` bytes."""
        start = self.used
        readinto = getattr(stream, "readinto", None)
        while True:
            # one byte past the limit says it is passed; at most CHUNK a read, so that a local
            # file's deadline (remote._Local) is checked as often as remote.read_all checked it
            room = self._room(min(CHUNK, limit + 1 - (self.used - start)))
            if readinto is not None:
                got = readinto(room)
            else:
                data = stream.read(len(room))
                got = len(data)
                room[:got] = data
            if not got:
                return start, self.used
            self.used += got
            if self.used - start > limit:
                raise ShardError(f"more than {limit} bytes")

    def rewind(self, to):
        """Forget what was read from `to` on (a read that starts its shard over)."""
        self.used = to

    def view(self, start, end):
        return memoryview(self.buf)[start:end]

    def _room(self, most):
        """The free part of the buffer, at most `most` bytes; grown first when less than
        MIN_ROOM is free (a shard as long as its manifest says fills its room exactly, and
        the read after it, which finds the end, needs a byte more)."""
        if len(self.buf) - self.used < MIN_ROOM:
            grown = np.empty(max(2 * len(self.buf), self.used + CHUNK), np.uint8)
            grown[:self.used] = self.buf[:self.used]
            self.buf = grown
        return memoryview(self.buf)[self.used:self.used + most]


class Rows:
    """Raw images of `size` bytes at byte `offsets` of an arena's current window: what
    `read.regular_members` found in a shard read there. Indexing keeps the arena and
    picks offsets; `take` copies the rows out."""

    def __init__(self, arena, offsets, size, window=None):
        self.arena, self.offsets, self.size = arena, np.asarray(offsets, np.int64), int(size)
        self.window = arena.window if window is None else window

    def __len__(self):
        return len(self.offsets)

    def __getitem__(self, index):
        return Rows(self.arena, self.offsets[index], self.size, self.window)

    def take(self, index):
        """The images at `index` as a new (len(index), size) uint8 array, in one gather: row o of
        `windows` is the `size` bytes from offset o of the arena. (np.take(windows, ...,
        out=...) would first copy all of `windows`, len(buf) x size bytes.)"""
        if self.window != self.arena.window:
            raise RuntimeError("rows of a window whose arena was read over since")
        buf = self.arena.buf
        windows = np.ndarray((len(buf) - self.size + 1, self.size), np.uint8, buf, 0, (1, 1))
        return windows[self.offsets[index]]

    def tobytes(self):
        """Each image as bytes (a window that mixes raw rows with encoded images)."""
        return [row.tobytes() for row in self.take(slice(None))]

    @staticmethod
    def join(parts):
        """The rows of several `Rows` of one arena's window as one (the shards of a window;
        those with rows share one size)."""
        full = [p for p in parts if len(p)] or parts[:1]
        return Rows(full[0].arena, np.concatenate([p.offsets for p in full]), full[0].size, full[0].window)
