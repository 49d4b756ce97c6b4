"""The read stage's reader: each window's shards read once (members grouped into samples, labels
parsed, members a source does not use dropped unread), remote shards fetched ahead in threads
within a byte budget, and the window's samples kept while its positions are taken."""
import collections
import io
import os
import queue
import signal
import threading
import weakref
from concurrent.futures import Future

import numpy as np

from pipeline.data.store import remote
from pipeline.data.decoding.decode import image_format, image_of
from pipeline.data.decoding.labelling import Unlabelled, class_index, label_of, parse_label_key
from pipeline.errors import DigestError, Errors, ShardError, cut
from pipeline.data.shards.readbuffer import Arena, Rows
from pipeline.data.shards.read import MAX_MEMBER, is_meta, iter_samples
from pipeline.data.shards.regular import regular_members
from pipeline.data.streams.windowdata import WindowData
from pipeline.data.fields.schema import Oversized


WHOLE_SHARD = 64 << 20  # shards up to this size are read into memory at once (see read.regular)
PREFETCH_THREADS = 16  # transfers of remote shards one (rank, worker) runs at once ahead of its reading; 0: none
FETCH_AHEAD = 64 << 20  # bytes of later windows' remote shards one (rank, worker) fetches ahead, per source


def _fetch(url, policy, nbytes, digest, cache_dir):
    """A remote shard's bytes, fetched ahead (in a `_Fetcher` thread) through `remote.read_url`
    as the reader would read it, with its retries, deadline, sha256 check and cache: (bytes,
    None), or (None, the error), or, for bytes that arrived whole but differ from the manifest,
    (those bytes, the DigestError): parsing them comes first, as when a shard streams in."""
    got = []

    def grab(stream):
        got.clear()
        got.append(remote.read_all(stream, WHOLE_SHARD))
        return got[0]

    try:
        return remote.read_url(url, grab, policy=policy, nbytes=nbytes, digest=digest, cache_dir=cache_dir), None
    except DigestError as e:
        return (got[0] if got else None), e.with_traceback(None)
    except Exception as e:  # noqa: BLE001 - handed to the reader, which raises it where it would have met it
        return None, e.with_traceback(None)


def _take(fetched, consume):
    """consume(stream) on a shard fetched ahead (a Future of `_fetch`); its fetch's error
    raised as `remote.read_url` would have raised it to the reader."""
    data, error = fetched.result()
    if error is None:
        return consume(io.BytesIO(data))
    if data is not None:
        consume(io.BytesIO(data))  # a ShardError of parsing is what the reader would have met first
    raise error


# What people and schedulers send to stop a run (pipeline.train.stop.ALLOWED): blocked in the fetch
# threads, so that the kernel hands it to the trainer's own thread, whose wait for this thread's shard
# it must interrupt (stop.StopRequest.interruptible); a signal taken by this thread would wait out the read.
STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGQUIT,
                signal.SIGXCPU}


def _work(jobs, stopped):
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    while not stopped.is_set():
        job = jobs.get()
        if job is None:
            return
        future, args = job
        job = None  # a thread waiting for work holds no shard: once the reader drops a shard, its bytes go
        if stopped.is_set() or not future.set_running_or_notify_cancel():
            continue
        future.set_result(_fetch(*args))
        future = args = None


class _Fetcher:
    """Daemon threads fetching remote shards into memory ahead of a `Reader`, started as work
    comes (a source of local files never starts one). Daemon, and holding no reference to the
    reader: a transfer in flight never holds up an exit, and a reader that is collected stops
    them (`stop`, by its weakref.finalize). A forked process has none of them: a reader notices
    the new pid and starts its own (`Reader._ahead`)."""

    def __init__(self, threads):
        self.pid, self.size, self.threads = os.getpid(), threads, []
        self.jobs, self.stopped = queue.SimpleQueue(), threading.Event()

    def submit(self, *args):
        future = Future()
        self.jobs.put((future, args))
        if len(self.threads) < self.size:
            t = threading.Thread(target=_work, args=(self.jobs, self.stopped), name="pipeline-prefetch", daemon=True)
            t.start()
            self.threads.append(t)
        return future

    def stop(self):
        """Each thread ends after its transfer in flight; queued ones never start."""
        self.stopped.set()
        for _ in self.threads:
            self.jobs.put(None)


