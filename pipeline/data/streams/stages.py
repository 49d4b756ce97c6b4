"""The stages of one source's samples inside one (rank, loader worker), in order:

    plan        the pair's run of the epoch's positions (pipeline.ordering.deal), as the
                windows that hold them (pipeline.ordering.order): `RunPlan`
    read        each window's shards read once: members grouped into samples, labels
                parsed, members the source doesn't use dropped unread (`Reader`)
    shuffle     one seeded permutation of each window's samples
    take        the next n samples decoded, through the user's sample stages
                (`SourceStream.take`)

and across sources, `mix.RandomMix` takes each batch's samples from the sources its
`deal.Choices` name.

Every stage has one method, `next(n)`: its next item (for a source's stages, the chunk of
the next n positions), pulled from the stage before it, its `upstream`, as webdataset's and
torchdata's stages pull theirs. Stages keep no state a checkpoint needs.

Every stage before `take` is a pure function of (seed, epoch, source, position):
where a stream stands is, per source, how many positions of its run it has read
(`SourceStream.state`), and any such point is reached again without reading what
came before it. Positions count whether the sample there was kept, skipped as
damaged or dropped by a stage, so a pure stage of the user's resumes exactly.

Two stages are written here rather than taken from webdataset, for measured
reasons (docs/benchmarks.md, "Why some stages are our own"): tar reading (`pipeline.data.shards.read`),
and the shuffle, a permutation per window instead of `wds.shuffle`'s buffer,
which costs a `random.randint` per sample and holds state no checkpoint can reach.
"""
import collections
import io
import os
import queue
import threading
import weakref
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from pipeline.ordering import order

from pipeline.data.store import remote
from pipeline.data.fields import member_values
from pipeline.ordering.topology import stride
from pipeline.data.decoding.decode import decode_batch, image_format, image_of
from pipeline.data.decoding.labelling import Unlabelled, class_index, label_of, parse_label_key
from pipeline.errors import DigestError, Errors, InputError, ShardError
from pipeline.data.shards.readbuffer import Arena, Rows
from pipeline.data.shards.read import MAX_MEMBER, is_meta, iter_samples, regular_members
from pipeline.data.fields.schema import Oversized
from pipeline.data.fields.member_values import user_stage


def split(urls, topo, worker):
    """This (rank, worker)'s shards for evaluation: the islice rule of `wds.split_by_node`,
    then `wds.split_by_worker`, with the rank and worker handed in (topology.stride)."""
    first, step = stride(topo.rank, topo.world, worker.id, worker.count)
    return list(urls)[first::step]


@dataclass(frozen=True)
class Window:
    """Shards read and shuffled together, and which of its places a chain takes.

    rows: (url, lo, hi) sample ranges of shards in their own order (hi None: to the end);
    key: the shuffle's generator key (None: read in order); places skip..size of the
    window's shuffled order are taken, the first of them being the run's position
    `start`. Two windows with the same rows and key hold the same samples in the same
    order (`same`), so a chain reads and shuffles them once."""

    rows: tuple
    key: tuple = None
    start: int = 0
    size: int = None
    skip: int = 0

    def same(self, other):
        return other is not None and (other is self or (other.rows == self.rows and other.key == self.key))


class RunPlan:
    """The windows one (rank, worker) reads of one source: its run of the epoch's positions
    (pipeline.ordering.deal), window by window (pipeline.ordering.order), from `at` positions in.

    Each window is read whole and its positions taken where the run holds them. A pair that
    passed over damaged samples and still owes samples goes on into its `reserve`
    (deal.Segment.reserves: positions no other pair reads); past that too, it reads its run
    again from the start (those samples then repeat: the damage is counted).
    """

    def __init__(self, order, urls, run, at=0, reserve=()):
        self.order, self.urls, self.run = order, list(urls), list(run) + list(reserve)
        self.own = sum(n for _, n in run)  # the run proper: what is fetched ahead
        self.ends = np.cumsum([n for _, n in self.run]) if self.run else np.zeros(0, np.int64)
        self.length = int(self.ends[-1]) if self.run else 0
        self.reset(at)

    def reset(self, at=None):
        self.at, self.current = int(at or 0), None

    def next(self):
        """The window holding the run's next position (the current one counts as read)."""
        if self.current is not None:
            w = self.current
            self.at = w.start + w.size - w.skip
        if not self.length:
            raise StopIteration
        self.current = self._window_at(self.at)
        return self.current

    def _window_at(self, at):
        place = at % self.length  # past the run's end only after damage
        k = int(np.searchsorted(self.ends, place, side="right"))
        start, n = self.run[k]
        position = start + place - (int(self.ends[k]) - n)
        q, j, offset = self.order.locate(position)
        shards, size, key = self.order.window_of(q, j)
        take = min(size - offset, int(self.ends[k]) - place)
        rows = tuple((self.urls[i], 0, None) for i in shards.tolist())
        return Window(rows, key, start=at, size=offset + take, skip=offset)

    def upcoming(self):
        """The windows after the current one, to the run's end: what a reader fetches ahead.
        It stops at the run's end, where only damage makes a pair read its reserve."""
        w = self.current
        at = self.at if w is None else w.start + w.size - w.skip
        while at < self.own:
            w = self._window_at(at)
            yield w
            at = w.start + w.size - w.skip

    def state(self, pos=0):
        """Positions of the run read: the current window counted `pos` positions past its start."""
        w = self.current
        return self.at if w is None else w.start + min(pos, w.size - w.skip)


