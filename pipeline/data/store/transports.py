"""How remote bytes are opened: an http(s) response whose sockets are shut at the deadline (redirects
kept to http(s), an Authorization header sent to its own host only), a pipe: command's output;
`Transient`, the failure worth another attempt."""
import base64
import contextlib
import http.client
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

from pipeline.data.store import storage
from pipeline.errors import DigestError, ShardError, cut, redact


class Transient(OSError):
    """A failure worth another attempt."""


class _Watched(urllib.request.HTTPHandler, urllib.request.HTTPSHandler):
    """urllib's http(s) handlers, handing each socket they connect to `watch`."""

    def __init__(self, watch, context=None):
        super().__init__()
        self.watch = watch
        if context is not None:  # else urllib's default, which honours $SSL_CERT_FILE
            self._context = context

    def http_open(self, req):
        return self.do_open(self._conn(http.client.HTTPConnection), req)

    def https_open(self, req):
        return self.do_open(self._conn(http.client.HTTPSConnection), req, context=self._context)

    def _conn(self, base):
        watch = self.watch

        class Conn(base):
            cut = None

            def connect(self):
                super().connect()
                watch(self.sock)

            def request(self, *args, **kwargs):
                """A body cut short by the server (S3 refuses an upload before reading it): the
                answer it sent first is read by getresponse and said, not the broken pipe."""
                try:
                    super().request(*args, **kwargs)
                except (BrokenPipeError, ConnectionResetError) as e:
                    self.cut = e

            def getresponse(self):
                if self.cut is None:
                    return super().getresponse()
                try:
                    answer = super().getresponse()
                except Exception:  # noqa: BLE001 - no answer came: the send's error is the one
                    answer = None
                if answer is None or answer.status < 300:  # a success for bytes it did not get is none
                    raise urllib.error.URLError(self.cut)
                return answer
        return Conn


class _RedirectRefused(urllib.error.HTTPError):
    """A redirect to anything but http(s): said as itself, whoever serves the URL."""


