"""Test helpers for the stream tests: tiny synthetic shard sets, a local HTTP server,
hand-written tar shards, and a free port. Nothing here reads ../shared/data."""
import contextlib
import functools
import http.server
import io
import socket
import tarfile
import threading

from pipeline import shards
from pipeline.sources import SyntheticSource


def build_shards(out, name, split, n, *, shape=(1, 28, 28), encoding="raw", maxcount=20, seed=0):
    """Write n synthetic samples of `name`/`split` as shards plus manifest under `out`.

    Returns (manifest, source): the source gives each key's true image and label.
    """
    source = SyntheticSource(name, split, n, shape, seed)
    manifest = shards.build(source, str(out), encoding=encoding, maxcount=maxcount, seed=seed, progress=False)
    return manifest, source


def sample_key(name, split, index):
    """The key make_shards gives sample `index` (see shards.write_shard)."""
    return f"{name}-{split}-{index:07d}"


def key_index(key):
    return int(key.rsplit("-", 1)[1])


def read_members(path):
    """[(member name, bytes)] of a tar file, read with Python's tarfile (not our parser)."""
    with tarfile.open(path) as tar:
        return [(m.name, tar.extractfile(m).read()) for m in tar.getmembers() if m.isfile()]


def shard_keys(path):
    """Sample keys of a shard in file order, read with tarfile."""
    keys = []
    for name, _ in read_members(path):
        key = name.split(".", 1)[0]
        if not keys or keys[-1] != key:
            keys.append(key)
    return keys


def write_tar(path, members):
    """Write [(name, bytes)] as a plain USTAR tar file, the format make_shards writes."""
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            tar.addfile(info, io.BytesIO(data))


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@contextlib.contextmanager
def serve(folder):
    """Serve `folder` over HTTP on 127.0.0.1 in a thread; yields the base URL (with '/')."""
    handler = functools.partial(_QuietHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
