"""Object stores: S3 and S3-compatible servers, Google Cloud Storage, the Hugging Face Hub and
any fsspec protocol, behind one small table.

A location is parsed once (`Location`); its scheme names the entry that reads, lists and
writes it. Stores go through fsspec's implementations (s3fs, gcsfs, huggingface_hub's
HfFileSystem), installed as the project's extras (`pip install -e '.[s3]'`); credentials come the
way each ecosystem finds them (the AWS chain: environment, config files, instance roles,
`AWS_ENDPOINT_URL` for S3-compatible servers; `HF_TOKEN` and `HF_ENDPOINT` for the Hub;
Google's application default credentials), never from the URL. What the project
promises for HTTP holds here too: pipeline.data.store.remote wraps a store's reader with the
job's deadline, retries, byte cap, sha256 check and cache.
"""
import contextlib
import functools
import os
import posixpath
import re
import ssl
import threading
import time
import urllib.parse
from dataclasses import dataclass

from pipeline.errors import FetchError, ShardError, cut, redact

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


SIGNED_FOR = 3600  # seconds a signed S3 URL is good for: checked when a request starts, never during it


@dataclass(frozen=True)
class Direct:
    """A store object read with one plain GET by pipeline.data.store.remote's own HTTP client, the
    one that reads http(s):// shards: its URL, the Authorization header's value sent with it
    (to that host only, never after a redirect; None: none), and `refused(status, headers,
    body)`, the exception for an error answer (`Missing` or `Unreachable`, one line)."""

    url: str
    header: object
    refused: object
    context: object = None  # the ssl.SSLContext of an https URL whose store names its own CA bundle


def direct(url, timeout=30.0):
    """The `Direct` read of a store URL: S3 (a signed URL) and the Hugging Face Hub (its
    resolve URL); None for stores read through fsspec. One request per shard where s3fs makes
    two (it asks for the size first), and 1.07-1.18x the plain HTTP path's CPU per sample where
    s3fs's file object cost 1.68-2.04x (`python tools/bench_loader.py --stores --synthetic`,
    docs/benchmarks.md#object-stores); reading the Hub needs no package. timeout: seconds a
    request may wait for one answer (the job's --io-timeout), for the one that finds an S3
    bucket's region."""
    loc = parse(url)
    if loc.scheme in ("s3", "s3a"):
        bucket, _, key = loc.path.partition("/")
        if not key or key.endswith("/"):  # a GET of it would be the bucket's listing, read as a damaged shard
            raise Missing("a prefix, not an object: name a shard (s3://BUCKET/KEY)")
        signer = _signer(loc, bucket, timeout)
        return Direct(_call(loc, lambda: signer.url(key)), None, refusal(signer), signer.context)
    if loc.scheme == "hf":
        token = hub_token()
        return Direct(hub_url(loc), token, hub_refusal(token))
    return None


# ---------------------------------------------------------------- the Hugging Face Hub

HUB = "https://huggingface.co"


def hub_url(loc):
    """The resolve URL of an hf:// file, as huggingface_hub downloads it: hf://datasets/USER/REPO
    [@REVISION]/PATH (spaces/... likewise, USER/REPO/PATH a model) ->
    $HF_ENDPOINT/datasets/USER/REPO/resolve/REVISION/PATH, the revision `main` when none is given
    (one with a slash written %2F, as HfFileSystem takes it)."""
    parts = loc.path.split("/")
    kind = parts[0] if parts[0] in ("datasets", "spaces", "models") else None
    rest = parts[1:] if kind else parts
    if len(rest) < 3 or not all(rest[:2]) or not rest[-1]:
        raise Missing("not a file of a repository: write hf://datasets/USER/REPO/PATH")
    repo, _, revision = rest[1].partition("@")
    revision = urllib.parse.unquote(revision) or "main"
    endpoint = hub_endpoint()
    prefix = "" if kind in (None, "models") else kind + "/"
    return (f"{endpoint}/{prefix}{rest[0]}/{repo}/resolve/{urllib.parse.quote(revision, safe='')}/"
            f"{urllib.parse.quote('/'.join(rest[2:]))}")


def hub_endpoint():
    """The Hub's base URL: $HF_ENDPOINT (a mirror or a self-hosted Hub), else huggingface.co."""
    return (os.environ.get("HF_ENDPOINT") or HUB).rstrip("/")


