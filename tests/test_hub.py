"""Shards on the Hugging Face Hub (hf://), read as huggingface_hub downloads them: the resolve URL
under $HF_ENDPOINT, the token from $HF_TOKEN or the login file, sent to the Hub only, never to
the storage a download is redirected to. A local server on 127.0.0.1 plays the Hub: a private
dataset repository whose tar files redirect to a signed "CDN" URL, as LFS files do, and whose
errors carry X-Error-Code and X-Error-Message, as the Hub's do."""
import http.server
import os
import sys
import urllib.parse

import pytest

from helpers import HANG, build_shards, run_capture, serving
from pipeline.data.store import remote, storage
from pipeline.data.store import hf_hub
from pipeline.data.manifests.manifest import resolve
from pipeline.data.streams.stream import MixedStream
from pipeline.errors import FetchError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKEN = "hf_n3ver-printed-token-0123456789"
REPO = "/datasets/someone/digits"


class _Hub(http.server.BaseHTTPRequestHandler):
    """GET /datasets/someone/digits/resolve/main/PATH: the file under `server.folder`, for the
    right token only; a .tar answers 302 to http://localhost:PORT/cdn/PATH?X-Amz-Signature=... (the
same server under another host name, as the Hub's CDN is another host), served to requests
    without a token only; /datasets/someone/old-name/... redirects to the repository's new name,
    for the right token."""

    def log_message(self, *args):
        pass

    def do_GET(self):
        path, _, query = self.path.partition("?")
        auth = self.headers.get("Authorization")
        self.server.seen.append((path, auth))
        if path.startswith("/cdn/"):
            if auth is not None or "X-Amz-Signature=" not in query:
                return self._error(403, None, "the CDN takes a signed URL and nothing else")
            return self._file(urllib.parse.unquote(path[len("/cdn/"):]))
        prefix = f"{REPO}/resolve/"
        if path.startswith(f"/api{REPO}/tree/main/") and auth == f"Bearer {TOKEN}":
            return self._tree(urllib.parse.unquote(path[len(f"/api{REPO}/tree/main/"):]), query)
        if path.startswith("/datasets/someone/old-name/") and auth == f"Bearer {TOKEN}":  # renamed: to itself
            self.send_response(307)
            self.send_header("Location", REPO + path[len("/datasets/someone/old-name"):])
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        if not path.startswith(prefix):
            return self._error(404, "RepoNotFound", f"Repository Not Found for url: {self.path}.")
        if auth != f"Bearer {TOKEN}":
            return self._error(401, "RepoNotFound", f"Repository Not Found for url: {self.path}. Please make sure "
                                                    f"you are authenticated.")
        revision, _, name = path[len(prefix):].partition("/")
        if revision != "main":
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {urllib.parse.unquote(revision)}")
        name = urllib.parse.unquote(name)
        if not os.path.isfile(os.path.join(self.server.folder, name)):
            return self._error(404, "EntryNotFound", f"Entry Not Found for url: {self.path}.")
        if name.endswith(".tar"):
            self.send_response(302)
            cdn = f"http://localhost:{self.server.server_address[1]}"  # another host, as the Hub's CDN is
            self.send_header("Location", f"{cdn}/cdn/{urllib.parse.quote(name)}?X-Amz-Signature=cafe&Expires=1")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        return self._file(name)

    def _tree(self, folder, query):
        """The tree API's page: two entries a page, the next one named by a Link header."""
        import json

        names = sorted(os.listdir(os.path.join(self.server.folder, folder)))
        start = int(dict(urllib.parse.parse_qsl(query)).get("cursor", 0))
        entries = [{"type": "file", "path": f"{folder}/{n}", "size": 1} for n in names[start:start + 2]]
        body = json.dumps(entries).encode()
        self.send_response(200)
        if start + 2 < len(names):
            self.send_header("Link", f'<{self.server.url}api{REPO}/tree/main/{folder}?cursor={start + 2}>; rel="next"')
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _file(self, name):
        with open(os.path.join(self.server.folder, name), "rb") as f:
            data = f.read()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status, code, message):
        body = ('{"error": "%s"}' % message).encode()
        self.send_response(status)
        if code:
            self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """The local Hub, as $HF_ENDPOINT, holding mnist shards under shards/ of a private dataset
    repository, and $HF_TOKEN its token: (the local folder, the hf:// URL of the shards)."""
    folder = tmp_path / "repo" / "shards"
    build_shards(folder, "mnist", "train", 120, maxcount=25)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # no login file unless a test writes one
    with serving(_Hub, folder=str(tmp_path / "repo"), seen=[]) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url.rstrip("/"))
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        yield folder, "hf://datasets/someone/digits/shards/", server


