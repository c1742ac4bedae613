"""Engine output readers: SGLang /generate, vLLM prompt_logprobs, OpenAI completions -> SequenceLogprobs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from comparator.judging.logprob_thresholds import LogprobThresholds
from comparator.logprobs import UNKNOWN_TOKEN, SequenceLogprobs, align_samples, compare_logprobs
from comparator.logprobs.sources.engine_formats import detect_format
from comparator.logprobs.sources.engine_json import parse_record, read_logprobs_jsonl
from dumper.errors import NotComparableError, UsageError

# One request described by every engine: prompt "<s> The cat sat", output " on</s>".
PROMPT_IDS = [1, 415, 5255, 3290]
PROMPT_TXT = ["<s>", " The", " cat", " sat"]
OUTPUT_IDS = [356, 2]
OUTPUT_TXT = [" on", "</s>"]
LOGPROBS = [None, -7.25, -5.5, -3.125, -0.75, -2.5]
# top-2 of the distribution predicting each position (the actual token is always among them here)
TOP2 = [
    None,
    [(415, -7.25), (13, -1.5)],
    [(5255, -5.5), (2, -0.375)],
    [(3290, -3.125), (338, -1.25)],
    [(356, -0.75), (297, -1.875)],
    [(2, -2.5), (29889, -0.25)],
]
TEXT = {
    1: "<s>",
    415: " The",
    5255: " cat",
    3290: " sat",
    356: " on",
    2: "</s>",
    13: "\n",
    338: " is",
    297: " in",
    29889: ".",
}


def expected(rid: str = "req-0", with_top: bool = True) -> SequenceLogprobs:
    top = tuple(None if t is None else tuple(sorted(t, key=lambda e: -e[1])) for t in TOP2) if with_top else None
    return SequenceLogprobs(rid, tuple(PROMPT_IDS + OUTPUT_IDS), tuple(LOGPROBS), top)


def sglang_response(rid: str = "req-0", start: int = 0) -> dict:
    """SGLang /generate with return_logprob, top_logprobs_num=2, logprob_start_len=start."""

    def triple(lp, t):
        return [lp, t, TEXT[t]]

    def top(i):
        if TOP2[i] is None or i == start:
            return None
        return sorted([triple(lp, t) for t, lp in TOP2[i]], key=lambda e: -e[0])

    n = len(PROMPT_IDS)
    return {
        "text": "".join(OUTPUT_TXT),
        "output_ids": OUTPUT_IDS,
        "meta_info": {
            "id": rid,
            "finish_reason": {"type": "length", "length": 2},
            "prompt_tokens": n,
            "completion_tokens": 2,
            "cached_tokens": 0,
            "e2e_latency": 0.031,
            "input_token_logprobs": [
                triple(None if i == start else LOGPROBS[i], PROMPT_IDS[i]) for i in range(start, n)
            ],
            "output_token_logprobs": [triple(LOGPROBS[n + j], t) for j, t in enumerate(OUTPUT_IDS)],
            "input_top_logprobs": [top(i) for i in range(start, n)],
            "output_top_logprobs": [top(n + j) for j in range(len(OUTPUT_IDS))],
        },
    }


def vllm_entry(i: int, token: int) -> dict | None:
    if TOP2[i] is None:
        return None
    ranked = sorted(TOP2[i], key=lambda e: -e[1])
    return {str(t): {"logprob": lp, "rank": r + 1, "decoded_token": TEXT[t]} for r, (t, lp) in enumerate(ranked)}


def vllm_request_output(rid: str = "req-0") -> dict:
    """vLLM offline RequestOutput (SamplingParams(prompt_logprobs=2, logprobs=2)) as JSON."""
    n = len(PROMPT_IDS)
    return {
        "request_id": rid,
        "prompt": "".join(PROMPT_TXT),
        "prompt_token_ids": PROMPT_IDS,
        "prompt_logprobs": [vllm_entry(i, t) for i, t in enumerate(PROMPT_IDS)],
        "outputs": [
            {
                "index": 0,
                "text": "".join(OUTPUT_TXT),
                "token_ids": OUTPUT_IDS,
                "cumulative_logprob": -3.25,
                "logprobs": [vllm_entry(n + j, t) for j, t in enumerate(OUTPUT_IDS)],
                "finish_reason": "length",
            }
        ],
        "finished": True,
    }


def openai_completion(rid: str = "req-0", *, ids: bool = True, echo: bool = True) -> dict:
    """OpenAI /v1/completions with echo=True, logprobs=2 (vLLM adds token ids with return_token_ids)."""
    toks = PROMPT_IDS + OUTPUT_IDS if echo else OUTPUT_IDS
    first = 0 if echo else len(PROMPT_IDS)
    choice = {
        "index": 0,
        "text": "".join(PROMPT_TXT + OUTPUT_TXT),
        "logprobs": {
            "tokens": [TEXT[t] for t in toks],
            "token_logprobs": LOGPROBS[first:],
            "top_logprobs": [
                None if TOP2[first + i] is None else {TEXT[t]: lp for t, lp in TOP2[first + i]}
                for i in range(len(toks))
            ],
            "text_offset": list(range(len(toks))),
        },
        "finish_reason": "length",
    }
    if ids:
        choice["prompt_token_ids"] = PROMPT_IDS
        choice["token_ids"] = OUTPUT_IDS
    return {
        "id": rid,
        "object": "text_completion",
        "created": 1718000000,
        "model": "m",
        "choices": [choice],
        "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6},
    }


def write_jsonl(path: Path, *objs, raw: list[str] | None = None) -> Path:
    lines = [json.dumps(o) for o in objs] + (raw or [])
    path.write_text("\n".join(lines) + "\n")
    return path


# --------------------------------------------------------------------------- the same tokens, three engines


def test_sglang_vllm_openai_parse_to_the_same_sequence(tmp_path):
    sg = read_logprobs_jsonl(write_jsonl(tmp_path / "sglang.jsonl", sglang_response()))
    vl = read_logprobs_jsonl(write_jsonl(tmp_path / "vllm.jsonl", vllm_request_output()))
    oa = read_logprobs_jsonl(write_jsonl(tmp_path / "openai.jsonl", openai_completion()))
    assert sg == [expected()]
    assert vl == [expected()]
    assert oa == [expected(with_top=False)]  # OpenAI top logprobs are keyed by text: dropped
    v = compare_logprobs(sg, vl, LogprobThresholds(mse=0.0, max_abs_err=0.0, topk_max_err=0.0))
    assert v.passed and v.mse == 0.0 and v.compared_positions == 5 and v.topk_max_err == 0.0
    assert compare_logprobs(sg, oa, LogprobThresholds(mse=0.0)).passed


def test_detect_format():
    assert detect_format(sglang_response()) == "sglang"
    assert detect_format(vllm_request_output()) == "vllm"
    assert detect_format(openai_completion()) == "openai"


def test_sglang_logprob_start_len_keeps_absolute_positions():
    s = parse_record(sglang_response(start=2))
    assert s.token_ids == (UNKNOWN_TOKEN, UNKNOWN_TOKEN) + tuple(PROMPT_IDS[2:] + OUTPUT_IDS)
    assert s.logprobs == (None, None, None) + tuple(LOGPROBS[3:])
    assert s.top is not None and s.top[:3] == (None, None, None) and s.top[3] == expected().top[3]
    al = align_samples([expected()], [s])
    assert al.samples[0].positions.tolist() == [3, 4, 5]
    # the request's input_ids merged into the line fill in the skipped token ids
    with_ids = parse_record({**sglang_response(start=2), "input_ids": PROMPT_IDS})
    assert with_ids.token_ids == tuple(PROMPT_IDS + OUTPUT_IDS)
    with pytest.raises(UsageError, match="input_ids"):
        parse_record({**sglang_response(start=2), "input_ids": [9, 9, 9, 9]})


def test_sglang_without_text_and_top():
    r = sglang_response()
    meta = r["meta_info"]
    for key in ("input_token_logprobs", "output_token_logprobs"):
        meta[key] = [[lp, t, None] for lp, t, _ in meta[key]]  # return_text_in_logprobs=False
    del meta["input_top_logprobs"], meta["output_top_logprobs"]
    assert parse_record(r) == expected(with_top=False)


def test_vllm_openai_server_prompt_logprobs():
    """vLLM's OpenAI server: prompt_logprobs and prompt_token_ids inside choices[0], output OpenAI-style."""
    choice = openai_completion(echo=False)["choices"][0]
    choice["prompt_logprobs"] = [vllm_entry(i, t) for i, t in enumerate(PROMPT_IDS)]
    obj = {"id": "req-0", "object": "text_completion", "choices": [choice]}
    assert detect_format(obj) == "vllm"
    s = parse_record(obj)
    assert s.token_ids == expected().token_ids and s.logprobs == expected().logprobs
    assert s.top[:4] == expected().top[:4] and s.top[4:] == (None, None)


