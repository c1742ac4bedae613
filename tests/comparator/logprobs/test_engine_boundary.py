"""Engine JSON at the trust boundary: every bad line exits 2 with one line naming file, request and position.

Each test runs ``python -m comparator logprobs A B`` through :func:`comparator.cli.main.main` (the
CLI's own entry point, exit code included) on real JSONL files built from the engine responses
of ``tests/comparator/logprobs/test_engines.py``; one test runs it in a subprocess.
"""

from __future__ import annotations

import copy
import json
import os
import tracemalloc
from pathlib import Path

import pytest
import torch

import dumper
from bench.anonpeak import AnonPeak
from comparator.cli.main import main
from comparator.logprobs.judge import compare_logprob_sources
from comparator.logprobs.sources import one_sided_parts, read_logprob_source
from comparator.logprobs.sources.engine_json import read_logprobs_jsonl
from comparator.logprobs.sources.input_caps import MAX_LINE_BYTES, MAX_POSITIONS, MAX_TOTAL_POSITIONS
from dumper.errors import UsageError
from dumper.format import LOGITS, LOGPROB_TOKEN_ID, LOGPROB_TOP_VALUE, LOGPROB_VALUE
from dumper.prefill.logprob_records import LogprobSpec
from dumper.prefill.presets import load_model
from dumper.prefill.run import RunConfig, run_dump
from tests.comparator.logprobs import test_engines as engines
from tests.comparator.logprobs.test_engines import write_jsonl
from tests.conftest import run_cli


def sglang_response(*args, **kwargs) -> dict:
    """A fresh copy (the fixtures share their id lists, which these tests mutate)."""
    return copy.deepcopy(engines.sglang_response(*args, **kwargs))


def vllm_request_output(*args, **kwargs) -> dict:
    return copy.deepcopy(engines.vllm_request_output(*args, **kwargs))


def openai_completion(*args, **kwargs) -> dict:
    return copy.deepcopy(engines.openai_completion(*args, **kwargs))


def logprobs_cli(capsys, a: Path, b: Path) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``python -m comparator logprobs a b``."""
    code = main(["logprobs", str(a), str(b)])
    out, err = capsys.readouterr()
    return code, out, err


def refused(capsys, a: Path, b: Path, *needles: str) -> str:
    """Assert exit 2 with one error line naming every needle; return that line."""
    code, _, err = logprobs_cli(capsys, a, b)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


@pytest.fixture
def good(tmp_path) -> dict[str, Path]:
    """One clean response per engine format, each in its own file."""
    return {
        "sglang": write_jsonl(tmp_path / "sglang.jsonl", sglang_response()),
        "vllm": write_jsonl(tmp_path / "vllm.jsonl", vllm_request_output()),
        "openai": write_jsonl(tmp_path / "openai.jsonl", openai_completion()),
    }


def test_clean_responses_pass(capsys, good, tmp_path):
    for a in good.values():
        for b in good.values():
            if a == b:  # a file against itself is refused (nothing would be tested): compare it with a copy
                b = tmp_path / f"copy-{b.name}"
                b.write_bytes(a.read_bytes())
            code, out, err = logprobs_cli(capsys, a, b)
            assert code == 0 and "PASS" in out, err
    code, _, err = logprobs_cli(capsys, a, a)
    assert code == 2 and "the same file" in err


# --------------------------------------------------------------------------- null logprobs


def _null_at_2(fmt: str) -> dict:
    if fmt == "sglang":
        r = sglang_response()
        r["meta_info"]["input_token_logprobs"][2][0] = None
    elif fmt == "vllm":
        r = vllm_request_output()
        r["prompt_logprobs"][2] = None
    else:
        r = openai_completion()
        r["choices"][0]["logprobs"]["token_logprobs"][2] = None
    return r


@pytest.mark.parametrize("fmt", ["sglang", "vllm", "openai"])
def test_null_logprob_after_the_first_position_is_refused(capsys, tmp_path, good, fmt):
    """Today's false pass: the null position was silently left out of the comparison."""
    bad = write_jsonl(tmp_path / "null.jsonl", _null_at_2(fmt))
    refused(capsys, good[fmt], bad, "null.jsonl:1", "'req-0'", "position 2")
    refused(capsys, bad, good[fmt], "null.jsonl:1", "position 2")  # either side


