"""Fuzz the engine JSON reader: mutated real responses never crash, and dropped data never passes.

Each example takes one real engine response (the SGLang, vLLM and OpenAI fixtures of
``tests/comparator/logprobs/test_engines.py``), mutates one node of its JSON tree (drop it, null it, truncate a
list, change its type, inject NaN/inf/huge/negative numbers) or the line's text itself, writes
it next to the unmutated response and runs ``python -m comparator logprobs`` through
:func:`comparator.cli.main.main`, on either side. Properties:

- the exit code is 0, 1 or 2, never 3 (an internal error), and nothing prints a traceback;
- exit 2 prints exactly one ``error:`` line;
- a mutation that drops, nulls or truncates per-token data (a logprob or token id, or a list
  of them, a required key) never exits 0. Optional fields (texts, ranks, top-k lists as a
  whole, usage) may go: the comparison is then made on what is left.
"""

from __future__ import annotations

import copy
import io
import json
import math
import tempfile
from collections.abc import Callable, Iterator
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from comparator.cli.main import main
from tests.comparator.logprobs import test_engines as engines

Path_ = tuple[Any, ...]


def _vllm_server() -> dict:
    """vLLM's OpenAI server: prompt_logprobs in choices[0], the output OpenAI-style."""
    choice = engines.openai_completion(echo=False)["choices"][0]
    choice["prompt_logprobs"] = [engines.vllm_entry(i, t) for i, t in enumerate(engines.PROMPT_IDS)]
    return {"id": "req-0", "object": "text_completion", "choices": [choice]}


def _chat() -> dict:
    return {
        "id": "req-0",
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "logprobs": {
                    "content": [
                        {"token": " on", "logprob": -0.75, "bytes": [32, 111, 110], "top_logprobs": []},
                        {"token": "</s>", "logprob": -2.5, "bytes": None, "top_logprobs": []},
                    ]
                },
            }
        ],
    }


FIXTURES: dict[str, Callable[[], dict]] = {
    "sglang": engines.sglang_response,
    "sglang-start": lambda: engines.sglang_response(start=2),
    "vllm": engines.vllm_request_output,
    "vllm-server": _vllm_server,
    "openai": engines.openai_completion,
    "openai-text": lambda: engines.openai_completion(ids=False),
    "openai-chat": _chat,
}

# Per-token data: a path under one of these prefixes holds logprobs, token ids or a list of them.
_TOKEN_LISTS: dict[str, tuple[Path_, ...]] = {
    "sglang": (("meta_info", "input_token_logprobs"), ("meta_info", "output_token_logprobs")),
    "vllm": (("prompt_logprobs",), ("prompt_token_ids",), ("outputs",)),
    "openai": (
        ("choices", 0, "logprobs", "token_logprobs"),
        ("choices", 0, "logprobs", "tokens"),
        ("choices", 0, "prompt_token_ids"),
        ("choices", 0, "token_ids"),
        ("choices", 0, "prompt_logprobs"),
        ("choices", 0, "logprobs", "content"),
    ),
}
_TOKEN_LISTS["sglang-start"] = _TOKEN_LISTS["sglang"]
_TOKEN_LISTS["vllm-server"] = (
    ("choices", 0, "prompt_logprobs"),
    ("choices", 0, "prompt_token_ids"),
    ("choices", 0, "token_ids"),
    ("choices", 0, "logprobs", "token_logprobs"),
)
_TOKEN_LISTS["openai-text"] = _TOKEN_LISTS["openai"]
_TOKEN_LISTS["openai-chat"] = _TOKEN_LISTS["openai"]
_DESCRIPTIVE = {
    "text",
    "decoded_token",
    "rank",
    "bytes",
    "top_logprobs",
    "text_offset",
    "index",
    "finish_reason",
    "cumulative_logprob",
    "finished",
}
"""Keys whose values the comparison does not use (in these formats)."""


def _paths(node: Any, path: Path_ = ()) -> Iterator[Path_]:
    yield path
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, (*path, i))


def _get(obj: Any, path: Path_) -> Any:
    for p in path:
        obj = obj[p]
    return obj


def carries_token_data(fmt: str, obj: dict, path: Path_) -> bool:
    """Whether the node at ``path`` is (part of) a logprob, a token id or a list of them."""
    if not path or any(p in _DESCRIPTIVE for p in path if isinstance(p, str)):
        return False
    if fmt.startswith("sglang") and len(path) >= 4 and path[3] == 2:
        return False  # the token text of a [logprob, id, text] triple
    if fmt.startswith("sglang") and path[:3] == ("meta_info", "input_token_logprobs", 0):
        return False  # the first reported position: its logprob is null, its id never compared with one
    if fmt == "vllm-server" and path == ("choices", 0, "prompt_logprobs"):
        return False  # without it the response is a plain completion, which scores only its output
    if fmt.startswith("vllm"):
        # a vLLM logprobs dict entry: only the actual token's entry is token data (the rest is top-k)
        for lists in (("prompt_logprobs",), ("choices", 0, "prompt_logprobs"), ("outputs", 0, "logprobs")):
            n = len(lists)
            if path[:n] == lists and len(path) > n + 1:
                ids = _get(
                    obj,
                    ("choices", 0, "prompt_token_ids")
                    if lists[0] == "choices"
                    else ("prompt_token_ids",)
                    if lists[0] == "prompt_logprobs"
                    else ("outputs", 0, "token_ids"),
                )
                return path[n + 1] == str(ids[path[n]])
    return any(path[: len(p)] == p for p in _TOKEN_LISTS[fmt])


