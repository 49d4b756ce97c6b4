"""Where a shard is, spelled once: `canonical` (a local path resolved, a URL normalised), the
same shard listed twice found (`repeated`), the shard of a `pipe:` command, and a file beside a
shard."""
import hashlib
import json
import os
import posixpath
import re
import urllib.parse

from pipeline.data.store import remote
from pipeline.errors import ShardError


# a shard's file name inside a pipe: command; the longest suffix first, or "x.tar.gz" would be read as "x.tar"
# A shard's file name inside a pipe: command: it ends where a shell word ends (space, quote,
# ; | & < > ) or the end), and holds no $ ( ) ` that the shell would expand.
PIPE_SHARD = re.compile(r"[^/\s'\"$()`;|&<>]+\.(?:tar\.gz|tgz|tar)(?=$|[\s'\";|&<>)])")


def listing_digest(entries):
    """sha256 of the shard list as the manifest gives it (names, sha256, bytes, samples, in order):
    the same data behind a source, wherever its folder or server is now."""
    listing = [[e["name"], e.get("sha256"), e["bytes"], e["samples"]] for e in entries]
    return hashlib.sha256(json.dumps(listing).encode()).hexdigest()


def canonical(location, folders=None):
    """One spelling of where a shard is: a local path resolved (`dir//name`, `./name`, links and
    the absolute form of a relative name all become one path); an http(s) URL with its scheme and
    host in lower case, no default port, no fragment, its path's escapes decoded and its `//`, `.`
    and `..` collapsed; a pipe: command as it is (its names are plain, checked by `locate`).
    `folders`: a dict of resolved folders to reuse, so that a million shards in a few folders cost
    an lstat each rather than a realpath each."""
    where = remote.kind(location)
    if where == "file":
        if os.path.islink(location):
            return os.path.realpath(location)
        folder, name = os.path.split(os.path.abspath(location))
        folders = {} if folders is None else folders
        if folder not in folders:
            folders[folder] = os.path.realpath(folder)
        return os.path.join(folders[folder], name)
    if where == "pipe":
        return location
    if where == "store":  # scheme://bucket/key: the key's // and . collapsed
        scheme, _, path = location.partition("://")
        return f"{scheme.lower()}://{posixpath.normpath(re.sub('/+', '/', path))}"
    u = urllib.parse.urlsplit(location)
    try:
        port = u.port
    except ValueError:
        raise ShardError(f"{location}: not a valid URL (its port)") from None
    host = (u.hostname or "").rstrip(".")  # "h.example." is h.example
    default = {"http": 80, "https": 443}[u.scheme.lower()]
    netloc = (f"[{host}]" if ":" in host else host) + (f":{port}" if port not in (None, default) else "")
    if u.username is not None:
        netloc = f"{u.username}{':' + u.password if u.password is not None else ''}@{netloc}"
    path = posixpath.normpath(re.sub("/+", "/", urllib.parse.unquote(u.path)) or "/")
    path = urllib.parse.quote(path + ("/" if u.path.endswith("/") and path != "/" else ""))
    return urllib.parse.urlunsplit((u.scheme.lower(), netloc, path, u.query, ""))


def repeated(named):
    """[(first name, later name)] for (name, sha256) pairs whose bytes an earlier name already
    holds: a copy under a second name is read twice an epoch (the indexer and the trainer
    both warn of it)."""
    seen, twice = {}, []
    for name, digest in named:
        if digest in seen:
            twice.append((seen[digest], name))
        elif digest:
            seen[digest] = name
    return twice


def _once(locations, where):
    """Refuse two spellings of one shard: it would be read twice, in training and in evaluation."""
    seen, folders = {}, {}
    for loc in locations:
        key = canonical(loc, folders)
        if key in seen:
            raise ShardError(f"{where}: {seen[key]!r} and {loc!r} are the same shard ({key}); list it once")
        seen[key] = loc


def _beside(shard_url, filename):
    """The URL of `filename` in the same folder as a shard (path, URL or inside a pipe: command)."""
    if remote.kind(shard_url) == "pipe":
        head, _, tail = shard_url.rpartition(pipe_shard_name(shard_url))
        return head + filename + tail
    return shard_url[:shard_url.rfind("/") + 1] + filename


def pipe_shard_name(command):
    """The shard's file name in a pipe: command (its one *.tar, *.tar.gz or *.tgz): the one
    rule that both the manifest's reader and the indexer use. Two different names are
    refused: which one the manifest sits beside would be a guess."""
    found = set(PIPE_SHARD.findall(command))
    if not found:
        raise ShardError(f"{command}: no shard file name (*.tar, *.tar.gz, *.tgz) in the command")
    if len(found) > 1:
        raise ShardError(f"{command}: more than one shard file name ({', '.join(sorted(found))}); "
                         f"write the command with the shard's name once")
    return found.pop()


def _normal(url):
    return os.path.normpath(url) if remote.kind(url) == "file" else url