def test_null_logprob_of_the_first_reported_position_is_fine(capsys, tmp_path, good):
    """Position 0 has no logprob; with logprob_start_len=2 SGLang's first position (2) has none either."""
    start = write_jsonl(tmp_path / "start.jsonl", sglang_response(start=2))
    code, out, err = logprobs_cli(capsys, good["vllm"], start)
    assert code == 0, err


def test_null_top_logprobs_after_the_first_position_is_refused(capsys, tmp_path, good):
    r = sglang_response()
    r["meta_info"]["input_top_logprobs"][3] = None
    refused(capsys, good["sglang"], write_jsonl(tmp_path / "top.jsonl", r), "'req-0'", "input_top_logprobs[3]")
    r = sglang_response()
    r["meta_info"]["input_top_logprobs"][3].pop()  # top-2 everywhere else
    refused(capsys, good["sglang"], write_jsonl(tmp_path / "k.jsonl", r), "top logprobs lists differ in length")


# --------------------------------------------------------------------------- coverage


def test_a_shorter_response_is_refused_naming_both_lengths(capsys, tmp_path, good):
    """Today's false pass: the common prefix was compared and passed."""
    r = sglang_response()
    for key in ("output_token_logprobs", "output_top_logprobs"):
        r["meta_info"][key].pop()
    short = write_jsonl(tmp_path / "short.jsonl", r)
    line = refused(capsys, good["vllm"], short, "'req-0'", "6 positions", "the target 5", "vllm.jsonl", "short.jsonl")
    assert "baseline" in line
    refused(capsys, short, good["vllm"], "'req-0'", "5 positions", "the target 6")
    vllm_prompt_only = vllm_request_output()
    del vllm_prompt_only["outputs"]
    refused(capsys, good["openai"], write_jsonl(tmp_path / "prompt.jsonl", vllm_prompt_only), "6 positions", "target 4")


@pytest.mark.parametrize("content", ["", "\n\n  \n", "[]\n"])
def test_a_file_without_responses_is_refused(capsys, tmp_path, good, content):
    empty = tmp_path / "empty.jsonl"
    empty.write_text(content)
    refused(capsys, good["sglang"], empty, "empty.jsonl")
    refused(capsys, empty, good["sglang"], "empty.jsonl")


def test_requests_that_match_nothing_are_refused(capsys, tmp_path, good):
    other = write_jsonl(tmp_path / "other.jsonl", sglang_response("req-1"), vllm_request_output("req-2"))
    refused(capsys, good["sglang"], other, "no request id in common")


# --------------------------------------------------------------------------- token ids


@pytest.mark.parametrize("tid", [-5, -1, 2**31, 10**30])
def test_token_ids_out_of_range_are_refused(capsys, tmp_path, good, tid):
    r = sglang_response()
    r["meta_info"]["input_token_logprobs"][2][1] = tid
    refused(
        capsys,
        good["sglang"],
        write_jsonl(tmp_path / "a.jsonl", r),
        "'req-0'",
        "input_token_logprobs[2][1]",
        "out of range",
    )
    v = vllm_request_output()
    v["prompt_token_ids"][3] = tid
    refused(capsys, good["vllm"], write_jsonl(tmp_path / "b.jsonl", v), "'req-0'", "prompt_token_ids[3]")
    v = vllm_request_output()
    v["prompt_logprobs"][1][str(tid)] = {"logprob": -9.0, "rank": 3}  # a top-k entry
    refused(capsys, good["vllm"], write_jsonl(tmp_path / "c.jsonl", v), "'req-0'", "prompt_logprobs[1]")
    o = openai_completion()
    o["choices"][0]["token_ids"][1] = tid
    refused(capsys, good["openai"], write_jsonl(tmp_path / "d.jsonl", o), "token_ids[1]")


