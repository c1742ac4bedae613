"""Each CLI flag is defined once, with one default, in every command that takes it.

Read on the source (every ``add_argument("--flag"`` in ``dumper/`` and ``comparator/``) and on
the parsers both CLIs build; a logprob option given without ``--logprobs`` is the same one line
in every dumper command that takes it.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

from comparator.cli.main import build_parser as comparator_parser
from dumper.cli.flags import NEEDS_LOGPROBS
from dumper.cli.main import build_parser as dumper_parser
from dumper.cli.main import main as dumper_main
from dumper.server.client import ServerClient
from dumper.server.flags import DEFAULT_RETRIES, DEFAULT_TIMEOUT_S

ROOT = Path(__file__).resolve().parents[3]
_DEFINITION = re.compile(r'add_argument\(\s*"(--[a-z0-9-]+)"')

SEVERAL_MEANINGS = {
    "--model": "the model run, replay, selfcheck and sweep load; the checkpoint a server serves (dumper collect); "
    "a row of the logprob threshold table (comparator); the run group of a store (regress, store ls)",
    "--threshold": "selfcheck's limit on the mean k3; the comparator's whole-tensor rel_diff threshold",
    "--timeout": "a live server's deadline per request; how long bisect lets a build's command run",
    "--new-tokens": "an optional decode after the prompt (run, collect: default 0); the decode selfcheck checks "
    "(default 16, at least 1)",
    "--calibrate": "run's switch that records a calibrated baseline; the VARIANT dumps regress and promote measure",
    "--tensors": "ls lists a dump's tensors; the comparator's report adds a row per tensor",
}
"""Flags spelled alike that mean different things in different commands, so each has its own definitions."""


def _definitions() -> Counter[str]:
    return Counter(
        flag
        for package in ("dumper", "comparator")
        for path in sorted((ROOT / package).rglob("*.py"))
        for flag in _DEFINITION.findall(path.read_text(encoding="utf-8"))
    )


def test_a_flag_with_one_meaning_is_defined_once() -> None:
    counts = _definitions()
    several = {flag: n for flag, n in counts.items() if n > 1 and flag not in SEVERAL_MEANINGS}
    assert not several, f"defined more than once (add it once, in dumper/cli/common.py or a flags module): {several}"
    stale = [flag for flag in SEVERAL_MEANINGS if counts[flag] < 2]
    assert not stale, f"SEVERAL_MEANINGS names flags defined once or not at all: {stale}"


LIVE_SERVER = {
    "dumper collect": (dumper_parser, ["collect", "--server", "u", "--spool", "s", "--out", "o"]),
    "dumper selfcheck": (dumper_parser, ["selfcheck"]),
    "comparator collect": (comparator_parser, ["collect", "--server", "u", "--api", "vllm", "--out", "o"]),
}


@pytest.mark.parametrize("command", sorted(LIVE_SERVER))
def test_the_live_server_flags_have_one_default(command: str) -> None:
    build, argv = LIVE_SERVER[command]
    args = build().parse_args(argv)
    assert (args.timeout, args.retries) == (DEFAULT_TIMEOUT_S, DEFAULT_RETRIES) == (120.0, 3)
    client = ServerClient("http://127.0.0.1:9")
    assert (client.timeout, client.retries) == (DEFAULT_TIMEOUT_S, DEFAULT_RETRIES)


MODEL_COMMANDS = {
    "run": ["run", "--out", "o"],
    "replay": ["replay", "--baseline", "b", "--out", "o"],
    "selfcheck": ["selfcheck"],
    "sweep": ["sweep", "--baseline", "b", "--grid", "batch_size=1,2", "--out", "o"],
}


@pytest.mark.parametrize("command", sorted(MODEL_COMMANDS))
def test_the_model_flags_parse_alike_in_every_command(command: str) -> None:
    args = dumper_parser().parse_args(MODEL_COMMANDS[command])
    assert (args.model, args.attn, args.device) == ("tiny-llama", "eager", "cpu")
    # sweep leaves what the baseline dump records unset, and takes the baseline's
    assert (args.dtype, args.seed) == ((None, None) if command == "sweep" else ("float32", 0))
    given = dumper_parser().parse_args(
        [
            *MODEL_COMMANDS[command],
            "--model",
            "tiny-qwen2",
            "--dtype",
            "bfloat16",
            "--attn",
            "sdpa",
            "--device",
            "cuda:1",
            "--seed",
            "7",
        ]
    )
    assert (given.model, given.dtype, given.attn, given.device, given.seed) == (
        "tiny-qwen2",
        "bfloat16",
        "sdpa",
        "cuda:1",
        7,
    )


SWEEP = ["sweep", "--baseline", "{tmp}/b", "--grid", "batch_size=1,2", "--out", "{tmp}/s"]
COLLECT = ["collect", "--server", "http://127.0.0.1:9", "--spool", "{tmp}", "--out", "{tmp}/c", "--input-ids", "1,2"]
NEEDS = [
    (["run", "--out", "{tmp}/d", "--top-k", "2"], "--top-k"),
    (["run", "--out", "{tmp}/d", "--logprob-start-len", "1"], "--logprob-start-len"),
    (["run", "--out", "{tmp}/d", "--save-logits"], "--save-logits"),
    ([*SWEEP, "--top-k", "2"], "--top-k"),
    ([*SWEEP, "--save-logits"], "--save-logits"),
    ([*COLLECT, "--top-k", "2"], "--top-k"),
]


@pytest.mark.parametrize(("argv", "flag"), NEEDS, ids=[f"{a[0]}{f}" for a, f in NEEDS])
def test_a_logprob_option_without_logprobs_is_one_line(argv: list[str], flag: str, tmp_path: Path, capsys) -> None:
    rc = dumper_main([a.format(tmp=tmp_path) for a in argv])
    out, err = capsys.readouterr()
    assert (rc, out, err) == (2, "", f"error: {NEEDS_LOGPROBS.format(flag=flag)}\n")
    assert err == f"error: {flag} needs --logprobs\n"
    assert list(tmp_path.iterdir()) == []  # refused before anything was written