def keys(src):
    return [k for b in MixedStream([src], {"mnist": 1}, 8, seed=3) for k in b["key"]]


def test_a_source_on_the_hub_reads_the_batches_its_local_twin_reads(hub):
    folder, url, server = hub
    src = resolve("mnist", url, "train")
    assert src.urls[0].startswith(url) and remote.kind(src.urls[0]) == "store"
    assert keys(src) == keys(resolve("mnist", str(folder), "train"))
    cdn = [auth for path, auth in server.seen if path.startswith("/cdn/")]
    hub_side = [auth for path, auth in server.seen if not path.startswith("/cdn/")]
    assert len(cdn) >= len(src.urls) and set(cdn) == {None}, "the token went to the storage a download redirects to"
    assert set(hub_side) == {f"Bearer {TOKEN}"}


def test_the_token_comes_from_the_login_file_when_the_variable_is_unset(hub, tmp_path, monkeypatch):
    _, url, _ = hub
    monkeypatch.delenv("HF_TOKEN")
    with pytest.raises(Exception, match="Repository Not Found"):
        resolve("mnist", url, "train")
    os.makedirs(tmp_path / "hf-home")
    (tmp_path / "hf-home" / "token").write_text(TOKEN + "\n")
    assert len(resolve("mnist", url, "train").urls) == 5


def test_a_renamed_repository_is_followed_with_the_token_and_its_cdn_gets_none(hub):
    """The Hub redirects a renamed repository to its new name on the same host: the token goes
    on there (a private repository read as not found without it), and not to the CDN after."""
    folder, _, server = hub
    src = resolve("mnist", "hf://datasets/someone/old-name/shards/", "train")
    assert keys(src) == keys(resolve("mnist", str(folder), "train"))
    tar = [(p, a) for p, a in server.seen if p.endswith("mnist-train-000000.tar")]
    assert [p.split("/")[1:4] for p, _ in tar] == [["datasets", "someone", "old-name"], ["datasets", "someone", "digits"],
                                                  ["cdn", "shards", "mnist-train-000000.tar"]], tar
    assert [a for _, a in tar] == [f"Bearer {TOKEN}", f"Bearer {TOKEN}", None], tar


@pytest.mark.parametrize("token", [TOKEN + "\nhf_second-line-secret\n", TOKEN + "\r\nX-Injected: 1"])
def test_a_token_with_a_line_break_is_never_shown(hub, tmp_path, monkeypatch, token):
    """A login file of two lines kept its inner line break; http.client refused the header with
    a ValueError quoting it, and the trainer printed the token in a traceback."""
    _, url, server = hub
    monkeypatch.delenv("HF_TOKEN")
    os.makedirs(tmp_path / "hf-home")
    (tmp_path / "hf-home" / "token").write_text(token)
    with pytest.raises(FetchError) as e:
        remote.fetch(url + "mnist-train.json", policy=remote.Policy(retries=0))
    said = str(e.value)
    assert "Repository Not Found" in said and "\n" not in said and "n3ver" not in said and "second" not in said, said
    assert [a for _, a in server.seen] == ["Bearer " + token.replace("\r", "").replace("\n", "").strip()]