@pytest.mark.parametrize("tid", [True, 415.0, "415", None, [415]])
def test_token_ids_must_be_integers(capsys, tmp_path, good, tid):
    r = sglang_response()
    r["meta_info"]["input_token_logprobs"][1][1] = tid
    refused(capsys, good["sglang"], write_jsonl(tmp_path / "a.jsonl", r), "input_token_logprobs[1][1]", "integer")
    v = vllm_request_output()
    v["prompt_token_ids"][1] = tid
    refused(capsys, good["vllm"], write_jsonl(tmp_path / "b.jsonl", v), "prompt_token_ids[1]", "integer")


@pytest.fixture(scope="module")
def logits_dump(tmp_path_factory) -> Path:
    """A real tiny-llama dump with logprobs and logits rows (their width is the vocabulary size)."""
    out = tmp_path_factory.mktemp("vocab") / "dump"
    run_dump(
        RunConfig(out=str(out), prompts=("vocab check",), layers="0", logprobs=LogprobSpec(top_k=2, save_logits=True))
    )
    return out


def test_token_ids_outside_a_known_vocabulary_are_refused(capsys, tmp_path, logits_dump):
    from comparator.logprobs.sources import read_logprob_source

    src = read_logprob_source(logits_dump)
    vocab = src.vocab_size
    assert vocab == src.logits["0"][1].shape[1] == load_model("tiny-llama")[0].config.vocab_size

    def sglang_of(seq, bump: int | None = None, top_bump: int | None = None) -> dict:
        triples = [[lp, t, None] for lp, t in zip(seq.logprobs, seq.token_ids, strict=True)]
        tops = [None if t is None else [[v, i, None] for i, v in t] for t in seq.top]
        if bump is not None:
            triples[bump][1] = vocab
        if top_bump is not None:
            tops[top_bump][1][1] = vocab + 1000
        return {"meta_info": {"id": seq.request, "input_token_logprobs": triples, "input_top_logprobs": tops}}

    seq = src.sequences[0]
    ok = write_jsonl(tmp_path / "ok.jsonl", sglang_of(seq))
    assert logprobs_cli(capsys, logits_dump, ok)[0] == 0
    bad = write_jsonl(tmp_path / "bad.jsonl", sglang_of(seq, bump=4))
    # a token mismatch would be found too; the vocabulary check names the impossible id first
    refused(capsys, logits_dump, bad, "bad.jsonl", "'0'", "position 4", f"token id {vocab} ", f"[0, {vocab})")
    top = write_jsonl(tmp_path / "top.jsonl", sglang_of(seq, top_bump=3))
    refused(capsys, top, logits_dump, "top.jsonl", "position 3", f"token id {vocab + 1000} ")


# --------------------------------------------------------------------------- values and lines


@pytest.mark.parametrize(
    "value", ["-1.0", True, float("nan"), float("inf"), 10**400], ids=["string", "bool", "nan", "inf", "10**400"]
)
def test_logprobs_must_be_finite_numbers_or_minus_inf(capsys, tmp_path, good, value):
    r = sglang_response()
    r["meta_info"]["output_token_logprobs"][0][0] = value
    refused(capsys, good["sglang"], write_jsonl(tmp_path / "v.jsonl", r), "'req-0'", "output_token_logprobs[0][0]")


def test_minus_infinity_is_a_logprob(capsys, tmp_path):
    """-inf (JSON -Infinity) is a real logprob: the same on both sides passes, against a finite one fails."""
    r = sglang_response()
    r["meta_info"]["input_token_logprobs"][3][0] = float("-inf")
    a = write_jsonl(tmp_path / "a.jsonl", r)
    b = write_jsonl(tmp_path / "b.jsonl", r)
    assert logprobs_cli(capsys, a, b)[0] == 0
    assert logprobs_cli(capsys, a, write_jsonl(tmp_path / "c.jsonl", sglang_response()))[0] == 1