def hub_token():
    """`Bearer TOKEN` from where huggingface_hub finds it: $HF_TOKEN, else the file `huggingface-cli
    login` writes ($HF_TOKEN_PATH, else $HF_HOME/token, else ~/.cache/huggingface/token); None
    without one (public repositories)."""
    token = os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN")
    if not token:
        home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
        path = os.environ.get("HF_TOKEN_PATH") or os.path.join(home, "token")
        with contextlib.suppress(OSError, UnicodeDecodeError):
            with open(path, encoding="utf-8") as f:
                token = f.read(4096)
    # a line break (a login file of two lines) is dropped: http.client would refuse the header, quoting the token
    token = (token or "").replace("\r", "").replace("\n", "").strip()
    return f"Bearer {token}" if token else None


def hub_error(status, headers, body):
    """The exception for an error answer of the Hub: its X-Error-Message (or the JSON body's
    "error") and X-Error-Code; `Missing` for 4xx but 408 and 429, else `Unreachable`."""
    said = (headers.get("X-Error-Message") if headers else None) or _json_error(body) or _bare(status)
    code = headers.get("X-Error-Code") if headers else None
    text = f"{said} ({code})" if code else said
    return (Missing if _permanent(status) else Unreachable)(cut(redact(" ".join(text.split())), 300))


NO_HUB_TOKEN = ("no Hugging Face token was found, so the request went without one (looked for in $HF_TOKEN, then the "
                "file `huggingface-cli login` writes: $HF_TOKEN_PATH, else $HF_HOME/token, else "
                "~/.cache/huggingface/token)")


def hub_refusal(token):
    """The `refused` of a Hub request sent with `token` (None: without one): hub_error, and
    for a 401 or 403 without a token, that none was found and where it is looked for."""
    def refused(status, headers, body):
        error = hub_error(status, headers, body)
        return type(error)(f"{error}; {NO_HUB_TOKEN}") if status in (401, 403) and not token else error
    return refused


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


# ---------------------------------------------------------------- S3


class _Signer:
    """Signed URLs of one bucket's objects. botocore's client makes the first one, which gives
    the URL's form (endpoint, addressing style) and the signing region; the rest are that
    form with the key put in and signed by botocore's SigV4 query signer, 2.5x less CPU than
    the client's generate_presigned_url, which resolves the endpoint again for every URL."""

    def __init__(self, client, bucket, credentials, context=None):
        probe = urllib.parse.urlsplit(client.generate_presigned_url(
            "get_object", Params={"Bucket": bucket, "Key": "k"}, ExpiresIn=SIGNED_FOR))
        self.base = urllib.parse.urlunsplit(probe._replace(path=probe.path[:-1], query=""))
        scope = dict(urllib.parse.parse_qsl(probe.query)).get("X-Amz-Credential", "").split("/")
        self.region = scope[2] if len(scope) == 5 else client.meta.region_name
        self.signs = credentials is not None
        self._credentials, self.pid, self.context = credentials, os.getpid(), context
        self.bucket = None  # its _Bucket, which forgets it when the store names another region

    def url(self, key, query=None):
        """A GET of `key`, or with `query` (a dict of parameters) of the bucket itself: a
        listing (pipeline.data.store.listings), its parameters signed with it."""
        from botocore.auth import S3SigV4QueryAuth
        from botocore.awsrequest import AWSRequest

        url = self.base + urllib.parse.quote(key, safe="/~")  # as botocore writes a key into a path
        if query is not None:  # no slash after a bucket named in the path, as botocore writes a listing's URL
            url = (url if urllib.parse.urlsplit(url).path == "/" else url.rstrip("/")) + "?" + \
                urllib.parse.urlencode(query, quote_via=urllib.parse.quote)
        if not self.signs:
            return url
        request = AWSRequest(method="GET", url=url)
        S3SigV4QueryAuth(self.credentials().get_frozen_credentials(), "s3", self.region,
                         expires=SIGNED_FOR).add_auth(request)
        return request.url

    def credentials(self):
        """The chain's credentials, found again in a forked loader worker (10 ms, against
        0.1 s for a client and a HEAD): a parent thread may have held a refreshable set's lock
        when the worker was forked. The signer itself holds no client or socket, so workers
        use the one the parent made reading the manifest."""
        if self.pid != os.getpid():
            import botocore.session

            credentials = botocore.session.get_session().get_credentials()
            if credentials is None:
                raise Missing("the AWS chain found no credentials in this worker")
            self._credentials, self.pid = credentials, os.getpid()
        return self._credentials


class _Bucket:
    """What one process knows of a bucket (under one configuration): its settled `signer`,
    kept by forked workers; the `lock` held while its region is looked up; when the last
    lookup `ended` and its `outcome` (a _Signer or the exception); the thread of its last
    region HEAD (`asking`)."""

    def __init__(self):
        self.signer = None
        self.forked()

    def forked(self):
        """A forked worker's view: the signer stays, what parent threads held does not."""
        self.lock, self.ended, self.outcome, self.asking = threading.Lock(), 0.0, None, None


