"""What a console line may show: no credentials of a URL (pipeline.errors.redact) and no
name of a megabyte (pipeline.errors.cut), whichever path the line takes: a tool's error,
a retry warning, a skipped sample, the trainer's one-line error."""
import http.server
import os
import sys
import warnings

import pytest

from helpers import HANG, Quiet, build_shards, run_capture, serving, train_in_process, write_tar
from pipeline.cli import printable
from pipeline.errors import LINE_LIMIT, FetchError, ShardError, cut, redact

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECRET = "s3cret"


@pytest.mark.parametrize("url, shown", [
    ("http://user:s3cret@h:8/x.tar", "http://user:***@h:8/x.tar"),
    ("https://s3cret@h/a@b.tar", "https://***@h/a@b.tar"),
    ("https://h/x.tar?X-Amz-Algorithm=A&X-Amz-Credential=s3cret%2F1&X-Amz-Signature=s3cret",
     "https://h/x.tar?X-Amz-Algorithm=A&X-Amz-Credential=***&X-Amz-Signature=***"),
    ("https://h/x.tar?sv=1&sig=s3cret&se=2", "https://h/x.tar?sv=1&sig=***&se=2"),
    ("https://h/x?Signature=s3cret&Key-Pair-Id=s3cret&token=s3cret&access_token=s3cret#f",
     "https://h/x?Signature=***&Key-Pair-Id=***&token=***&access_token=***#f"),
    ("shard x.tar: label 3 outside 0..2 (a@b, key: 3)", "shard x.tar: label 3 outside 0..2 (a@b, key: 3)"),
])
def test_redact_hides_userinfo_and_signed_query_values(url, shown):
    assert redact(url) == shown
    assert redact(f"error: {url}: failed") == f"error: {shown}: failed"


def test_errors_naming_a_url_never_hold_its_credentials():
    url = "http://user:s3cret@127.0.0.1:1/x.tar?X-Amz-Signature=s3cret"
    for e in (ShardError(f"{url}: bad"), FetchError(f"{url}: gone")):
        assert SECRET not in str(e) and "user:***@" in str(e)


def test_long_text_is_cut_to_a_line_with_a_count_and_keeps_its_end():
    name = "n" * 100_000
    line = printable(f"class name {name!r} is not one of the source's 3 classes; fix: --classes")
    assert len(line) < LINE_LIMIT + 60 and line.endswith("; fix: --classes")
    assert "more characters)" in line
    assert cut("x" * 1000, 300) == "x" * 200 + "... (700 more characters) ..." + "x" * 100
    assert cut("short", 300) == "short"
    assert printable("\x1b[2J" * 300_000).count("\\x1b") <= LINE_LIMIT // 4  # escaped, then cut
    assert "\n" not in printable("a\nb" * 100_000)


class Shards(Quiet, http.server.BaseHTTPRequestHandler):
    """Serves the server's `files` to requests carrying user:s3cret as basic auth; 401 to others."""

    def do_GET(self):
        body = self.server.files.get(self.path.split("?")[0])
        if self.headers.get("Authorization") != "Basic dXNlcjpzM2NyZXQ=":  # user:s3cret
            self.send_error(401)
        elif body is None:
            self.send_error(404)
        else:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    do_HEAD = do_GET


def secret_url(base, path):
    return base.replace("http://", "http://user:s3cret@") + path + "?X-Amz-Signature=s3cret&X-Amz-Credential=s3cret"


def test_make_shards_index_never_prints_a_urls_credentials(tmp_path):
    """A shard read with basic auth and a signed query: a bad sample, then a missing shard
    (retried, with a warning each time), fail with one line each that never shows s3cret."""
    write_tar(tmp_path / "x.tar", [("a.png", b"not a png"), ("a.cls", b"1")])
    with serving(Shards, files={"/x.tar": (tmp_path / "x.tar").read_bytes()}) as server:
        for path, needle in (("x.tar", "undecodable"), ("gone.tar", "404")):
            spec = f"toy:train={secret_url(server.url, path)}"
            p = run_capture([sys.executable, "tools/make_shards.py", "--index", spec,
                             "--out", tmp_path / "m", "--retries", "1", "--io-timeout", "2"],
                            cwd=ROOT, capture_output=True, text=True, timeout=HANG)
            said = p.stdout + p.stderr
            assert p.returncode != 0 and needle in said and "user:***@" in said, said[-2000:]
            assert SECRET not in said and "Traceback" not in said, said[-2000:]


def test_the_trainer_never_prints_a_urls_credentials(tmp_path):
    """A damaged shard behind basic auth: the warning that skips it, and under --strict the
    error that ends the run, name the URL without its password."""
    build_shards(tmp_path / "d", "toy", "train", 20, maxcount=10)
    files = {f"/{f}": (tmp_path / "d" / f).read_bytes() for f in os.listdir(tmp_path / "d")}
    damaged = bytearray(files["/toy-train-000001.tar"])
    damaged[600] ^= 0xFF
    files["/toy-train-000001.tar"] = bytes(damaged)
    with serving(Shards, files=files) as server:
        url = server.url.replace("http://", "http://user:s3cret@")
        args = ["--train", f"toy={url}", "--batch-size", "5", "--workers", "0", "--width", "4", "--epochs", "1",
                "--retries", "0"]
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            loose = train_in_process([*args, "--out", tmp_path / "loose"])
            strict = train_in_process([*args, "--out", tmp_path / "strict", "--strict"])
    said = [str(x.message) for x in w]
    assert loose.returncode == 0 and any("toy-train-000001.tar" in s for s in said), (loose.stderr, said)
    assert strict.returncode != 0 and "user:***@" in strict.stderr, strict.stderr[-2000:]
    for text in (loose.stdout, loose.stderr, strict.stdout, strict.stderr, *said):
        assert SECRET not in text, text[-2000:]