class _Walk:
    """The shards of the windows after the one being read, in reading order, up to `ahead`
    bytes (at least one shard; a shard of unknown size counts as `ahead`): what a `Reader`
    fetches ahead. It is walked once: each window carries it on from where the last one
    stopped, so a window costs what entered or left the look-ahead, not its length (walked
    from the start for each window, 3000 one-sample windows over HTTP took 57 s, 9-12 s without
    fetching ahead)."""

    def __init__(self, windows, ahead, size_of, last):
        self.windows, self.ahead, self.size_of = windows, ahead, size_of
        self.walked = collections.deque()  # (window, its shards counted in `held`), in reading order
        self.held = {}  # shard -> how many walked windows hold it; its size counts once in `bytes`
        self.bytes = 0
        self.rest = None  # (shards, index) of the last walked window where the budget stopped the walk
        self.last = last  # the window last reached: the one being read when the walk began

    def reached(self, window):
        """Whether `window` is the walk's next: if so, it and the windows before it that held
        the same shards as the last one reached (`Window.same`: those are never handed to the
        reader) leave the walk, their shards read. A walk that stopped short of it (its
        bytes spent) goes on to it."""
        while self.walked or self._take():
            w = self.walked[0][0]
            if w == window:
                self._leave()
                self.last = window
                return True
            if not w.same(self.last):
                return False
            self._leave()
        return False

    def _take(self):
        """The next window joins the walk, none of its shards walked yet."""
        w = next(self.windows, None)
        if w is None:
            return False
        self.walked.append((w, []))
        self.rest = (list(dict.fromkeys(u for u, _, _ in w.rows)), 0)
        return True

    def _leave(self):
        _, shards = self.walked.popleft()
        for url in shards:
            self.held[url] -= 1
            if not self.held[url]:
                del self.held[url]
                self.bytes -= self._size(url)
        if not self.walked:
            self.rest = None  # the rest of a window walked in part is read now

    def extend(self):
        """The shards that joined the walk: windows walked until the next shard would pass `ahead`."""
        joined = []
        while True:
            if self.rest is None and not self._take():
                return joined
            shards, i = self.rest
            counted = self.walked[-1][1]
            while i < len(shards):
                url = shards[i]
                if url not in self.held:
                    size = self._size(url)
                    if self.held and self.bytes + size > self.ahead:
                        self.rest = (shards, i)
                        return joined
                    self.held[url], self.bytes = 0, self.bytes + size
                    joined.append(url)
                self.held[url] += 1
                counted.append(url)
                i += 1
            self.rest = None

    def _size(self, url):
        size = self.size_of(url)
        return self.ahead if size is None else size


def _remote(url):
    try:
        return remote.kind(url) in ("http", "store")
    except ShardError:  # said when it is read
        return False


