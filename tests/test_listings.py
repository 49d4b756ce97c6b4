"""Listing a store prefix under the job's limits (pipeline.data.store.listings), against hostile
servers on 127.0.0.1: an S3 look-alike whose ListObjectsV2 answers drip, run huge, hold
entities or a NUL, loop or never end; a Hub look-alike whose tree pages do the same. Each
ends in one line within the job's deadline, having read about its cap."""
import http.server
import threading
import urllib.parse
import warnings

import pytest

from conftest import S3_SECRET, as_aws_endpoint
from helpers import drip, make_shards_in_process, no_aws_credentials, serving
from pipeline.data.store import listings, remote, storage
from pipeline.data.store import s3
from pipeline.errors import FetchError

QUICK = remote.Policy(retries=3, delay=0.01, timeout=1, min_rate=64 << 20)  # a page's deadline: 1 s + its size
ROOMY = remote.Policy(retries=3, delay=0.01, timeout=60)  # for the cases that are not about time: a loaded machine


def page(keys, token=None, prefix="base/"):
    """A ListObjectsV2 answer naming `keys` (URL-encoded, as S3 encodes them when asked to),
    cut short with `token` when given."""
    contents = "".join(f"<Contents><Key>{urllib.parse.quote(k)}</Key><Size>3</Size></Contents>" for k in keys)
    more = f"<IsTruncated>true</IsTruncated><NextContinuationToken>{token}</NextContinuationToken>" if token else \
        "<IsTruncated>false</IsTruncated>"
    return (f'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult><Name>b</Name><Prefix>{prefix}</Prefix>'
            f"<EncodingType>url</EncodingType>{more}{contents}</ListBucketResult>").encode()


class _Lister(http.server.BaseHTTPRequestHandler):
    """An S3 endpoint (path-style): a bucket's HEAD names us-east-1; a GET is answered by
    `server.answer(handler, query)`, its query (a dict) kept in `server.gets`; `server.sent`
    counts the bytes `send` wrote before the client hung up."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_HEAD(self):
        self.send_response(200)
        self.send_header("x-amz-bucket-region", "us-east-1")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self):
        query = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(self.path).query))
        self.server.gets.append(query)
        self.server.answer(self, query)

    def send(self, status, body, length=True, filler=b"", count=0):
        """`body`, then `filler` `count` times (a huge answer made of one small buffer)."""
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length" if length else "Connection",
                         str(len(body) + len(filler) * count) if length else "close")
        self.end_headers()
        try:
            for part in [body] + [filler] * count:
                self.wfile.write(part)
                self.server.sent += len(part)
        except OSError:
            pass
        self.close_connection = True


@pytest.fixture
def lister(monkeypatch):
    monkeypatch.setattr(s3, "_BUCKETS", {})
    with serving(_Lister, answer=None, gets=[], sent=0) as server:
        as_aws_endpoint(monkeypatch, server.url)
        yield server


def listed(policy=ROOMY, url="s3://b/base/"):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return listings.urls(url, policy=policy)


def refused(policy=ROOMY, url="s3://b/base/"):
    with pytest.raises(FetchError) as e:
        listed(policy, url)
    text = str(e.value)
    assert text.startswith(f"{url}: cannot list: ") and "\n" not in text and S3_SECRET not in text, text
    return text


def test_pages_are_followed_by_their_tokens_and_keys_decoded(lister):
    """Three pages joined by continuation tokens; keys URL-decoded as botocore decodes them
    (a space, a plus, unicode); keys below a "folder" or outside the prefix are not listed."""
    pages = {None: page(["base/a b+c.tar", "base/x/deeper.tar", "base/zz-ü.tar"], "t1"),
             "t1": page(["base/n.json", "elsewhere/o.tar"], "t 2/+="), "t 2/+=": page(["base/q.tgz"])}
    lister.answer = lambda h, q: h.send(200, pages[q.get("continuation-token")])
    assert listed() == ["s3://b/base/a b+c.tar", "s3://b/base/q.tgz", "s3://b/base/zz-ü.tar"]
    assert [q.get("continuation-token") for q in lister.gets] == [None, "t1", "t 2/+="]
    assert all(q["prefix"] == "base/" and q["delimiter"] == "/" and q["list-type"] == "2" for q in lister.gets)


def test_a_listing_that_drips_ends_within_the_job_s_deadline(lister):
    """ListObjectsV2 answered 200, then a byte every 0.2 s: through s3fs the listing went on as
    long as the server did (`make_shards --index ... --io-timeout 3` still running after 90 s)."""
    lister.answer = lambda h, q: (h.send_response(200), h.end_headers(), drip(h, b" ", 300, b"<?xml"))
    box = {}
    thread = threading.Thread(target=lambda: box.setdefault("said", refused(QUICK)), daemon=True)
    thread.start()
    thread.join(90)  # a hang guard: the deadline is about 1 s
    assert not thread.is_alive(), "the dripping listing was still being read after 90 s"
    assert "not listed within" in box["said"] or "deadline" in box["said"], box["said"]


def test_a_listing_of_slow_pages_ends_within_its_deadline_in_all(lister):
    """Each page in time for its own deadline, fresh tokens for ever: the listing as a whole
    has --io-timeout plus its bytes at --min-rate."""
    import time

    def answer(h, q):
        time.sleep(0.3)
        h.send(200, page([f"base/{len(lister.gets):09d}.tar"], f"t{len(lister.gets)}"))
    lister.answer = answer
    box = {}
    thread = threading.Thread(target=lambda: box.setdefault("said", refused(QUICK)), daemon=True)
    thread.start()
    thread.join(90)
    assert not thread.is_alive(), "the listing of slow pages was still going after 90 s"
    assert "not listed within 1." in box["said"] or "(no time left)" in box["said"], box["said"]


def test_make_shards_index_of_a_dripping_listing_ends_in_one_line(lister):
    lister.answer = lambda h, q: (h.send_response(200), h.end_headers(), drip(h, b" ", 300, b"<?xml"))
    box = {}
    thread = threading.Thread(target=lambda: box.setdefault("p", make_shards_in_process(
        ["--index", "web:train=s3://listdrip/base/", "--io-timeout", "1", "--min-rate", "64", "--out", "unused"])),
        daemon=True)
    thread.start()
    thread.join(120)
    assert not thread.is_alive(), "make_shards --index was still listing after 120 s"
    p = box["p"]
    assert p.returncode == 2 and p.stderr.strip().splitlines()[-1].startswith(
        "make-shards: error: s3://listdrip/base/: cannot list: "), p.stderr


def test_an_error_answer_s_huge_body_is_read_up_to_a_small_cap_and_named(lister):
    """A 500 with a 200 MB body: botocore read it whole, five times (1.4 GB); now its first
    64 KiB, and the line says the status and S3's code."""
    error = b"<Error><Code>InternalError</Code><Message>We encountered an internal error.</Message>"
    lister.answer = lambda h, q: h.send(500, error, filler=b" " * (1 << 20), count=200)
    said = refused(remote.Policy(retries=0, timeout=5))
    assert said.endswith("We encountered an internal error. (InternalError, HTTP 500)"), said
    assert lister.sent < 40 << 20, f"{lister.sent} bytes of the error answer sent"


