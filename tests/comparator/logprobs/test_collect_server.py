"""The live-server client against real servers on 127.0.0.1, started and stopped here.

One ``vllm serve`` (through ``python -m dumper.engines.vllm.serve``) and one llama-cpp-python
OpenAI-compatible server serve the tiny checkpoint for the whole module; a stdlib HTTP server
in a thread plays the servers that answer wrongly (no logprobs, HTML, 503).
"""

from __future__ import annotations

import http.server
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest

from tests.conftest import ROOT, run_cli, serve_in_thread, subprocess_env
from tests.engine_models import build_checkpoint, engine_missing, to_gguf

IDS = ("1,20,30,40,50,60,70,80", "1,5,9,13,17")
TEXT = "The quick brown fox jumps over the lazy dog."


def need(why: str | None) -> None:
    """Skip for ``why`` on a developer machine; in CI a missing engine fails."""
    if why:
        pytest.fail(why) if os.environ.get("CI") == "true" else pytest.skip(why)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


class _Server:
    """A server process in its own group (vLLM runs its engine in a child): started at once, waited
    for on first use, and the whole group killed at the end."""

    def __init__(self, cmd: list[str], base: str, ready: str, log: Path) -> None:
        self.cmd, self.base, self.ready, self.log = cmd, base, ready, log
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT, env=subprocess_env()
            )

    def wait(self, deadline_s: float) -> str:
        """The base URL, once ``base + ready`` answers 200; the log's tail in the failure otherwise."""
        end = time.monotonic() + deadline_s
        while not _answers(self.base + self.ready):
            if self.proc.poll() is not None or time.monotonic() > end:
                how = (
                    f"exit {self.proc.returncode}" if self.proc.poll() is not None else f"no answer in {deadline_s:g} s"
                )
                pytest.fail(
                    f"{' '.join(self.cmd[1:3])} did not come up ({how}):\n"
                    f"{self.log.read_text(errors='replace')[-3000:]}"
                )
            time.sleep(0.5)
        return self.base

    def stop(self) -> None:
        for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
                self.proc.wait(timeout=wait)
                return
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")


