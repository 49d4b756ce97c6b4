"""Credentials for plain HTTP(S): an Authorization header from $PIPELINE_HTTP_AUTHORIZATION
(pipeline.data.store.transports._request), against a server on 127.0.0.1 that answers 401 without it.
The header goes to the hosts the job reads (or those $PIPELINE_HTTP_AUTH_HOSTS names), never to
a host a redirect leads to, and never into a message."""
import functools
import http.server

import pytest

from helpers import Quiet, build_shards, serving, train_in_process
from pipeline.data.store import remote
from pipeline.data.store import transports
from pipeline.errors import FetchError

TOKEN = "Bearer http-t0ken-never-printed-9876"
FAST = remote.Policy(retries=1, delay=0.01, timeout=5)


class Guarded(Quiet, http.server.SimpleHTTPRequestHandler):
    """Serves a folder to requests that carry the server's `token` (401 without); /away/NAME
    redirects to server.elsewhere + NAME, /here/NAME to /NAME, /port/P/NAME to 127.0.0.1:P/NAME. Every Authorization header it saw goes to server.seen."""

    def do_GET(self):
        self._guard(super().do_GET)

    def do_HEAD(self):
        self._guard(super().do_HEAD)

    def _guard(self, serve):
        self.server.seen.append(self.headers.get("Authorization"))
        if self.server.token is not None and self.headers.get("Authorization") != self.server.token:
            self.send_response(401)
            self.send_header("WWW-Authenticate", 'Bearer realm="shards"')
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if self.path.startswith("/port/"):  # to a port that is no port
            self.send_response(302)
            self.send_header("Location", "http://127.0.0.1:" + self.path[len("/port/"):])
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if self.path.startswith(("/away/", "/here/")):  # to the other server; to this one (a relative Location)
            self.send_response(302)
            away = self.path.startswith("/away/")
            self.send_header("Location", (self.server.elsewhere if away else "/") + self.path[len("/away/"):])
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        serve()


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    folder = tmp_path_factory.mktemp("guarded")
    build_shards(folder, "mnist", "train", 60, maxcount=20)
    return folder


@pytest.fixture
def guarded(shards):
    """(the guarded server, an open one on another port): both serve `shards`."""
    handler = functools.partial(Guarded, directory=str(shards))
    with serving(handler, token=None, seen=[], elsewhere="") as other, \
            serving(handler, token=TOKEN, seen=[], elsewhere=None) as server:
        server.elsewhere = other.url
        yield server, other


def test_a_read_with_the_variable_gets_the_bytes(guarded, shards, monkeypatch):
    server, _ = guarded
    monkeypatch.setenv(transports.AUTH_VARIABLE, TOKEN)
    assert remote.fetch(server.url + "mnist-train.json", policy=FAST) == (shards / "mnist-train.json").read_bytes()
    assert server.seen == [TOKEN]


def test_without_the_variable_a_401_is_one_line_at_once(guarded, monkeypatch):
    server, _ = guarded
    monkeypatch.delenv(transports.AUTH_VARIABLE, raising=False)
    with pytest.raises(FetchError) as e:
        remote.fetch(server.url + "mnist-train.json", policy=remote.Policy(retries=3, delay=5.0, timeout=5))
    assert "401" in str(e.value) and "mnist-train.json" in str(e.value) and "\n" not in str(e.value)
    assert server.seen == [None]  # permanent: not retried (15 s of retries if it were)


def test_a_wrong_header_is_refused_and_never_shown(guarded, monkeypatch):
    server, _ = guarded
    monkeypatch.setenv(transports.AUTH_VARIABLE, "Bearer wrong-t0ken-also-secret")
    with pytest.raises(FetchError) as e:
        remote.fetch(server.url + "mnist-train.json", policy=FAST)
    assert "401" in str(e.value) and "wrong-t0ken" not in str(e.value)


def test_the_header_never_follows_a_redirect(guarded, shards, monkeypatch):
    server, other = guarded
    monkeypatch.setenv(transports.AUTH_VARIABLE, TOKEN)
    got = remote.fetch(server.url + "away/mnist-train.json", policy=FAST)
    assert got == (shards / "mnist-train.json").read_bytes()
    assert server.seen == [TOKEN] and other.seen == [None]


def test_the_header_follows_a_redirect_within_its_own_origin(guarded, shards, monkeypatch):
    """As requests does: the same scheme, host and port keep the credentials (the Hub redirects
    a renamed repository to itself); tokens were dropped there, and a private file read as
    missing."""
    server, _ = guarded
    monkeypatch.setenv(transports.AUTH_VARIABLE, TOKEN)
    got = remote.fetch(server.url + "here/mnist-train.json", policy=FAST)
    assert got == (shards / "mnist-train.json").read_bytes() and server.seen == [TOKEN, TOKEN]