class OncePlan:
    """Evaluation: each of the pair's shards once, whole and in order."""

    def __init__(self, urls):
        self.urls = list(urls)
        self.reset()

    def next(self):
        self.at += 1
        return self.windows[self.at - 1] if self.at <= len(self.windows) else None

    def upcoming(self):
        return iter(self.windows[self.at:])

    def state(self, pos=0):
        return {}

    def reset(self, state=None):
        self.windows, self.at = [Window(((u, 0, None),)) for u in self.urls], 0


class WindowData:
    """The samples of one window as columns: keys, labels (class indices), the shard each
    came from, and images: `arena.Rows` (raw pixels where the window's shards were read)
    when every shard was read by `read.regular_members` with raw pixels, else a list of
    encoded images with their extensions."""

    def __init__(self):
        self.keys, self.labels, self.urls, self.chunks = [], [], [], []

    def add(self, keys, images, exts, labels, url):
        """One shard's samples: images `Rows` (exts "raw") or a list (exts a list)."""
        self.keys += keys
        self.labels.append(np.asarray(labels, np.int64))
        self.urls += [url] * len(keys)
        self.chunks.append((images, exts))

    def seal(self):
        self.labels = np.concatenate(self.labels) if self.labels else np.zeros(0, np.int64)
        self.key_column = np.array(self.keys, dtype=object)  # taken by index arrays, as the other columns
        if self.chunks and all(isinstance(images, Rows) for images, _ in self.chunks):
            self.images, self.exts = Rows.join([images for images, _ in self.chunks]), "raw"
        else:
            self.images, self.exts = [], []
            for images, exts in self.chunks:
                dense = isinstance(images, Rows)
                self.images += images.tobytes() if dense else images
                self.exts += [exts] * len(images) if dense else exts
        del self.chunks
        return self

    def __len__(self):
        return len(self.keys)


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


def _work(jobs, stopped):
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
            self._piece(url, shards[url], lo, hi, out)
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

    def _piece(self, url, shard, lo, hi, out):
        """The samples at positions [lo, hi) of a read shard into `out`; what is missing
        there, or bad, counted as skipped."""
        cols, bad, got, error, count = shard
        end = (count or got) if hi is None else hi
        lost = max(end - max(lo, got), 0)
        if error is not None and end >= (count or got):
            lost = max(lost, 1)  # the shard's end was damaged
        if error is not None and lost and url in self.damage_said:
            self.errors.skipped += lost
        elif error is not None and lost:
            self.damage_said.add(url)
            self.errors(f"{url}: {error}", lost, said=f"{url}: {error}; skipped {lost} sample(s)")
        elif lost:  # a tar that ends early: named once when read (see _read_shard)
            self.errors.skipped += lost
        for at, key, e in bad:
            if lo <= at < end:
                self.bad(url, key, e)
        if cols is None or not len(cols[0]):
            return
        keys, images, exts, labels, where = cols
        where = np.asarray(where)
        if lo > 0 or end < got:
            keep = np.flatnonzero((where >= lo) & (where < end))
            if not len(keep):
                return
            keys = [keys[i] for i in keep.tolist()]
            images = images[keep] if isinstance(images, Rows) else [images[i] for i in keep.tolist()]
            exts = exts if isinstance(exts, str) else [exts[i] for i in keep.tolist()]
            labels = np.asarray(labels)[keep]
        out.add(keys, images, exts, labels, url)

    @staticmethod
    def _images(found, buf, arena=None, start=0):
        """(keys, images, labels) of a shard `read.regular_members` read in `buf`: images
        `Rows` where `buf` is the arena's from `start` and they are all of one size, else a
        list of bytes."""
        keys, labels, starts, sizes = found
        if arena is not None and (sizes == sizes[0]).all():
            return keys, Rows(arena, starts + start, sizes[0]), labels
        return keys, [bytes(buf[a:a + z]) for a, z in zip(starts.tolist(), sizes.tolist())], labels

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

    def bad(self, url, key, error):
        self.errors(f"{url}: sample {key}: {error}", said=f"{url}: skipped sample {key}: {error}")


