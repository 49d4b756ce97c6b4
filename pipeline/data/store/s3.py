"""S3 requests made by hand: each signed (SigV4, through botocore) for its bucket's region, found once
a bucket, and S3's refusals read into one line that names the cause."""
import contextlib
import functools
import os
import re
import ssl
import threading
import time
import urllib.parse

from pipeline.errors import ShardError, cut, redact
from pipeline.data.store.storage import Missing, Unreachable, _CONFIG, _bare, _call, _permanent


SIGNED_FOR = 3600  # seconds a signed S3 URL is good for: checked when a request starts, never during it


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

    def signed(self, method, key, headers, digest):
        """(URL, headers) of a `method` request of `key` (a write: pipeline.data.store.s3_write)
        signed in its headers, as botocore's client signs them: `headers` and Host signed with
        them, the body's sha256 `digest` among them, so S3 refuses a body that differs."""
        url = self.base + urllib.parse.quote(key, safe="/~")
        parts = urllib.parse.urlsplit(url)
        host = parts.netloc.rpartition("@")[2].removesuffix({"http": ":80", "https": ":443"}.get(parts.scheme, ""))
        headers = {"Host": host, "X-Amz-Content-SHA256": digest, **headers}
        if not self.signs:
            return url, headers
        from botocore.auth import S3SigV4Auth
        from botocore.awsrequest import AWSRequest

        class Signed(S3SigV4Auth):
            def payload(self, request):  # the digest given: botocore's would read a file body through again
                return digest
        request = AWSRequest(method=method, url=url, headers=headers)
        Signed(self.credentials().get_frozen_credentials(), "s3", self.region).add_auth(request)
        return url, dict(request.headers.items())

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
