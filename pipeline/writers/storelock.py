"""The writer's lock of a store prefix (`make_shards --out s3://BUCKET/PREFIX`): a key, since a
store has no file lock, that names its holder (host, pid), when it was taken and when it was
last renewed.

A store cannot release a key when its writer dies, as the kernel releases the trainer's
--out lock (pipeline.files.locked), so the holder renews it every RENEW seconds and a lock
is its holder's only while that goes on: a run finding one takes it over when the holder is
gone, that is when it was written on this host by a process that no longer runs, or has not
been renewed for STALE seconds (a requeued job on another node). A stopped run (SIGTERM, an
error) removes its lock and its temporary keys itself; the keys a killed one left
(`NAME.tar.tmp-PID`) are removed by the next run that holds the lock. Best effort: two runs
that take over one stale lock at the same moment can both go on (a store has no atomic
create here); the time is each host's clock.
"""
import contextlib
import json
import os
import re
import socket
import threading
import time
import uuid

from pipeline.errors import FetchError, ShardError, printable

LOCK = ".make_shards.lock"  # the name of a local --out's lock too (shards.LOCK)
RENEW = 30.0  # seconds between renewals of a held lock
STALE = 4 * RENEW  # a lock not renewed for this long is its holder's no more
TEMPORARY = re.compile(r"^[^/]+\.tar\.tmp-\d+$")  # the temporary keys of make_shards' uploads (publish.publish)


@contextlib.contextmanager
def store_writing(out, policy=None, say=None):
    """Hold the lock of the store prefix `out`, or raise ShardError at once while its holder is
    alive. Writing it is also the check that the prefix is writable (a missing bucket or a
    refused key says so in one line). `say(line)` hears of a lock taken over and the
    temporaries removed."""
    from pipeline.data.store import listings, remote, writing

    say = say or (lambda line: None)
    store = writing.Writer(out, policy)
    held = _read(store)
    if held is not None:
        gone = _gone(held)
        if not gone:
            raise ShardError(f"{out}: another make-shards is writing this prefix ({_who(held)}, its lock "
                             f"{store.url(LOCK)}); wait for it to finish: the lock is taken over once its holder is "
                             f"gone (its process ended on that host, or {STALE:.0f} s without a renewal)")
        say(printable(f"  took over {store.url(LOCK)} from {_who(held)}: {gone}"))
    me = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time(), "token": uuid.uuid4().hex}
    _write(store, me)
    stop = threading.Event()
    renewing = threading.Thread(target=_renew, args=(store, me, stop), name="make-shards-lock", daemon=True)
    renewing.start()
    try:
        left = [k for k in listings.names(out, policy or remote.Policy()) if TEMPORARY.match(k)]
        for k in left:
            store.remove(k)
        if left:
            say(f"  removed {len(left)} temporary key(s) a stopped make-shards left in {out}/ (e.g. {left[0]})")
        yield
    finally:
        stop.set()
        renewing.join(RENEW)
        with contextlib.suppress(FetchError, OSError):
            if (_read(store) or {}).get("token") == me["token"]:
                store.remove(LOCK)


def _write(store, me):
    store.write_bytes((json.dumps(dict(me, renewed=time.time())) + "\n").encode(), LOCK)


def _read(store):
    """The lock's record, or None when there is none; FetchError when it cannot be read. A
    record that is not one (another tool's, an older make_shards' line) counts as never
    renewed."""
    if not store.exists(LOCK):
        return None
    from pipeline.data.store import remote

    try:
        record = json.loads(remote.fetch(store.url(LOCK), policy=store.policy or remote.Policy(), limit=1 << 16))
        return record if isinstance(record, dict) else {}
    except (ShardError, ValueError):
        return {}


def _who(held):
    host, pid, since = held.get("host"), held.get("pid"), held.get("since")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else "?"
    renewed = held.get("renewed")
    ago = f", renewed {time.time() - renewed:.0f} s ago" if isinstance(renewed, (int, float)) else ""
    # a lock is a key anyone with write access may have written: its fields are shown escaped, and short
    return printable(f"host {str(host)[:100]} pid {str(pid)[:20]} since {when}{ago}") if host else \
        "a lock of unknown holder"


def _gone(held):
    """Why the lock's holder is gone ('' while it may be alive)."""
    pid, renewed = held.get("pid"), held.get("renewed")
    if held.get("host") == socket.gethostname() and isinstance(pid, int) and pid > 0 and pid != os.getpid():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return f"process {pid} no longer runs on this host"
        except PermissionError:
            pass
    if not isinstance(renewed, (int, float)):
        return "the lock names no renewal time"
    if time.time() - renewed > STALE:
        return f"not renewed for {time.time() - renewed:.0f} s"
    return ""


def _renew(store, me, stop):
    """Renew the lock every RENEW s while held; a lock another run took over is left alone."""
    while not stop.wait(RENEW):
        with contextlib.suppress(FetchError, OSError, ShardError):
            if (_read(store) or {}).get("token") != me["token"]:
                return
            _write(store, me)
