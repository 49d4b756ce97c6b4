"""Listing a store prefix (`make_shards --index s3://BUCKET/PREFIX/`, the keys under a store
`--out`) under the job's limits, as a shard is read.

S3's listing (ListObjectsV2) and the Hub's (its tree API) are GETs sent by the project's own
HTTP client (pipeline.data.store.remote, signed by botocore for S3 as reads are), page by page:
each page within a transfer's deadline (--io-timeout plus its bytes at --min-rate) and at
most PAGE_BYTES, retried as a read is; the whole listing within --io-timeout plus all its
bytes at --min-rate plus a thousandth of --io-timeout for each entry it lists (a full page of
S3's 1,000 buys one --io-timeout: its round trip), checked before each page and before each
retry (then the last failure is the line), and never more than --max-shard-bytes of answers. A server that pages slowly for ever, an entry a page, ends
there.
s3fs listed before, outside every deadline: a server that answered 200 and then a byte a second
held `make_shards --index ... --io-timeout 3` without end, a 300 MB answer cost 1.4 GB, and a
500 with a 200 MB body was read whole, five times. An error answer's body is read up to
64 KiB (remote._HTTP), and its status and code are the line.

An S3 answer is parsed with expat as it streams in, never held whole. A DOCTYPE is refused
before anything in it is read, so no entity is ever declared, let alone expanded (a
billion-laughs answer is one line); anything that is not a ListBucketResult, a NUL character
reference or a field longer than S3 allows is a malformed listing, one line. A continuation
token or a key that comes again is a loop. Other stores (gs://, az://, any fsspec protocol)
are listed by their own client in a thread, waited for --io-timeout plus UNKNOWN_SIZE at
--min-rate.
"""
import dataclasses
import json
import re
import threading
import time
import urllib.parse
from xml.parsers import expat

from pipeline.data.store import remote, storage
from pipeline.data.store import hf_hub
from pipeline.data.store import s3
from pipeline.data.store import direct_read
from pipeline.errors import FetchError, ShardError, cut, redact

PAGE_BYTES = 8 << 20  # the most one page may hold: S3's 1,000 keys of 1,024 bytes, URL-encoded, with their fields, stay under 4 MB
FIELD_CHARS = 3 * 1024  # a key is at most 1,024 bytes (S3, GCS): 3 characters a byte URL-encoded


class Malformed(ShardError):
    """An answer that is no listing."""


class Overdue(ShardError):
    """A listing past its deadline in all: no page is asked for (nor asked again)."""


def names(url, policy=remote.Policy(), suffixes=None):
    """The names of the objects directly under the store prefix `url` (a "folder"), relative
    to it and sorted; only those ending in `suffixes` when given. FetchError (one line) when it
    cannot be listed."""
    loc = storage.parse(url.rstrip("/") + "/")
    try:
        if loc.scheme in ("s3", "s3a"):
            found = _s3(loc, policy)
        elif loc.scheme == "hf":
            found = _hub(loc, policy)
        else:
            found = _fsspec(loc, policy)
    except (ShardError, FetchError, storage.Missing, storage.Unreachable) as e:
        said = str(e).removeprefix(f"{redact(loc.url)}: ")
        raise FetchError(f"{loc.shown}: cannot list: {cut(said, 400)}") from None
    return sorted(n for n in found if not suffixes or n.endswith(tuple(suffixes)))


def urls(url, suffixes=(".tar", ".tar.gz", ".tgz"), policy=remote.Policy()):
    """`names` as full URLs: the shards under a store prefix (make_shards --index)."""
    return [storage.join(url, n) for n in names(url, policy, suffixes)]


class _Pages:
    """The limits of one listing across its pages: the page policy (PAGE_BYTES at most), the
    bytes read so far against --max-shard-bytes and the deadline in all, and what came
    before (continuation tokens, keys), so that a server that loops is caught."""

    def __init__(self, loc, policy):
        self.loc, self.policy, self.got, self.start = loc, policy, 0, time.monotonic()
        self.page = dataclasses.replace(policy, max_bytes=min(PAGE_BYTES, policy.max_bytes),
                                        max_source="the most one listing page may hold")
        self.tokens, self.keys, self.count, self.entries = set(), set(), 0, 0

    def read(self, request, consume):
        """consume(stream) on the next page, within the listing's limits: it starts, and is
        tried again, only while the listing is within its deadline in all."""
        self.count += 1
        limit = self.policy.deadline(self.got) + self.entries * self.policy.timeout / 1000
        if time.monotonic() - self.start > limit:
            raise Overdue(f"not listed within {limit:.1f} s (--io-timeout, plus its {self.got} bytes at --min-rate, "
                          f"plus a thousandth of --io-timeout for each of its {self.entries} entries), at page "
                          f"{self.count}")

        def counted(stream):
            return consume(_Counting(stream, self))
        return remote.read_url(self.loc.url, counted, policy=self.page, request=request, until=self.start + limit)

    def next(self, token, what="continuation token"):
        if token in self.tokens:
            raise Malformed(f"the listing loops: page {self.count} gave a {what} that an earlier page gave")
        self.tokens.add(token)

    def key(self, key):
        self.entries += 1
        if key in self.keys:
            raise Malformed(f"the listing loops: page {self.count} names {cut(key, 100)!r} again")
        self.keys.add(key)


