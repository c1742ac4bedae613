"""The live-server client at the trust boundary: real servers on 127.0.0.1 that answer wrongly.

Each server here writes its answer as raw bytes (status line, headers, framing and body chosen
by the test) so the client meets what a broken or hostile server sends: a byte every 0.25 s, a
redirect to another host, a body shorter than its ``Content-Length``, chunked bodies whole and
cut, huge declared lengths, control characters in error messages. ``comparator collect`` runs as
a real CLI (a subprocess, or its ``main`` in this process under :func:`tests.fuzzing.run_main`).
"""

from __future__ import annotations

import http.server
import json
import math
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from comparator.cli.main import main as comparator_main
from dumper.cli.main import main as dumper_main
from dumper.errors import UsageError
from dumper.server.client import ServerClient, ServerError
from dumper.server.flags import MAX_RETRIES, MAX_TIMEOUT_S, check_retries, check_timeout
from tests.comparator.logprobs import test_engines as engines
from tests.conftest import run_cli, serve_in_thread
from tests.fuzzing import FUZZ, check_outcome, has_control, run_main

GOOD = json.dumps(engines.sglang_response()).encode()
"""An SGLang /generate answer that ``comparator collect --api sglang --prompt TEXT`` accepts."""


def _collect_args(url: str, out: Path, *extra: str) -> list[str]:
    return ["collect", "--server", url, "--api", "sglang", "--prompt", "x", "--out", str(out), *extra]


def _one_error_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in stderr, stderr
    return lines[0]


def _answer(status: int, body: bytes, *headers: str, length: int | None = None) -> bytes:
    """Raw HTTP/1.1 answer bytes: ``Content-Length`` is ``length`` (default the body's) unless chunked."""
    head = [f"HTTP/1.1 {status} X", "Content-Type: application/json", "Connection: close", *headers]
    if not any(h.lower().startswith("transfer-encoding") for h in headers):
        head.append(f"Content-Length: {len(body) if length is None else length}")
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


def _chunked(body: bytes, size: int = 7, *, last: bool = True) -> bytes:
    pieces = [body[i : i + size] for i in range(0, len(body), size)]
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + (b"0\r\n\r\n" if last else b"")