def test_retries_end_with_the_listing_s_time_and_the_line_keeps_the_answer(lister):
    """A page refused with a 500 is tried again while the listing has time; when it has none
    left, the line is the last answer's status and code, not the clock's."""
    error = b"<Error><Code>InternalError</Code><Message>We encountered an internal error.</Message></Error>"
    lister.answer = lambda h, q: h.send(500, error)
    said = refused(remote.Policy(retries=5, delay=2, timeout=1, min_rate=64 << 20))
    assert said.endswith("failed after 1 attempts (no time left): Unreachable: We encountered an internal error. "
                         "(InternalError, HTTP 500)"), said
    assert len(lister.gets) == 1


@pytest.mark.parametrize("announced", [True, False])
def test_a_huge_listing_costs_about_its_cap_not_its_size(lister, announced):
    """A 300 MB answer cost 1.37 GB before it was refused. A page is read up to 8 MiB; an
    answer that announces more is refused before its body is read."""
    one = b"<Contents><Key>base/" + b"k" * 900 + b".tar</Key></Contents>"
    lister.answer = lambda h, q: h.send(200, page([])[:-len(b"</ListBucketResult>")], announced, one,
                                        (300 << 20) // len(one))
    said = refused(remote.Policy(retries=0, timeout=5))
    assert f"more than {listings.PAGE_BYTES} bytes" in said, said
    assert lister.sent < (listings.PAGE_BYTES + (32 << 20) if not announced else 32 << 20), lister.sent


LAUGHS = ('<?xml version="1.0"?><!DOCTYPE r [<!ENTITY a0 "lol">'
          + "".join(f'<!ENTITY a{i} "{f"&a{i - 1};" * 10}">' for i in range(1, 10))
          + ']><ListBucketResult><IsTruncated>false</IsTruncated><Contents><Key>base/&a9;.tar</Key></Contents>'
            '</ListBucketResult>').encode()


@pytest.mark.parametrize("body, said", [
    (page(["base/a.tar"]).replace(b"a.tar", b"a&#0;.tar"), "malformed XML (reference to invalid character number"),
    (LAUGHS, "malformed: it holds a DOCTYPE (entities are never read)"),
    (b'<?xml version="1.0"?><!DOCTYPE r [<!ENTITY e SYSTEM "file:///etc/passwd">]><ListBucketResult><Contents>'
     b"<Key>&e;</Key></Contents></ListBucketResult>", "holds a DOCTYPE"),
    (b"<Error><Code>AccessDenied</Code></Error>", "no listing: <Error>"),
    (b"not XML at all", "malformed XML"),
    (page(["base/a.tar"])[:-20], "malformed XML (unclosed token"),
    (page(["base/" + "k" * 5000 + ".tar"]), "a <Key> of more than 3072 characters"),
    (page(["base/a.tar"]).replace(b"<IsTruncated>false", b"<IsTruncated>true"), "gives no continuation token")],
    ids=["nul", "laughs", "external-entity", "error-200", "not-xml", "cut", "huge-key", "no-token"])
def test_a_malformed_listing_is_one_line_saying_so(lister, body, said):
    """An answer 200 holding a NUL reference or a billion laughs ended as `[Errno 121] Internal
    Server Error`; now one line that says the listing is malformed, no entity ever expanded,
    and no retry (a malformed answer is not an outage)."""
    lister.answer = lambda h, q: h.send(200, body)
    text = refused()
    assert said in text and len(lister.gets) == 1, text


@pytest.mark.parametrize("loop", ["token", "key"])
def test_a_listing_that_loops_is_one_line(lister, loop):
    """Continuation tokens that come back, or fresh tokens that name the same keys again."""
    def answer(h, q):
        n = len(lister.gets)
        if loop == "token":
            return h.send(200, page([f"base/{n}.tar"], "again" if n > 1 else "first"))
        return h.send(200, page(["base/same.tar"], f"fresh-{n}"))
    lister.answer = answer
    said = refused()
    assert "the listing loops" in said and len(lister.gets) <= 3, said


def test_a_listing_that_never_ends_stops_at_the_job_s_byte_cap(lister):
    """Fresh tokens and fresh keys for ever: the listing is one transfer of --max-shard-bytes
    at most."""
    lister.answer = lambda h, q: h.send(200, page([f"base/{len(lister.gets):09d}.tar"], f"t{len(lister.gets)}"))
    said = refused(remote.Policy(retries=0, timeout=30, max_bytes=64 << 10))
    assert f"more than {64 << 10} bytes of listing" in said, said
    assert len(lister.gets) < 400


def test_a_listing_refused_without_credentials_says_none_were_found(lister, monkeypatch, tmp_path):
    """A 403 to a request that went unsigned, because the AWS chain found nothing, says so and
    where credentials are looked for; a read says the same."""
    no_aws_credentials(monkeypatch, tmp_path)
    lister.answer = lambda h, q: h.send(403, b"<Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>")
    said = refused()
    assert "Access Denied (AccessDenied, HTTP 403); no AWS credentials were found, so the request went unsigned" \
           in said and "~/.aws/credentials" in said and "role" in said, said
    with pytest.raises(FetchError, match="no AWS credentials were found, so the request went unsigned"):
        remote.fetch("s3://b/base/x.tar", policy=ROOMY)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "some-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", S3_SECRET)
    monkeypatch.setattr(s3, "_BUCKETS", {})
    assert "no AWS credentials" not in refused()  # signed and refused: the key's fault, not a missing one