_SCALARS = st.sampled_from(
    [
        None,
        True,
        False,
        0,
        -1,
        -7,
        2**31,
        10**30,
        1.5,
        -0.0,
        math.nan,
        math.inf,
        -math.inf,
        1e308,
        -1e308,
        "",
        "7",
        "-1.0",
        "NaN",
        [],
        {},
        [None],
        {"logprob": None},
    ]
)


def _mutate(obj: dict, path: Path_, how: str, value: Any) -> bool:
    """Mutate ``obj`` in place at ``path``; True when it changed."""
    before = copy.deepcopy(obj)
    parent, key = (_get(obj, path[:-1]), path[-1]) if path else (None, None)
    node = _get(obj, path)
    if how == "drop" and parent is not None:
        del parent[key]
    elif how == "null" and parent is not None:
        parent[key] = None
    elif how == "truncate" and isinstance(node, list) and node:
        del node[len(node) // 2 :]
    elif how == "replace" and parent is not None:
        parent[key] = value
    elif how == "wrap" and parent is not None:
        parent[key] = [node] if not isinstance(node, list) else {"0": node}
    return obj != before or json.dumps(obj) != json.dumps(before)


def _run(a: Path, b: Path) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(["logprobs", str(a), str(b)])
    return code, err.getvalue()


def _check(code: int, err: str) -> None:
    assert code in (0, 1, 2), err
    assert "Traceback" not in err and "internal error" not in err, err
    if code == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), err


_JUNK = st.one_of(
    st.binary(max_size=40), st.text(alphabet='{}[]",:0123456789-+eE.ntrufalsNIiy \\', max_size=40).map(str.encode)
)
"""Junk for a line: random bytes, or text made of JSON's own characters (so it often parses)."""
_SETTINGS = settings(
    max_examples=1500, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow]
)


@pytest.mark.slow
@_SETTINGS
@given(
    data=st.data(),
    fmt=st.sampled_from(sorted(FIXTURES)),
    how=st.sampled_from(["drop", "null", "truncate", "replace", "wrap"]),
    on_target=st.booleans(),
)
def test_mutated_engine_json(data, fmt, how, on_target):
    clean = copy.deepcopy(FIXTURES[fmt]())
    obj = copy.deepcopy(clean)
    path = data.draw(st.sampled_from(list(_paths(obj))), label="path")
    value = data.draw(_SCALARS, label="value") if how == "replace" else None
    essential = carries_token_data(fmt, obj, path)
    if not _mutate(obj, path, how, value):
        return
    with tempfile.TemporaryDirectory() as d:
        good, bad = Path(d, "good.jsonl"), Path(d, "bad.jsonl")
        good.write_text(json.dumps(clean) + "\n")
        bad.write_text(json.dumps(obj) + "\n")  # NaN/Infinity as JSON's extensions, as engines write them
        code, err = _run(good, bad) if on_target else _run(bad, good)
    _check(code, err)
    if how in ("drop", "null", "truncate") and essential:
        assert code != 0, (fmt, how, path)


@pytest.mark.slow
@_SETTINGS
@given(
    fmt=st.sampled_from(sorted(FIXTURES)),
    cut=st.floats(0, 1),
    junk=_JUNK,
    at=st.floats(0, 1),
    mode=st.sampled_from(["truncate", "insert", "replace", "append line"]),
)
def test_garbled_lines(fmt, cut, junk, at, mode):
    line = json.dumps(FIXTURES[fmt]()).encode()
    if mode == "truncate":
        raw = line[: int(len(line) * cut)]
    elif mode == "insert":
        i = int(len(line) * at)
        raw = line[:i] + junk + line[i:]
    elif mode == "replace":
        raw = junk
    else:
        raw = line + b"\n" + junk
    with tempfile.TemporaryDirectory() as d:
        good, bad = Path(d, "good.jsonl"), Path(d, "bad.jsonl")
        good.write_bytes(line + b"\n")
        bad.write_bytes(raw + b"\n")
        code, err = _run(good, bad)
    _check(code, err)
    if mode == "truncate" and raw.strip() != line:
        assert code == 2, err  # a cut JSON text is never valid
