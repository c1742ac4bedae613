"""``python -m comparator``'s subcommands are real argparse subparsers: listed by ``--help``, one line each.

Real CLI subprocesses over real dumps of the tiny-llama preset (eager and sdpa attention: a benign
pair whose layer 0 inputs match exactly). ``BASELINE TARGET`` still compares with its exit codes,
each subcommand still runs and has its ``--help``, a mistyped command is one line and exit 2,
:func:`comparator.cli.main.build_parser` (and :func:`dumper.cli.main.build_parser`) parse every
command line without running it, and the amplification column of a passing run shows no ``inf``.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from comparator.cli.main import build_parser
from comparator.cli.parser import summary
from comparator.reports.layer_table import FROM_ZERO, FROM_ZERO_LEGEND
from comparator.results import load_report
from dumper.cli.main import build_parser as build_dumper_parser
from dumper.errors import UsageError
from tests.conftest import run_cli, subprocess_env

COMMANDS = ["bisect", "calibrate", "collect", "drill", "import-sglang", "logprobs", "regress", "store"]
STORE_COMMANDS = ["ls", "show", "promote", "prune"]


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> dict[str, Path]:
    """Dumps of the same prompts with eager and sdpa attention (a benign pair), every layer."""
    root = tmp_path_factory.mktemp("subcommands")
    for attn in ("eager", "sdpa"):
        r = run_cli("dumper", "run", "--layers", "all", "--attn", attn, "--quiet", "--out", root / attn)
        assert r.returncode == 0, r.stderr
    return {"eager": root / "eager", "sdpa": root / "sdpa"}


def _one_line_error(r: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: ") and "Traceback" not in r.stderr, r.stderr
    for needle in needles:
        assert needle in r.stderr, r.stderr
    assert r.stdout == ""


def _listed(help_text: str, parsers: dict) -> None:
    """Each of ``parsers`` has exactly one line in ``help_text``: its name, then its description's first sentence."""
    for name, parser in parsers.items():
        lines = [x for x in help_text.splitlines() if re.match(rf"^ +{re.escape(name)} {{2,}}\S", x)]
        assert len(lines) == 1, (name, help_text)
        assert lines[0].split(None, 1)[1] == summary(parser.description), lines[0]
        assert parser.description.startswith(lines[0].split(None, 1)[1])  # the line is the subcommand's own


def test_help_lists_every_subcommand_with_one_line():
    commands = build_parser().commands.choices
    assert sorted(commands) == COMMANDS
    r = run_cli("comparator", "--help")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    _listed(r.stdout, commands)
    assert r.stdout.startswith("usage: python -m comparator BASELINE TARGET [options]\n")
    for flag in ("--threshold", "--noise", "--html", "--require-all", "--model", "--debug"):  # compare's flags
        assert flag in r.stdout, flag
    r = run_cli("comparator", "store", "--help")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    store = next(a for a in commands["store"]._actions if a.dest == "command")
    assert list(store.choices) == STORE_COMMANDS
    _listed(r.stdout, store.choices)


@pytest.mark.parametrize("argv", [[c] for c in COMMANDS] + [["store", c] for c in STORE_COMMANDS], ids=" ".join)
def test_each_subcommand_has_its_help(argv):
    r = run_cli("comparator", *argv, "--help")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout.startswith(f"usage: python -m comparator {' '.join(argv)} ")
    parser = build_parser().commands.choices[argv[0]]
    if len(argv) == 2:
        parser = next(a for a in parser._actions if a.dest == "command").choices[argv[1]]
    flags = {o for a in parser._actions for o in a.option_strings}
    assert flags and all(f in r.stdout for f in flags), flags