@pytest.mark.parametrize("where, said", [
    ("hf://datasets/someone/digits/shards/nothing.tar", "Entry Not Found for url"),
    ("hf://datasets/someone/digits@v9/shards/mnist-train-000000.tar", "Invalid rev id: v9 (RevisionNotFound)"),
    ("hf://datasets/someone/elsewhere/x.tar", "Repository Not Found for url"),
    ("hf://datasets/someone/digits", "not a file of a repository")])
def test_the_hub_s_refusals_are_one_line_at_once(hub, where, said):
    policy = remote.Policy(retries=3, delay=5.0)  # 15 s of waiting if a refusal were retried
    with pytest.raises(FetchError) as e:
        remote.fetch(where, policy=policy)
    text = str(e.value)
    assert said in text and text.startswith("hf://") and "\n" not in text and TOKEN not in text, text


def test_hub_urls_are_written_as_huggingface_hub_downloads_them(monkeypatch):
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    url = lambda u: hf_hub.hub_url(storage.parse(u))  # noqa: E731
    assert url("hf://datasets/u/d/shards/a b+c.tar") == "https://huggingface.co/datasets/u/d/resolve/main/shards/a%20b%2Bc.tar"
    assert url("hf://datasets/u/d@refs%2Fpr%2F3/x.tar") == "https://huggingface.co/datasets/u/d/resolve/refs%2Fpr%2F3/x.tar"
    assert url("hf://spaces/u/s/x.tar") == "https://huggingface.co/spaces/u/s/resolve/main/x.tar"
    assert url("hf://u/model/x.tar") == url("hf://models/u/model/x.tar") == "https://huggingface.co/u/model/resolve/main/x.tar"
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9/mirror/")
    assert url("hf://datasets/u/d/x.tar") == "http://127.0.0.1:9/mirror/datasets/u/d/resolve/main/x.tar"
    for bad in ("hf://datasets/u/d", "hf://datasets/u/d/", "hf://datasets//d/x.tar", "hf://u/x.tar"):
        with pytest.raises(storage.Missing, match="hf://datasets/USER/REPO/PATH"):
            url(bad)


def test_a_run_from_the_hub_never_prints_or_writes_the_token(hub, tmp_path):
    _, url, _ = hub
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = run_capture([sys.executable, "-m", "pipeline.train", "--train", f"mnist={url}", "--epochs", "1",
                     "--batch-size", "8", "--workers", "1", "--width", "4", "--out", str(out)],
                    capture_output=True, text=True, env=env, timeout=HANG)
    assert p.returncode == 0, p.stderr[-2000:]
    assert TOKEN not in p.stdout + p.stderr
    for root, _, files in os.walk(out):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                assert TOKEN.encode() not in f.read(), name


def test_a_hub_folder_is_indexed_in_place(hub, tmp_path):
    """make_shards --index of an hf:// folder lists it through the Hub's tree API, page by page
    (no package needed), and reads each shard through its resolve URL."""
    from helpers import make_shards_in_process

    folder, url, server = hub
    build_shards(folder.parent / "png", "mnist", "train", 100, maxcount=25, encoding="png")  # raw needs its manifest
    url = url.replace("/shards/", "/png/")
    p = make_shards_in_process(["--index", f"digits:train={url}", "--out", tmp_path / "m", "--workers", "1", "--quiet"])
    assert p.returncode == 0, p.stderr
    src = resolve("digits", str(tmp_path / "m"), "train")
    assert src.urls == [f"{url}mnist-train-{i:06d}.tar" for i in range(4)]
    assert sum(1 for path, _ in server.seen if "/tree/" in path) == 3  # 4 shards and a manifest, 2 a page
    assert len([k for b in MixedStream([src], {"digits": 1}, 10, seed=3) for k in b["key"]]) == 100
    assert all(auth == f"Bearer {TOKEN}" for path, auth in server.seen if "/tree/" in path)
