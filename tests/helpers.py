"""Test helpers for the stream tests: tiny synthetic shard sets, a local HTTP server,
hand-written tar shards, and a free port. Nothing here reads ../shared/data."""
import contextlib
import functools
import http.server
import io
import socket
import tarfile
import threading
import time

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


def launch_train(args, nproc=2, extra_launcher=(), pythonpath=()):
    """`python -m torch.distributed.run ... -m pipeline.train ARGS` in a session of its own."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, *pythonpath]), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
           *extra_launcher, "-m", "pipeline.train", *map(str, args)]
    return subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def finish(proc, timeout=180):
    """(exit code, stderr) of a launched job; kills its whole session and fails the test on a hang."""
    import os
    import signal
    import subprocess

    import pytest

    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"still running after {timeout} s: a hang")
    return proc.returncode, err


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Quiet:
    """A request handler mixin that keeps the test output free of access logs."""

    def log_message(self, *args):
        pass


class _QuietHandler(Quiet, http.server.SimpleHTTPRequestHandler):
    pass


@contextlib.contextmanager
def serving(handler, **attrs):
    """Run an http.server `handler` on 127.0.0.1 in a thread; yields the server, with its
    base URL (ending in '/') as `.url` and `attrs` set on it for the handler to read.
    `.stopping` turns True before the shutdown, so that a handler that stalls on purpose ends."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads, server.stopping = True, False
    for name, value in attrs.items():
        setattr(server, name, value)
    server.url = f"http://127.0.0.1:{server.server_address[1]}/"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.stopping = True
        server.shutdown()
        server.server_close()
        thread.join(5)


@contextlib.contextmanager
def serve(folder):
    """Serve `folder` over HTTP on 127.0.0.1 in a thread; yields the base URL (with '/')."""
    with serving(functools.partial(_QuietHandler, directory=str(folder))) as server:
        yield server.url


def drip(handler, byte, seconds, first=b""):
    """Write `first`, then `byte` every 0.2 s for at most `seconds`, until the server stops
    or the client hangs up: a server slower than any deadline, never silent long enough
    for a socket timeout."""
    t0 = time.time()
    try:
        handler.wfile.write(first)
        while time.time() - t0 < seconds and not handler.server.stopping:
            handler.wfile.write(byte)
            handler.wfile.flush()
            time.sleep(0.2)
    except OSError:
        pass


# ---------------------------------------------------------------- other writers' WebDatasets


def foreign_image(label, size, seed, mode="RGB"):
    """A learnable synthetic image: class `label` sets which quadrant is bright, noise on top."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    h, w = size
    a = rng.integers(0, 90, (h, w, 3), dtype=np.uint8)
    qy, qx = divmod(label % 4, 2)
    a[qy * h // 2:(qy + 1) * h // 2, qx * w // 2:(qx + 1) * w // 2] += 150
    img = Image.fromarray(a)
    return img.convert(mode) if mode != "RGB" else img


def encode_pil(img, fmt, **kw):
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def write_shardwriter(folder, n, *, classes=4, per_shard=20, seed=0):
    """`wds.ShardWriter` shards (a PAX header per member): JPEGs of mixed sizes and modes,
    keys with directories in them (`train/c2/000123`), labels in .cls. Returns the keys."""
    import os

    import webdataset as wds

    os.makedirs(folder, exist_ok=True)
    keys = []
    with wds.ShardWriter(os.path.join(str(folder), "wds-%06d.tar"), maxcount=per_shard, verbose=0) as sink:
        for i in range(n):
            label = i % classes
            size = [(32, 32), (40, 56), (64, 48)][i % 3]
            img = foreign_image(label, size, seed * 100003 + i, "L" if i % 7 == 0 else "RGB")
            key = f"train/c{label}/{i:06d}"
            sink.write({"__key__": key, "jpg": encode_pil(img, "JPEG", quality=90), "cls": str(label).encode()})
            keys.append(key)
    return keys


def write_gnu_tar(folder, n, *, classes=4, per_shard=25, seed=1):
    """GNU `tar` over a folder of name.png + name.cls (long names included). Returns the keys."""
    import os
    import shutil
    import subprocess

    os.makedirs(folder, exist_ok=True)
    keys = []
    for s in range(0, n, per_shard):
        src = os.path.join(str(folder), f"src{s}")
        os.makedirs(src)
        members = []
        for i in range(s, min(n, s + per_shard)):
            label = i % classes
            name = f"sample_{i:05d}" + ("_with_a_rather_long_file_name" * 3 if i % 5 == 0 else "")
            with open(os.path.join(src, name + ".png"), "wb") as f:
                f.write(encode_pil(foreign_image(label, (32, 32), seed * 100003 + i), "PNG"))
            with open(os.path.join(src, name + ".cls"), "w") as f:
                f.write(f"{label}\n")
            members += [name + ".png", name + ".cls"]
            keys.append(name)
        subprocess.run(["tar", "--format=gnu", "-cf", os.path.join(str(folder), f"gnu-{s // per_shard:04d}.tar"),
                        "-C", src, *members], check=True)
        shutil.rmtree(src)
    return keys


def write_img2dataset(folder, n, *, classes=4, per_shard=20, seed=2, gz=False):
    """img2dataset's layout: 000012345.jpg, .json (label in a field), .txt caption; plain
    USTAR written by tarfile, optionally gzip-compressed. Returns the keys."""
    import json
    import os

    os.makedirs(folder, exist_ok=True)
    keys = []
    for s in range(0, n, per_shard):
        path = os.path.join(str(folder), f"{s // per_shard:05d}.tar" + (".gz" if gz else ""))
        with tarfile.open(path, "w:gz" if gz else "w", format=tarfile.USTAR_FORMAT) as tar:
            for i in range(s, min(n, s + per_shard)):
                label = i % classes
                key = f"{s // per_shard:05d}{i:04d}"
                body = {"jpg": encode_pil(foreign_image(label, (48, 48), seed * 100003 + i), "JPEG", quality=90),
                        "json": json.dumps({"key": key, "label": label, "width": 48}).encode(),
                        "txt": f"a picture of class {label}".encode()}
                for ext, data in body.items():
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
                keys.append(key)
    return keys