_BUCKETS = {}  # (bucket, configuration) -> its _Bucket
_BUCKETS_LOCK = threading.Lock()


def _forked():
    global _BUCKETS_LOCK
    _BUCKETS_LOCK = threading.Lock()
    for b in _BUCKETS.values():
        b.forked()


os.register_at_fork(after_in_child=_forked)  # a parent thread may have held a lock when a worker was forked


def _signer(loc, bucket, timeout):
    """A bucket's _Signer, made once: by the process that reads the manifest, and so inherited
    by the loader workers it forks. Its region is looked up under the bucket's own lock
    (another bucket's lookup never waits on it), and kept only when the answer was one:
    after an answer a retry may change (a 5xx, throttling) the next read looks again."""
    key = (bucket, *(os.environ.get(v) for v in _CONFIG))
    arrived = time.monotonic()
    with _BUCKETS_LOCK:
        b = _BUCKETS.setdefault(key, _Bucket())
    with b.lock:
        if b.signer is not None:
            return b.signer
        if b.ended >= arrived:  # a lookup ended while this read waited for it: its outcome is this read's too
            if isinstance(b.outcome, Exception):
                raise type(b.outcome)(str(b.outcome))
            return b.outcome
        try:
            found, lasting = _call(loc, lambda: _regional_signer(bucket, timeout, b))
        except (Missing, Unreachable) as e:
            b.ended, b.outcome = time.monotonic(), e
            raise
        found.bucket = b
        b.ended, b.outcome = time.monotonic(), found
        if lasting:
            b.signer = found
        return found


def _regional_signer(bucket, timeout, known):
    """(the bucket's _Signer, whether its region is settled). The region is the one the
    bucket's HEAD answer names (as s3fs finds it), whatever the answer's status; botocore's
    own retries are off (pipeline.data.store.remote retries) and its timeouts are the job's. The
    CA bundle is the one botocore would use ($AWS_CA_BUNDLE, the config file's ca_bundle)."""
    try:
        import botocore
        import botocore.config
        import botocore.session
        from botocore.exceptions import ClientError
    except ImportError:
        raise ShardError(f"s3://{bucket}: s3:// needs botocore: pip install s3fs (the project's [s3] extra: "
                         f"pip install -e '.[s3]')") from None
    session = botocore.session.get_session()
    credentials = session.get_credentials()

    def client(region=None):
        config = botocore.config.Config(signature_version="s3v4" if credentials else botocore.UNSIGNED,
                                        connect_timeout=timeout, read_timeout=timeout,
                                        retries={"total_max_attempts": 1})
        return session.create_client("s3", region_name=region, config=config)

    def head():
        try:
            return first.head_bucket(Bucket=bucket)
        except ClientError as e:
            return e.response
    first = client()
    answer = _within(timeout, head, f"s3://{bucket}: its region", known)
    meta = answer.get("ResponseMetadata", {})
    region = meta.get("HTTPHeaders", {}).get("x-amz-bucket-region")
    status = meta.get("HTTPStatusCode") or 0
    lasting = bool(region) or status < 500 and status not in (408, 429)
    bundle = session.get_config_variable("ca_bundle")
    context = ssl.create_default_context(cafile=bundle) if bundle else None
    signing = first if not region or region == first.meta.region_name else client(region)
    try:
        return _Signer(signing, bucket, credentials, context), lasting
    finally:  # the signer keeps no client: their sockets go now, not when the collector finds them
        for made in {id(first): first, id(signing): signing}.values():
            with contextlib.suppress(Exception):
                made.close()


