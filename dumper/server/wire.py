"""One HTTP/1.1 answer read under a deadline, by its declared framing: the wire half of the server client.

:class:`http.client.HTTPResponse` parses the status line and headers (bounded in count and length)
from a reader whose every socket read gets what is left of the request's deadline
(:class:`DeadlineRaw`), so a server that drips bytes trips the deadline as surely as a silent one.
The body is framed here, not by :mod:`http.client`, which reads a negative chunk size as "to the end"
and accepts a body shorter than its ``Content-Length``: a cut answer is :class:`Incomplete`
(retried like a reset connection), a lying or unsupported framing is :class:`Refused`.
"""

from __future__ import annotations

import http.client
import io
import re
import socket
import time
from dataclasses import dataclass
from typing import Any, Final

from dumper.format.files import printable

__all__ = ["Incomplete", "Refused", "Answer", "DeadlineRaw", "Source", "left", "one_line", "read_body", "PIECE"]

PIECE: Final = 1 << 16
"""Bytes asked of the socket at a time."""
_MAX_LINE: Final = 1 << 16
_CHUNK_SIZE: Final = re.compile(rb"[0-9A-Fa-f]{1,15}")
_CUT_CHUNKED: Final = "incomplete response: the chunked body ended before its last chunk"


class Incomplete(Exception):
    """An answer cut short: retried like a reset connection."""


class Refused(Exception):
    """An answer whose framing cannot be trusted (lying, conflicting or unsupported headers, over the limit)."""


def one_line(text: str, limit: int = 300) -> str:
    """``text`` on one printable line of at most ``limit`` characters (before escaping)."""
    flat = " ".join(text.split())
    return printable(flat if len(flat) <= limit else flat[: limit - 3] + "...")


def _over(limit: int) -> str:
    return f"the response is over {limit >> 20} MiB"


def left(deadline: float) -> float:
    """Seconds until ``deadline``; a TimeoutError once it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the request's deadline passed")
    return left


class DeadlineRaw(io.RawIOBase):
    """A socket's reads, each given what is left of the request's deadline."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock, self._deadline = sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        self._sock.settimeout(left(self._deadline))
        return self._sock.recv_into(buffer)


class Source:
    """What :class:`http.client.HTTPResponse` reads its status line and headers from: our deadline reader."""

    def __init__(self, fp: io.BufferedReader) -> None:
        self.fp = fp

    def makefile(self, mode: str, *args: Any) -> io.BufferedReader:
        return self.fp


@dataclass(frozen=True)
class Answer:
    status: int
    ctype: str
    location: str | None
    body: bytes


def _read_exact(fp: io.BufferedReader, n: int, out: io.BytesIO, deadline: float) -> int:
    """Copy ``n`` bytes of ``fp`` to ``out`` in bounded pieces; the number copied (fewer at an early end)."""
    done = 0
    while done < n:
        left(deadline)
        piece = fp.read(min(n - done, PIECE))
        if not piece:
            break
        out.write(piece)
        done += len(piece)
    return done


def _read_line(fp: io.BufferedReader) -> bytes:
    line = fp.readline(_MAX_LINE + 1)
    if not line.endswith(b"\n"):
        if len(line) > _MAX_LINE:
            raise http.client.LineTooLong("chunked body line")
        raise Incomplete(_CUT_CHUNKED)
    return line


def _read_chunked(fp: io.BufferedReader, limit: int, deadline: float, refuse_over: bool) -> bytes:
    """A chunked body of at most ``limit`` bytes (past it: :class:`Refused`, or cut at ``limit``)."""
    out = io.BytesIO()
    while True:
        left(deadline)
        size_text = _read_line(fp).split(b";", 1)[0].strip()
        if not _CHUNK_SIZE.fullmatch(size_text):
            raise http.client.HTTPException(f"bad chunk size {size_text[:20]!r} in a chunked body")
        size = int(size_text, 16)
        if size == 0:
            for _ in range(100):  # the trailer: header lines up to a blank one
                if not _read_line(fp).strip():
                    return out.getvalue()
            raise http.client.HTTPException("more than 100 trailer lines after a chunked body")
        if out.tell() + size > limit:
            if refuse_over:
                raise Refused(_over(limit))
            _read_exact(fp, limit - out.tell(), out, deadline)
            return out.getvalue()
        if _read_exact(fp, size, out, deadline) < size:
            raise Incomplete(_CUT_CHUNKED)
        if _read_line(fp).strip():
            raise http.client.HTTPException("a chunk of a chunked body is longer than its size")


def read_body(
    fp: io.BufferedReader, resp: http.client.HTTPResponse, limit: int, deadline: float, refuse_over: bool
) -> bytes:
    """The body framed as ``resp``'s headers say: chunked, ``Content-Length`` bytes, or up to the close.

    At most ``limit`` bytes: a longer body is :class:`Refused` (before reading when declared) with
    ``refuse_over``, else cut at ``limit`` (an error answer, read for its message)."""
    if resp.status in (204, 304) or resp.status < 200:
        return b""
    encoding = resp.headers.get("Transfer-Encoding")
    if encoding is not None:
        if encoding.strip().lower() != "chunked":
            raise Refused(f"unsupported Transfer-Encoding {one_line(encoding, 60)!r}")
        return _read_chunked(fp, limit, deadline, refuse_over)
    out = io.BytesIO()
    lengths = {v.strip() for v in resp.headers.get_all("Content-Length") or ()}
    if len(lengths) > 1:
        raise Refused(f"conflicting Content-Length headers ({one_line(', '.join(sorted(lengths)), 60)})")
    if lengths:
        text = lengths.pop()
        if not (text.isascii() and text.isdigit()):
            raise Refused(f"malformed Content-Length '{one_line(text, 40)}'")
        declared = int(text) if len(text) <= 15 else 1 << 60
        if declared > limit and refuse_over:
            raise Refused(f"{_over(limit)}: its Content-Length declares {one_line(text, 30)} bytes")
        n = min(declared, limit)
        got = _read_exact(fp, n, out, deadline)
        if got < n:
            raise Incomplete(
                f"incomplete response: the connection closed after {got} of the {declared} bytes "
                "its Content-Length declares"
            )
        return out.getvalue()
    while out.tell() <= limit:  # no length: the body ends when the server closes the connection
        left(deadline)
        piece = fp.read(min(PIECE, limit + 1 - out.tell()))
        if not piece:
            return out.getvalue()
        out.write(piece)
    if refuse_over:
        raise Refused(_over(limit))
    return out.getvalue()[:limit]