def _label_error(value, target, lookup):
    """What the sequential path says of a label it can't use (decode.class_index)."""
    try:
        class_index(value, target, lookup)
    except ValueError as e:
        return str(e)
    raise AssertionError(f"label {value} is usable")


@dataclass
class Chunk:
    """What moves down a source's chain: the samples at positions [lo, hi) of a window's
    order, filled in stage by stage (the rows of `data`, then decoded columns)."""

    window: Window
    lo: int
    hi: int
    data: WindowData = None
    idx: np.ndarray = None
    crops: np.ndarray = None  # the window's crop table, taken by idx where images are decoded
    seed0: int = 0  # the seed of position lo; the user's stages number on from it
    kept: np.ndarray = None  # which of idx decoded (None: all)
    keys: list = None
    pixels: np.ndarray = None
    labels: np.ndarray = None
    seeds: np.ndarray = None


class Positions:
    """The plan's windows, handed down as ranges of their places; `position()` is how many
    positions of the run the chain has taken: all a resume needs of it."""

    upstream = None  # the first stage: it pulls from the plan

    def __init__(self, plan):
        self.plan, self.window, self.at = plan, None, 0

    def next(self, n):
        w = self.window
        if w is None or self.at >= (w.size if w.size is not None else self.at + 1):
            w = self.window = self.plan.next()
            if w is None:
                raise StopIteration
            self.at = w.skip
        if w.size is None:  # evaluation: the window's length is known once read
            lo, self.at = self.at, self.at + n
            return Chunk(w, lo, self.at)
        lo, self.at = self.at, min(self.at + n, w.size)
        return Chunk(w, lo, self.at)

    def exhausted(self):
        """The current window read to its end (a shard that holds fewer samples than its manifest)."""
        if self.window is not None:
            self.at = self.window.size if self.window.size is not None else float("inf")

    def position(self):
        return self.plan.state(self.at - (self.window.skip if self.window else 0))


class Read:
    """Each window's pieces read once (`Reader`), kept while its positions are taken."""

    def __init__(self, reader, plan=None):
        self.reader, self.window, self.data = reader, None, None
        self.upcoming = getattr(plan, "upcoming", None)  # the windows after, whose remote shards are fetched ahead

    def next(self, n):
        chunk = self.upstream.next(n)
        if not chunk.window.same(self.window):
            self.data = self.reader(chunk.window, self.upcoming)
        self.window = chunk.window
        chunk.data = self.data
        return chunk


class Shuffle:
    """One permutation of each window's samples, and each sample's crop, drawn from the
    window's key; windows without a key (evaluation) keep their order."""

    def __init__(self, shuffle=True):
        self.shuffle, self.window, self.order, self.crops, self.seed0 = shuffle, None, None, None, 0

    def next(self, n):
        chunk = self.upstream.next(n)
        w = chunk.window
        if not w.same(self.window):
            k = len(chunk.data)
            if self.shuffle and w.key is not None:
                rng = order.generator(*w.key)
                self.order = rng.permutation(k)
                # crops place random crops of decoded images; raw pixels have none to place
                self.crops = None if chunk.data.exts == "raw" else rng.random((k, 2))
            else:
                self.order, self.crops = np.arange(k), None
            self.seed0 = order.seed_of(w.key) if w.key is not None else 0
        self.window = w
        chunk.idx, chunk.crops, chunk.seed0 = self.order[chunk.lo:chunk.hi], self.crops, self.seed0 + chunk.lo
        return chunk