class _Raw(http.server.BaseHTTPRequestHandler):
    """Answers every request with ``answer`` as raw bytes; with ``hold``, keeps the connection open
    until the client closes it (at most 10 s)."""

    answer: ClassVar[bytes] = b""
    hold: ClassVar[bool] = False
    hits: ClassVar[int] = 0

    def log_message(self, *args: object) -> None:  # keep pytest's output clean
        pass

    def _serve(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        type(self).hits += 1
        try:
            self.wfile.write(self.answer)
            if self.hold:
                self.connection.settimeout(10)
                self.connection.recv(1)
        except OSError:  # the client gave up
            pass
        self.close_connection = True

    do_GET = do_POST = _serve  # http.server's naming


class _Good(_Raw):
    answer = _answer(200, GOOD)
    hits = 0


class _Drip(http.server.BaseHTTPRequestHandler):
    """A byte every 0.25 s, forever (until the client hangs up): in the headers or in the body."""

    where: ClassVar[str] = "body"

    def log_message(self, *args: object) -> None:
        pass

    def _serve(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            if self.where == "headers":
                self.wfile.write(b"HTTP/1.1 200 OK\r\nX-Slow: ")
            else:
                self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n")
            for _ in range(400):  # 100 s at most, should the client never hang up
                time.sleep(0.25)
                self.wfile.write(b" ")
        except OSError:
            pass
        self.close_connection = True

    do_GET = do_POST = _serve


@pytest.fixture
def raw() -> Iterator[str]:
    _Raw.answer, _Raw.hold, _Raw.hits = b"", False, 0
    with serve_in_thread(_Raw) as url:
        yield url


# --------------------------------------------------------------------------- --timeout and --retries


@pytest.mark.parametrize("value", ["inf", "1e300", "nan", "0", "-1", "-inf", "86401", "ten"])
def test_a_timeout_that_is_not_a_finite_positive_day_is_refused(
    value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = "http://127.0.0.1:9"
    rc = comparator_main(_collect_args(url, tmp_path / "x.jsonl", "--timeout", value, "--retries", "0"))
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 2 and "--timeout" in line and "127.0.0.1" not in line, line  # refused before any request
    rc = dumper_main(["selfcheck", "--server", url, "--api", "sglang", "--input-ids", "1,2", "--timeout", value])
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 2 and "--timeout" in line and "127.0.0.1" not in line, line


@pytest.mark.parametrize("value", ["-1", "101", "1.5", "1e3", "9" * 5000])
def test_retries_must_be_a_small_count(value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = comparator_main(_collect_args("http://127.0.0.1:9", tmp_path / "x.jsonl", "--retries", value))
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 2 and "--retries" in line and len(line) < 200, line


@pytest.mark.slow
def test_timeout_inf_through_the_real_cli(tmp_path: Path) -> None:
    for cli, args in (
        ("comparator", _collect_args("http://127.0.0.1:9", tmp_path / "x.jsonl")),
        ("dumper", ["selfcheck", "--server", "http://127.0.0.1:9", "--api", "vllm"]),
    ):
        r = run_cli(cli, *args, "--timeout", "inf")
        assert r.returncode == 2 and "--timeout inf:" in _one_error_line(r.stderr), r.stderr


def test_the_library_checks_the_same_bounds() -> None:
    assert check_timeout(MAX_TIMEOUT_S) == MAX_TIMEOUT_S and check_retries(MAX_RETRIES) == MAX_RETRIES
    for bad in (math.inf, 1e300, math.nan, 0, -1.0, True, "5"):
        with pytest.raises(UsageError, match="--timeout"):
            ServerClient("http://127.0.0.1:9", timeout=bad)  # type: ignore[arg-type]
    for bad in (-1, MAX_RETRIES + 1, 1.0, True):
        with pytest.raises(UsageError, match="--retries"):
            ServerClient("http://127.0.0.1:9", retries=bad)  # type: ignore[arg-type]
    for url in (
        "http://[::1",
        "http://h:99999",
        "http://h:port",
        "http://user:pw@h:1",
        "http://h\x1b[31m:1",
        "ftp://h",
        "http:///x",
    ):
        with pytest.raises(UsageError, match="--server"):
            ServerClient(url)


# --------------------------------------------------------------------------- one deadline per request


@pytest.mark.slow
@pytest.mark.parametrize("where", ["body", "headers"])
def test_a_dripping_server_trips_the_timeout(where: str, tmp_path: Path) -> None:
    _Drip.where = where
    with serve_in_thread(_Drip) as url:
        start = time.monotonic()
        r = run_cli("comparator", *_collect_args(url, tmp_path / "x.jsonl", "--timeout", "2", "--retries", "0"))
        wall = time.monotonic() - start
        print(f"drip in the {where}: comparator collect --timeout 2 --retries 0 took {wall:.2f} s (process included)")
        line = _one_error_line(r.stderr)
        assert r.returncode == 2 and f"{url}/generate: no complete answer within 2 s (after 1 try" in line, line
        assert wall < 2 + 8
        assert not (tmp_path / "x.jsonl").exists()

        start = time.monotonic()
        with pytest.raises(ServerError, match="no complete answer within 1 s"):
            ServerClient(url, timeout=1, retries=1, backoff=0.5).post("/generate", {})
        wall = time.monotonic() - start
        print(f"drip in the {where}: ServerClient(timeout=1, retries=1) gave up after {wall:.2f} s")
        assert 2.5 <= wall < 2.5 + 4  # timeout * (retries + 1) + one backoff of 0.5 s


# --------------------------------------------------------------------------- redirects


class _Redirect(_Raw):
    target: ClassVar[str] = ""
    status: ClassVar[int] = 302

    def _serve(self) -> None:
        location = self.target + self.path if self.target.startswith("http") else self.target
        type(self).answer = _answer(self.status, b"", f"Location: {location}")
        super()._serve()

    do_GET = do_POST = _serve


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_a_redirect_to_another_host_is_refused(status: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with serve_in_thread(_Good) as good, serve_in_thread(_Redirect) as redirecting:
        assert comparator_main(_collect_args(good, tmp_path / "good.jsonl", "--retries", "0")) == 0  # it would pass
        capsys.readouterr()
        before = _Good.hits
        _Redirect.target, _Redirect.status = good.replace("127.0.0.1", "localhost"), status
        if status == 302:  # once through the real CLI
            r = run_cli("comparator", *_collect_args(redirecting, tmp_path / "x.jsonl", "--retries", "2"))
            rc, err = r.returncode, r.stderr
        else:
            rc = comparator_main(_collect_args(redirecting, tmp_path / "x.jsonl", "--retries", "2"))
            err = capsys.readouterr().err
        line = _one_error_line(err)
        assert rc == 2, line
        assert f"{redirecting}/generate: HTTP {status} redirects to {_Redirect.target}/generate" in line, line
        assert _Good.hits == before and not (tmp_path / "x.jsonl").exists()


def test_a_redirect_on_the_same_host_is_refused_too(raw: str) -> None:
    _Raw.answer = _answer(302, b"", "Location: /elsewhere\x1b[2J")
    with pytest.raises(ServerError) as e:
        ServerClient(raw, retries=3).get("/v1/models")
    assert f"{raw}/v1/models: HTTP 302 redirects to {raw}/elsewhere" in str(e.value) and not has_control(str(e.value))
    assert e.value.status == 302 and _Raw.hits == 1


# --------------------------------------------------------------------------- framing


def test_a_body_shorter_than_its_content_length_is_incomplete(
    raw: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _Raw.answer = _answer(200, GOOD, length=len(GOOD) + 5)  # all of a valid answer, but 5 bytes short
    rc = comparator_main(_collect_args(raw, tmp_path / "x.jsonl", "--retries", "1"))
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 2 and _Raw.hits == 2, line
    assert (
        f"/generate: incomplete response: the connection closed after {len(GOOD)} of the {len(GOOD) + 5} bytes "
        "its Content-Length declares (after 2 tries"
    ) in line, line
    assert not (tmp_path / "x.jsonl").exists()


def test_chunked_answers_are_read_and_checked(raw: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for size in (1, 7, 1 << 20):
        _Raw.answer = _answer(200, _chunked(GOOD, size), "Transfer-Encoding: chunked")
        assert comparator_main(_collect_args(raw, tmp_path / f"{size}.jsonl", "--quiet")) == 0, capsys.readouterr()
    _Raw.answer = _answer(200, _chunked(GOOD, last=False), "Transfer-Encoding: chunked")  # no last chunk
    rc = comparator_main(_collect_args(raw, tmp_path / "x.jsonl", "--retries", "0"))
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 2 and "incomplete response: the chunked body ended before its last chunk" in line, line
    _Raw.answer = _answer(200, b"-5\r\n" + GOOD, "Transfer-Encoding: chunked")  # http.client would read to the end
    rc = comparator_main(_collect_args(raw, tmp_path / "x.jsonl", "--retries", "0"))
    assert rc == 2 and "bad chunk size b'-5'" in _one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize("framing", ["Content-Length: 1099511627776", "Transfer-Encoding: chunked"])
def test_a_declared_body_over_the_limit_is_refused_before_reading(raw: str, framing: str) -> None:
    body = b"fffffffff\r\n" if "chunked" in framing else b""
    head = f"HTTP/1.1 200 OK\r\n{framing}\r\n\r\n".encode()
    _Raw.answer, _Raw.hold = head + body, True  # nothing more comes: reading would wait for the timeout
    start = time.monotonic()
    with pytest.raises(ServerError, match="the response is over 256 MiB"):
        ServerClient(raw, timeout=30, retries=2).get("/v1/models")
    assert _Raw.hits == 1 and time.monotonic() - start < 10


def test_error_text_from_the_server_is_printable(raw: str, tmp_path: Path) -> None:
    message = "bad\x1b]0;owned\x07 request\r\nSet-Cookie: x\x9b31m"
    _Raw.answer = _answer(400, json.dumps({"error": {"message": message}}).encode())
    with pytest.raises(ServerError) as e:
        ServerClient(raw).post("/generate", {})
    assert "HTTP 400: bad" in str(e.value) and not has_control(str(e.value)) and "\n" not in str(e.value)
    r = run_cli("comparator", *_collect_args(raw, tmp_path / "x.jsonl"))
    assert r.returncode == 2 and not has_control(r.stderr) and "HTTP 400: bad" in _one_error_line(r.stderr)


# --------------------------------------------------------------------------- fuzz: whatever a server sends


def _mostly(common: st.SearchStrategy, rare: st.SearchStrategy, one_in: int = 3) -> st.SearchStrategy:
    """``common``, and ``rare`` about once in ``one_in`` draws: most answers should get far into the client."""
    return st.integers(1, one_in).flatmap(lambda i: rare if i == 1 else common)


_TEXT = st.text(st.characters(max_codepoint=0x2FF), max_size=40)  # control characters, CR and LF included
_VALUE = _mostly(st.text(st.characters(max_codepoint=0x2FF, blacklist_characters="\r\n"), max_size=40), _TEXT, 6)
_STATUS = _mostly(
    st.just(200),
    st.sampled_from(
        [
            100,
            101,
            103,
            199,
            201,
            204,
            206,
            299,
            301,
            302,
            304,
            307,
            308,
            400,
            404,
            413,
            418,
            429,
            500,
            502,
            503,
            504,
            599,
            600,
            999,
        ]
    )
    | st.integers(0, 1200),
    2,
)
_BODY = _mostly(
    st.just(GOOD),
    st.one_of(
        st.builds(lambda cut: GOOD[:cut], st.integers(0, len(GOOD))),
        st.builds(lambda m: json.dumps({"error": {"message": m}}).encode(), _TEXT),
        st.builds(lambda m: json.dumps({"detail": [{"msg": m}]}).encode(), _TEXT),
        st.binary(max_size=200),
        st.sampled_from([b"[" * 100_000, b'{"meta_info": NaN}', b"1" * 5000, b"null", b"", b'"\\ud800"']),
    ),
    2,
)


def _is_length(text: str, n: int) -> bool:
    text = text.strip()
    return text.isascii() and text.isdigit() and int(text) == n


@st.composite
def _answers(draw: st.DrawFn) -> tuple[bytes, bool, bool]:
    """(raw answer, hold the connection open, an answer that must not pass)."""
    status, body = draw(_STATUS), draw(_BODY)
    line = draw(
        _mostly(
            st.just(f"HTTP/1.1 {status} OK"),
            st.sampled_from(
                [
                    f"HTTP/1.0 {status}",
                    f"HTTP/2 {status} OK",
                    f"HTTP/1.1 {status} {draw(_TEXT)}",
                    f"{status} OK",
                    "",
                    "HTTP/1.1 2OO OK",
                    f"HTTP/1.1 {status} OK\n",
                ]
            ),
        )
    )
    headers = [
        f"{k}: {v}"
        for k, v in draw(
            st.lists(
                st.tuples(
                    st.sampled_from(["Content-Type", "Location", "X-Junk", "Connection", "Content-Encoding"]), _VALUE
                ),
                max_size=3,
            )
        )
    ]
    clean = not any(c in "\r\n" for c in line + "".join(headers))  # else the text ends a header: no prediction
    framing = draw(
        _mostly(
            st.sampled_from(["length", "chunked"]),
            st.sampled_from(["short", "long", "huge", "bad", "two", "none", "cut-chunked", "gzip-chunked"]),
            2,
        )
    )
    n = len(body)
    must_fail = not 200 <= status < 300 or not line.startswith("HTTP/1.") or f" {status}" not in line
    if framing == "chunked":
        headers.append("Transfer-Encoding: chunked")
        body = _chunked(body, draw(st.integers(1, 64)))
    elif framing == "cut-chunked":
        headers.append("Transfer-Encoding: chunked")
        body, must_fail = _chunked(body, 5, last=False), must_fail or clean
    elif framing == "gzip-chunked":
        headers.append("Transfer-Encoding: gzip, chunked")
        body, must_fail = _chunked(body), must_fail or clean
    elif framing != "none":
        declared = {
            "length": n,
            "short": max(n - draw(st.integers(1, 10)), 0),
            "long": n + draw(st.integers(1, 10)),
            "huge": 1 << draw(st.integers(28, 70)),
            "bad": draw(_VALUE),
            "two": n,
        }[framing]
        headers.append(f"Content-Length: {declared}")
        if framing == "two":
            headers.append(f"Content-Length: {n + 1}")
        must_fail = (
            must_fail
            or clean
            and (framing in ("long", "huge", "two") or framing == "bad" and not _is_length(str(declared), n))
        )
    if draw(st.integers(0, 5)) == 0:
        line = "HTTP/1.1 100 Continue\r\n\r\n" + line
    raw_answer = ("\r\n".join([line, *headers]) + "\r\n\r\n").encode("utf-8", "surrogatepass") + body
    hold = draw(st.integers(0, 9)) == 0  # now and then the server keeps the connection open after answering
    return raw_answer, hold, must_fail


_FUZZ_TIMEOUT = 0.5


@pytest.mark.slow
@given(case=_answers())
@settings(FUZZ, max_examples=250)
def test_fuzz_whatever_the_server_sends(raw: str, case: tuple[bytes, bool, bool]) -> None:
    """Exit 0 or 2, one printable line, bounded memory and time; a 3xx, a cut body or a non-2xx never passes."""
    _Raw.answer, _Raw.hold, must_fail = case
    with tempfile.TemporaryDirectory() as tmp:
        start = time.monotonic()
        o = run_main(
            comparator_main,
            _collect_args(raw, Path(tmp) / "x.jsonl", "--timeout", str(_FUZZ_TIMEOUT), "--retries", "0"),
        )
        wall = time.monotonic() - start
        code = check_outcome(o)
        assert code in (0, 2) and wall < _FUZZ_TIMEOUT + 3, (code, wall)
        assert not (must_fail and code == 0), (case, o.err)
        assert (code == 0) == (Path(tmp) / "x.jsonl").exists()
