"""JSON over HTTP to an inference server, standard library only: deadlines, retries, one-line errors.

:class:`ServerClient` posts a JSON body and returns the decoded answer. Each request has one
deadline, ``timeout`` seconds for connect, send and the whole answer (a server that drips bytes
trips it as surely as a silent one): every socket operation gets the time left and the body is
read in bounded pieces. A connection that is refused or reset, a timeout, an answer cut short
(fewer bytes than its ``Content-Length``, a chunked body that stops) and an HTTP 5xx or 429 are
retried with exponential backoff, so one call takes at most ``timeout * (retries + 1)`` plus the
backoff sleeps (0.5, 1, 2, 4, 8, 8, ... s) plus name resolution. An HTTP 4xx is the caller's
mistake and is raised at once with the server's own message; a redirect (3xx) is refused, naming
both URLs, so the answers recorded are always those of the URL given. A body over
:data:`MAX_RESPONSE_BYTES` is refused, before reading when its ``Content-Length`` says so. Every
failure is a :class:`ServerError` (exit 2) of one printable line that names the URL.

Example::

    from dumper.server.client import ServerClient
    client = ServerClient("http://127.0.0.1:8000", timeout=30, retries=2)
    client.get("/v1/models")["data"][0]["id"]
"""

from __future__ import annotations

import http.client
import io
import json
import socket
import ssl
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any, Final

from dumper.errors import DriftscopeError, UsageError
from dumper.format.files import check_json_memory
from dumper.server.flags import (
    DEFAULT_RETRIES,
    DEFAULT_TIMEOUT_S,
    check_retries,
    check_timeout,
)
from dumper.server.wire import (
    PIECE,
    Answer,
    DeadlineRaw,
    Incomplete,
    Refused,
    Source,
    left,
    one_line,
    read_body,
)

__all__ = ["ServerClient", "ServerError", "normalize_base_url", "MAX_RESPONSE_BYTES"]

MAX_RESPONSE_BYTES: Final = 256 << 20
"""Largest response body read; a longer one is refused (a prompt-logprobs answer is far smaller)."""
_MAX_ERROR_BYTES: Final = 1 << 16
"""How much of an error answer's body is read for its message."""
_RETRY_STATUS: Final = frozenset({429, 500, 502, 503, 504})
_MAX_BACKOFF_S: Final = 8.0


class ServerError(UsageError):
    """The server cannot be used: down, unreachable, refusing the request, or answering nonsense.

    ``status`` is the HTTP status of a refused request (None for every other failure)."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def normalize_base_url(url: str) -> str:
    """``http://host:port[/prefix]`` without a trailing ``/`` or ``/v1``; a UsageError for anything else."""
    bad = UsageError(f"--server {url!r}: expected http://HOST:PORT (or https://...)")
    if not url.strip().isprintable() or any(c.isspace() for c in url.strip()):
        raise bad
    try:
        parts = urllib.parse.urlsplit(url.strip())
        parts.port  # noqa: B018 - a ValueError for a port that is not a number in 0..65535
    except ValueError:
        raise bad from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise bad
    if parts.username is not None or parts.password is not None:
        raise UsageError(f"--server: credentials in the URL are not supported ({parts.scheme}://HOST:PORT)")
    if ":" not in parts.hostname:
        try:
            parts.hostname.encode("idna")
        except UnicodeError:
            raise bad from None
    path = urllib.parse.quote(parts.path.rstrip("/").removesuffix("/v1"), safe="/%:@!$&'()*+,;=~")
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, "", ""))


# --------------------------------------------------------------------------- messages


def _server_message(body: bytes) -> str:
    """The message in an error body: OpenAI/vLLM ``{"error": {"message"}}``, flat ``{"message"}``,
    FastAPI ``{"detail"}``, ``{"error": "..."}``, else the text itself."""
    text = body.decode("utf-8", errors="replace")
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        return one_line(text) or "(empty body)"
    if isinstance(obj, dict):
        err = obj.get("error")
        for v in (err.get("message") if isinstance(err, dict) else err, obj.get("message"), obj.get("detail")):
            if v:
                try:
                    return one_line(v if isinstance(v, str) else json.dumps(v))
                except (ValueError, RecursionError):  # a NaN or a deep nest in detail: show the text
                    break
    return one_line(text) or "(empty body)"