class _Counting:
    """A page's stream, adding what it reads to the listing's bytes, refused past
    --max-shard-bytes in all."""

    def __init__(self, stream, pages):
        self.stream, self.pages = stream, pages
        self.raw = getattr(stream, "raw", None)

    def read(self, n):
        data = self.stream.read(n)
        self.pages.got += len(data)
        if self.pages.got > self.pages.policy.max_bytes:
            raise ShardError(f"more than {self.pages.policy.max_bytes} bytes of listing, the most this job allows "
                             f"({self.pages.policy.max_source})")
        return data


# ---------------------------------------------------------------- S3 (ListObjectsV2)


def _s3(loc, policy):
    bucket, _, prefix = loc.path.partition("/")
    if not bucket:
        raise storage.Missing("no bucket")
    pages, found, token = _Pages(loc, policy), [], None
    while True:
        query = {"list-type": "2", "prefix": prefix, "delimiter": "/", "encoding-type": "url"}
        if token is not None:
            query["continuation-token"] = token

        def request(query=query):
            signer = s3._signer(loc, bucket, policy.timeout)
            return direct_read.Direct(signer.url("", query), None, s3.refusal(signer), signer.context)
        page = pages.read(request, _parse_s3)
        pages.entries += page.folders
        for key in page.keys:
            pages.key(key)
            name = key[len(prefix):] if key.startswith(prefix) else ""
            if name and "/" not in name:  # a key outside the prefix or below a "folder" in it is not listed
                found.append(name)
        if not page.truncated:
            return found
        if not page.token:
            raise Malformed(f"page {pages.count} of the listing says it is cut short but gives no continuation token")
        token = page.token
        pages.next(token)


class _S3Page:
    """One ListObjectsV2 answer, parsed as it streams in: its keys (URL-decoded when the answer
    says it encoded them, as botocore decodes them), whether it is cut short and the token
    of the next page."""

    FIELDS = ("Key", "NextContinuationToken", "IsTruncated", "EncodingType")

    def __init__(self):
        self.keys, self.token, self.truncated, self.encoded, self.folders = [], None, False, False, 0
        self.path, self.text, self.size = [], None, 0
        p = self.parser = expat.ParserCreate()
        p.StartDoctypeDeclHandler = self._doctype
        p.EntityDeclHandler = self._doctype  # unreachable after the DOCTYPE's refusal: a second lock
        p.StartElementHandler, p.EndElementHandler, p.CharacterDataHandler = self._start, self._end, self._data

    @staticmethod
    def _doctype(*_):
        raise Malformed("the listing is malformed: it holds a DOCTYPE (entities are never read)")

    def _start(self, name, _attrs):
        if not self.path and name != "ListBucketResult":
            raise Malformed(f"the answer is no listing: <{cut(name, 40)}> where <ListBucketResult> was expected")
        self.path.append(name)
        if len(self.path) > 8:
            raise Malformed("the listing is malformed: nested deeper than S3's answer")
        self.text, self.size = ([] if name in self.FIELDS else None), 0

    def _data(self, text):
        if self.text is not None:
            self.size += len(text)
            if self.size > FIELD_CHARS:
                raise Malformed(f"the listing is malformed: a <{self.path[-1]}> of more than {FIELD_CHARS} "
                                f"characters (a key is at most 1,024 bytes)")
            self.text.append(text)

    def _end(self, name):
        self.path.pop()
        if name == "CommonPrefixes" and self.path == ["ListBucketResult"]:
            self.folders += 1  # an entry of the page (S3 counts it against its 1,000), though not listed here
        if self.text is None:
            return
        text, self.text = "".join(self.text), None
        parent = self.path[-1] if self.path else None
        if name == "Key" and parent == "Contents":
            self.keys.append(text)
        elif parent == "ListBucketResult":
            if name == "NextContinuationToken":
                self.token = text
            elif name == "IsTruncated":
                self.truncated = text.strip() == "true"
            elif name == "EncodingType":
                self.encoded = text.strip() == "url"

    def feed(self, data, final=False):
        try:
            self.parser.Parse(data, final)
        except expat.ExpatError as e:
            raise Malformed(f"the listing is malformed XML ({cut(str(e), 100)})") from None


