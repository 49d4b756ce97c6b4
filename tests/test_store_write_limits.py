"""S3 writes under the job's limits (pipeline.data.store.s3_write, issue 53 item 9), against an
S3 look-alike on 127.0.0.1: every request it gets is checked against its SigV4 signature and
its body against the sha256 it was signed with, as S3 checks them; it answers writes as
`server.put` says. A 500 whose body is 200 MB cost `make-shards --out s3://...` 28.6-35 s and
about 1 GB (botocore read it whole, 5 times); now one line, about the cap read a try."""
import http.server
import os
import re
import subprocess
import sys
import urllib.parse
import warnings

import pytest

from conftest import S3_SECRET, as_aws_endpoint
from helpers import HANG, drip, serving
from pipeline.data.store import remote, s3, s3_write, storage, writing
from pipeline.errors import FetchError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ERROR = b"<Error><Code>InternalError</Code><Message>We encountered an internal error.</Message>"


def signature_fault(handler, body):
    """What is wrong with a request's SigV4 signature or its body's sha256 ('' when nothing),
    computed from what came over the wire with the test's secret, as S3 computes it."""
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    found = re.fullmatch(r"AWS4-HMAC-SHA256 Credential=([^/]+)/\d{8}/([^/]+)/s3/aws4_request, "
                         r"SignedHeaders=([^,]+), Signature=([0-9a-f]{64})", handler.headers.get("Authorization", ""))
    if not found:
        return f"no signature: {handler.headers.get('Authorization')!r}"
    key_id, region, names, signature = found.groups()
    names = names.split(";")
    if not {"host", "x-amz-date", "x-amz-content-sha256"} <= set(names):
        return f"signed headers {names}"
    headers = {n: handler.headers[n] for n in names}
    request = AWSRequest(method=handler.command, url=f"http://{handler.headers['Host']}{handler.path}", headers=headers)
    request.context["timestamp"] = handler.headers["X-Amz-Date"]
    auth = S3SigV4Auth(Credentials(key_id, S3_SECRET), "s3", region)
    expected = auth.signature(auth.string_to_sign(request, auth.canonical_request(request)), request)
    if expected != signature:
        return "signature differs"
    import hashlib

    if hashlib.sha256(body).hexdigest() != handler.headers["X-Amz-Content-SHA256"]:
        return "body differs from its sha256"
    return ""


class _S3Writes(http.server.BaseHTTPRequestHandler):
    """An S3 endpoint (path-style) for writes: a bucket's HEAD names us-east-1, an object's
    HEAD is 404 unless it was written; a listing is empty; PUT (an object, or a copy with
    x-amz-copy-source) and DELETE are answered by `server.put`: "ok", or ("huge", status,
    bytes): those of a shard's key with an error answer of that many bytes, sent as fast as
    it is read (`server.sent` counts them), or ("drip", seconds): a PUT's answer dripped a
    byte every 0.2 s, or ("early", status): S3's AccessDenied sent before the body is read, then
    the connection closed, or ("redirect", status, location), sent as early, or ("answer",
    bytes): a PUT answered 200 with them; a GET answers a written object, else an empty
    listing. `server.seen` keeps (method, key, what was wrong with its signature)."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _key(self):
        return urllib.parse.unquote(urllib.parse.urlsplit(self.path).path).lstrip("/").partition("/")[2]

    def do_HEAD(self):
        key = self._key()
        self.server.seen.append(("HEAD", key, key and signature_fault(self, b"")))
        self.send_response(200 if not key or key in self.server.objects else 404)
        self.send_header("x-amz-bucket-region", "us-east-1")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self):
        body = self.server.objects.get(self._key(),
                                       b"<ListBucketResult><IsTruncated>false</IsTruncated></ListBucketResult>")
        self._answer(200, body)

    def _hostile(self, key):
        """True when `server.put` says this write is refused: the keys of shards, not a lock's."""
        return self.server.put != "ok" and ".tar" in key

    def do_PUT(self):
        key = self._key()
        if self._hostile(key) and self.server.put[0] in ("early", "redirect"):  # before a byte of the body is read
            self.server.seen.append(("PUT", key, ""))
            self.close_connection = True
            if self.server.put[0] == "redirect":
                self.send_response(self.server.put[1])
                self.send_header("Location", self.server.put[2])
                self.send_header("Content-Length", "0")
                return self.end_headers()
            return self._answer(self.server.put[1], b"<Error><Code>AccessDenied</Code><Message>Access Denied</Message>"
                                                    b"</Error>")
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.server.seen.append(("PUT", key, signature_fault(self, body)))
        if self._hostile(key) and self.server.put[0] == "drip":
            return drip(self, b" ", self.server.put[1], b"HTTP/1.1 200 OK\r\nx-pad:")
        if self._hostile(key) and self.server.put[0] == "answer":
            return self._answer(200, self.server.put[1])
        if self._hostile(key):
            return self._huge(*self.server.put[1:])
        source = self.headers.get("x-amz-copy-source")
        if source:
            copied = self.server.objects[urllib.parse.unquote(source).partition("/")[2]]
            self.server.objects[key] = copied
            self._answer(200, b"<CopyObjectResult><ETag>\"e\"</ETag></CopyObjectResult>")
        else:
            self.server.objects[key] = body
            self._answer(200, b"")

    def do_DELETE(self):
        key = self._key()
        self.server.seen.append(("DELETE", key, signature_fault(self, b"")))
        if self._hostile(key):
            return self._huge(*self.server.put[1:])
        self.server.objects.pop(key, None)
        self._answer(204, None)

    def _answer(self, status, body):
        self.send_response(status)
        if body is not None:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if body:
            self.wfile.write(body)

    def _huge(self, status, size):
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(size))
        self.end_headers()
        sent, block = 0, ERROR + b" " * ((1 << 20) - len(ERROR))
        try:
            while sent < size and not self.server.stopping:
                self.wfile.write(block[:size - sent])
                sent += len(block[:size - sent])
                block = b" " * (1 << 20)
        except OSError:
            pass
        self.server.sent += sent