_MALFORMED = [
    "bad-utf8",
    "int",
    "str",
    "list-of-ints",
    "deep",
    "id-object",
    "null-list",
    "prompt-tokens",
    "unicode-digit",
]


@pytest.mark.parametrize(
    "raw, needle",
    [
        (b'{"id": "\xff\xfe"}\n', "not UTF-8"),
        (b"42\n", "expected a JSON object, got int"),
        (b'"text"\n', "expected a JSON object, got str"),
        (b"[1, 2]\n", "array element 0: expected a JSON object"),
        (b"[" * 100_000 + b"]" * 100_000 + b"\n", "nested too deeply"),
        (
            b'{"meta_info": {"id": {"a": 1}, "input_token_logprobs": []}}\n',
            "meta_info.id must be a string or an integer",
        ),
        (b'{"meta_info": {"id": "x", "input_token_logprobs": null}}\n', "input_token_logprobs must be a list"),
        (b'{"meta_info": {"id": "x", "prompt_tokens": 1000000000000, "input_token_logprobs": []}}\n', "over"),
        (b'{"request_id": "x", "prompt_token_ids": [1], "prompt_logprobs": [{"\xc2\xb2": -1.0}]}\n', "not a token id"),
    ],
    ids=_MALFORMED,
)
def test_malformed_lines_are_refused(capsys, tmp_path, good, raw, needle):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(raw)
    refused(capsys, good["sglang"], bad, "bad.jsonl:1", needle)


def test_duplicate_request_ids_are_refused(capsys, tmp_path, good):
    dup = write_jsonl(tmp_path / "dup.jsonl", sglang_response(), openai_completion())
    refused(capsys, good["sglang"], dup, "dup.jsonl:2", "duplicate request id 'req-0'")


def test_a_fifo_is_refused_without_blocking(capsys, tmp_path, good):
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(UsageError, match="not a regular file"):
        read_logprobs_jsonl(fifo)
    refused(capsys, good["sglang"], fifo, "fifo.jsonl")


@pytest.mark.parametrize("what", ["too long", "too many values"])
def test_huge_lines_are_refused_with_bounded_memory(capsys, tmp_path, good, what):
    big = tmp_path / "big.jsonl"
    with big.open("wb") as f:
        if what == "too long":  # one string just over the line limit
            f.write(b'{"id": "x", "pad": "' + b"a" * MAX_LINE_BYTES + b'"}\n')
        else:  # 48 MiB of triples: about 500 MiB of Python objects
            f.write(
                b'{"meta_info": {"id": "x", "input_token_logprobs": ['
                + b"[-1.5, 7, null]," * (3 << 20)
                + b"[-1.5, 7, null]]}}\n"
            )
    start = AnonPeak.now()
    with AnonPeak() as peak:
        line = refused(capsys, good["sglang"], big, "big.jsonl:1")
    assert ("longer than" in line) if what == "too long" else ("too many JSON values" in line)
    grew = peak.peak - start
    assert grew < 512 << 20, f"{grew >> 20} MiB"


# --------------------------------------------------------------------------- dumps holding logprob records


def _logprob_dump(
    out: Path, positions: list[int], *, ids_rows: int | None = None, ids_dtype=torch.int64, first_id: int = 5
) -> Path:
    """A dump whose logprob records are written with dumper.dump (one sequence, prompt unknown)."""
    n = len(positions)
    ids = torch.arange(first_id, first_id + (ids_rows or n), dtype=torch.int64).to(ids_dtype)[:, None]
    with dumper.capture(None, out):
        dumper.dump(
            LOGPROB_VALUE,
            -torch.arange(1, n + 1, dtype=torch.float32)[:, None] / 8,
            positions=positions,
            sequence_ids=[0] * n,
            point="logprobs",
        )
        dumper.dump(
            LOGPROB_TOKEN_ID,
            ids,
            positions=positions[: ids.shape[0]],
            sequence_ids=[0] * ids.shape[0],
            point="logprobs",
        )
    return out


