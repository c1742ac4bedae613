"""Capture from a live ``vllm serve``: one real server (driftscope's tap, a spool) for the module, judged against HF.

The server is ``python -m dumper.engines.vllm.serve`` on the shared test checkpoint, compiled (vLLM's
default), started once by a module fixture and its process group killed at the end. The client is
``python -m dumper collect`` in a subprocess; while it runs, a thread sends other traffic to the same
server: requests without a marker and requests marked with other tokens, which must never be in
its dump. Verdicts come from ``python -m comparator`` subprocesses.
"""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from dumper.errors import UsageError
from dumper.format import load_manifest
from tests.comparator.logprobs.test_collect_server import _free_port, _Server
from tests.conftest import run_cli, serve_in_thread
from tests.dumper.engines.test_engine_vllm import need, shared_checkpoint

_rng = np.random.default_rng(11)
PROMPTS = [
    [1] + _rng.integers(3, 300, 299).tolist(),  # 300 tokens: two full KV blocks of 128
    [1] + _rng.integers(3, 300, 23).tolist(),
    [1] + _rng.integers(3, 300, 40).tolist(),
]
FOREIGN = [2] + _rng.integers(300, 500, 30).tolist()  # anyone else's prompt: other tokens
N_LAYERS = 4
LOGPROBS = ("--logprobs", "--top-k", "5")
TAP = json.dumps({"driftscope": {"layers": "all"}})


@dataclass
class Served:
    url: str
    spool: Path
    root: Path
    ckpt: Path
    prompts: Path
    hf: Path


def complete(url: str, model: str, body: dict) -> dict:
    """One ``POST /v1/completions`` of another client (no driftscope in it)."""
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps({"model": model, **body}).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)


@dataclass
class Traffic:
    """Other clients' requests, sent back to back from threads: unmarked ones, and ones marked with other tokens."""

    url: str
    model: str
    stop: threading.Event = field(default_factory=threading.Event)
    sent: dict[str, int] = field(default_factory=lambda: {"unmarked": 0, "marked": 0})
    tokens: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _loop(self, kind: str) -> None:
        try:
            while not self.stop.is_set():
                body = {"prompt": FOREIGN, "max_tokens": 2, "temperature": 0.0}
                if kind == "marked":
                    with self._lock:
                        token = f"foreign-{len(self.tokens)}"
                        self.tokens.append(token)
                    body["vllm_xargs"] = {"driftscope_capture": token, "driftscope_seq": 0, "driftscope_n": 1}
                complete(self.url, self.model, body)
                with self._lock:
                    self.sent[kind] += 1
        except Exception as e:  # noqa: BLE001 - reported by the test
            self.errors.append(repr(e))

    def start(self, threads: int = 3) -> list[threading.Thread]:
        """``threads`` loops (one of marked requests, the others unmarked), already answered at least once each."""
        kinds = ["marked"] + ["unmarked"] * (threads - 1)
        started = [threading.Thread(target=self._loop, args=(k,), daemon=True) for k in kinds]
        for t in started:
            t.start()
        while min(self.sent.values()) < 1 and not self.errors:
            time.sleep(0.05)
        return started


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    """The tapped server recording into its spool, and the HF reference dump made while it starts."""
    need("vllm")
    root = tmp_path_factory.mktemp("served")
    spool = root / "spool"
    spool.mkdir()
    ckpt = shared_checkpoint()
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in PROMPTS))
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
        "--max-model-len",
        "512",
        "--additional-config",
        TAP,
    ]
    with pytest.MonkeyPatch.context() as mp:  # _Server passes this process's environment on
        mp.setenv("DRIFTSCOPE_VLLM_SPOOL", str(spool))
        proc = _Server(cmd, f"http://127.0.0.1:{port}", "/health", root / "serve.log")
    try:
        hf = run_cli(
            "dumper",
            "run",
            "--model",
            ckpt,
            "--prompts",
            prompts,
            "--layers",
            "all",
            *LOGPROBS,
            "--out",
            root / "hf",
            "--quiet",
        )
        assert hf.returncode == 0, hf.stderr
        yield Served(proc.wait(600), spool, root, ckpt, prompts, root / "hf")
    finally:
        proc.stop()