# ---------------------------------------------------------------- the Hub's tree listing


class _Hub(http.server.BaseHTTPRequestHandler):
    """A Hub look-alike: GET /api/datasets/u/r/tree/REV/FOLDER[?cursor=N] answers
    `server.pages[N]` (a JSON list as bytes) with a Link to `server.next(N)` when it gives one;
    the Authorization headers it got in `server.auth`."""

    def log_message(self, *args):
        pass

    def do_GET(self):
        parts = urllib.parse.urlsplit(self.path)
        self.server.auth.append(self.headers.get("Authorization"))
        self.server.paths.append(parts.path)
        n = int(dict(urllib.parse.parse_qsl(parts.query)).get("cursor", 0))
        status, body = self.server.pages[min(n, len(self.server.pages) - 1)]
        self.send_response(status)
        nxt = self.server.next(n)
        if nxt:
            self.send_header("Link", f'<{nxt}>; rel="next"')
        if status >= 400:
            self.send_header("X-Error-Code", "RepoNotFound")
            self.send_header("X-Error-Message", "Repository not found")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def tree(*files, folder="shards", dirs=()):
    import json

    return 200, json.dumps([{"type": "file", "path": f"{folder}/{f}", "size": 3} for f in files]
                           + [{"type": "directory", "path": f"{folder}/{d}"} for d in dirs]).encode()