def test_a_header_with_a_line_break_is_one_line_that_never_shows_it(guarded, monkeypatch):
    """http.client refuses such a header with a ValueError quoting it: the secret, in a traceback."""
    server, _ = guarded
    monkeypatch.setenv(transports.AUTH_VARIABLE, "Bearer line-t0ken-secret\nX-Injected: 1")
    with pytest.raises(FetchError) as e:
        remote.fetch(server.url + "mnist-train.json", policy=remote.Policy(retries=3, delay=5.0, timeout=5))
    said = str(e.value)
    assert f"${transports.AUTH_VARIABLE} holds a line break" in said and "t0ken" not in said and "\n" not in said, said
    assert server.seen == []


@pytest.mark.parametrize("port", ["99999", "abc"])
def test_a_redirect_to_a_port_that_is_no_port_is_one_line_with_credentials_too(guarded, monkeypatch, port):
    """Comparing origins read the redirect's port, which raised ValueError past every handler:
    a traceback when a token was set, one line without."""
    server, _ = guarded
    monkeypatch.setenv(transports.AUTH_VARIABLE, TOKEN)
    with pytest.raises(FetchError) as e:
        remote.fetch(server.url + f"port/{port}/x", policy=remote.Policy(retries=0, timeout=5))
    assert "\n" not in str(e.value) and "t0ken" not in str(e.value), str(e.value)


def test_a_header_with_a_line_break_is_one_line_when_shards_are_checked_too(guarded, monkeypatch):
    """The check of a local manifest's http shards (remote.head_check) took the refusal for an
    HTTP answer and read its status code: AttributeError, a traceback."""
    server, _ = guarded
    monkeypatch.setenv(transports.AUTH_VARIABLE, "Bearer line-t0ken-secret\nX-Injected: 1")
    problems, resized = remote.head_check([server.url + "mnist-train-000000.tar"], policy=FAST)
    assert len(problems) == 1 and not resized and f"${transports.AUTH_VARIABLE} holds a line break" in problems[0]
    assert "t0ken" not in problems[0] and server.seen == []


@pytest.mark.parametrize("hosts, sent", [("127.0.0.1", True), ("127.0.0.1:{port}", True), ("LOCALHOST, 127.0.0.1", True),
                                         ("shards.example.org", False), ("127.0.0.1:1", False)])
def test_the_hosts_variable_limits_where_the_header_goes(guarded, monkeypatch, hosts, sent):
    server, _ = guarded
    monkeypatch.setenv(transports.AUTH_VARIABLE, TOKEN)
    monkeypatch.setenv(transports.AUTH_HOSTS_VARIABLE, hosts.format(port=server.server_address[1]))
    if sent:
        remote.fetch(server.url + "mnist-train.json", policy=FAST)
    else:
        with pytest.raises(FetchError, match="401"):
            remote.fetch(server.url + "mnist-train.json", policy=FAST)
    assert server.seen == [TOKEN if sent else None]


def test_a_user_password_url_wins_over_the_variable(guarded, monkeypatch):
    """The URL's own credentials are the more specific: basic auth from them, not the variable."""
    server, _ = guarded
    monkeypatch.setenv(transports.AUTH_VARIABLE, TOKEN)
    url = server.url.replace("http://", "http://user:pw-secret@") + "mnist-train.json"
    with pytest.raises(FetchError) as e:
        remote.fetch(url, policy=FAST)
    assert server.seen[0].startswith("Basic ") and "pw-secret" not in str(e.value) and "user:***@" in str(e.value)


def test_the_trainer_reads_a_guarded_server_with_the_variable_and_says_one_line_without(guarded, tmp_path,
                                                                                         monkeypatch):
    server, _ = guarded
    args = ["--train", f"mnist={server.url}", "--epochs", "1", "--batch-size", "8", "--workers", "0", "--width", "4",
            "--retries", "1", "--io-timeout", "5"]
    monkeypatch.delenv(transports.AUTH_VARIABLE, raising=False)
    p = train_in_process([*args, "--out", tmp_path / "without"])
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    errors = [ln for ln in p.stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1 and "401" in errors[0] and "mnist-train.json" in errors[0], p.stderr[-2000:]
    monkeypatch.setenv(transports.AUTH_VARIABLE, TOKEN)
    p = train_in_process([*args, "--out", tmp_path / "with"])
    assert p.returncode == 0, p.stderr[-2000:]
    assert TOKEN.split()[1] not in p.stdout + p.stderr
    for name in ("metrics.jsonl", "summary.json", "checkpoint.pt"):
        assert TOKEN.split()[1].encode() not in (tmp_path / "with" / name).read_bytes(), name
