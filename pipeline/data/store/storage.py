"""Object stores: S3 and S3-compatible servers, Google Cloud Storage, the Hugging Face Hub and
any fsspec protocol, behind one small table.

A location is parsed once (`Location`); its scheme names the entry that reads, lists and
writes it (pipeline.data.store.writing). Stores go through fsspec's implementations (s3fs, gcsfs,
huggingface_hub's HfFileSystem), installed as the project's extras (`pip install -e '.[s3]'`),
but S3: requests of the project's own, signed by botocore (direct_read, listings, s3_write), read,
list and write it. Credentials come the
way each ecosystem finds them (the AWS chain: environment, config files, instance roles,
`AWS_ENDPOINT_URL` for S3-compatible servers; `HF_TOKEN` and `HF_ENDPOINT` for the Hub;
Google's application default credentials), never from the URL. What the project
promises for HTTP holds here too: pipeline.data.store.remote wraps a store's reader with the
job's deadline, retries, byte cap, sha256 check and cache.
"""
import contextlib
import os
import posixpath
import re
import time
from dataclasses import dataclass

from pipeline.errors import ShardError, cut, redact

# scheme -> (the extra that installs its fsspec implementation, the package it imports)
STORES = {"s3": ("s3", "s3fs"), "s3a": ("s3", "s3fs"), "gs": ("gcs", "gcsfs"), "gcs": ("gcs", "gcsfs"),
          "hf": ("hf", "huggingface_hub"), "az": ("azure", "adlfs"), "abfs": ("azure", "adlfs")}
OURS = ("file", "http", "https", "pipe")  # read by pipeline.data.store.remote itself
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+)://")
BLOCK = 8 << 20  # bytes a store's reader asks for at a time


@dataclass(frozen=True)
class Location:
    """A store URL, parsed once: scheme and the path fsspec takes (bucket/key...)."""

    url: str
    scheme: str
    path: str

    @property
    def shown(self):
        return cut(redact(self.url))


def scheme_of(url):
    """A store's scheme for a URL it reads (s3, gs, hf, az, or another fsspec protocol),
    else None (local paths, http(s), pipe:)."""
    m = _SCHEME.match(url)
    if not m or m[1].lower() in OURS:
        return None
    scheme = m[1].lower()
    if scheme in STORES or _registered(scheme):
        return scheme
    return None


def known_store(url):
    """True for a URL of one of the stores in STORES (s3, gs, hf, az): the only schemes a
    manifest may name. A manifest is data: it may not send the job to fsspec's other
    protocols (local://, ssh://, reference://...), which a user may still type."""
    m = _SCHEME.match(url)
    return bool(m) and m[1].lower() in STORES


def _registered(scheme):
    """A protocol a user registered with fsspec (register_implementation), or one fsspec knows."""
    try:
        import fsspec
    except ImportError:
        return False
    return scheme in fsspec.available_protocols()


def parse(url):
    scheme = scheme_of(url)
    if scheme is None:
        raise ShardError(f"{cut(redact(url))}: not an object-store URL")
    path = url[len(_SCHEME.match(url)[0]):]
    if not path or path.startswith("/"):
        raise ShardError(f"{cut(redact(url))}: no bucket (write {scheme}://BUCKET/KEY)")
    return Location(url, scheme, path)


def filesystem(loc):
    """The fsspec filesystem of a location's scheme; ShardError naming the extra to install
    when its implementation is missing."""
    import fsspec

    extra, package = STORES.get(loc.scheme, (None, None))
    # one client per scheme, process and configuration: starting one costs 0.3-1 s
    key = (loc.scheme, os.getpid(), *(os.environ.get(v) for v in _CONFIG))
    if key in _CLIENTS:
        return _CLIENTS[key]
    try:
        _CLIENTS[key] = fs = fsspec.filesystem(loc.scheme, **_options(loc.scheme))
        return fs
    except ImportError:
        hint = (f"pip install {package} (the project's [{extra}] extra: pip install -e '.[{extra}]')" if extra
                else "install its fsspec implementation")
        raise ShardError(f"{loc.shown}: {loc.scheme}:// needs {package or 'a package'}: {hint}") from None