@pytest.fixture(scope="module")
def vllm_server(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Server]:
    need(engine_missing("vllm"))
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "dumper.engines.vllm.serve",
        str(ckpt),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        "512",
        "--distributed-executor-backend",
        "uni",
    ]
    server = _Server(cmd, f"http://127.0.0.1:{port}", "/health", tmp_path_factory.mktemp("vllm") / "serve.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def hf_dump(vllm_server: _Server, ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The HF fp32 reference of IDS, made while the vLLM server starts (hence the dependency)."""
    out = tmp_path_factory.mktemp("hf") / "dump"
    r = run_cli(
        "dumper",
        "run",
        "--model",
        ckpt,
        "--logprobs",
        "--top-k",
        "5",
        "--input-ids",
        IDS[0],
        "--input-ids",
        IDS[1],
        "--out",
        out,
        "--quiet",
    )
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture(scope="module")
def vllm_url(vllm_server: _Server) -> str:
    return vllm_server.wait(600)


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _logprobs(base: Path, target: Path, tmp: Path) -> tuple[int, dict]:
    report = tmp / f"{target.stem}.verdict.json"
    r = run_cli("comparator", "logprobs", base, target, "--quiet", "--json", report)
    assert r.returncode in (0, 1), r.stderr
    return r.returncode, json.loads(report.read_text())


@pytest.mark.engine
def test_vllm_collect_round_trips_against_an_hf_dump(hf_dump: Path, vllm_url: str, tmp_path: Path) -> None:
    out = tmp_path / "vllm.jsonl"
    r = run_cli(
        "comparator",
        "collect",
        "--server",
        vllm_url,
        "--api",
        "vllm",
        "--input-ids",
        IDS[0],
        "--input-ids",
        IDS[1],
        "--top-k",
        "5",
        "--out",
        out,
    )
    assert r.returncode == 0, r.stderr
    assert "2 requests, 13 prompt positions" in r.stdout
    lines = _lines(out)
    assert [x["request_id"] for x in lines] == ["0", "1"]
    assert [x["choices"][0]["prompt_token_ids"] for x in lines] == [[int(t) for t in s.split(",")] for s in IDS]

    rc, verdict = _logprobs(hf_dump, out, tmp_path)
    assert rc == 0, verdict
    assert verdict["compared_positions"] == 11 and verdict["max_abs_err"]["value"] < 1e-4

    entry = lines[1]["choices"][0]["prompt_logprobs"][3]  # request 1, position 3: token 13
    entry["13"]["logprob"] -= 0.5
    bad = tmp_path / "perturbed.jsonl"
    bad.write_text("".join(json.dumps(x) + "\n" for x in lines))
    rc, verdict = _logprobs(out, bad, tmp_path)
    assert rc == 1
    assert verdict["max_abs_err"]["sample"] == "1" and verdict["max_abs_err"]["position"] == 3
    assert abs(verdict["max_abs_err"]["value"] - 0.5) < 1e-9


@pytest.mark.engine
def test_openai_api_against_vllm_scores_the_prompt_only(hf_dump: Path, vllm_url: str, tmp_path: Path) -> None:
    out = tmp_path / "openai.jsonl"
    r = run_cli(
        "comparator",
        "collect",
        "--server",
        f"{vllm_url}/v1",
        "--api",
        "openai",
        "--input-ids",
        IDS[0],
        "--input-ids",
        IDS[1],
        "--top-k",
        "2",
        "--out",
        out,
    )
    assert r.returncode == 0, r.stderr
    for line, ids in zip(_lines(out), IDS, strict=True):
        ch = line["choices"][0]
        n = len(ids.split(","))
        assert ch["prompt_token_ids"] == [int(t) for t in ids.split(",")]
        assert len(ch["logprobs"]["token_logprobs"]) == n  # the generated token is cut
        assert "prompt_logprobs" not in ch
    rc, verdict = _logprobs(hf_dump, out, tmp_path)
    assert rc == 0 and verdict["max_abs_err"]["value"] < 1e-4, verdict


@pytest.mark.engine
def test_selfcheck_over_http_passes_on_fp32(vllm_url: str, ckpt: Path, tmp_path: Path) -> None:
    report = tmp_path / "selfcheck.json"
    r = run_cli(
        "dumper",
        "selfcheck",
        "--server",
        vllm_url,
        "--api",
        "vllm",
        "--input-ids",
        IDS[1],
        "--new-tokens",
        "6",
        "--json",
        report,
    )
    assert r.returncode == 0, r.stderr
    run = json.loads(report.read_text())["runs"][0]
    assert run["passed"] and len(run["k3"]) == 6 and run["positions"] == [5, 6, 7, 8, 9, 10]
    assert run["k3_mean"] <= 1e-3

    # the decode logprobs are the model's: HF's prefill of prompt + output gives them too
    full = [int(t) for t in IDS[1].split(",")] + run["output_ids"]
    hf = tmp_path / "hf_full"
    from comparator.logprobs.sources import read_logprob_source
    from dumper.cli.main import main

    assert (
        main(
            [
                "run",
                "--model",
                str(ckpt),
                "--logprobs",
                "--input-ids",
                ",".join(map(str, full)),
                "--out",
                str(hf),
                "--quiet",
            ]
        )
        == 0
    )

    ref = read_logprob_source(hf).sequences[0].logprobs[-6:]
    assert max(abs(a - b) for a, b in zip(ref, run["decode_logprobs"], strict=True)) < 1e-4


@pytest.mark.engine
def test_vllm_refusal_is_one_line_with_the_servers_message(vllm_url: str, tmp_path: Path) -> None:
    r = run_cli(
        "comparator",
        "collect",
        "--server",
        vllm_url,
        "--api",
        "vllm",
        "--input-ids",
        IDS[1],
        "--top-k",
        "1000",
        "--out",
        tmp_path / "x.jsonl",
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "HTTP 400" in r.stderr and "logprobs" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "x.jsonl").exists()


def test_a_server_that_is_down_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dumper.cli.main import main

    url = f"http://127.0.0.1:{_free_port()}"
    r = run_cli(
        "comparator",
        "collect",
        "--out",
        tmp_path / "x.jsonl",
        "--server",
        url,
        "--api",
        "vllm",
        "--input-ids",
        "1,2,3",
        "--retries",
        "1",
    )
    rc = main(["selfcheck", "--server", url, "--api", "sglang", "--input-ids", "1,2,3", "--retries", "0"])
    err = capsys.readouterr().err
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert f"{url}/v1/models: connection refused" in r.stderr and "after 2 tries" in r.stderr
    assert rc == 2 and err.count("\n") == 1 and f"{url}/flush_cache: connection refused" in err, err


# --------------------------------------------------------------------------- servers that answer wrongly


class _Stub(http.server.BaseHTTPRequestHandler):
    """``/nolp/...``: completions without logprobs; ``/html/...``: an HTML page; ``/busy/...``: 503;
    ``/slow/...``: no answer for 2 s."""

    hits: ClassVar[dict[str, int]] = {}

    def log_message(self, *args: object) -> None:  # keep pytest's output clean
        pass

    def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
        try:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (the /slow case)
            pass

    def _answer(self) -> None:
        prefix = self.path.split("/")[1]
        _Stub.hits[prefix] = _Stub.hits.get(prefix, 0) + 1
        if prefix == "slow":
            time.sleep(2)
        if prefix == "busy":
            return self._send(503, b'{"error": {"message": "overloaded"}}')
        if prefix == "html":
            return self._send(200, b"<html><body>a proxy login page</body></html>", "text/html")
        if self.path.endswith("/v1/models"):
            return self._send(200, json.dumps({"data": [{"id": "stub"}]}).encode())
        if self.path.endswith("/generate"):
            return self._send(200, json.dumps({"text": "hi", "meta_info": {"id": "x", "prompt_tokens": 3}}).encode())
        body = {
            "id": "cmpl-1",
            "choices": [{"index": 0, "text": "hi", "logprobs": None, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1},
        }
        return self._send(200, json.dumps(body).encode())

    def do_GET(self) -> None:  # http.server's naming
        self._answer()

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._answer()


@pytest.fixture(scope="module")
def stub_url() -> Iterator[str]:
    with serve_in_thread(_Stub) as url:
        yield url


def _collect(capsys: pytest.CaptureFixture[str], url: str, api: str, out: Path, *extra: str) -> tuple[int, str]:
    from comparator.cli.main import main

    rc = main(["collect", "--server", url, "--api", api, "--input-ids", "1,2,3", "--out", str(out), *extra])
    return rc, capsys.readouterr().err


@pytest.mark.parametrize(
    ("api", "says"), [("vllm", "no prompt logprobs"), ("openai", "no logprobs"), ("sglang", "no prompt logprobs")]
)
def test_a_server_without_logprobs_is_refused(
    stub_url: str, api: str, says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, err = _collect(capsys, f"{stub_url}/nolp", api, tmp_path / "x.jsonl")
    assert rc == 2 and err.count("\n") == 1 and says in err and f"{stub_url}/nolp/" in err, err
    assert not (tmp_path / "x.jsonl").exists()


def test_html_busy_and_slow_servers(stub_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = _collect(capsys, f"{stub_url}/html", "vllm", tmp_path / "x.jsonl", "--model", "m")
    assert rc == 2 and "not JSON" in err and "text/html" in err, err
    before = _Stub.hits.get("busy", 0)
    rc, err = _collect(capsys, f"{stub_url}/busy", "sglang", tmp_path / "x.jsonl", "--retries", "2")
    assert rc == 2 and "HTTP 503: overloaded (after 3 tries" in err, err
    assert _Stub.hits["busy"] - before == 3
    rc, err = _collect(capsys, f"{stub_url}/slow", "vllm", tmp_path / "x.jsonl", "--timeout", "0.3", "--retries", "0")
    assert rc == 2 and "/slow/v1/models: no complete answer within 0.3 s (after 1 try" in err, err


# --------------------------------------------------------------------------- llama-cpp-python's server


def _llama_server_missing() -> str | None:
    why = engine_missing("llama.cpp")
    if why:
        return why
    extras = [
        m
        for m in ("starlette_context", "pydantic_settings", "sse_starlette", "uvicorn", "fastapi")
        if importlib.util.find_spec(m) is None
    ]
    return f"llama_cpp.server needs {', '.join(extras)} (pip install 'llama-cpp-python[server]')" if extras else None


@pytest.fixture(scope="module")
def llama_url(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    need(_llama_server_missing())
    tmp = tmp_path_factory.mktemp("llama")
    gguf = to_gguf(ckpt, tmp / "tiny-f32.gguf", "f32")
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "llama_cpp.server",
        "--model",
        str(gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--n_ctx",
        "512",
        "--type_k",
        "0",
        "--type_v",
        "0",
    ]
    server = _Server(cmd, f"http://127.0.0.1:{port}", "/v1/models", tmp / "serve.log")
    yield server.wait(120)
    server.stop()


@pytest.mark.engine
def test_llama_cpp_server_prompt_logprobs(llama_url: str, vllm_url: str, tmp_path: Path) -> None:
    from comparator.cli.main import main
    from comparator.logprobs.sources.engine_json import read_logprobs_jsonl

    outs = {}
    for name, url in (("llama", llama_url), ("vllm", vllm_url)):
        outs[name] = tmp_path / f"{name}.jsonl"
        assert (
            main(
                [
                    "collect",
                    "--server",
                    url,
                    "--api",
                    "openai",
                    "--prompt",
                    TEXT,
                    "--top-k",
                    "2",
                    "--out",
                    str(outs[name]),
                    "--quiet",
                ]
            )
            == 0
        )
    llama, vllm = (read_logprobs_jsonl(outs[n])[0] for n in ("llama", "vllm"))
    # llama-cpp-python echoes the prompt without its BOS and gives no logprob for the token after it
    assert llama.token_texts == vllm.token_texts[1:] and llama.logprobs[0] is None
    diffs = [abs(a - b) for a, b in zip(llama.logprobs[1:], vllm.logprobs[2:], strict=True)]
    assert len(diffs) >= 8 and max(diffs) < 1e-4

    copy = tmp_path / "llama-copy.jsonl"
    shutil.copy(outs["llama"], copy)
    assert _logprobs(outs["llama"], copy, tmp_path)[0] == 0
    line = _lines(outs["llama"])[0]
    line["choices"][0]["logprobs"]["token_logprobs"][4] += 0.25
    copy.write_text(json.dumps(line) + "\n")
    rc, verdict = _logprobs(outs["llama"], copy, tmp_path)
    assert rc == 1 and verdict["max_abs_err"]["position"] == 4


@pytest.mark.engine
def test_llama_cpp_server_takes_no_token_ids(llama_url: str, tmp_path: Path) -> None:
    r = run_cli(
        "comparator",
        "collect",
        "--server",
        llama_url,
        "--api",
        "openai",
        "--input-ids",
        IDS[1],
        "--retries",
        "0",
        "--out",
        tmp_path / "x.jsonl",
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "valid string" in r.stderr  # the server's own validation message