class Decode:
    """The chunk's images decoded to the source's shape; what fails to decode is reported
    to the error policy (through the reader) and left out."""

    def __init__(self, reader):
        self.reader, self.target = reader, reader.target
        self.schema = getattr(reader, "schema", None)

    def next(self, n):
        chunk = self.upstream.next(n)
        if self.schema is not None:
            return self._fields(chunk)
        d, idx = chunk.data, chunk.idx
        if isinstance(d.images, Rows):
            chunk.pixels = d.images.take(idx).reshape(len(idx), *self.target.shape)
        else:
            rows = idx.tolist()
            pixels, kept, errors = decode_batch([d.images[i] for i in rows], [d.exts[i] for i in rows], self.target,
                                                None if chunk.crops is None else chunk.crops[idx])
            for k, message in errors:
                self.reader.bad(d.urls[rows[k]], d.keys[rows[k]], message)
            if errors:
                chunk.kept = np.asarray(kept, np.int64)
                idx = idx[chunk.kept]
            chunk.pixels = pixels
        chunk.keys, chunk.labels = d.key_column[idx].tolist(), d.labels[idx]
        return chunk

    def _fields(self, chunk):
        """A schema's source: each sample's fields decoded and through the schema's stages, seeded by
        its position as the user's stages are (`__seed__`); chunk.pixels is then an object array of
        {field: value}. What does not fit its field is reported and left out, like an undecodable
        image; a sample a stage of the schema drops is left out unreported, as UserStage does."""
        d, idx = chunk.data, chunk.idx
        seeds = np.arange(len(idx), dtype=np.uint64) + np.uint64(chunk.seed0)
        source, rows, masked = self.reader.source.name, idx.tolist(), [s & SEED_MASK for s in seeds.tolist()]
        decoded = self.schema.decode_images([d.images[i] for i in rows], masked)
        values, kept = [], []
        for j, (i, seed) in enumerate(zip(rows, masked)):
            try:
                v = self.schema.sample(d.images[i], seed, d.keys[i], source, decoded[j])
            except InputError:  # a stage of the user's that failed: the user's to fix, not the sample's
                raise
            except ValueError as e:
                self.reader.bad(d.urls[i], d.keys[i], e)
                continue
            if v is not None:
                values.append(v)
                kept.append(j)
        if len(kept) < len(idx):
            chunk.kept = np.asarray(kept, np.int64)
            idx = idx[chunk.kept]
        chunk.pixels = np.empty(len(values), object)
        for j, v in enumerate(values):
            chunk.pixels[j] = v
        chunk.seeds = seeds if chunk.kept is None else seeds[chunk.kept]
        chunk.keys, chunk.labels = d.key_column[idx].tolist(), np.zeros(len(idx), np.int64)
        return chunk


class UserStage:
    """A function of the user's on each decoded sample, a dict {"__key__", "__source__",
    "image", "label", "__seed__"}; it returns the sample or None to drop it. The stream
    counts positions, not kept samples, so a stage that depends only on its sample
    resumes exactly."""

    def __init__(self, fn, source, shape, classes):
        self.fn, self.source, self.shape, self.classes = fn, source, tuple(shape), classes

    def next(self, n):
        chunk = self.upstream.next(n)
        if chunk.seeds is None:  # the first of the user's stages: each position's seed
            seeds = np.arange(len(chunk.idx), dtype=np.uint64) + np.uint64(chunk.seed0)
            chunk.seeds = seeds if chunk.kept is None else seeds[chunk.kept]
        if chunk.pixels.dtype == object:  # a schema's source: the stage sees and returns its fields
            return self._fields(chunk)
        keep, pixels, labels = [], [], []
        for i, (key, image, label, seed) in enumerate(zip(chunk.keys, chunk.pixels, chunk.labels,
                                                          chunk.seeds.tolist())):
            sample = self._apply({"__key__": key, "__source__": self.source, "image": image.copy(),
                                  "label": int(label), "__seed__": seed & SEED_MASK})
            if sample is not None:
                keep.append(i)
                pixels.append(np.asarray(sample["image"]))
                labels.append(int(sample["label"]))
        c, h, w = self.shape
        chunk.keys = [chunk.keys[i] for i in keep]
        chunk.pixels = np.stack(pixels) if pixels else np.zeros((0, c, h, w), np.uint8)
        chunk.labels, chunk.seeds = np.array(labels, np.int64), chunk.seeds[keep]
        return chunk

    def _fields(self, chunk):
        schema = self.upstream_schema()
        keep, values = [], []
        for i, (key, v, seed) in enumerate(zip(chunk.keys, chunk.pixels, chunk.seeds.tolist())):
            v = user_stage(self.fn, v, key, self.source, seed & SEED_MASK, schema.final)
            if v is not None:
                keep.append(i)
                values.append(v)
        chunk.keys = [chunk.keys[i] for i in keep]
        chunk.pixels = np.empty(len(values), object)
        for j, v in enumerate(values):
            chunk.pixels[j] = v
        chunk.labels, chunk.seeds = chunk.labels[keep], chunk.seeds[keep]
        return chunk

    def upstream_schema(self):
        """The schema of the Decode stage this stage follows (through the user's stages before it)."""
        node = self.upstream
        while not isinstance(node, Decode):
            node = node.upstream
        return node.schema

    def _apply(self, sample):
        key, fn = sample["__key__"], self.fn
        sample = member_values.call_stage(fn, sample, key)
        if sample is None:
            return None
        image = np.asarray(sample.get("image"))
        if image.shape != self.shape or image.dtype != np.uint8:
            raise InputError(f"sample stage {_name(fn)} returned a {image.dtype} image of shape {image.shape}; "
                             f"it must stay uint8 {self.shape}")
        label = sample.get("label")
        if isinstance(label, bool) or not isinstance(label, (int, np.integer)) or not 0 <= label < self.classes:
            raise InputError(f"sample stage {_name(fn)} returned label {label!r}; it must stay an integer in "
                             f"0..{self.classes - 1}")
        return sample