def _within(timeout, fn, what, known):
    """fn() waited for `timeout` seconds in all: botocore's timeouts hold each socket operation,
    so a server that drips its answer a byte at a time would hold the caller, and every read
    of the bucket waiting on its lock, without end. The thread left behind goes on as long as
    the server drips (botocore's socket can't be reached to close it): while it does, the
    bucket's next lookups fail at once instead of starting more (`known.asking`: its _Bucket's)."""
    if known.asking is not None and known.asking.is_alive():
        raise Unreachable(f"{what}: no answer yet to the lookup that ran out of time before")
    done, box = threading.Event(), {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller as it is
            box["error"] = e
        finally:
            done.set()
    known.asking = threading.Thread(target=run, name="pipeline-s3-region", daemon=True)
    known.asking.start()
    if not done.wait(timeout):
        raise Unreachable(f"{what}: no answer within {timeout:g} s")
    if "error" in box:
        raise box.pop("error")
    return box["value"]


def refusal(signer):
    """The `refused` of a Direct request signed (or not) by `signer`."""
    return functools.partial(_s3_refused, signer)


NO_AWS_CREDENTIALS = ("no AWS credentials were found, so the request went unsigned (looked for in $AWS_ACCESS_KEY_ID "
                      "and $AWS_SECRET_ACCESS_KEY, $AWS_PROFILE with ~/.aws/credentials and ~/.aws/config, and the "
                      "instance, container or pod role)")


def _s3_refused(signer, status, headers, body):
    """s3_error, unless the answer names another region than the URL was signed for (the
    bucket moved, or its region was guessed): then the signer is forgotten and the read
    tried again, which looks the region up anew."""
    region = headers.get("x-amz-bucket-region") if headers else None
    if region and region != signer.region:
        with _BUCKETS_LOCK:
            if signer.bucket is not None and signer.bucket.signer is signer:
                signer.bucket.signer = None
        return Unreachable(f"the bucket is in {cut(redact(region), 40)}, not {signer.region}: its region is "
                           f"looked up again")
    error = s3_error(status, headers, body)
    return type(error)(f"{error}; {NO_AWS_CREDENTIALS}") if status in (401, 403) and not signer.signs else error


def s3_error(status, headers, body):
    """The exception for an S3 error answer (`status`, its XML body): `Missing` for what no
    retry fixes (no such key or bucket, a denied or badly signed request), `Unreachable` for
    the rest (throttling, 5xx). Its text is the answer's Message, Code and status."""
    code = re.search(rb"<Code>([^<]{1,100})</Code>", body or b"")
    said = re.search(rb"<Message>([^<]{1,300})</Message>", body or b"")
    code = code[1].decode("utf-8", "replace") if code else None
    said = said[1].decode("utf-8", "replace") if said else None
    tag = f"{code}, HTTP {status}" if code else f"HTTP {status}"
    text = ("no such object" if code == "NoSuchKey" else f"{said} ({tag})" if said else
            f"{code} (HTTP {status})" if code else _bare(status))
    permanent = _permanent(status) and code not in ("SlowDown", "RequestTimeout")
    return (Missing if permanent else Unreachable)(cut(redact(" ".join(text.split())), 300))


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


def put(local_path, url):
    """Upload a local file to a store URL (the file at a temporary key first would not make it
    safer: a store writes an object whole or not at all)."""
    loc = parse(url)
    try:
        _call(loc, lambda: filesystem(loc).put_file(local_path, loc.path))
    except (Missing, Unreachable) as e:
        raise FetchError(f"{loc.shown}: cannot write: {e}") from None


def exists(url):
    loc = parse(url)
    try:
        return bool(_call(loc, lambda: filesystem(loc).exists(loc.path)))
    except Missing:
        return False
    except Unreachable as e:
        raise FetchError(f"{loc.shown}: {e}") from None


def join(base, name):
    """`name` (a plain relative name) in the store "folder" `base`."""
    return base.rstrip("/") + "/" + posixpath.normpath(name)



# ---------------------------------------------------------------- writing (make_shards.py --out URL)


class Writer:
    """Objects under one store prefix, written, moved and removed through one client (listed by
    pipeline.data.store.listings):
    a client per call (as the functions above make) spends most of a small upload starting
    its session. Names are relative to the prefix; a failure is a FetchError naming the URL."""

    def __init__(self, prefix, policy=None):
        self.prefix, self.policy = prefix.rstrip("/"), policy
        self.loc = parse(self.prefix + "/")
        self.fs = filesystem(self.loc)

    def url(self, name):
        return join(self.prefix, name)

    def _do(self, name, what, fn):
        loc = parse(self.url(name))
        try:
            return _call(loc, lambda: fn(loc.path))
        except (Missing, Unreachable) as e:
            raise FetchError(f"{loc.shown}: cannot {what}: {e}") from None

    def exists(self, name):
        try:
            return bool(self._do(name, "tell", self.fs.exists))
        except FetchError:
            return False

    def put(self, local_path, name):
        self._do(name, "write", lambda path: self.fs.put_file(local_path, path))

    def write_bytes(self, data, name):
        self._do(name, "write", lambda path: self.fs.pipe_file(path, data))

    def move(self, src, dst):
        """`src` becomes `dst` (a server-side copy, then `src` removed: a store has no rename)."""
        target = parse(self.url(dst)).path
        self._do(src, f"copy to {dst}", lambda path: self.fs.copy(path, target))
        self.remove(src)

    def remove(self, name):
        with contextlib.suppress(FetchError):
            self._do(name, "remove", self.fs.rm_file)


def write_bytes(data, url):
    """Write `data` as the object at a store URL."""
    base, _, name = url.rpartition("/")
    Writer(base).write_bytes(data, name)