@pytest.fixture
def s3_writes(monkeypatch):
    """An _S3Writes on 127.0.0.1 as the AWS endpoint, with a key pair; signers made by earlier
    tests forgotten."""
    monkeypatch.setattr(s3, "_BUCKETS", {})
    with serving(_S3Writes, put="ok", objects={}, seen=[], sent=0) as server:
        as_aws_endpoint(monkeypatch, server.url)
        yield server


FAST = remote.Policy(retries=2, delay=0.01, timeout=10)


def test_writes_are_signed_as_s3_checks_them_and_carry_their_bytes(s3_writes, tmp_path):
    """PUT, copy, HEAD and DELETE of a key with spaces and non-ASCII characters: each signature
    is the one S3 computes from the request that arrived, each body the one signed."""
    shard = tmp_path / "a.tar"
    shard.write_bytes(os.urandom(300_000))
    store = writing.Writer("s3://bucket/p q", FAST)
    store.put(str(shard), "é ü+1.tar.tmp-1")
    store.move("é ü+1.tar.tmp-1", "é ü+1.tar", shard.stat().st_size)
    store.write_bytes(b"lock", ".lock")
    assert store.exists("é ü+1.tar") and not store.exists("absent.tar")
    assert s3_writes.objects == {"p q/é ü+1.tar": shard.read_bytes(), "p q/.lock": b"lock"}
    assert [s[:2] for s in s3_writes.seen if s[1]] == [("PUT", "p q/é ü+1.tar.tmp-1"), ("PUT", "p q/é ü+1.tar"),
                                              ("DELETE", "p q/é ü+1.tar.tmp-1"), ("PUT", "p q/.lock"),
                                              ("HEAD", "p q/é ü+1.tar"), ("HEAD", "p q/absent.tar")]
    assert [s[2] for s in s3_writes.seen if s[1]] == [""] * 6, s3_writes.seen


@pytest.mark.parametrize("what, status", [("put", 500), ("copy", 500), ("delete", 500), ("copy", 200)])
def test_a_500_with_a_huge_body_is_read_to_its_cap_tried_again_and_named(s3_writes, tmp_path, what, status):
    """Each try reads about the 64 KiB cap of the 200 MB answer (and what the sockets'
    buffers hold), the tries are the policy's, and the line says the status and S3's words.
    A copy S3 accepts (200) and then fails says so in its body: the same."""
    shard = tmp_path / "a.tar"
    shard.write_bytes(b"x" * 1000)
    store = writing.Writer("s3://bucket/p", FAST)
    s3_writes.put = ("huge", status, 200 << 20)
    act = {"put": lambda: store.put(str(shard), "a.tar"), "copy": lambda: store.move("a.tar.tmp-1", "a.tar", 1000),
           "delete": lambda: s3_write.delete(storage.parse("s3://bucket/p/a.tar"), FAST)}[what]  # remove() is quiet
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises((FetchError, storage.Unreachable)) as e:
            act()
    said = str(e.value)
    assert said == {"put": "s3://bucket/p/a.tar: cannot write: ", "copy": "s3://bucket/p/a.tar.tmp-1: cannot copy "
                    "to a.tar: ", "delete": ""}[what] + ("failed after 3 attempts: Unreachable: We encountered an "
                                                        f"internal error. (InternalError, HTTP {status})"), said
    assert len([s for s in s3_writes.seen if s[1]]) == 3 and len([w for w in caught if "retrying" in str(w.message)]) == 2
    assert s3_writes.sent < 3 * (8 << 20), s3_writes.sent  # 600 MB were there to read


