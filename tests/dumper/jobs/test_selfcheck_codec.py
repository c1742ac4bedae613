"""``SelfCheckResult`` and ``ServerSelfCheck`` read back what they wrote, from real tiny-llama self-checks.

Local: every mode on a healthy tiny-llama, and one whose final norm outputs NaN at one decode
step (a NaN logprob: k3 NaN, written ``null``, read back infinite, so it still fails). Server: an
SGLang-style ``/generate`` + ``/flush_cache`` server on 127.0.0.1, in a thread, that answers
from a real tiny-llama (greedy decode with its KV cache, and a fresh prefill); once healthy, once
reporting ``-inf`` for one decoded token (k3 infinite, ``null`` in JSON). The server's results
also come back through ``python -m dumper selfcheck --server ... --json``.
"""

from __future__ import annotations

import http.server
import json
import math
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
import torch

from dumper.jobs.selfcheck import MODES, SelfCheckResult, greedy_decode, selfcheck
from dumper.jobs.server_selfcheck import ServerSelfCheck, server_selfcheck
from dumper.prefill.logprobs import input_token_logprobs
from dumper.server.api import Prompt
from dumper.server.client import ServerClient
from tests.conftest import run_cli, serve_in_thread, tiny_llama

PROMPT = "The quick brown fox jumps over the lazy dog."
IDS = (1, 20, 30, 40, 50, 60, 70)
BAD_STEP = 2
"""The decode step the broken model (NaN) and the broken server (-inf) get wrong."""


@pytest.fixture(scope="module")
def model_tok():
    return tiny_llama()


@pytest.fixture(scope="module")
def local(model_tok) -> dict[str, SelfCheckResult]:
    model, tok = model_tok
    ids = tok.encode(PROMPT)
    out = {mode: selfcheck(model, ids, new_tokens=6, mode=mode) for mode in MODES}
    steps: list[int] = []

    def nan_at_one_decode_step(_mod: torch.nn.Module, _args: object, output: torch.Tensor) -> torch.Tensor:
        if output.shape[1] == 1:  # one new token: a decode step, never the prefill
            steps.append(1)
            if len(steps) == BAD_STEP:
                return torch.full_like(output, math.nan)
        return output

    handle = model.model.norm.register_forward_hook(nan_at_one_decode_step)
    try:
        out["nan"] = selfcheck(model, ids, new_tokens=6, mode="no-cache")
    finally:
        handle.remove()
    return out


def _same(a: Any, b: Any) -> bool:
    """Equal, with NaN equal to NaN, inside tuples too."""
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("which", [*MODES, "nan"])
def test_selfcheck_result_round_trips(local: dict[str, SelfCheckResult], which: str) -> None:
    r = local[which]
    d = r.to_json()
    back = SelfCheckResult.from_json(json.loads(json.dumps(d)))
    assert back.to_json().keys() == d.keys() and json.dumps(back.to_json()) == json.dumps(d)
    for name, value in vars(r).items():
        if name in ("k3_mean", "k3_max", "max_abs_err") and math.isnan(value):
            value = math.inf  # null reads back as infinity, the value that never passes
        assert _same(getattr(back, name), value), name
    if which != "nan":
        assert back == r and back.passed


def test_the_nan_case_is_exercised(local: dict[str, SelfCheckResult]) -> None:
    r = local["nan"]
    assert math.isnan(r.decode_logprobs[BAD_STEP]) and math.isnan(r.k3_mean) and not r.passed
    assert r.to_json()["k3_mean"] is None
    back = SelfCheckResult.from_json(json.loads(json.dumps(r.to_json())))
    assert back.k3_mean == math.inf and not back.passed


class _SGLang(http.server.BaseHTTPRequestHandler):
    """SGLang's ``/generate`` (greedy, with logprobs) and ``/flush_cache``, answered by a real model."""

    model: ClassVar[torch.nn.Module]
    broken: ClassVar[bool] = False
    """Report ``-inf`` for decoded token ``BAD_STEP`` (a server that masks a token after choosing it)."""

    def log_message(self, *args: object) -> None:  # keep pytest's output clean
        pass

    def _send(self, obj: Any) -> None:
        body = json.dumps(obj).encode()  # -inf as -Infinity, which Python's json (the client's) reads
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:  # http.server's naming
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path == "/flush_cache":
            self._send("Cache flushed.")
            return
        req = json.loads(body)
        ids = torch.tensor([req["input_ids"]])
        n = req["sampling_params"]["max_new_tokens"]
        with torch.inference_mode():
            prompt = input_token_logprobs(self.model(input_ids=ids, use_cache=False).logits[0], ids[0])
            out, lps, _ = greedy_decode(self.model, ids, n) if n else ([], [], None)
        if self.broken and n > BAD_STEP:
            lps[BAD_STEP] = -math.inf
        self._send(
            {
                "meta_info": {
                    "id": req["rid"],
                    "prompt_tokens": ids.shape[1],
                    "input_token_logprobs": [
                        [lp, t, None] for lp, t in zip(prompt.logprobs, prompt.token_ids, strict=True)
                    ],
                    "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, out, strict=True)],
                }
            }
        )


@pytest.fixture(scope="module")
def server(model_tok) -> Iterator[str]:
    _SGLang.model = model_tok[0]
    with serve_in_thread(_SGLang) as url:
        yield url
    _SGLang.broken = False


@pytest.fixture(scope="module")
def remote(server: str) -> dict[str, ServerSelfCheck]:
    client = ServerClient(server, retries=0)
    out = {"healthy": server_selfcheck(client, "sglang", Prompt("0", ids=IDS), new_tokens=5)}
    _SGLang.broken = True
    try:
        out["broken"] = server_selfcheck(client, "sglang", Prompt("0", ids=IDS), new_tokens=5)
    finally:
        _SGLang.broken = False
    return out


@pytest.mark.parametrize("which", ["healthy", "broken"])
def test_server_selfcheck_round_trips(remote: dict[str, ServerSelfCheck], which: str) -> None:
    r = remote[which]
    back = ServerSelfCheck.from_json(json.loads(json.dumps(r.to_json())))
    assert back == r and back.to_json() == r.to_json() and back.output_texts is None


def test_the_infinite_case_is_exercised(remote: dict[str, ServerSelfCheck]) -> None:
    healthy, broken = remote["healthy"], remote["broken"]
    assert healthy.passed and healthy.positions == tuple(range(len(IDS), len(IDS) + 5))
    assert broken.decode_logprobs[BAD_STEP] == -math.inf and broken.k3[BAD_STEP] == math.inf and not broken.passed
    d = broken.to_json()
    assert d["k3"][BAD_STEP] is None and d["k3_mean"] is None and d["k3_max_position"] == len(IDS) + BAD_STEP


def test_the_clis_json_reads_back_as_the_librarys_result(
    server: str, remote: dict[str, ServerSelfCheck], tmp_path
) -> None:
    report = tmp_path / "selfcheck.json"
    r = run_cli(
        "dumper",
        "selfcheck",
        "--server",
        server,
        "--api",
        "sglang",
        "--input-ids",
        ",".join(map(str, IDS)),
        "--new-tokens",
        "5",
        "--json",
        report,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert ServerSelfCheck.from_json(json.loads(report.read_text())["runs"][0]) == remote["healthy"]
