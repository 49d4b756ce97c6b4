"""S3 writes made by hand (`make-shards --out s3://...`: pipeline.writers.publish, storelock): an
object's PUT, a server-side copy, a DELETE and a HEAD, each signed in its headers by botocore
(s3._Signer, the bucket's region found as reads find it) and sent by the read path's own HTTP
client (transports._HTTP) under the job's limits: a transfer's deadline (--io-timeout plus its
bytes at --min-rate), an error answer's body read to 64 KiB for a few seconds at most and said
in one line (status, S3's code and message), --retries more attempts with doubling delays after
a 5xx, 408, 429, a timeout or a dropped connection; any other refusal fails at once.

s3fs wrote before: botocore read a 500's whole body on each of its attempts, so a server
answering 500 with 200 MB held a 40-sample `make-shards --out s3://...` 56-73 s, had 2.1 GB sent
and a 1.6 GB peak; now 15 s (the retries' waits), 9-18 MB and 69 MB (tools/bench/store_writes.py).

One PUT an object, no multipart upload: a shard is one sample group of --maxcount samples,
far under S3's 5 GiB for one PUT (and one copy); a larger file is refused in one line.
"""
import contextlib
import dataclasses
import functools
import hashlib
import os
import re
import time
import urllib.parse
import warnings

from pipeline.data.store import remote, s3, transports
from pipeline.data.store.direct_read import Direct
from pipeline.data.store.storage import Missing, Unreachable
from pipeline.errors import cut, redact

MOST = 5 << 30  # bytes: S3's most for one PUT and for one CopyObject
ANSWER = 1 << 16  # bytes of a successful answer read (a copy's result, which may hold an error)
EMPTY = hashlib.sha256(b"").hexdigest()


class _Absent(Missing):
    """A HEAD answered 404: no such object (exists() is False)."""


def put(loc, source, policy):
    """Write `source` (a local file's path, or bytes) as the object at `loc`."""
    size = len(source) if isinstance(source, (bytes, bytearray)) else os.path.getsize(source)
    if size > MOST:
        raise Missing(f"{size} bytes: more than S3's {MOST} for one PUT; write smaller shards (a lower --maxcount)")
    if isinstance(source, (bytes, bytearray)):
        digest = hashlib.sha256(source).hexdigest()

        def body():
            return contextlib.nullcontext(bytes(source))
    else:
        digest = _sha256(source)

        def body():
            return open(source, "rb")
    _send(loc, "PUT", policy, size, {"Content-Type": "application/octet-stream", "Content-Length": str(size)},
          body, digest)


def copy(loc, target, policy, size=None):
    """A server-side copy of the object at `loc` to `target` (in the same store); `size`: its
    bytes when known, which set the copy's deadline (else remote.UNKNOWN_SIZE's)."""
    bucket, _, key = loc.path.partition("/")
    source = urllib.parse.quote(f"{bucket}/{key}", safe="/~-._")  # as botocore writes x-amz-copy-source
    _send(target, "PUT", policy, remote.UNKNOWN_SIZE if size is None else size, {"x-amz-copy-source": source})


def delete(loc, policy):
    """Remove the object at `loc` (S3 answers 204 whether it was there or not)."""
    _send(loc, "DELETE", policy, 0)


def exists(loc, policy):
    """True when an object is at `loc`, False when the store answers 404; Missing or
    Unreachable (one line) when it cannot tell."""
    try:
        _send(loc, "HEAD", policy, 0)
        return True
    except _Absent:
        return False


def _sha256(path):
    """The file's sha256, which signs its PUT (S3 checks the bytes it got against it)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def _send(loc, method, policy, size, headers=None, body=None, digest=EMPTY):
    """One request, tried again after a transient failure (policy.retries times, policy.wait
    apart); its answer's body is read to ANSWER bytes and checked for an S3 error (a copy
    answers 200 and may fail after). body: a function opening the bytes sent (again for each
    attempt), whose sha256 is `digest`. Raises Missing or Unreachable, one line."""
    bucket, _, key = loc.path.partition("/")
    if not bucket or not key or key.endswith("/"):
        raise Missing("a prefix, not an object: name one (s3://BUCKET/KEY)")
    budget = dataclasses.replace(policy, max_bytes=max(policy.max_bytes, size))  # our own bytes: the deadline's size
    for attempt in range(policy.retries + 1):
        try:
            return _once(loc, bucket, key, method, budget, size, dict(headers or {}), body, digest)
        except Exception as e:  # noqa: BLE001 - sorted into permanent, transient and the rest below
            if remote.permanent(e) or not remote.transient(e):
                raise
            if attempt == policy.retries:
                raise Unreachable(f"failed after {attempt + 1} attempts: {remote.describe(e)}") from None
            wait = policy.wait(attempt)
            warnings.warn(f"{loc.shown}: {method}: {remote.describe(e)}; retrying in {wait:g} s", stacklevel=3)
            time.sleep(wait)


def _once(loc, bucket, key, method, policy, size, headers, body, digest):
    signer = s3._signer(loc, bucket, policy.timeout)
    url, signed = signer.signed(method, key, headers, digest)
    direct = Direct(url, None, functools.partial(_refused, s3.refusal(signer), method), signer.context,
                    tuple(signed.items()))
    with (body() if body is not None else contextlib.nullcontext()) as data:
        http = transports._HTTP(url, policy, size, method=method, direct=direct, data=data)
        try:
            answer = b""
            while len(answer) < ANSWER and method != "HEAD" and (part := http.read(ANSWER - len(answer))):
                answer += part
        finally:
            http.close()
    if re.search(rb"<Error>", answer):  # a copy S3 took (200) and then failed: the answer's body says why
        raise s3.s3_error(200, {}, answer)
    if "x-amz-copy-source" in headers and not re.search(rb"<CopyObjectResult[\s>]", answer):
        # S3 may pad a long copy's answer with spaces before its result (xmlns=...) or its error: no result, no copy
        raise Unreachable(f"a copy answered 200 without <CopyObjectResult> in the first {ANSWER} bytes of its answer: "
                          f"not known to be done")


def _refused(refused, method, status, headers, body):
    """The exception for an error answer: a HEAD's 404 is no object; a redirect (3xx) is not
    followed, since a write goes to its bucket's own endpoint only (a region's is found by
    s3.refusal from x-amz-bucket-region), and the line names where it pointed; else
    s3.refusal's."""
    if status == 404 and method == "HEAD":
        return _Absent("no such object")
    where = headers.get("Location") if headers and 300 <= status < 400 else None
    if where and not headers.get("x-amz-bucket-region"):
        return Missing(f"HTTP {status}: a redirect to {cut(redact(where), 100)!r}, not followed (a write goes to the "
                       f"bucket's own endpoint only); check $AWS_ENDPOINT_URL and the bucket's region")
    return refused(status, headers, body)
