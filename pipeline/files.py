"""Writing files so that a crash or a full disk never leaves half of one behind, and
so that two processes writing one folder take turns."""
import contextlib
import errno
import fcntl
import json
import os
import stat

from pipeline.errors import ShardError


def write_atomic(path, data):
    """Write bytes to a temporary name and rename it over `path` when complete.

    On any error (ENOSPC included, or a stop signal) the temporary file is removed and `path` keeps
    its previous content; the OSError propagates with the path in its message.
    """
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:  # a stop signal too (pipeline.train.stop.Interrupted): no half-made file left
        try:
            os.remove(tmp)
        except OSError:
            pass
        if isinstance(e, OSError):
            raise OSError(e.errno, f"could not write {path}: {e.strerror or e}") from None
        raise


def write_json_atomic(path, obj):
    write_atomic(path, (json.dumps(obj, indent=1) + "\n").encode())


SPECIAL = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
           (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def open_regular(path):
    """`path` opened for reading in binary if it is a regular file (links followed), else
    ShardError before it is opened: opening a FIFO blocks until someone writes to it,
    /dev/zero never ends, a device may act on open. The open itself never blocks, and a
    file swapped for something else between the check and the open is refused too."""
    info = os.stat(path)
    if not stat.S_ISREG(info.st_mode):
        what = next((name for test, name in SPECIAL if test(info.st_mode)), "not a regular file")
        raise ShardError(f"{path} is {what}, not a regular file: refused")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    try:
        now = os.fstat(fd)
        if not stat.S_ISREG(now.st_mode) or (now.st_dev, now.st_ino) != (info.st_dev, info.st_ino):
            raise ShardError(f"{path} changed into something else while it was opened: refused")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


MAX_JSON = 64 << 20  # a manifest for millions of shards is a few hundred MB; more is not a manifest


def read_json(path):
    try:
        with open_regular(path) as f:
            data = f.read(MAX_JSON + 1)
    except FileNotFoundError:
        raise ShardError(f"{path}: no such file") from None
    if len(data) > MAX_JSON:
        raise ShardError(f"{path}: more than the {MAX_JSON} bytes a manifest may hold")
    return parse_json(data, path)


def parse_json(data, where):
    """JSON from a file or a server, whatever it holds: ShardError naming `where` if it isn't."""
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:  # bad UTF-8 or JSON, 5,000-digit numbers, 100,000-deep nesting
        raise ShardError(f"{where}: not valid JSON ({e.__class__.__name__}: {str(e)[:200]})") from None


def append_line(path, text):
    """Append one line (or lines: `text` ending where the last ends) whole, or nothing: a failed
    write (disk full, a file size limit) is cut back off, and its error names the file (the
    write's own names none). Unbuffered, so that closing the file does not write the rest again."""
    data = memoryview((text.rstrip("\n") + "\n").encode())
    with open(path, "ab", buffering=0) as f:
        start = f.tell()
        try:
            while data:
                data = data[f.write(data):]
        except OSError as e:
            f.truncate(start)
            raise OSError(e.errno, e.strerror, path) from None


def cut_to_complete_lines(path):
    """Drop a torn last line (a write cut short by a crash); returns the complete lines.

    Lines end at "\n" only: str.splitlines would also split at "\r", "\x85", "\u2028" and
    the like, which a line may hold (a key log's key), and so miscount and rewrite them."""
    if not os.path.exists(path):
        return []
    with open_regular(path) as f:
        data = f.read()
    end = data.rfind(b"\n") + 1
    if end != len(data):
        with open(path, "r+b") as f:
            f.truncate(end)
    return data[:end].decode("utf-8", "replace").split("\n")[:-1]


def keep_lines(path, lines):
    """Rewrite a text file to hold exactly `lines` (atomically)."""
    write_atomic(path, "".join(ln + "\n" for ln in lines).encode())


class Busy(OSError):
    """Another process holds the lock (see `locked`)."""


@contextlib.contextmanager
def locked(path, *, wait=True):
    """Hold an exclusive lock on the file `path` (created, and removed again on release).

    flock on a file opened for writing, so that it also holds on NFS, where flock is a
    whole-file fcntl lock. A process that dies releases its lock with its descriptors.
    The file is removed while held, so after acquiring we check that `path` is still
    the file we locked; else another process removed it meanwhile and we lock anew.
    Without `wait`, a lock held by another process raises Busy naming its pid.
    """
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)  # a planted link is no lock
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
                raise Busy(errno.EWOULDBLOCK, f"{path} is held by another process (pid {holder})") from None
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                try:
                    yield
                finally:
                    with contextlib.suppress(OSError):
                        os.remove(path)
                return
        finally:
            os.close(fd)


def missing_folder(spec):
    """True for a local SPEC that can only mean a folder (a trailing '/', or neither a manifest,
    a shard pattern nor a shard name) and is not one. URLs and pipe: commands are not local.
    The trainer asks before torch is imported (options.check_out), manifest.resolve after."""
    if "://" in spec or spec.startswith("pipe:") or spec.endswith((".json", ".tar", ".tar.gz", ".tgz")) \
            or any(c in spec for c in "{*?["):  # a brace pattern or a glob
        return False
    return not (os.path.isdir(spec) if spec.endswith("/") else os.path.exists(spec))


def no_manifest(path):
    """The line for a local manifest that is not there (manifest.load, missing_line), naming the
    .json of its folder that `path` is a typo of, if one is (closest_json)."""
    closest = closest_json(path)
    return (f"no manifest at {path} (build one with make-shards, or index existing shards with "
            f"make-shards --index)" + (f"; did you mean {closest}?" if closest else ""))


TYPO = 0.85  # difflib ratio: mnist-trian.json / mnist-train.jsn -> mnist-train.json (0.94, 0.97), not
# mnist-test.json (0.77: another split, whose data would train or test in the other's place), not package.json


def closest_json(path):
    """The .json file in `path`'s folder whose name `path`'s is a typo of (the closest at TYPO or
    above), else None; None where the folder is not there."""
    import difflib

    folder, base = os.path.split(path)
    try:
        jsons = [n for n in os.listdir(folder or ".") if n.endswith(".json") and n != base]
    except OSError:
        return None
    closest = difflib.get_close_matches(base, jsons, n=1, cutoff=TYPO)
    return os.path.join(folder, closest[0]) if closest else None


def missing_line(name, spec):
    """The one line for a local NAME=SPEC that missing_folder found missing. A path ending in a
    file name in a folder that is there (`.../mine-train.jsn`, a mistyped manifest) gets the
    missing manifest's line (with the .json it is a typo of, if any); else no such folder."""
    folder, base = os.path.split(spec)
    ext = os.path.splitext(base)[1][1:]
    if spec.endswith("/") or not (ext.isalpha() and len(ext) <= 5) or not os.path.isdir(folder or "."):
        return f"{name}={spec}: no such folder"
    return no_manifest(spec)


def new_folders(out):
    """The folders that making `out` (os.makedirs) will create, the deepest last."""
    made, path = [], os.path.abspath(out)
    while not os.path.lexists(path):
        made.insert(0, path)
        path = os.path.dirname(path)
    return made


def remove_empty(made):
    """Remove the folders new_folders listed, deepest first, as far as they are empty: a failed
    command takes back what it created, and what another process put there meanwhile stays."""
    for path in reversed(made):
        try:
            os.rmdir(path)
        except OSError:
            return