def test_vllm_top_keeps_the_actual_token_outside_top_k():
    obj = vllm_request_output()
    obj["prompt_logprobs"][1] = {"13": {"logprob": -1.5, "rank": 1}, "415": {"logprob": -7.25, "rank": 40}}
    del obj["outputs"]
    s = parse_record(obj)
    assert s.logprobs == tuple(LOGPROBS[:4]) and s.top[1] == ((13, -1.5), (415, -7.25))


def test_openai_without_ids_uses_texts():
    s = parse_record(openai_completion(ids=False))
    assert s.token_ids == () and s.token_texts == tuple(PROMPT_TXT + OUTPUT_TXT) and s.top is None
    assert s.logprobs == tuple(LOGPROBS)
    t = parse_record(openai_completion(ids=False))
    assert compare_logprobs([s], [t], LogprobThresholds(mse=0.0)).passed  # text vs text
    with pytest.raises(NotComparableError, match="one side has ids, the other only text"):
        align_samples([expected()], [s])


def test_openai_completion_only_starts_after_the_prompt():
    s = parse_record(openai_completion(echo=False))
    assert s.token_ids == expected().token_ids
    assert s.logprobs == (None,) * 4 + tuple(LOGPROBS[4:])


def test_openai_chat_completion():
    obj = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": " on"},
                "logprobs": {
                    "content": [
                        {
                            "token": " on",
                            "logprob": -0.75,
                            "bytes": [32, 111, 110],
                            "top_logprobs": [{"token": " on", "logprob": -0.75}],
                        },
                        {"token": "</s>", "logprob": -2.5, "bytes": None, "top_logprobs": []},
                    ]
                },
                "finish_reason": "length",
            }
        ],
    }
    s = parse_record(obj)
    assert s.request == "chatcmpl-1" and s.token_texts == (" on", "</s>") and s.logprobs == (-0.75, -2.5)