def test_dump_logprob_records_are_checked(capsys, tmp_path):
    ok = _logprob_dump(tmp_path / "ok", [1, 2, 3, 4])
    assert logprobs_cli(capsys, ok, _logprob_dump(tmp_path / "same", [1, 2, 3, 4]))[0] == 0
    gap = _logprob_dump(tmp_path / "gap", [1, 2, 4, 5])
    refused(capsys, ok, gap, "gap", "sequence 0", "4 positions in 1..5")
    rows = _logprob_dump(tmp_path / "rows", [1, 2, 3, 4], ids_rows=3)
    refused(capsys, ok, rows, "rows", LOGPROB_TOKEN_ID, "does not hold 4 rows")
    floats = _logprob_dump(tmp_path / "floats", [1, 2, 3, 4], ids_dtype=torch.float32)
    refused(capsys, ok, floats, "floats", "not an integer type")
    neg = _logprob_dump(tmp_path / "neg", [1, 2, 3, 4], first_id=-2)
    refused(capsys, ok, neg, "neg", "token id -2 is out of range")


def test_subprocess_exit_code_and_one_line(tmp_path):
    """The real ``python -m comparator logprobs`` in a subprocess: exit 2, one line, no traceback."""
    a = write_jsonl(tmp_path / "a.jsonl", sglang_response())
    b = write_jsonl(tmp_path / "b.jsonl", _null_at_2("sglang"))
    r = run_cli("comparator", "logprobs", a, b)
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "b.jsonl:1: request 'req-0': null logprob at position 2" in r.stderr


# --------------------------------------------------------------------------- memory and one-sided parts


def _traced_peak(fn) -> int:
    """Peak bytes Python allocated while ``fn()`` ran."""
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _far_rows_dump(out: Path, seqs: int, pos: int, *, input_ids: list[list[int]] | None = None) -> Path:
    """A dump whose ``seqs`` sequences each hold one logprob row, at position ``pos`` (a 2 KB manifest
    that claims ``seqs * (pos + 1)`` positions)."""
    with dumper.capture(None, out, extra={"input_ids": input_ids} if input_ids else None):
        meta = {"positions": [pos] * seqs, "sequence_ids": list(range(seqs)), "point": "logprobs"}
        dumper.dump(LOGPROB_VALUE, torch.full((seqs, 1), -1.0), **meta)
        dumper.dump(LOGPROB_TOKEN_ID, torch.zeros((seqs, 1), dtype=torch.int64), **meta)
    return out