def _parse_s3(stream):
    page = _S3Page()
    while data := stream.read(1 << 16):
        page.feed(data)
    page.feed(b"", True)
    if page.encoded:
        page.keys = [urllib.parse.unquote_plus(k) for k in page.keys]
    return page


# ---------------------------------------------------------------- the Hugging Face Hub (its tree API)


def _hub(loc, policy):
    """The files directly in a folder of a Hub repository: GET $HF_ENDPOINT/api/KIND/USER/REPO/
    tree/REVISION/FOLDER, pages joined by their Link: rel="next", as huggingface_hub lists
    them; the token goes to the Hub's origin only, so a next page elsewhere is refused."""
    parts = loc.path.rstrip("/").split("/")
    kind = parts[0] if parts[0] in ("datasets", "spaces", "models") else "models"
    rest = parts[1:] if parts[0] in ("datasets", "spaces", "models") else parts
    if len(rest) < 2 or not all(rest[:2]):
        raise storage.Missing("not a folder of a repository: write hf://datasets/USER/REPO/FOLDER/")
    repo, _, revision = rest[1].partition("@")
    folder = "/".join(rest[2:])
    endpoint = hf_hub.hub_endpoint()
    origin = urllib.parse.urlsplit(endpoint)[:2]
    url = (f"{endpoint}/api/{kind}/{rest[0]}/{repo}/tree/"
           f"{urllib.parse.quote(urllib.parse.unquote(revision) or 'main', safe='')}"
           + (f"/{urllib.parse.quote(folder)}" if folder else ""))
    pages, found, token = _Pages(loc, policy), [], hf_hub.hub_token()
    while url:
        page, url = pages.read(lambda url=url: direct_read.Direct(url, token, hf_hub.hub_refusal(token)), _parse_hub)
        for entry in page:
            path = entry.get("path") if isinstance(entry, dict) else None
            if not isinstance(path, str):
                raise Malformed(f"page {pages.count} of the listing is malformed: an entry without a path")
            pages.key(path)
            name = path[len(folder) + 1:] if folder and path.startswith(folder + "/") else "" if folder else path
            if entry.get("type") == "file" and name and "/" not in name:
                found.append(name)
        if url:
            if urllib.parse.urlsplit(url)[:2] != origin:
                raise Malformed(f"page {pages.count} of the listing sends the next one to another host "
                                f"({cut(redact(url), 80)}): refused")
            pages.next(url, "next page")
    return found


_NEXT = re.compile(r'<([^>]*)>\s*;[^,]*\brel="?next"?')


def _parse_hub(stream):
    """(the entries of one page of a tree listing, the URL of the next page or None)."""
    data = remote.read_all(stream)
    resp = stream.raw.resp  # the page's answer (transports._HTTP's): its Link header and URL
    try:
        entries = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise Malformed(f"the listing is malformed JSON ({cut(str(e), 100)})") from None
    if not isinstance(entries, list):
        raise Malformed("the listing is malformed: a JSON list of entries expected")
    found = _NEXT.search(resp.headers.get("Link") or "")
    return entries, (urllib.parse.urljoin(resp.url, found[1]) if found else None)  # a relative link too


# ---------------------------------------------------------------- other stores (fsspec)


def _fsspec(loc, policy):
    """fs.ls of the prefix in a thread, waited for a transfer's deadline of unknown size:
    such a store's client has its own per-request timeouts, never one in all."""
    fs = storage.filesystem(loc)
    top = loc.path.rstrip("/")
    done, box = threading.Event(), {}

    def run():
        try:
            box["value"] = storage._call(loc, lambda: fs.ls(top, detail=False))
        except BaseException as e:  # noqa: BLE001 - handed to the caller as it is
            box["error"] = e
        finally:
            done.set()
    threading.Thread(target=run, name="pipeline-store-listing", daemon=True).start()
    limit = policy.deadline(None)
    if not done.wait(limit):
        raise storage.Unreachable(f"no answer within {limit:.0f} s (--io-timeout plus {remote.UNKNOWN_SIZE} bytes "
                                  f"at --min-rate)")
    if "error" in box:
        raise box["error"]
    return [n.lstrip("/")[len(top) + 1:] for n in box["value"] if n.lstrip("/").startswith(top + "/")]
