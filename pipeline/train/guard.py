"""The trainer's start-up checks of a job against its machine, its --out folder and its data.

Each answers before the first sample is read: a batch too large for the machine is one
line, not an OOM kill; a second trainer on a live run's --out is one line, not two runs
writing one folder; data that would make "test accuracy" mean something else (the same
shards in training and evaluation, a manifest of the other split) is a warning naming both.
"""
import contextlib
import os
import re
import sys
import warnings

from pipeline.data.handover import budget
from pipeline.data.store import remote
from pipeline.data.manifests.locations import repeated
from pipeline.errors import InputError, redact
from pipeline.files import Busy, locked
from pipeline.train.options import DEFAULT_MODEL

LOCK = ".train.lock"  # in --out while a trainer runs there; holds its pid
EVAL_SPLITS = ("test", "val", "valid", "validation", "eval", "holdout")


def check_memory(args, stream, eval_sources=0, device=None):
    """ValueError (one line) when the job's batches, and on a CPU `device` the model's step, may
    take more than --max-batch-memory (pipeline.data.handover.budget; the step of the default --model
    only); `stream`: the training MixedStream, built but not yet read. A GPU's step is in its own
    memory, not counted here."""
    cap = getattr(args, "max_batch_memory", None) or budget.default_cap()
    step = 0
    if device is not None and device.type == "cpu" and getattr(args, "model", DEFAULT_MODEL) == DEFAULT_MODEL:
        from pipeline.train.model import step_bytes  # fitted to the default CNN: another model's step is not counted

        step = step_bytes(args.batch_size, *stream.layout.hw, args.width)
    return budget.check_budget(args.batch_size, {s.name: s.shape for s in stream.sources}, args.workers, cap,
                               window_bytes=stream.window_held(), eval_sources=eval_sources,  # the loaders' PREFETCH
                               fetched_ahead=stream.fetches_ahead(), step_bytes=step,
                               width=getattr(args, "width", None),
                               fields=stream.layout.memory(args.batch_size) if schemas(stream) else None)


def schemas(stream):
    """Whether a source has fields of its own: its batch is counted field by field."""
    return any(getattr(s, "schema", None) is not None for s in stream.sources)


@contextlib.contextmanager
def out_lock(out, topo):
    """Rank 0 holds --out/LOCK for the job's life (one lock per job: the other ranks write
    nothing before prepare_out's barrier, which rank 0 reaches holding it). A lock held by
    another trainer is InputError naming its pid on every rank (they learn rank 0's verdict
    in one all_gather, so none is left waiting for it in a collective), before anything in
    --out is touched. The kernel releases the lock with the process, however it ends; a
    folder made here only to hold it is removed again if the job leaves it empty."""
    from pipeline.train import dist

    with contextlib.ExitStack() as stack:
        problem = None
        if topo.is_main:
            try:
                if not os.path.isdir(out):
                    with contextlib.suppress(FileExistsError):  # another job may make it at the same moment
                        os.makedirs(out)
                        stack.callback(_remove_if_empty, out)
                stack.enter_context(locked(os.path.join(out, LOCK), wait=False))
            except Busy as e:
                pid = re.search(r"\(pid ([^)]*)\)", e.strerror or "")
                problem = (f"--out {out}: another trainer is running there (pid {pid[1] if pid else 'unknown'}); "
                           f"nothing touched: wait for it to end, stop it, or choose another --out")
            except OSError as e:  # not writable, not a folder: every rank ends with it
                problem = f"--out {out}: {e.strerror or e}"
        problem = dist.all_gather(problem)[0]
        if problem:
            raise InputError(problem)
        yield


def _remove_if_empty(folder):
    with contextlib.suppress(OSError):
        os.rmdir(folder)


def earlier_run(out, names):
    """The one line for --resume-or-start over an earlier run that left no checkpoint."""
    return (f"--resume-or-start: {out} holds an earlier run's files ({', '.join(names)}) but no checkpoint.pt to "
            f"continue from; nothing touched: to replace them run once with --overwrite instead of "
            f"--resume-or-start, or choose another --out")