def test_a_dump_claiming_far_positions_is_refused_before_allocating(capsys, tmp_path):
    """(a) Positions far past the rows are refused from the manifest: by their sum over sequences
    (each sequence alone is under MAX_POSITIONS), or past the prompt the run recorded."""
    ok = _logprob_dump(tmp_path / "ok", [1, 2, 3, 4])
    far = _far_rows_dump(tmp_path / "far", 20, MAX_POSITIONS - 1)
    peak = _traced_peak(lambda: refused(capsys, ok, far, str(far), "20 sequences", f"limit of {MAX_TOTAL_POSITIONS}"))
    assert peak < 256 << 20, f"{peak >> 20} MiB"
    two = _far_rows_dump(tmp_path / "two", 2, MAX_TOTAL_POSITIONS // 2)
    refused(capsys, ok, two, str(two), f"span {MAX_TOTAL_POSITIONS + 2} positions")
    past = _far_rows_dump(tmp_path / "past", 1, 4000, input_ids=[[1, 2, 3, 4]])
    refused(capsys, ok, past, str(past), "sequence 0", "position 4000", "its 4 tokens (extra.input_ids")


def test_sglang_prompt_lengths_count_against_one_budget_per_file(capsys, tmp_path, good):
    """(b) ``prompt_tokens`` claims an unscored prefix; MAX_TOTAL_POSITIONS bounds the whole file's."""
    half = MAX_TOTAL_POSITIONS // 2 + 1  # each line alone is under MAX_POSITIONS
    big = tmp_path / "sg.jsonl"
    big.write_text(
        "".join(
            json.dumps({"meta_info": {"id": f"r{i}", "input_token_logprobs": [[-1.0, 5, None]], "prompt_tokens": half}})
            + "\n"
            for i in range(10)
        )
    )
    peak = _traced_peak(
        lambda: refused(
            capsys, good["sglang"], big, "sg.jsonl:2", "'r1'", f"prompt length {half}", f"{MAX_TOTAL_POSITIONS} in all"
        )
    )
    assert peak < 256 << 20, f"{peak >> 20} MiB"


def _logits_dump(out: Path, variant: str) -> Path:
    """Three logprob rows of sequence 0 and a logits record, well formed or broken as ``variant`` says."""
    meta = {"positions": [1, 2, 3], "sequence_ids": [0, 0, 0], "point": "logprobs"}
    logits = {
        "ok": (torch.zeros(3, 8), meta),
        "nopos": (torch.zeros(3, 8), {"point": "logits"}),
        "1d": (torch.zeros(24), {"point": "logits"}),
        "3d": (torch.zeros(1, 3, 8), meta),
        "int": (torch.zeros(3, 8, dtype=torch.int32), meta),
        "moved": (torch.zeros(3, 8), {**meta, "positions": [2, 3, 4]}),
    }[variant]
    with dumper.capture(None, out):
        dumper.dump(LOGPROB_VALUE, torch.full((3, 1), -1.0), **meta)
        dumper.dump(LOGPROB_TOKEN_ID, torch.tensor([[1], [2], [3]]), **meta)
        dumper.dump(LOGITS, logits[0], **logits[1])
    return out


@pytest.mark.parametrize(
    "variant, needle",
    [
        ("nopos", "lack positions or sequence ids"),
        ("1d", "shape [24] is not [rows, vocab]"),
        ("3d", "shape [1, 3, 8] is not [rows, vocab]"),
        ("int", "dtype I32 is not a float type"),
        ("moved", f"positions or sequence ids differ from those of {LOGPROB_VALUE}"),
    ],
)
def test_malformed_logits_records_are_refused(capsys, tmp_path, variant, needle):
    """(c) A logits record that is not float [rows, V] on the logprob rows' positions is corrupt (exit 2)."""
    ok = _logits_dump(tmp_path / "ok", "ok")
    assert logprobs_cli(capsys, ok, _logits_dump(tmp_path / "same", "ok"))[0] == 0
    bad = _logits_dump(tmp_path / variant, variant)
    refused(capsys, ok, bad, str(bad), LOGITS, needle)
    refused(capsys, bad, ok, str(bad), needle)


def test_parts_recorded_on_one_side_only_are_named(capsys, tmp_path, logits_dump):
    """(d) KL and top-k metrics need both sides: a dump without logits rows and top-k still passes
    against one with them, but the verdict, the --quiet line and the full render name what was skipped."""
    plain = tmp_path / "plain"
    run_dump(RunConfig(out=str(plain), prompts=("vocab check",), layers="0", logprobs=LogprobSpec()))
    full_src, plain_src = read_logprob_source(logits_dump), read_logprob_source(plain)
    assert one_sided_parts(full_src, plain_src) == ([LOGITS, LOGPROB_TOP_VALUE], [])
    assert one_sided_parts(plain_src, full_src) == ([], [LOGITS, LOGPROB_TOP_VALUE])
    assert one_sided_parts(full_src, full_src) == ([], [])
    v = compare_logprob_sources(logits_dump, plain)
    assert v.passed and v.kl_mean is None and v.topk_max_err is None
    assert (v.unmatched_baseline, v.unmatched_target) == ((LOGITS, LOGPROB_TOP_VALUE), ())
    code = main(["logprobs", str(logits_dump), str(plain), "--quiet"])
    out = capsys.readouterr().out
    assert code == 0 and out.startswith("PASS (") and "only in the baseline" in out, out
    code = main(["logprobs", str(plain), str(logits_dump)])
    out = capsys.readouterr().out
    assert code == 0 and f"{LOGITS}, {LOGPROB_TOP_VALUE}" in out, out