@pytest.fixture
def hub(monkeypatch):
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    with serving(_Hub, pages=[], next=lambda n: None, auth=[], paths=[]) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url.rstrip("/"))
        monkeypatch.setenv("HF_HOME", server.url)  # no login file there
        yield server


def test_a_hub_folder_is_listed_page_by_page_with_the_token_to_the_hub_only(hub, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    hub.pages = [tree("a.tar", "b.json", dirs=["sub.tar"]), tree("c.tar", "d.tgz")]
    hub.next = lambda n: "/api/datasets/u/r/tree/main/shards?cursor=1" if n == 0 else None  # relative: on the Hub
    assert listed(url="hf://datasets/u/r/shards/") == ["hf://datasets/u/r/shards/a.tar", "hf://datasets/u/r/shards/c.tar",
                                                       "hf://datasets/u/r/shards/d.tgz"]
    assert hub.paths == ["/api/datasets/u/r/tree/main/shards"] * 2 and hub.auth == ["Bearer hf_secret"] * 2


@pytest.mark.parametrize("case, said", [("loop", "the listing loops"), ("elsewhere", "to another host"),
                                        ("json", "malformed JSON"), ("object", "a JSON list of entries expected"),
                                        ("missing", "Repository not found (RepoNotFound); no Hugging Face token "
                                                    "was found, so the request went without one")])
def test_a_hostile_hub_listing_is_one_line(hub, case, said):
    hub.pages = {"loop": [tree("a.tar")] * 3, "elsewhere": [tree("a.tar")], "json": [(200, b"[{")],
                 "object": [(200, b'{"error": 1}')], "missing": [(401, b"")]}[case]
    hub.next = {"loop": lambda n: f"{hub.url}api/datasets/u/r/tree/main/shards?cursor={min(n + 1, 1)}",
                "elsewhere": lambda n: "http://127.0.0.2:1/api/next"}.get(case, lambda n: None)
    text = refused(url="hf://datasets/u/r/shards/")
    assert said in text and len(hub.paths) <= 3, text


def test_many_tiny_keys_over_many_pages_are_all_listed(lister):
    """2,500 keys, 1,000 a page as S3 pages them, a "folder" among them (a CommonPrefixes
    entry), and the longest key S3 allows (1,024 bytes of 3-byte characters, 9 characters
    each URL-encoded): all listed, in order."""
    longest = "base/" + "中" * 338 + "x.tar"
    assert len(longest.encode()) == 1024
    keys = sorted([f"base/{i:05d}.tar" for i in range(2499)] + [longest])

    def answer(h, q):
        start = int(q.get("continuation-token", "0"))
        body = page(keys[start:start + 1000], str(start + 1000) if start + 1000 < len(keys) else None)
        h.send(200, body.replace(b"</ListBucketResult>", b"<CommonPrefixes><Prefix>base/sub/</Prefix>"
                                                          b"</CommonPrefixes></ListBucketResult>"))
    lister.answer = answer
    assert listed() == [f"s3://b/{k}" for k in keys]
    assert len(lister.gets) == 3


@pytest.mark.parametrize("args", [["--index", "w:train=gs://bucket/base/", "--out", "OUT"],
                                  ["--synthetic", "--datasets", "mnist", "--splits", "train", "--limit", "20",
                                   "--out", "gs://bucket/p"],
                                  ["--verify", "--out", "gs://bucket/p"]])
def test_gs_without_its_package_is_one_line_naming_the_extra(args, tmp_path):
    """gcsfs is not installed here: listing, writing and verifying gs:// each say which extra
    brings it, in one line."""
    try:
        import gcsfs  # noqa: F401
        pytest.skip("gcsfs is installed")
    except ImportError:
        pass
    p = make_shards_in_process([str(tmp_path / "out") if a == "OUT" else a for a in args])
    said = (p.stdout + p.stderr).strip().splitlines()
    assert p.returncode in (1, 2) and any("gs:// needs gcsfs: pip install gcsfs (the project's [gcs] extra: "
                                          "pip install -e '.[gcs]')" in line for line in said), said
    assert "Traceback" not in p.stderr
