"""The Hugging Face Hub read over plain HTTP(S): an hf:// location's resolve URL ($HF_ENDPOINT
honoured), the token looked for where huggingface_hub looks, and the Hub's refusals in one line."""
import contextlib
import os
import urllib.parse

from pipeline.errors import cut, redact
from pipeline.data.store.storage import Missing, Unreachable, _bare, _json_error, _permanent


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