def test_a_file_over_s3_s_most_for_one_put_is_refused_before_a_request(s3_writes, tmp_path):
    """One PUT an object (no multipart upload): a file over 5 GiB is one line naming the
    limit and the fix, sent nowhere (a sparse file: no disk used)."""
    big = tmp_path / "big.tar"
    with open(big, "wb") as f:
        f.truncate(s3_write.MOST + 1)
    with pytest.raises(FetchError) as e:
        writing.Writer("s3://bucket/p", FAST).put(str(big), "big.tar")
    assert str(e.value) == (f"s3://bucket/p/big.tar: cannot write: {s3_write.MOST + 1} bytes: more than S3's "
                            f"{s3_write.MOST} for one PUT; write smaller shards (a lower --maxcount)"), str(e.value)
    assert not [s for s in s3_writes.seen if s[1]]


def test_an_upload_whose_answer_drips_ends_at_its_deadline_each_try(s3_writes, tmp_path):
    """botocore's timeouts hold each socket operation: an answer dripped a byte at a time never
    trips one. Each try ends at the transfer's deadline (--io-timeout plus its bytes at
    --min-rate), and the tries are the policy's."""
    import threading

    shard = tmp_path / "a.tar"
    shard.write_bytes(b"x" * 1000)
    s3_writes.put = ("drip", 120)
    box = {}

    def upload():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            box["error"] = pytest.raises(FetchError, writing.Writer("s3://bucket/p", remote.Policy(
                retries=1, delay=0.01, timeout=1)).put, str(shard), "a.tar").value
    thread = threading.Thread(target=upload, daemon=True)
    thread.start()
    thread.join(60)  # two tries of about 1 s each; the server drips for 120 s a try
    assert not thread.is_alive(), "the upload was still waiting after 60 s"
    assert str(box["error"]) == ("s3://bucket/p/a.tar: cannot write: failed after 2 attempts: transfer not finished "
                                 "within its 1 s deadline"), str(box["error"])
    assert len([s for s in s3_writes.seen if s[1]]) == 2


PEAK = ("import resource, runpy, sys\nsys.argv = sys.argv[1:]\ntry:\n    runpy.run_path(sys.argv[0], "
        "run_name='__main__')\nfinally:\n    print('peak rss', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "
        "file=sys.stderr)\n")


def make_shards_peak(args):
    """`make-shards ARGS` in a process of its own: (its CompletedProcess less the peak line,
    its peak RSS in bytes)."""
    p = subprocess.run([sys.executable, "-c", PEAK, os.path.join(ROOT, "tools", "make_shards.py"), *map(str, args)],
                       capture_output=True, text=True, timeout=HANG, env=dict(os.environ, PYTHONPATH=ROOT))
    *rest, peak = p.stderr.rstrip("\n").split("\n")
    assert peak.startswith("peak rss "), p.stderr[-2000:]
    return subprocess.CompletedProcess(p.args, p.returncode, p.stdout, "\n".join(rest)), int(peak.split()[-1])


BUILD = ["--synthetic", "--datasets", "mnist", "--splits", "train", "--limit", "40", "--maxcount", "20",
         "--workers", "1", "--quiet", "--retries", "2", "--io-timeout", "10"]