class SourceStream:
    """One source's samples for one (rank, worker): a chain of stages, each pulling from
    the one before, in this order:

        positions  the plan's windows as ranges of places (`Positions`): the only place kept
        read     each window's shards read once (`Read`)
        shuffle  a seeded permutation and crops per window (`Shuffle`)
        decode   images to the source's shape (`Decode`)
        stage:…  the user's sample stages, in order (`UserStage`)

    `take(n)` returns the next n good samples as (keys, uint8 images (n, C, H, W),
    labels); a training plan never runs out, an evaluation plan may return fewer.
    `position()` is how many positions of the run were read, from which a new chain goes on.
    """

    def __init__(self, plan, reader, *, shuffle=True, sample_stages=()):
        self.reader, self.target = reader, reader.target
        source = reader.source
        self.stages = [("positions", Positions(plan)), ("read", Read(reader, plan)), ("shuffle", Shuffle(shuffle)),
                       ("decode", Decode(reader))]
        self.stages += [(f"stage:{_name(fn)}", UserStage(fn, source.name, self.target.shape, self.target.classes))
                        for fn in sample_stages]
        for (_, before), (_, after) in zip(self.stages, self.stages[1:]):
            after.upstream = before
        self.plan, self.last = plan, self.stages[-1][1]
        self.empty, self.window, self.window_good = 0, None, True  # windows in a row that gave nothing usable
        self.limit = 2 * len(source.urls) + 2

    def position(self):
        """Positions of the run read (the positions stage's): what a worker's batch carries, and
        where a chain rebuilt for a resume starts (`RunPlan(..., at)`)."""
        return self.stages[0][1].position()

    def next(self, n=None):
        return self.take(n)

    def take(self, n):
        keys, parts, labels = [], [], []
        while n > 0:
            try:
                chunk = self.last.next(n)
            except StopIteration:
                break
            if chunk.window is not self.window:
                self._opened(chunk.window)
            if not len(chunk.idx) and chunk.lo >= len(chunk.data):  # the shard held fewer samples than its manifest
                self.stages[0][1].exhausted()
                continue
            if chunk.keys:
                self.window_good = True
            keys += chunk.keys
            parts.append(chunk.pixels)
            labels.append(chunk.labels)
            n -= len(chunk.keys)
        c, h, w = self.target.shape
        if not parts:
            return [], np.zeros((0, c, h, w), np.uint8), np.zeros(0, np.int64)
        return keys, parts[0] if len(parts) == 1 else np.concatenate(parts), np.concatenate(labels)

    def _opened(self, window):
        """Raises ShardError when more windows in a row than twice the source's shards gave no usable sample."""
        self.empty = 0 if self.window_good else self.empty + 1
        if self.empty > self.limit:
            stages = [name for name, _ in self.stages if name.startswith("stage:")]
            why = f", or the sample stages ({', '.join(s[6:] for s in stages)}) dropped every one" if stages else ""
            raise ShardError(f"{self.reader.source.name}: no readable samples in this worker's shards "
                             f"(e.g. {self.reader.source.urls[0]}){why}")
        self.window, self.window_good = window, False


SEED_MASK = (1 << 63) - 1  # a sample's seed fits an int64 and any numpy or torch generator


def _name(fn):
    return member_values.stage_name(fn)