def test_request_ids_line_numbers_and_arrays(tmp_path):
    a = sglang_response("x")
    b = sglang_response()
    del b["meta_info"]["id"]
    path = write_jsonl(tmp_path / "ids.jsonl", a, b, raw=["", json.dumps([sglang_response("y"), b])])
    got = read_logprobs_jsonl(path)
    assert [s.request for s in got] == ["x", "line-2", "y", "line-4.1"]  # the blank line 3 still counts


# --------------------------------------------------------------------------- malformed input


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "not valid JSON"),
        ("42", "expected a JSON object"),
        ('{"hello": 1}', "unrecognized response"),
        ('{"meta_info": {"id": "a"}}', "return_logprob"),
        (
            '{"meta_info": {"id": "a", "input_token_logprobs": [[null, 1, null], [-1.0, "x", null]]}}',
            r"input_token_logprobs\[1\]\[1\] must be an integer",
        ),
        (
            '{"meta_info": {"id": "a", "input_token_logprobs": [[null, 1, null], ["bad", 2, null]]}}',
            r"input_token_logprobs\[1\]\[0\] must be a number",
        ),
        (
            '{"meta_info": {"id": "a", "input_token_logprobs": [[null, 1]], "input_top_logprobs": [null, null]}}',
            "2 entries for 1 tokens",
        ),
        ('{"meta_info": {"id": "a", "prompt_tokens": 1, "input_token_logprobs": [[null, 1], [-1.0, 2]]}}', "shorter"),
        ('{"request_id": "a", "prompt_token_ids": [1, 2], "prompt_logprobs": [null]}', "1 entries for 2"),
        (
            '{"request_id": "a", "prompt_token_ids": [1, 2], "prompt_logprobs": [null, {"7": {"logprob": -1.0}}]}',
            "no entry for its token id 2",
        ),
        ('{"request_id": "a", "prompt_logprobs": [null]}', "prompt_token_ids"),
        ('{"id": "a", "choices": [{"logprobs": {"tokens": ["a", "b"], "token_logprobs": [null]}}]}', "2 tokens but 1"),
        (
            '{"id": "a", "choices": [{"logprobs": {"tokens": ["a"], "token_logprobs": [null]}, '
            '"token_ids": [1, 2, 3]}]}',
            "do not cover the 1 logprob tokens",
        ),
        ('{"id": "a", "choices": [{"text": "x"}]}', "no logprobs"),
        ('{"id": "a", "choices": [{"logprobs": {"token_logprobs": [null]}}]}', "tokens must be a list"),
    ],
)
def test_malformed_line_names_path_and_line(tmp_path, line, message):
    path = write_jsonl(tmp_path / "bad.jsonl", sglang_response("ok"), raw=[line])
    with pytest.raises(UsageError, match=message) as e:
        read_logprobs_jsonl(path)
    assert str(e.value).startswith(f"{path}:2: ")
    assert "\n" not in str(e.value)


def test_duplicate_ids_and_unreadable_file(tmp_path):
    path = write_jsonl(tmp_path / "dup.jsonl", sglang_response("a"), vllm_request_output("b"), sglang_response("a"))
    with pytest.raises(UsageError, match=r"dup.jsonl:3: duplicate request id 'a' \(first on line 1\)"):
        read_logprobs_jsonl(path)
    with pytest.raises(UsageError, match="cannot read"):
        read_logprobs_jsonl(tmp_path / "missing.jsonl")
