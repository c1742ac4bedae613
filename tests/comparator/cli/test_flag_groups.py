"""The shared flag groups (:mod:`comparator.cli.args`): one definition, the same answer in every subcommand.

A bad threshold is refused the same way by every subcommand that takes it (exit 2, one line
naming the flag), while the same command with a sound value passes: the refusal is the value's.
Real CLI subprocesses on real dumps, a real run store and real engine JSONL files.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from comparator.cli.args import compare_config, parse_args
from comparator.cli.main import build_logprobs_parser, build_parser
from comparator.cli.store import build_regress_parser, build_store_parser
from comparator.store import RunStore
from comparator.store.regress import regress
from dumper.errors import UsageError
from tests.conftest import run_cli
from tests.storeutil import synth_dump


def _sglang_jsonl(path: Path, *, seed: int = 0, requests: int = 2, tokens: int = 9, vocab: int = 32) -> Path:
    """SGLang ``/generate`` lines: log-softmax logprobs of seeded logits for each request's prompt tokens."""
    rng = np.random.default_rng(seed)
    lines = []
    for req in range(requests):
        logits = rng.standard_normal((tokens, vocab))
        logprobs = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
        ids = rng.integers(0, vocab, tokens)
        triples = [[None, int(ids[0]), None]] + [
            [float(logprobs[i - 1, ids[i]]), int(ids[i]), None] for i in range(1, tokens)
        ]
        lines.append(json.dumps({"text": "", "meta_info": {"id": str(req), "input_token_logprobs": triples}}))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def sides(tmp_path_factory) -> dict[str, list[str]]:
    """The positional arguments of each subcommand, on inputs that pass with sound thresholds."""
    root = tmp_path_factory.mktemp("flags")
    a = synth_dump(root / "a")
    b = root / "b"
    shutil.copytree(a, b)
    store = root / "store"
    assert regress(a, store, bootstrap=True).label == "baseline"
    lp = _sglang_jsonl(root / "base.jsonl")
    lp2 = root / "target.jsonl"
    shutil.copy(lp, lp2)
    return {
        "compare": [str(a), str(b)],
        "logprobs": ["logprobs", str(lp), str(lp2)],
        "regress": ["regress", str(b), "--store", str(store)],
    }


# (flag, bad value, what the one line says) -- each is refused where the flag exists
BAD = [
    ("--threshold", "nan", "nan must be a finite number >= 0"),
    ("--threshold", "-1", "-1.0 must be a finite number >= 0"),
    ("--token-threshold", "inf", "inf must be a finite number >= 0"),
    ("--logprob-threshold", "kl_max=abc", "'abc' is not a number"),
]
TAKES = {
    "compare": {"--threshold", "--token-threshold", "--logprob-threshold"},
    "logprobs": {"--logprob-threshold"},
    "regress": {"--threshold", "--token-threshold", "--logprob-threshold"},
}
CASES = [(cmd, flag, value, says) for cmd, flags in TAKES.items() for flag, value, says in BAD if flag in flags]


@pytest.mark.parametrize(("cmd", "flag", "value", "says"), CASES, ids=[f"{c[0]}{c[1]}={c[2]}" for c in CASES])
def test_a_bad_threshold_is_one_line_naming_the_flag(sides, cmd, flag, value, says):
    r = run_cli("comparator", *sides[cmd], flag, value, "--quiet")
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: ") and "Traceback" not in r.stderr, r.stderr
    assert flag in r.stderr and says in r.stderr, r.stderr
    assert r.stdout == ""


@pytest.mark.parametrize("cmd", sorted(TAKES))
def test_the_same_command_with_sound_values_passes(sides, cmd):
    sound = {"--threshold": "1e-3", "--token-threshold": "1e-3", "--logprob-threshold": "kl_max=1"}
    flags = [x for flag in sorted(TAKES[cmd]) for x in (flag, sound[flag])]
    r = run_cli("comparator", *sides[cmd], *flags, "--quiet")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "PASS" in r.stdout, r.stdout


THRESHOLD_PARSERS = {"compare": (build_parser, ["A", "B"]), "regress": (build_regress_parser, ["R", "--store", "S"])}


@pytest.mark.parametrize("cmd", sorted(THRESHOLD_PARSERS))
def test_threshold_flags_parse_alike_and_resolve_into_the_config(cmd):
    build, positional = THRESHOLD_PARSERS[cmd]
    args = parse_args(
        build(),
        [
            *positional,
            "--threshold",
            "2.5e-4",
            "--token-threshold",
            "0",
            "--logprob-threshold",
            "kl_max=off",
            "--logprob-threshold",
            "mse=1e-6",
        ],
    )
    assert (args.threshold, args.token_threshold) == (2.5e-4, 0.0)
    config = compare_config(args)
    assert (config.threshold, config.token_threshold, config.fixed_explicit) == (2.5e-4, 0.0, True)
    assert dict(config.logprob_thresholds) == {"kl_max": None, "mse": 1e-6}
    unset = compare_config(parse_args(build(), positional))
    assert unset.fixed_explicit is False and not math.isnan(unset.threshold)


def test_model_is_a_threshold_row_in_comparator_and_a_run_group_in_regress():
    assert parse_args(build_parser(), ["A", "B", "--model", "tiny-llama"]).threshold_row == "tiny-llama"
    assert (
        parse_args(build_logprobs_parser(), ["A", "B", "--model", "default@bfloat16"]).threshold_row
        == "default@bfloat16"
    )
    regress_args = parse_args(build_regress_parser(), ["R", "--store", "S", "--model", "nightly-8b"])
    assert regress_args.run_group == "nightly-8b" and not hasattr(regress_args, "threshold_row")
    assert parse_args(build_store_parser(), ["ls", "S", "--model", "nightly-8b"]).run_group == "nightly-8b"
    # a run group is any name; a threshold row must exist in the table
    with pytest.raises(UsageError, match="'nightly-8b': no such row"):
        parse_args(build_parser(), ["A", "B", "--model", "nightly-8b"])


def test_regress_files_a_run_under_its_run_group(sides, tmp_path):
    a, b = sides["compare"]
    store = tmp_path / "store"
    r = run_cli("comparator", "regress", a, "--store", store, "--model", "group-x", "--bootstrap", "--quiet")
    assert r.returncode == 0, r.stdout + r.stderr
    assert [e.record.model for e in RunStore(store).runs() if e.record] == ["group-x"]
    r = run_cli("comparator", "store", "ls", store, "--model", "group-x")
    assert r.returncode == 0 and "1 runs shown" in r.stdout, r.stdout + r.stderr
    r = run_cli("comparator", "store", "ls", store, "--model", "synth")
    assert r.returncode == 0 and "0 runs shown" in r.stdout, r.stdout + r.stderr