def test_parsing_and_help_load_no_torch(tmp_path):
    script = tmp_path / "no_torch.py"
    script.write_text(
        "import contextlib, io, sys\nfrom comparator.cli.main import build_parser, main\n"
        "for argv in (['--help'], ['import-sglang', '--help'], ['store', 'ls', '--help']):\n"
        "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "        main(argv)\n"
        "build_parser().parse_args(['import-sglang', 'SRC', '--out', 'DST'])\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=subprocess_env())
    assert r.returncode == 0, r.stdout + r.stderr


def test_import_sglang_takes_the_flags_of_the_converter():
    """The subcommand's parser (parsed without torch) and :func:`dumper.engines.sglang.main_import`'s, which
    runs the conversion, take the same arguments: usage and argument sections alike, word for word."""
    ours = run_cli("comparator", "import-sglang", "--help")
    theirs = run_cli("dumper.engines.sglang", "--help")
    assert ours.returncode == theirs.returncode == 0, ours.stderr + theirs.stderr
    for text in (ours.stdout, theirs.stdout):
        assert text.startswith("usage: python -m comparator import-sglang [-h] --out OUT"), text
    usage, args = (lambda t: t.split("\n\n")[0], lambda t: t[t.index("positional arguments:") :])
    assert usage(ours.stdout) == usage(theirs.stdout) and args(ours.stdout) == args(theirs.stdout)


@pytest.mark.slow
def test_compare_keeps_its_exit_codes(dumps, tmp_path):
    base, target = dumps["eager"], dumps["sdpa"]
    r = run_cli("comparator", base, target, "--json", tmp_path / "r.json", "--debug")
    assert r.returncode == 0 and "PASS" in r.stdout, r.stdout + r.stderr
    assert load_report(tmp_path / "r.json").passed
    r = run_cli("comparator", base, target, "--threshold", "0", "--token-threshold", "0", "--quiet")
    assert r.returncode == 1 and r.stdout.startswith("DIVERGED at layer 1"), r.stdout + r.stderr
    _one_line_error(run_cli("comparator", base, tmp_path / "missing"), "missing")
    _one_line_error(run_cli("comparator", base), "the following arguments are required: target")
    _one_line_error(run_cli("comparator", base, target, "--no-such-flag"), "python -m comparator: unrecognized")
    # a dump directory named like a command, or a plain word that exists, is compared
    shutil.copytree(base, tmp_path / "store")
    shutil.copytree(target, tmp_path / "mydump")
    r = run_cli("comparator", "./store", "mydump", "--quiet", cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.startswith("PASS"), r.stdout + r.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    ("word", "hint"),
    [("frobnicate", None), ("logprob", "did you mean 'logprobs'?"), ("stores", "did you mean 'store'?")],
)
def test_an_unknown_command_is_one_line(dumps, tmp_path, word, hint):
    for rest in ([], [dumps["sdpa"]], [dumps["eager"], dumps["sdpa"]]):
        r = run_cli("comparator", word, *rest, cwd=tmp_path)
        _one_line_error(
            r,
            f"python -m comparator: {word!r} is neither a command (bisect, calibrate, collect, "
            "drill, import-sglang, logprobs, regress, store) nor an existing dump directory",
            *([hint] if hint else []),
        )
    _one_line_error(
        run_cli("comparator", "store", "lss", "x"),
        "python -m comparator store: argument COMMAND: invalid choice: 'lss'",
    )


@pytest.mark.slow
def test_subcommands_run_through_the_parser(dumps, tmp_path):
    base, target = dumps["eager"], dumps["sdpa"]
    r = run_cli("comparator", "calibrate", base, target, "--out", tmp_path / "noise.json", "--quiet")
    assert r.returncode == 0 and r.stdout.startswith(f"wrote {tmp_path / 'noise.json'}: noise of "), r.stderr
    store = tmp_path / "runs"
    r = run_cli("comparator", "regress", base, "--store", store, "--bootstrap", "--quiet")
    assert r.returncode == 0, r.stdout + r.stderr
    r = run_cli("comparator", "regress", target, "--store", store, "--quiet", "--json", tmp_path / "regress.json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads((tmp_path / "regress.json").read_text())["label"] == "passed"
    r = run_cli("comparator", "store", "ls", store, "--label", "passed")
    assert r.returncode == 0 and "1 runs shown" in r.stdout, r.stdout + r.stderr
    _one_line_error(run_cli("comparator", "logprobs", base, target), "logprobs")  # dumps without logprobs
    _one_line_error(
        run_cli(
            "comparator", "collect", "--server", "http://127.0.0.1:9", "--api", "nope", "--out", tmp_path / "x.jsonl"
        ),
        "python -m comparator collect: argument --api: invalid choice",
    )
    assert not (tmp_path / "x.jsonl").exists()


VALID = [
    ["A", "B"],
    ["A", "B", "--model", "default@bfloat16", "--html", "r.html", "--markdown", "--debug"],
    ["--quiet", "A", "B"],
    ["logprobs", "A.jsonl", "B.jsonl", "--logprob-threshold", "kl_max=1e-3"],
    ["collect", "--server", "http://h:8000", "--api", "vllm", "--out", "o.jsonl", "--prompt", "hi"],
    ["calibrate", "A", "V1", "V2", "--out", "n.json"],
    ["import-sglang", "SRC", "--out", "DST", "--name", "a=b"],
    ["regress", "R", "--store", "S", "--model", "any-group", "--calibrate", "V1"],
    ["store", "ls", "S", "--label", "baseline"],
    ["store", "show", "S", "RUN"],
    ["store", "promote", "S", "RUN", "--calibrate", "V"],
    ["store", "prune", "S", "--keep", "3", "--dry-run"],
]
INVALID = [
    [],
    ["A"],
    ["A", "B", "C"],
    ["A", "B", "--store", "S"],
    ["logprobs", "A"],
    ["collect", "--api", "vllm"],
    ["calibrate", "A", "--out", "n.json"],
    ["regress", "R"],
    ["store"],
    ["store", "ls"],
    ["store", "prune", "S"],
    ["logprob", "A", "B"],
    ["import-sglang", "SRC"],
]


@pytest.mark.parametrize("argv", VALID, ids=" ".join)
def test_build_parser_accepts_every_valid_command_line(argv, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = build_parser().parse_args(argv)
    assert args.subcommand == (argv[0] if argv[0] in COMMANDS else "compare")
    assert list(tmp_path.iterdir()) == []  # parsed, nothing run


@pytest.mark.parametrize("argv", INVALID, ids=lambda a: " ".join(a) or "nothing")
def test_build_parser_refuses_an_invalid_command_line(argv, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match=r"^python -m comparator"):
        build_parser().parse_args(argv)


def test_dumper_build_parser_parses_as_main_does():
    args = build_dumper_parser().parse_args(["run", "--out", "d", "--layers", "-3..-1", "--debug"])
    assert (args.command, args.layers) == ("run", "-3..-1")
    assert build_dumper_parser().parse_args(["ls", "d", "--tensors"]).tensors
    for bad in (["run"], ["nope"], ["ls"]):
        with pytest.raises(UsageError, match=r"^python -m dumper"):
            build_dumper_parser().parse_args(bad)


def _column(table: str, title: str) -> list[str]:
    """The cells of column ``title`` of a rich table printed in ``table`` (one per body row)."""
    lines = table.splitlines()
    head = next(line for line in lines if f"┃ {title} " in line)
    index = [c.strip() for c in head.split("┃")].index(title)
    return [[c.strip() for c in line.split("│")][index] for line in lines if line.startswith("│")]


@pytest.mark.slow
def test_a_benign_pass_shows_no_inf_amplification(dumps, tmp_path):
    r = run_cli(
        "comparator",
        dumps["eager"],
        dumps["sdpa"],
        "--json",
        tmp_path / "r.json",
        "--markdown",
        tmp_path / "r.md",
        "--html",
        tmp_path / "r.html",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    report = load_report(tmp_path / "r.json")
    layer0 = next(a for a in report.amplification if a.layer == 0)
    assert layer0.before == 0 and layer0.after > 0 and layer0.ratio == float("inf")  # what the JSON still says
    assert json.loads((tmp_path / "r.json").read_text())["amplification"][0]["ratio"] is None  # inf as null
    cells = _column(r.stdout, "amplification")
    assert len(cells) == 8 and cells[0] == FROM_ZERO and "inf" not in cells, cells
    assert all(c == "-" or c.endswith("x") for c in cells[1:]), cells
    assert " ".join(FROM_ZERO_LEGEND.split()) in " ".join(r.stdout.split())
    md = (tmp_path / "r.md").read_text()
    rows = [line.strip("|").split(" | ") for line in md.splitlines() if re.match(r"^\| \d", line)]
    assert [c[6].strip() for c in rows][0] == FROM_ZERO and "inf" not in [c[6].strip() for c in rows]
    assert "amplification 'from 0': rel\\_diff 0 at the layer's input" in md
    page = (tmp_path / "r.html").read_text()
    body = page[page.index('id="layer-table"') :]
    body = body[: body.index("</table>")]
    row0 = re.findall(r"<tr class=\"([^\"]*)\">(.*?)</tr>", body)[0]
    assert re.findall(r"<td[^>]*>(.*?)</td>", row0[1])[6] == FROM_ZERO
    assert "introduced" not in row0[0] and "INTRODUCES ERROR" not in body  # a benign start, not introduced error
    assert 'id="amplification-legend"' in page


@pytest.mark.slow
def test_a_divergent_run_still_marks_the_layer_that_grows_from_0(dumps, tmp_path):
    r = run_cli(
        "comparator",
        dumps["eager"],
        dumps["sdpa"],
        "--threshold",
        "0",
        "--token-threshold",
        "0",
        "--html",
        tmp_path / "r.html",
        "--markdown",
        tmp_path / "r.md",
    )
    assert r.returncode == 1, r.stdout + r.stderr
    assert _column(r.stdout, "amplification")[0] == FROM_ZERO
    page = (tmp_path / "r.html").read_text()
    row0 = re.search(r'<tr class="([^"]*)"><td class="n" data-v="0">0</td>(.*?)</tr>', page)
    assert "introduced" in row0.group(1).split() and "INTRODUCES ERROR" in row0.group(2)
    md_row0 = next(line for line in (tmp_path / "r.md").read_text().splitlines() if line.startswith("| 0 |"))
    assert md_row0.strip("|").split(" | ")[6].strip() == f"**{FROM_ZERO}**"