class _HttpOnly(urllib.request.HTTPRedirectHandler):
    """Follow redirects to http(s) URLs only: urllib would follow one to ftp:// too. The
    request's credentials (an unredirected Authorization header) go on to the same origin
    only, as requests sends them: the Hub redirects a renamed repository to itself, and a large
    file to its CDN, which must not get the token."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if not newurl.lower().startswith(("http://", "https://")):
            shown = cut(redact(newurl), 80)
            raise _RedirectRefused(req.full_url, 403, f"redirect to {shown!r} refused", headers, fp)
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        auth = req.unredirected_hdrs.get("Authorization")
        if new is not None and auth and _origin(new.full_url) == _origin(req.full_url):
            new.add_unredirected_header("Authorization", auth)
        return new


def _origin(url):
    """(scheme, host, port); a port that is no number is an origin of its own (matches none)."""
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port or (443 if parts.scheme.lower() == "https" else 80)
    except ValueError:
        return object()
    return parts.scheme.lower(), (parts.hostname or "").lower(), port


AUTH_VARIABLE = "PIPELINE_HTTP_AUTHORIZATION"  # an Authorization header's value for http(s) reads
AUTH_HOSTS_VARIABLE = "PIPELINE_HTTP_AUTH_HOSTS"  # optional: the hosts (host or host:port, commas) it goes to


def _request(url, method, direct=None, data=None):
    """A urllib Request for `url`. The `user:password@` of a URL becomes HTTP basic auth (urllib
    would take it for part of the host name); else $PIPELINE_HTTP_AUTHORIZATION, when set, is sent
    as the Authorization header (`Bearer TOKEN`, `Basic ...`), to the hosts named in
    $PIPELINE_HTTP_AUTH_HOSTS when that is set, else to every host the job reads. Either goes to
    that host only (never to another origin a redirect leads to: _HttpOnly), and neither
    is ever part of a message: errors name the URL through errors.redact."""
    parts = urllib.parse.urlsplit(url)
    if direct is not None:  # a store's: its own credentials (a signed URL carries them; a second is refused)
        req = urllib.request.Request(url, data=data, method=method)
        if direct.header:
            req.add_unredirected_header("Authorization", direct.header)
        for name, value in direct.headers:
            req.add_unredirected_header(name, value)
        return req
    if parts.username is None:
        req = urllib.request.Request(url, method=method)
        header = os.environ.get(AUTH_VARIABLE, "").strip()
        if header and _auth_host(parts):
            if any(c in header for c in "\r\n"):  # http.client's refusal would quote the value: the secret
                raise storage.Missing(f"${AUTH_VARIABLE} holds a line break, which no HTTP header may (its value "
                                      f"is not shown): set it to one line")
            req.add_unredirected_header("Authorization", header)
        return req
    bare = urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
    req = urllib.request.Request(bare, method=method)
    pair = f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
    req.add_unredirected_header("Authorization", "Basic " + base64.b64encode(pair.encode()).decode())
    return req


def _auth_host(parts):
    """True if $PIPELINE_HTTP_AUTHORIZATION goes to this URL's host: every host unless
    $PIPELINE_HTTP_AUTH_HOSTS names some (a name alone matches any port)."""
    hosts = [h.strip().lower() for h in os.environ.get(AUTH_HOSTS_VARIABLE, "").split(",") if h.strip()]
    if not hosts:
        return True
    host = (parts.hostname or "").lower()
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return any(h == host or h == f"{host}:{port}" or h == f"[{host}]:{port}" for h in hosts)


ERROR_BODY_SECONDS = 5.0  # the longest an error answer's body is waited for


class _HTTP:
    """A response whose sockets are shut at the deadline: a server that drips its status
    line, headers or chunk sizes never trips the per-operation socket timeout either."""

    def __init__(self, url, policy, nbytes, method="GET", direct=None, data=None):
        """direct: a store's `direct_read.Direct` read: `url` is its URL, sent with its header,
        and its error answers say what went wrong (Direct.refused). data: the body a store's
        write sends (bytes or a file object; its Content-Length among direct.headers), within
        the deadline of `nbytes`."""
        self.start = time.monotonic()
        self.socks, self.expired, self.resp, self.timer = [], threading.Event(), None, None
        self._arm(policy.deadline(nbytes))
        refusal = None
        try:
            opener = urllib.request.build_opener(_Watched(self._watch, direct and direct.context), _HttpOnly())
            try:
                self.resp = opener.open(_request(url, method, direct, data), timeout=policy.timeout)
            except _RedirectRefused:
                raise
            except urllib.error.HTTPError as e:
                if direct is None:
                    raise
                refusal = direct.refused(e.code, e.headers, self._said(e, policy))
                raise refusal from None
            self._late()  # headers cut short by the deadline read as if they had ended
            if method == "GET":
                self._announced(policy, nbytes)
        except Exception:
            self.close()
            if refusal is None:  # the answer came: what it says stands, however late its body was
                self._late()
            raise

    def _said(self, error, policy):
        """The first 64 KiB of an error answer's body, which says why, read for a few seconds
        at most: a store that drips it gets its answer taken for what its status says."""
        self._arm(min(self.limit, time.monotonic() - self.start + min(policy.timeout, ERROR_BODY_SECONDS)))
        body = b""
        with contextlib.suppress(Exception):  # a body cut short says less; its want is no error
            body = error.read(1 << 16)
        error.close()
        return body

    def _arm(self, limit):
        """(Re)start the deadline at `limit` seconds after the transfer began."""
        if self.timer is not None:
            self.timer.cancel()
        self.limit, self.end = limit, self.start + limit
        self.timer = threading.Timer(max(0.0, self.end - time.monotonic()), self._expire)
        self.timer.daemon = True
        self.timer.start()

    def _announced(self, policy, nbytes):
        """Check the Content-Length against the manifest and the job's ceiling, and let it set
        the deadline of a size the manifest left open (--index): shorter than the UNKNOWN_SIZE
        guess for a small shard, longer for a large one served honestly, up to the job's
        ceiling (max_bytes) and no further; past that it was refused above."""
        length = self.resp.length  # None: no Content-Length (chunked, or until the connection closes)
        if length is None:
            return
        if nbytes is not None and length != nbytes:
            raise DigestError(f"the server announces {length} bytes, the manifest says {nbytes}")
        if length > policy.max_bytes:
            raise ShardError(f"the server announces {length} bytes: more than {policy.max_bytes} bytes, the most this "
                             f"job allows ({policy.max_source})")
        if policy.deadline(length) != self.limit:
            self._arm(policy.deadline(length))

    def _watch(self, sock):
        self.socks.append(sock)
        if self.expired.is_set():
            self._expire()

    def _expire(self):  # wakes a blocked recv, which then reads an end of file
        self.expired.set()
        for sock in self.socks:
            with contextlib.suppress(OSError):
                socket.socket.shutdown(sock, socket.SHUT_RDWR)

    def _late(self):
        if self.expired.is_set() or time.monotonic() > self.end:
            raise Transient(f"transfer not finished within its {self.limit:.0f} s deadline")

    def read(self, n):
        self._late()
        try:
            data = self.resp.read1(n)  # one socket read at most: a dripping server can't hold read(n) open
        except Exception:
            self._late()
            raise
        if not data:
            self._late()  # a shut socket's end of file is no end of the body
            if self.resp.length:
                raise Transient(f"connection closed with {self.resp.length} of its announced bytes missing")
        return data

    def close(self):
        if self.timer is not None:
            self.timer.cancel()
        if self.resp is not None:
            self.resp.close()


class _Pipe:
    """A shell command's stdout; killed at the deadline. The command comes from the user's
    command line, with at most a validated shard name substituted in (see manifest.locate)."""

    def __init__(self, url, policy, nbytes):
        self.limit = policy.deadline(nbytes)
        self.proc = subprocess.Popen(url[len("pipe:"):], shell=True, stdout=subprocess.PIPE,
                                     start_new_session=True)  # its own group, killed as one
        self.killed = threading.Event()
        self.timer = threading.Timer(self.limit, self._kill)
        self.timer.daemon = True
        self.timer.start()

    def _kill(self):
        self.killed.set()
        self._killpg()

    def _killpg(self):  # the shell and what it started: a child holding stdout would keep read() waiting
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def read(self, n):
        data = self.proc.stdout.read(n)
        if not data:  # end of output: a command that failed or was killed must not look like a short file
            rc = self.proc.wait()
            if self.killed.is_set():
                raise Transient(f"command not finished within its {self.limit:.0f} s deadline")
            if rc != 0:
                raise Transient(f"command exited with status {rc}")
        return data

    def close(self):
        self.timer.cancel()
        if self.proc.poll() is None:
            self._killpg()
        self.proc.stdout.close()
        self.proc.wait()


def end_process(p, timeout=5):
    """SIGKILL a process (a multiprocessing.Process: a loader worker that did not stop) and the
    pipe: commands it started, then reap it. Each command runs in a process group of its own
    (`_Pipe`), which `_Pipe.close` kills; a worker killed never gets there, and its commands (the
    shell and what it started) lived on, re-parented to init, holding the trainer's stdout and
    stderr open (hostileO s5c: a caller waited 58 s for a stop that took 6 s). So the worker is
    frozen first (SIGSTOP: it starts no command after the look), the groups of its children are
    found in /proc and killed whole, then the worker. Linux; without /proc the worker alone, as
    before. Not PR_SET_PDEATHSIG in the command: it fires when the *thread* that forked exits
    (reads run in pools of threads), and it ends the shell alone, not the command's children."""
    if os.path.isdir("/proc"):
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signal.SIGSTOP)  # a zombie until reaped (p.join): the pid is not reused
            end_commands(p.pid)
    p.kill()
    p.join(timeout)


def end_commands(pid):
    """SIGKILL the children of `pid` (its pipe: commands), each with its process group where it
    leads one (one forked but not yet in its own session: the process alone)."""
    for child in _children(pid):
        with contextlib.suppress(ProcessLookupError):
            if os.getpgid(child) == child:
                os.killpg(child, signal.SIGKILL)
            else:
                os.kill(child, signal.SIGKILL)


def _children(pid):
    """The pids whose parent is `pid`, from /proc (none where there is no /proc)."""
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in filter(str.isdigit, entries):
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rfind(b")") + 2:].split()  # after "pid (comm) ": state, ppid, ...
        if len(fields) > 1 and int(fields[1]) == pid:
            found.append(int(entry))
    return found