_CLIENTS = {}  # (scheme, pid, configuration) -> filesystem: a forked loader worker makes its own
_CONFIG = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID", "AWS_PROFILE", "HF_ENDPOINT", "HF_TOKEN",
           "GOOGLE_APPLICATION_CREDENTIALS", "STORAGE_EMULATOR_HOST")


def _options(scheme):
    """Per-scheme settings: none beyond each ecosystem's own configuration, but fsspec's
    instance cache off, so a forked loader worker never shares its parent's event loop
    (this module keeps one client per process instead)."""
    return {"skip_instance_cache": True} if scheme in ("s3", "s3a", "gs", "gcs") else {}


def _permanent(status):
    """An answer no retry changes: a client error but a timeout or throttling, or a redirect
    that reached the store's error path (urllib follows the rest)."""
    return 300 <= status < 500 and status not in (408, 429)


def _bare(status):
    """What an error answer without a body of its own says."""
    if 300 <= status < 400:
        return f"HTTP {status}: a redirect that cannot be followed (no Location, or a loop)"
    return f"HTTP {status}"


def _json_error(body):
    import json

    with contextlib.suppress(ValueError, UnicodeDecodeError, AttributeError):
        return str(json.loads(body or b"{}").get("error") or "") or None
    return None


class Reader:
    """A store object read front to back, block by block, within a total deadline checked
    between reads (a store's client has its own per-request timeouts). Errors come out as
    `Missing` (no such object, bucket or permission: permanent) or `Unreachable` (worth
    another attempt)."""

    def __init__(self, url, limit):
        self.loc = parse(url)
        self.limit, self.spent, self.f = limit, 0.0, None
        fs = filesystem(self.loc)
        self.f = _call(self.loc, lambda: fs.open(self.loc.path, "rb", block_size=BLOCK, cache_type="readahead"))

    def read(self, n):
        if self.spent > self.limit:
            raise Unreachable(f"transfer not finished within its {self.limit:.0f} s deadline")
        start = time.monotonic()
        data = _call(self.loc, lambda: self.f.read(n))
        self.spent += time.monotonic() - start
        return data

    def close(self):
        if self.f is not None:
            with contextlib.suppress(Exception):
                self.f.close()


class Missing(FileNotFoundError):
    """No such object or bucket, or no permission to read it: waiting won't help."""


class Unreachable(ConnectionError):
    """The store did not answer as it should: another attempt may."""


def _call(loc, fn):
    try:
        return fn()
    except FileNotFoundError as e:
        text = " ".join(str(e).split())
        bare = not text or loc.path.rstrip("/").endswith(text.strip("'\"").rstrip("/"))  # s3fs's text: the key alone
        raise Missing("no such object" if bare else _reason(e)) from None
    except (PermissionError, IsADirectoryError, NotADirectoryError) as e:
        raise Missing(_reason(e)) from None
    except ShardError:
        raise
    except Exception as e:  # noqa: BLE001 - a client's own exceptions (botocore, aiohttp, gcsfs...)
        if e.__class__.__name__ == "ParamValidationError":  # botocore refuses the URL itself: a bucket name
            said = re.match(r'(Invalid bucket name ".*?"): ', str(e).splitlines()[-1] if str(e).strip() else "")
            raise Missing(cut(redact(said[1] if said else _reason(e)), 200)) from None
        if _denied(e):
            raise Missing(_reason(e)) from None
        raise Unreachable(_reason(e)) from None


def _denied(error):
    """Errors a store's client raises that no retry fixes: unknown keys, bad signatures, a
    bucket that does not exist."""
    text = f"{error.__class__.__name__} {error}"
    return any(w in text for w in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "NoSuchBucket", "AccessDenied",
                                   "Forbidden", "NoCredentials", "Unable to locate credentials"))


def _reason(error):
    text = " ".join(str(error).split()) or error.__class__.__name__
    return cut(redact(text), 300)


def join(base, name):
    """`name` (a plain relative name) in the store "folder" `base`."""
    return base.rstrip("/") + "/" + posixpath.normpath(name)
