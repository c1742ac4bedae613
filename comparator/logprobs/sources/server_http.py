"""JSON over HTTP to an inference server, standard library only: timeouts, retries, one-line errors.

:class:`ServerClient` posts a JSON body and returns the decoded answer. A connection that is
refused, reset or times out, and an HTTP 5xx or 429, are retried with exponential backoff; an
HTTP 4xx is the caller's mistake and is raised at once with the server's own message. Every
failure is a :class:`ServerError` (exit 2) of one line that names the URL.

Example::

    from comparator.logprobs.sources.server_http import ServerClient
    client = ServerClient("http://127.0.0.1:8000", timeout=30, retries=2)
    client.get("/v1/models")["data"][0]["id"]
"""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any, Final

from dumper.errors import UsageError

__all__ = ["ServerClient", "ServerError", "normalize_base_url", "MAX_RESPONSE_BYTES"]

MAX_RESPONSE_BYTES: Final = 256 << 20
"""Largest response body read; a longer one is refused (a prompt-logprobs answer is far smaller)."""
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
    parts = urllib.parse.urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise UsageError(f"--server {url!r}: expected http://HOST:PORT (or https://...)")
    path = parts.path.rstrip("/").removesuffix("/v1")
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def _one_line(text: str, limit: int = 300) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def _server_message(body: bytes) -> str:
    """The message in an error body: OpenAI/vLLM ``{"error": {"message"}}``, flat ``{"message"}``,
    FastAPI ``{"detail"}``, ``{"error": "..."}``, else the text itself."""
    text = body.decode("utf-8", errors="replace")
    try:
        obj = json.loads(text)
    except ValueError:
        return _one_line(text) or "(empty body)"
    if isinstance(obj, dict):
        err = obj.get("error")
        for v in (err.get("message") if isinstance(err, dict) else err, obj.get("message"), obj.get("detail")):
            if v:
                return _one_line(v if isinstance(v, str) else json.dumps(v))
    return _one_line(text)


@dataclass(frozen=True)
class ServerClient:
    """One server: ``base_url`` (see :func:`normalize_base_url`), a per-request ``timeout`` in
    seconds (default 60) and ``retries`` after the first try (default 3, backoff 0.5 s doubling
    up to 8 s) for connection errors, timeouts and HTTP 429/5xx."""

    base_url: str
    timeout: float = 60.0
    retries: int = 3
    backoff: float = 0.5

    def __post_init__(self) -> None:
        object.__setattr__(self, "base_url", normalize_base_url(self.base_url))
        if not self.timeout > 0:
            raise UsageError(f"--timeout must be > 0 seconds, got {self.timeout}")
        if self.retries < 0:
            raise UsageError(f"--retries must be >= 0, got {self.retries}")

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
            return json.loads(body)
        except (ValueError, RecursionError):
            shown = _one_line(body.decode("utf-8", errors="replace"), 80) or "(empty body)"
            raise ServerError(f"{self.url(path)}: the response is not JSON (content-type {ctype or 'none'}): "
                              f"{shown!r}") from None

    def _request(self, method: str, path: str, payload: Any) -> tuple[str, bytes]:
        """(content type, body) of a 2xx answer, retrying what may pass on a later try."""
        url = self.url(path)
        data = None if payload is None else json.dumps(payload).encode("utf-8")
        headers = {"Accept": "application/json"} | ({"Content-Type": "application/json"} if data else {})
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(self.backoff * 2 ** (attempt - 1), _MAX_BACKOFF_S))
            try:
                req = urllib.request.Request(url, data=data, headers=headers, method=method)
                with urllib.request.urlopen(req, timeout=self.timeout) as resp:  # http(s) only: normalize_base_url
                    body = resp.read(MAX_RESPONSE_BYTES + 1)
                    if len(body) > MAX_RESPONSE_BYTES:
                        raise ServerError(f"{url}: the response is over {MAX_RESPONSE_BYTES >> 20} MiB")
                    return resp.headers.get("Content-Type", ""), body
            except urllib.error.HTTPError as e:
                message = _server_message(e.read(1 << 16))
                if e.code not in _RETRY_STATUS:
                    raise ServerError(f"{url}: HTTP {e.code}: {message}", status=e.code) from None
                last = f"HTTP {e.code}: {message}"
            except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
                last = self._connection_problem(e)
        tries = f"{self.retries + 1} tries" if self.retries else "1 try"
        raise ServerError(f"{url}: {last} (after {tries}; --retries, --timeout)")

    def _connection_problem(self, e: BaseException) -> str:
        reason = e.reason if isinstance(e, urllib.error.URLError) else e
        if isinstance(reason, (TimeoutError, socket.timeout)):
            return f"no answer within {self.timeout:g} s"
        if isinstance(reason, ConnectionRefusedError):
            return "connection refused: is the server running?"
        if isinstance(reason, socket.gaierror):
            return f"cannot resolve the host ({reason.strerror or reason})"
        text = getattr(reason, "strerror", None) or str(reason)
        return f"cannot connect ({_one_line(text, 120) or type(reason).__name__})"