class Reader:
    """read_window for one source: reads shards with `pipeline.data.store.remote`, reports damage.

    What damage costs goes to `errors` (pipeline.errors.Errors): a malformed shard is
    skipped from the point of damage, its unread samples counted (or it raises, under
    "raise"); a sample without an image or a usable label likewise. A shard whose count differs from its manifest
    is named once. I/O errors that outlast the retries always raise.
    """

    def __init__(self, source, errors=None, *, policy=remote.Policy(), cache_dir=None, ahead=FETCH_AHEAD):
        self.source, self.policy, self.cache_dir, self.ahead = source, policy, cache_dir, ahead
        self.errors = errors or Errors()
        self.target = source.target
        self.lookup = self.target.lookup()
        self.want = self.target.members
        label_ext, field = parse_label_key(self.target.label)
        one_image = len(self.target.image_exts) == 1
        integers = field is None and self.target.names is None and label_ext != "dir"  # what read.regular parses
        self.regular = (self.target.image_exts[0], label_ext) if one_image and integers else None
        self.schema = getattr(source, "schema", None)  # fields of its own (pipeline.data.fields.schema), else image+label
        self.read_kw = {}
        if self.schema is not None:  # every field's members, each within its cap; one too large skips its sample
            self.want, self.regular = self.schema.members, None
            self.read_kw = {"max_member": min(self.schema.max_member, MAX_MEMBER), "oversized": Oversized}
        self.arena = Arena() if self.regular and self.regular[0] == "raw" else None  # raw shards: read into it
        n = len(source.urls)
        self.expected = {u: (c, b, d) for u, c, b, d in zip(source.urls, source.counts, source.sizes or [None] * n,
                                                         source.digests or [None] * n)}
        self.miscount_said = set()  # urls whose count differing from the manifest was reported
        self.damage_said = set()  # urls whose damage was reported: a later read of them counts it without a line
        self.suspect = {}  # url -> DigestError: the whole shard cannot be trusted, so it is not read again
        self.first_refused = None  # "sample KEY: why" of the first sample refused: the line of a source with none
        # remote shards read whole: fetched ahead of the reading (`_ahead`); never local files or pipe: commands
        self.fetchable = {u for u, (_, b, _) in self.expected.items() if b is not None and b <= WHOLE_SHARD
                          and _remote(u)}
        self.fetcher, self.fetched, self.walk = None, {}, None  # url -> Future of `_fetch`; a `_Walk`

    def __call__(self, window, upcoming=None):
        """The window's samples. upcoming(): the windows after it (RunPlan.upcoming), whose
        remote shards are fetched while this one is read, up to `ahead` bytes."""
        if self.fetchable and PREFETCH_THREADS > 0:
            self._ahead(window, upcoming)
        out, shards = WindowData(), {}
        if self.arena is not None:  # the last window's rows were all taken before this one is read
            claimed = sum(self.expected.get(url, (0, 0, 0))[1] or 0 for url in {url for url, _, _ in window.rows})
            self.arena.clear(min(claimed, WHOLE_SHARD))  # a claim sizes the first room, never more than a shard
        for url, lo, hi in window.rows:
            if url not in shards:  # a window may list a shard twice (drawn with replacement)
                shards[url] = self._read_shard(url, self.fetched.pop(url, None))
            self._piece(url, shards[url], lo, hi, out, window)
        return out.seal()

    def close(self):
        """Stop fetching ahead: the threads end after their transfers in flight, and shards
        fetched but not read are dropped. Each pass of an epoch makes readers of its own, and a
        reader's threads otherwise lived until the collector found it (10 more a pass seen)."""
        if self.fetcher is not None:
            self.fetcher.stop()
            for fetched in self.fetched.values():
                fetched.cancel()
        self.fetcher, self.fetched, self.walk = None, {}, None

    def _ahead(self, window, upcoming):
        """Start the transfers of this window's remote shards (read in order as they arrive) and
        of the shards of the windows after it, in reading order, up to `ahead` bytes (at least
        one shard): enough transfers at once that a store's per-request latency is spent while
        earlier shards are read. When the windows ahead are not the ones walked before (a new
        run, a resume), fetches for shards no longer ahead are cancelled."""
        if self.fetcher is None or self.fetcher.pid != os.getpid():
            self.fetcher, self.fetched, self.walk = _Fetcher(PREFETCH_THREADS), {}, None
            weakref.finalize(self, self.fetcher.stop)
        now = [u for u in dict.fromkeys(u for u, _, _ in window.rows) if u in self.fetchable]
        fresh = self.walk is None or not self.walk.reached(window)
        if fresh:
            self.walk = _Walk(iter(upcoming() if upcoming is not None else ()), self.ahead,
                              lambda u: self.expected.get(u, (0, None, 0))[1], window)
        later = self.walk.extend()
        if fresh:
            keep = set(now) | set(self.walk.held)
            for url in [u for u in self.fetched if u not in keep]:
                self.fetched.pop(url).cancel()
        reading = set(now)
        for url in now + [u for u in later if u in self.fetchable and u not in reading]:
            if url not in self.fetched:
                _, nbytes, digest = self.expected[url]
                self.fetched[url] = self.fetcher.submit(url, self.policy, nbytes, digest, self.cache_dir)

    def _read_shard(self, url, fetched=None):
        """Every sample of a shard: (columns, their positions in the shard, bad samples as
        (position, key, error), how many positions it held, the error that ended it). Raw
        shards read whole go into the window's arena, where their images stay."""
        arena = self.arena
        count, nbytes, digest = self.expected.get(url, (None, None, None))
        if url in self.suspect:  # read again (a pair's reserve, another pass): nothing in it can be used
            return None, [], 0, self.suspect[url], count
        whole = nbytes is not None and nbytes <= WHOLE_SHARD
        got, bad, cols = 0, [], None
        begin = arena.used if arena is not None else 0

        def consume(stream):
            nonlocal got, cols
            got, cols = 0, ([], [], [], [], [])  # a retry starts the shard over
            bad.clear()
            if whole:  # the manifest's size is a claim: a local file may be larger than it says
                if arena is not None:
                    arena.rewind(begin)
                    start, end = arena.read(stream, WHOLE_SHARD)
                    buf = arena.view(start, end)
                else:
                    start, buf = None, remote.read_all(stream, WHOLE_SHARD)
                found = regular_members(buf, *self.regular) if self.regular else None
                if found is not None:
                    if arena is not None:  # the arena keeps the shard up to its last image, nothing after
                        arena.rewind(start + int(found[2][-1] + found[3][-1]))
                    got, cols = len(found[0]), self._check_regular(*self._images(found, buf, arena, start), bad)
                    return
                stream = io.BytesIO(buf)  # a copy: the sequential reader's samples own their bytes
                if arena is not None:
                    arena.rewind(begin)
            keys, images, exts, labels, where = cols
            for sample in iter_samples(stream, self.want, url, **self.read_kw):
                if is_meta(sample["__key__"]):  # a shard's __meta__ sample: no training sample, as in the index
                    continue
                at = got
                try:
                    if self.schema is not None:  # the fields' members as read: decoded with the images, in Decode
                        label, ext, image = 0, None, self.schema.pick(sample)
                    else:
                        label = label_of(sample, self.target, self.lookup)
                        ext, image = image_of(sample, self.target)
                except Unlabelled as e:
                    if not self.target.skip_unlabelled:  # else left out, as the index counted it
                        got += 1
                        bad.append((at, sample["__key__"], f"no label: {e}"))
                    continue
                except ValueError as e:
                    got += 1
                    bad.append((at, sample["__key__"], e))
                    continue
                got += 1
                keys.append(sample["__key__"])
                images.append(image)
                exts.append(image_format(ext))
                labels.append(label)
                where.append(at)

        error = None
        try:
            if fetched is not None:
                _take(fetched, consume)
            else:
                remote.read_url(url, consume, policy=self.policy, nbytes=nbytes, digest=digest,
                                cache_dir=self.cache_dir)
        except ShardError as e:
            if self.errors.strict:
                raise ShardError(f"{url}: {e}") from None
            error = e.with_traceback(None)  # its frames would hold the shard's bytes (the arena's buffer)
            if isinstance(e, DigestError):  # the whole shard is suspect, not only its end
                got, cols, bad = 0, None, []
                self.suspect[url] = error
                self.fetchable.discard(url)
        else:
            if count is not None and got < count and self.errors.strict:  # a tar may end without its end blocks
                raise ShardError(f"{url}: {got} samples, the manifest says {count}: the tar ends early (truncated)")
            if count is not None and got != count and url not in self.miscount_said:
                self.miscount_said.add(url)
                lost = max(count - got, 0)
                self.errors.note(f"{url}: {got} samples, the manifest says {count}" +
                                 (f"; the {lost} missing counted as skipped" if lost else ""))
        return cols, bad, got, error, count

    def _piece(self, url, shard, lo, hi, out, window=None):
        """The samples at positions [lo, hi) of a read shard into `out`; what is missing there,
        or bad, counted as skipped: here for evaluation, for a training window by the chain that
        passes the places it leaves empty (`out.refused`, stages.SourceStream.take)."""
        cols, bad, got, error, count = shard
        end = (count or got) if hi is None else hi
        lost = max(end - max(lo, got), 0)
        if error is not None and end >= (count or got):
            lost = max(lost, 1)  # the shard's end was damaged
        # a training window's places left empty are counted by the chain that passes them
        # (stages.SourceStream.take), once each whatever the workers; evaluation counts them here
        training = window is not None and window.size is not None
        counted = 0 if training else lost
        if error is not None and lost and url in self.damage_said:
            self.errors.skipped += counted
        elif error is not None and lost:
            self.damage_said.add(url)
            self.errors(f"{url}: {error}", counted, said=f"{url}: {error}; skipped {lost} sample(s)")
        elif lost:  # a tar that ends early: named once when read (see _read_shard)
            self.errors.skipped += counted
        base = out.places - lo  # the window's place of the shard's position 0 (as its manifest counts)
        for at, key, e in bad:
            if not lo <= at < end:
                continue
            if not training or self.errors.strict:  # evaluation (each shard read once), or --strict: now
                self.bad(url, key, e)
            else:  # training: named and counted by the chain that passes the place it leaves empty
                out.refused.append((url, key, str(e)))  # a string: an exception would keep its frames
                out.refused_at.append(base + at)
        out.places += max(end - lo, 0)
        self._add(url, cols, lo, end, got, out, base)

    @staticmethod
    def _add(url, cols, lo, end, got, out, base):
        """The good samples of a read shard at positions [lo, end) into `out`, at places base + position."""
        if cols is None or not len(cols[0]):
            return
        keys, images, exts, labels, where = cols
        where = np.asarray(where, np.int64)
        if lo > 0 or end < got:
            keep = np.flatnonzero((where >= lo) & (where < end))
            if not len(keep):
                return
            keys = [keys[i] for i in keep.tolist()]
            images = images[keep] if isinstance(images, Rows) else [images[i] for i in keep.tolist()]
            exts = exts if isinstance(exts, str) else [exts[i] for i in keep.tolist()]
            labels, where = np.asarray(labels)[keep], where[keep]
        out.add(keys, images, exts, labels, url, base + where)

    @staticmethod
    def _images(found, buf, arena=None, start=0):
        """(keys, images, labels) of a shard `read.regular_members` read in `buf`: images
        `Rows` where `buf` is the arena's from `start` and they are all of one size, else a
        list of bytes: slices of `buf` where it is bytes (each its one copy; a bytes() call
        around it cost 0.1-0.2 us a small JPEG), copies out of the arena's memoryview else."""
        keys, labels, starts, sizes = found
        if arena is not None and (sizes == sizes[0]).all():
            return keys, Rows(arena, starts + start, sizes[0]), labels
        if type(buf) is bytes:
            return keys, [buf[a:a + z] for a, z in zip(starts.tolist(), sizes.tolist())], labels
        return keys, [buf[a:a + z].tobytes() for a, z in zip(starts.tolist(), sizes.tolist())], labels

    def _check_regular(self, keys, images, labels, bad):
        """Labels (and raw image sizes) of a shard read by read.regular, checked for all its
        samples at once. Returns the columns WindowData.add takes and their positions."""
        dense = isinstance(images, Rows)
        nbytes = int(np.prod(self.target.shape))
        where = np.arange(len(keys))
        if dense and images.size != nbytes:
            bad += [(i, k, f"{images.size} raw bytes, expected {nbytes} for shape {self.target.shape}")
                    for i, k in enumerate(keys)]
            return [], images[:0], "raw", labels[:0], where[:0]
        values = labels
        if self.lookup is not None:
            known = np.array(self.target.label_values)
            order = np.argsort(known)
            pos = np.clip(np.searchsorted(known[order], values), 0, len(known) - 1)
            ok = known[order][pos] == values
            labels = np.where(ok, order[pos], -1)
        else:
            ok = (labels >= 0) & (labels < self.target.classes)
        if not ok.all():
            bad += [(i, keys[i], _label_error(int(values[i]), self.target, self.lookup)) for i in np.flatnonzero(~ok)]
            keep = np.flatnonzero(ok)
            keys, labels, where = [keys[i] for i in keep], labels[keep], keep
            images = images[keep] if dense else [images[i] for i in keep]
        return keys, images, "raw" if dense else [image_format(self.target.image_exts[0])] * len(keys), labels, where

    def none_readable(self):
        """How a source none of whose samples read ends its line (stages.SourceStream): the first
        refusal's reason, which --verify (sizes, digests, counts) would not find; else the damage."""
        if self.first_refused is not None:
            return f"; the first refused: {self.first_refused}"
        return "; check them with make-shards --verify"

    def bad(self, url, key, error):
        """A sample that cannot be used: named and counted (or raised, under --strict)."""
        if self.first_refused is None:
            self.first_refused = f"sample {key}: {cut(error, 200)}"
        self.errors(f"{url}: sample {key}: {error}", said=f"{url}: skipped sample {key}: {error}")


def _label_error(value, target, lookup):
    """What the sequential path says of a label it can't use (decode.class_index)."""
    try:
        class_index(value, target, lookup)
    except ValueError as e:
        return str(e)
    raise AssertionError(f"label {value} is usable")