def warn_data(train_sources, eval_sources):
    """One warning line for each mistake that makes "test accuracy" mean something else: an eval
    source holding a training source's data (shards in both: the same file or URL, or the same
    sha256; the same listing of names, sizes and sha256 in another place; or a manifest of the
    training split), naming the training source and the split it records; a --train manifest of
    a held-out split that no eval line named; a training source holding the same bytes under two
    names, or shards of another training source."""
    named = set()  # training sources an eval line named
    for ev in eval_sources:
        why, fix = [], f"give --eval {ev.name} held-out shards (the source's test manifest, or a folder of other shards)"
        for tr in train_sources:
            shared = _shared(tr, ev)
            split = f", which records split {tr.split!r}" if tr.split in EVAL_SPLITS else ""
            if shared:
                why.append(f"shares {len(shared)} shard(s) with --train {tr.name} ({redact(tr.manifest)}{split}; the "
                           f"same file or sha256), e.g. {redact(shared[0])}")
            elif tr.listing and tr.listing == ev.listing:
                why.append(f"lists the same shards as --train {tr.name} ({redact(tr.manifest)}{split}: the same "
                           f"names, sizes and sha256)")
            else:
                continue
            named.add(id(tr))
            if split:
                fix = f"give --train {tr.name} the source's training manifest"
        if ev.split == "train":
            why.append("records split 'train'")
        if why:
            warnings.warn(f"--eval {ev.name} ({redact(ev.manifest)}) {'; '.join(why)}: its \"test accuracy\" is "
                          f"measured on data the model trains on ({fix})", stacklevel=2)
    for i, tr in enumerate(train_sources):
        for other in train_sources[:i]:
            shared = _shared(other, tr)
            if shared:
                warnings.warn(f"--train {tr.name} shares {len(shared)} shard(s) with --train {other.name} (the same "
                              f"file or sha256), e.g. {redact(shared[0])}: their samples are read twice an epoch, "
                              f"once under each name", stacklevel=2)
        twins = repeated(zip(tr.urls, tr.digests or []))
        if twins:
            warnings.warn(f"--train {tr.name}: {len(twins)} shard(s) hold the same bytes as another of its shards "
                          f"(equal sha256), e.g. {twins[0][0]} and {twins[0][1]}: they are read twice an epoch",
                          stacklevel=2)
        if tr.split in EVAL_SPLITS and id(tr) not in named:
            warnings.warn(f"--train {tr.name}: {redact(tr.manifest)} records split {tr.split!r}: the model trains on "
                          f"held-out data", stacklevel=2)


def _where(url):
    """A shard's location compared as the file it names (its device and inode: hard links, symbolic
    links and '..' are one file) or the URL."""
    if remote.kind(url) != "file":
        return url
    try:
        st = os.stat(url)
    except OSError:
        return os.path.realpath(url)
    return st.st_dev, st.st_ino


def _shared(a, b):
    """The shards of source b that source a holds too: same location or same sha256."""
    places = {_where(u) for u in a.urls}
    digests = {d for d in (a.digests or []) if d}
    return [u for u, d in zip(b.urls, b.digests or [None] * len(b.urls))
            if _where(u) in places or (d and d in digests)]


def warn_loader_timeout(args, policy, sources):
    """A --loader-timeout shorter than a shard's read may take under the I/O flags ends a run whose
    read is slow but within its deadline: the worker sends no batch meanwhile and is killed for it
    (hostileK: --io-timeout 20 let a 12 s stall through, --loader-timeout 5 ended the run). One line
    at the start, naming both, so the two deadlines do not disagree unseen."""
    if not args.loader_timeout or not args.workers:
        return
    largest = max((n for src in sources for n in (src.sizes or ()) if n), default=None)
    longest = policy.deadline(largest)
    if args.loader_timeout < longest:
        size = f"{largest:,} bytes" if largest is not None else "of a size no manifest gives"
        print(f"pipeline-train: warning: --loader-timeout {args.loader_timeout:g} s is shorter than a shard's read "
              f"may take ({longest:.1f} s for the largest, {size}, under --io-timeout {args.io_timeout:g} s and "
              f"--min-rate {args.min_rate:g} MB/s): a slow read within its deadline would end the run; raise "
              f"--loader-timeout", file=sys.stderr, flush=True)