def _collect(served: Served, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return run_cli("dumper", "collect", "--server", served.url, "--spool", served.spool, "--out", out, *args)


@pytest.fixture(scope="module")
def captured(server: Served):
    """``dumper collect --logprobs`` of PROMPTS while other traffic runs: (result, dump, traffic, spool after)."""
    traffic = Traffic(server.url, str(server.ckpt))
    threads = traffic.start()
    out = server.root / "dump"
    # one request at a time: the capture stays open across several engine steps, which the other traffic shares
    r = _collect(
        server, out, "--model", str(server.ckpt), "--prompts", str(server.prompts), *LOGPROBS, "--concurrency", "1"
    )
    during = dict(traffic.sent)
    traffic.stop.set()
    for t in threads:
        t.join(timeout=120)
    assert not traffic.errors, traffic.errors
    assert r.returncode == 0, r.stdout + r.stderr
    return r, out, traffic, during, sorted(p.name for p in server.spool.iterdir())


@pytest.mark.engine
def test_a_served_dump_matches_hf_fp32(server: Served, captured, tmp_path: Path) -> None:
    r, out, *_ = captured
    report = tmp_path / "report.json"
    c = run_cli("comparator", server.hf, out, "--json", report, "--quiet")
    assert c.returncode == 0, c.stdout + c.stderr
    rep = json.loads(report.read_text())
    assert rep["passed"] and rep["matched"] == N_LAYERS * len(PROMPTS) and not rep["unmatched_baseline"]
    lp = rep["logprobs"]
    assert lp["passed"] and lp["compared_positions"] == sum(len(p) - 1 for p in PROMPTS), lp
    assert f"{len(PROMPTS)} prompts ({sum(map(len, PROMPTS))} positions) from {server.url}" in r.stdout


@pytest.mark.engine
def test_other_clients_requests_are_never_in_the_dump(server: Served, captured) -> None:
    _, out, traffic, during, spool_after = captured
    assert during["unmarked"] >= 4 and during["marked"] >= 2, during  # both kinds ran while the client did
    m = load_manifest(out)
    hidden = [t for t in m.tensors if t.point == "input"]
    assert sorted({t.layer for t in hidden}) == list(range(N_LAYERS))
    for layer in range(N_LAYERS):
        recs = [t for t in hidden if t.layer == layer]
        seqs = np.concatenate([t.row_sequence_ids() for t in recs])
        pos = np.concatenate([t.row_positions() for t in recs])
        assert sum(t.shape[0] for t in recs) == sum(map(len, PROMPTS))  # not one row of anyone else's
        assert sorted(set(seqs.tolist())) == list(range(len(PROMPTS)))
        for s, prompt in enumerate(PROMPTS):
            assert sorted(pos[seqs == s].tolist()) == list(range(len(prompt)))
    assert m.extra["input_ids"] == PROMPTS
    # the other token's requests were recorded, into their own directories; this client's is gone
    assert {p for p in spool_after} <= set(traffic.tokens) and spool_after
    assert all((server.spool / t / "index-r0.json").is_file() for t in spool_after[:3])


@pytest.mark.engine
def test_the_manifest_says_where_the_dump_came_from(server: Served, captured) -> None:
    _, out, *_ = captured
    m, hf = load_manifest(out), load_manifest(server.hf)
    assert m.extra["server"] == server.url and m.extra["served_model"] == str(server.ckpt)
    engine = m.extra["engine"]
    assert engine["name"] == "vllm" and engine["settings"]["compiled"] and engine["settings"]["dtype"] == "float32"
    assert m.environment["engine"] == "vllm" and m.environment["engine_prefix_caching"] is True
    assert m.model["config_hash"] == hf.model["config_hash"] and m.model["architecture"] == hf.model["architecture"]
    assert m.extra["prefix_cache_hits"] == [0] * len(PROMPTS) and m.extra["missing_positions"] == [0] * len(PROMPTS)
    assert "note" not in m.extra


@pytest.mark.engine
def test_without_logprobs_prefix_cache_hits_are_said(server: Served, captured, tmp_path: Path) -> None:
    """The server read the long prompt's full blocks from its cache (computed for earlier requests): the dump
    lacks those positions, and its manifest and the output line say so."""
    block = load_manifest(captured[1]).extra["engine"]["settings"]["block_size"]
    assert len(PROMPTS[0]) > block > len(PROMPTS[1])
    complete(server.url, str(server.ckpt), {"prompt": PROMPTS[0], "max_tokens": 1})  # anyone's, computed in full
    out = tmp_path / "dump"
    r = _collect(
        server, out, "--input-ids", ",".join(map(str, PROMPTS[0])), "--input-ids", ",".join(map(str, PROMPTS[1]))
    )
    assert r.returncode == 0, r.stderr
    m = load_manifest(out)
    cached = (len(PROMPTS[0]) - 1) // block * block
    assert m.extra["prefix_cache_hits"] == [cached, 0] and m.extra["missing_positions"] == [cached, 0]
    assert (
        "prefix cache" in m.extra["note"] and "prefix cache" in r.stdout and f"{cached} leading positions" in r.stdout
    )
    recs = [t for t in m.tensors if t.point == "input" and t.layer == 0]
    seqs = np.concatenate([t.row_sequence_ids() for t in recs])
    pos = np.concatenate([t.row_positions() for t in recs])
    assert sorted(pos[seqs == 0].tolist()) == list(range(cached, len(PROMPTS[0])))
    assert sorted(pos[seqs == 1].tolist()) == list(range(len(PROMPTS[1])))


@pytest.mark.engine
def test_a_server_that_records_into_another_spool_is_one_line_and_exit_2(
    server: Served, captured, tmp_path: Path
) -> None:
    """The parts never appear where the client looks (as with a server started without the tap or the spool)."""
    empty = tmp_path / "empty-spool"
    empty.mkdir()
    start = time.monotonic()
    r = run_cli(
        "dumper",
        "collect",
        "--server",
        server.url,
        "--spool",
        empty,
        "--input-ids",
        "1,5,9",
        "--out",
        tmp_path / "dump",
        "--part-timeout",
        "2",
    )
    assert r.returncode == 2 and time.monotonic() - start < 30, r.stderr
    line = r.stderr.strip()
    assert "\n" not in line and "no capture part" in line, line
    assert f"DRIFTSCOPE_VLLM_SPOOL={empty}" in line and "--additional-config" in line
    assert not (tmp_path / "dump" / "manifest.json").exists() and not list(empty.iterdir())


# --------------------------------------------------------------------------- no vLLM needed


class _NotVllm(http.server.BaseHTTPRequestHandler):
    """An OpenAI-style server that is not vLLM: it has no /version."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(404)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"detail": "Not Found"}')

    def log_message(self, *args) -> None:
        pass


@pytest.mark.slow
def test_unusable_servers_and_spools_are_one_line_and_exit_2(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{_free_port()}"
    with serve_in_thread(_NotVllm) as other:
        cases = {
            "not a directory": (dead, tmp_path / "missing"),
            "connection refused": (dead, tmp_path),
            "not a vLLM server": (other, tmp_path),
        }
        for says, (url, spool) in cases.items():
            r = run_cli(
                "dumper",
                "collect",
                "--server",
                url,
                "--spool",
                spool,
                "--input-ids",
                "1,5,9",
                "--out",
                tmp_path / "dump",
                "--retries",
                "0",
            )
            assert r.returncode == 2 and says in r.stderr and r.stderr.count("\n") == 1, (says, r.stderr)
    assert not (tmp_path / "dump").exists()


def test_text_prompts_are_tokenized_as_dumper_run_tokenizes_them(tmp_path: Path) -> None:
    """Texts first, then ids, by the checkpoint's HF tokenizer: the sequences an HF dump of them numbers; no
    checkpoint, no text."""
    from dumper.engines.base import job_sequences
    from dumper.jobs.collect import CollectConfig, served_sequences
    from dumper.prefill.run import RunConfig

    ckpt, texts, ids = shared_checkpoint(), ("The quick brown fox", "def fib(n):"), ((1, 5, 9),)
    cfg = CollectConfig(
        server="http://127.0.0.1:1", spool=str(tmp_path), out=str(tmp_path / "d"), prompts=texts, input_ids=ids
    )
    run = RunConfig(out=str(tmp_path / "d"), model=str(ckpt), prompts=texts, input_ids=ids)
    assert served_sequences(cfg, ckpt, 512) == job_sequences(run, ckpt, 512)
    with pytest.raises(UsageError, match="--model CKPT"):
        served_sequences(cfg, None, None)
    with pytest.raises(UsageError, match="outside the vocabulary"):
        served_sequences(CollectConfig(server="x", spool="x", out="x", input_ids=((1, 600),)), None, 512)


@pytest.mark.engine
def test_a_served_decode_matches_an_hf_prefill_of_the_same_tokens(server: Served, captured, tmp_path: Path) -> None:
    """``collect --new-tokens``: the server decodes the marked requests (max_tokens > 1, several at once), records
    every decode step they feed, and sends each generated token's logprob; all of it matches HF's prefill."""
    new = 5
    r = _collect(
        server,
        tmp_path / "decode",
        "--model",
        str(server.ckpt),
        "--prompts",
        str(server.prompts),
        *LOGPROBS,
        "--new-tokens",
        str(new),
        "--quiet",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    m = load_manifest(tmp_path / "decode")
    assert m.extra["job"] == "decode" and [len(g) for g in m.extra["generated_ids"]] == [new] * len(PROMPTS)
    hf = run_cli(
        "dumper",
        "run",
        "--model",
        server.ckpt,
        "--tokens-from",
        tmp_path / "decode",
        "--layers",
        "all",
        *LOGPROBS,
        "--out",
        tmp_path / "hf",
        "--quiet",
    )
    assert hf.returncode == 0, hf.stderr
    c = run_cli("comparator", tmp_path / "hf", tmp_path / "decode", "--json", tmp_path / "r.json", "--quiet")
    assert c.returncode == 0, c.stdout + c.stderr
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["decode"]["steps"] == len(PROMPTS) * (new - 1) and not rep["decode"]["missing"]
    assert rep["logprobs"]["compared_positions"] == sum(len(p) - 1 + new for p in PROMPTS)