def test_make_shards_to_a_store_that_answers_500_with_200_mb_ends_in_one_line_at_about_its_cap(s3_writes, tmp_path):
    """The same build twice, through the look-alike: once answered, once each shard's upload
    answered 500 with 200 MB. The refused build ends in one line naming the 500, having had
    about the cap of each try sent (not 200 MB a try), its peak memory about the answered
    build's; the answered one wrote the bytes a local build writes."""
    ok, ok_peak = make_shards_peak([*BUILD, "--out", "s3://bucket/p"])
    assert ok.returncode == 0, ok.stdout[-2000:] + ok.stderr[-2000:]
    make_shards_peak([*BUILD, "--out", tmp_path / "local"])
    written = {k.removeprefix("p/"): v for k, v in s3_writes.objects.items() if not k.endswith(".lock")}
    assert written == {n: (tmp_path / "local" / n).read_bytes() for n in os.listdir(tmp_path / "local")}
    assert all(not fault for *_, fault in s3_writes.seen), [s for s in s3_writes.seen if s[2]]

    s3_writes.objects.clear()
    s3_writes.seen.clear()
    s3_writes.put = ("huge", 500, 200 << 20)
    p, peak = make_shards_peak([*BUILD, "--seed", "1", "--out", "s3://bucket/p"])
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 2 and last == ("make-shards: error: s3://bucket/p/mnist-train-000000.tar.tmp-"
                                          f"{last.split('.tmp-')[1].split(':')[0]}: cannot write: failed after 3 "
                                          "attempts: Unreachable: We encountered an internal error. (InternalError, "
                                          "HTTP 500)"), p.stderr[-3000:]
    tries = len([s for s in s3_writes.seen if ".tar" in s[1]])  # the PUT's 3, the DELETE's of its temporary key 3
    assert tries == 6 and s3_writes.sent < tries * (8 << 20), (tries, s3_writes.sent)
    assert peak - ok_peak < 64 << 20, (peak, ok_peak)


@pytest.mark.parametrize("answer", [b" " * 70_000 + ERROR + b"</Error>", b"", b"<Result>done</Result>"],
                         ids=["spaces-then-error", "empty", "other"])
def test_a_copy_is_done_only_when_its_answer_holds_its_result(s3_writes, answer):
    """A copy S3 takes answers 200 at once and may pad its answer with spaces until the copy
    ends in its result or an error: 70,000 spaces then an error, an empty answer or another
    document are no copy, retried as a 500 is, and said in one line (the move stops there:
    its source is not removed)."""
    s3_writes.objects["p/a.tar.tmp-1"] = b"x" * 1000
    s3_writes.put = ("answer", answer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(FetchError) as e:
            writing.Writer("s3://bucket/p", FAST).move("a.tar.tmp-1", "a.tar", 1000)
    assert str(e.value) == ("s3://bucket/p/a.tar.tmp-1: cannot copy to a.tar: failed after 3 attempts: Unreachable: a "
                            "copy answered 200 without <CopyObjectResult> in the first 65536 bytes of its answer: not "
                            "known to be done"), str(e.value)
    assert [s[:2] for s in s3_writes.seen if s[1]] == [("PUT", "p/a.tar")] * 3
    assert "p/a.tar.tmp-1" in s3_writes.objects


def test_an_upload_refused_before_its_body_is_read_is_said_as_refused_and_not_tried_again(s3_writes):
    """S3 answers a refused upload (403) before it reads the body and closes the connection:
    the sender's next write is a broken pipe (or a reset). The answer waiting is read and said,
    once: a 403 is no reason to try again."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s3_writes.put = ("early", 403)
        with pytest.raises(FetchError) as e:
            writing.Writer("s3://bucket/p", FAST).write_bytes(b"x" * (32 << 20), "a.tar")
    assert str(e.value) == "s3://bucket/p/a.tar: cannot write: Access Denied (AccessDenied, HTTP 403)", str(e.value)
    assert [s[:2] for s in s3_writes.seen if s[1]] == [("PUT", "p/a.tar")]
    assert not caught, [str(w.message) for w in caught]


@pytest.mark.parametrize("status", [301, 307])
def test_a_redirect_of_a_write_is_not_followed_and_names_where_it_pointed(s3_writes, status):
    """A write goes to its bucket's endpoint only (its signature is that host's): a redirect
    with a Location is refused at once, naming the place (its credentials redacted)."""
    s3_writes.put = ("redirect", status, "http://elsewhere.example/b/a.tar?X-Amz-Signature=abc123")
    with pytest.raises(FetchError) as e:
        writing.Writer("s3://bucket/p", FAST).write_bytes(b"x" * 1000, "a.tar")
    assert str(e.value) == (f"s3://bucket/p/a.tar: cannot write: HTTP {status}: a redirect to "
                            "'http://elsewhere.example/b/a.tar?X-Amz-Signature=***', not followed (a write goes to the "
                            "bucket's own endpoint only); check $AWS_ENDPOINT_URL and the bucket's region"), str(e.value)
    assert len([s for s in s3_writes.seen if s[1]]) == 1