# --------------------------------------------------------------------------- the client


@dataclass(frozen=True)
class ServerClient:
    """One server: ``base_url`` (see :func:`normalize_base_url`), a per-request deadline ``timeout``
    in seconds (default 120, as ``--timeout``; connect, send and the whole answer) and ``retries`` after
    the first try (default 3, backoff 0.5 s doubling up to 8 s) for connection errors, timeouts, cut
    answers and HTTP 429/5xx."""

    base_url: str
    timeout: float = DEFAULT_TIMEOUT_S
    retries: int = DEFAULT_RETRIES
    backoff: float = 0.5

    def __post_init__(self) -> None:
        object.__setattr__(self, "base_url", normalize_base_url(self.base_url))
        object.__setattr__(self, "timeout", check_timeout(self.timeout))
        object.__setattr__(self, "retries", check_retries(self.retries))
        if (
            isinstance(self.backoff, bool)
            or not isinstance(self.backoff, (int, float))
            or not 0 <= self.backoff <= _MAX_BACKOFF_S
        ):
            raise UsageError(f"backoff {self.backoff!r}: expected seconds from 0 to {_MAX_BACKOFF_S:g}")

    def url(self, path: str) -> str:
        return self.base_url + path

    def get(self, path: str) -> Any:
        """GET ``path`` and decode its JSON answer."""
        return self._json(path, self._request("GET", path, None))

    def post(self, path: str, payload: Any) -> Any:
        """POST ``payload`` as JSON to ``path`` and decode the JSON answer."""
        return self._json(path, self._request("POST", path, payload))

    def post_text(self, path: str, payload: Any = None) -> str:
        """POST to ``path`` and return the answer as text (SGLang's ``/flush_cache`` answers plain text)."""
        return self._request("POST", path, payload)[1].decode("utf-8", errors="replace")

    def _json(self, path: str, answer: tuple[str, bytes]) -> Any:
        ctype, body = answer
        try:
            check_json_memory(body, self.url(path), "response")
            return json.loads(body)
        except DriftscopeError as e:
            raise ServerError(str(e)) from None
        except (ValueError, RecursionError):
            shown = one_line(body[:4096].decode("utf-8", errors="replace"), 80) or "(empty body)"
            raise ServerError(
                f"{self.url(path)}: the response is not JSON (content-type {one_line(ctype, 60) or 'none'}): '{shown}'"
            ) from None

    def _request(self, method: str, path: str, payload: Any) -> tuple[str, bytes]:
        """(content type, body) of a 2xx answer, retrying what may pass on a later try."""
        url = self.url(path)
        data = None if payload is None else json.dumps(payload).encode("utf-8")
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(self.backoff * 2 ** (attempt - 1), _MAX_BACKOFF_S))
            try:
                answer = self._exchange(method, path, data)
            except Refused as e:
                raise ServerError(f"{url}: {e}") from None
            except TimeoutError:
                last = f"no complete answer within {self.timeout:g} s"
                continue
            except Incomplete as e:
                last = str(e)
                continue
            except (OSError, http.client.HTTPException) as e:
                last = self._connection_problem(e)
                continue
            status = answer.status
            if 200 <= status < 300:
                return answer.ctype, answer.body
            if 300 <= status < 400 and answer.location:
                raise ServerError(
                    f"{url}: HTTP {status} redirects to {self._location(url, answer.location)}: "
                    "redirects are not followed (the answers must come from the URL given); "
                    "pass the final URL to --server",
                    status=status,
                )
            message = _server_message(answer.body)
            if status not in _RETRY_STATUS:
                raise ServerError(f"{url}: HTTP {status}: {message}", status=status)
            last = f"HTTP {status}: {message}"
        tries = f"{self.retries + 1} tries" if self.retries else "1 try"
        raise ServerError(f"{url}: {last} (after {tries}; --retries, --timeout)")

    def _exchange(self, method: str, path: str, data: bytes | None) -> Answer:
        """One request and its whole answer within ``timeout`` seconds; the body read as its status allows."""
        deadline = time.monotonic() + self.timeout
        parts = urllib.parse.urlsplit(self.base_url)
        host, port = str(parts.hostname), parts.port or (443 if parts.scheme == "https" else 80)
        sock = self._connect(host, port, parts.scheme == "https", deadline)
        try:
            sock.settimeout(left(deadline))
            sock.sendall(self._request_bytes(method, parts, path, data))  # sendall: the timeout bounds it all
            fp = io.BufferedReader(DeadlineRaw(sock, deadline), PIECE)
            resp = http.client.HTTPResponse(Source(fp), method=method)  # type: ignore[arg-type]
            resp.begin()  # the status line (100 Continue skipped) and the headers, bounded by http.client
            ok = 200 <= resp.status < 300
            body = read_body(fp, resp, MAX_RESPONSE_BYTES if ok else _MAX_ERROR_BYTES, deadline, refuse_over=ok)
            return Answer(resp.status, resp.headers.get("Content-Type", ""), resp.headers.get("Location"), body)
        finally:
            sock.close()

    @staticmethod
    def _connect(host: str, port: int, tls: bool, deadline: float) -> socket.socket:
        """A connected socket (TLS-wrapped for https), each address tried with the time left."""
        error: OSError = OSError(f"no address for {host}")
        for family, kind, proto, _, address in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
            sock = socket.socket(family, kind, proto)
            try:
                sock.settimeout(left(deadline))
                sock.connect(address)
                if tls:  # the handshake, like every ssl operation, is bounded by the socket's timeout as a whole
                    sock.settimeout(left(deadline))
                    return ssl.create_default_context().wrap_socket(sock, server_hostname=host)
                return sock
            except OSError as e:
                sock.close()
                if isinstance(e, TimeoutError):
                    raise
                error = e
        raise error

    @staticmethod
    def _request_bytes(method: str, parts: urllib.parse.SplitResult, path: str, data: bytes | None) -> bytes:
        host = str(parts.hostname)
        host = f"[{host}]" if ":" in host else host.encode("idna").decode("ascii")
        head = [
            f"{method} {parts.path}{path} HTTP/1.1",
            f"Host: {host}{f':{parts.port}' if parts.port else ''}",
            "Accept: application/json",
            "User-Agent: driftscope",
            "Connection: close",
        ]
        if data is not None:
            head.append("Content-Type: application/json")
        if data is not None or method == "POST":
            head.append(f"Content-Length: {len(data or b'')}")
        return ("\r\n".join(head) + "\r\n\r\n").encode("ascii") + (data or b"")

    @staticmethod
    def _location(url: str, location: str) -> str:
        try:
            location = urllib.parse.urljoin(url, location.strip())
        except ValueError:
            pass
        return one_line(location, 200)

    def _connection_problem(self, e: BaseException) -> str:
        if isinstance(e, ConnectionRefusedError):
            return "connection refused: is the server running?"
        if isinstance(e, socket.gaierror):
            return f"cannot resolve the host ({one_line(str(e.strerror or e), 120)})"
        if isinstance(e, http.client.RemoteDisconnected):
            return "the server closed the connection without an answer"
        if isinstance(e, http.client.BadStatusLine):
            return f"not an HTTP answer (status line '{one_line(str(e), 80)}')"
        if isinstance(e, http.client.UnknownProtocol):
            return f"not an HTTP/1 answer (protocol '{one_line(str(e), 40)}')"
        if isinstance(e, http.client.HTTPException):
            return f"not an HTTP answer ({one_line(str(e), 120) or type(e).__name__})"
        if isinstance(e, (ConnectionResetError, BrokenPipeError)):
            return f"connection lost ({one_line(str(e.strerror or e), 120)})"
        text = getattr(e, "strerror", None) or str(e)
        return f"cannot connect ({one_line(text, 120) or type(e).__name__})"
