"""A store's object read directly over HTTP(S), without its client library: an S3 URL signed for
its bucket's region (s3.py), a Hugging Face Hub URL with its token (hf_hub.py)."""
from dataclasses import dataclass

from pipeline.data.store.hf_hub import hub_refusal, hub_token, hub_url
from pipeline.data.store.s3 import _signer, refusal
from pipeline.data.store.storage import Missing, _call, parse


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
    headers: tuple = ()  # more (name, value) pairs sent to that host only: a request signed in its headers (s3_write)


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
