"""Odd comparator arguments: exit 2 with one line, never a silent fallback or a replaced special file."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest

import dumper
from comparator.cli.main import main as comparator_main
from dumper.cli.common import guarded_main
from dumper.errors import EXIT_INTERNAL, EXIT_OK, EXIT_UNUSABLE, InternalError


def _layer_pair(root: Path, layers: int) -> tuple[Path, Path]:
    """A dump of ``layers`` seeded [4, 8] self-attention inputs, and a byte-identical copy of it."""
    import torch

    a = root / "a"
    with dumper.capture(None, a, model_name="odd"):
        for layer in range(layers):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(layer))  # [tokens, hidden]
            dumper.dump(
                f"model.layers.{layer}.self_attn.input",
                x,
                layer=layer,
                point="input",
                positions=range(4),
                sequence_ids=[0] * 4,
            )
    shutil.copytree(a, root / "b")
    return a, root / "b"


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    return _layer_pair(tmp_path_factory.mktemp("clib"), 2)


def _run(capsys, *argv) -> tuple[int, str]:
    code = comparator_main([str(a) for a in argv])
    err = capsys.readouterr().err
    return code, err


@pytest.mark.parametrize("threads", ["0", "-1", "100000"])
def test_thread_counts_out_of_range(pair, capsys, threads):
    code, err = _run(capsys, *pair, "--threads", threads, "--quiet")
    assert code == EXIT_UNUSABLE and "threads must be between 1 and 256" in err and err.count("\n") == 1


def test_an_explicit_threshold_row_must_exist(pair, capsys):
    """A typo in --model must not fall back to the loose default thresholds."""
    code, err = _run(capsys, *pair, "--model", "tiny-lama", "--quiet")
    assert code == EXIT_UNUSABLE and "'tiny-lama': no such row" in err and "tiny-llama" in err
    assert _run(capsys, *pair, "--model", "tiny-llama", "--quiet")[0] == EXIT_OK


@pytest.mark.parametrize("flag", ["--json", "--csv", "--html", "--markdown"])
def test_a_report_never_replaces_a_special_file(pair, capsys, tmp_path, flag):
    target = tmp_path / "fifo"
    os.mkfifo(target)
    code, err = _run(capsys, *pair, "--quiet", flag, target)
    assert code == EXIT_UNUSABLE and "not a regular file; refusing to replace it" in err
    assert stat.S_ISFIFO(os.lstat(target).st_mode)


def test_a_report_is_written_through_a_symlink(pair, capsys, tmp_path):
    real = tmp_path / "real.json"
    real.write_text("{}")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    assert _run(capsys, *pair, "--quiet", "--json", link)[0] == EXIT_OK
    assert link.is_symlink() and '"passed": true' in real.read_text()


def test_internal_errors_exit_3_with_one_line(capsys, monkeypatch):
    def boom(argv):
        raise InternalError("an invariant broke")

    assert guarded_main(boom, []) == EXIT_INTERNAL
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bug in driftscope" in err and "--debug" in err and "Traceback" not in err
    monkeypatch.delenv("DRIFTSCOPE_DEBUG", raising=False)
    seen = []
    assert (
        guarded_main(lambda argv: seen.append(os.environ.get("DRIFTSCOPE_DEBUG")) or boom(argv), ["--debug"])
        == EXIT_INTERNAL
    )
    assert "Traceback" in capsys.readouterr().err
    assert seen == ["1"] and "DRIFTSCOPE_DEBUG" not in os.environ  # for the run (an engine's start), not after
    assert guarded_main(boom, []) == EXIT_INTERNAL and "Traceback" not in capsys.readouterr().err
    monkeypatch.setenv("DRIFTSCOPE_DEBUG", "1")
    assert guarded_main(lambda argv: (_ for _ in ()).throw(KeyError("k")), []) == EXIT_INTERNAL
    assert "Traceback" in capsys.readouterr().err


def test_an_oserror_without_a_file_is_a_bug_not_bad_input(capsys):
    def boom(argv):
        raise OSError("socket went away")

    assert guarded_main(boom, []) == EXIT_INTERNAL

    def missing(argv):
        open("/nonexistent/driftscope-input")  # noqa: SIM115 - the OSError is the point

    assert guarded_main(missing, []) == EXIT_UNUSABLE
    assert "/nonexistent/driftscope-input" in capsys.readouterr().err


@pytest.fixture(scope="module")
def wide_pair(tmp_path_factory) -> tuple[Path, Path]:
    """Dumps of 1,500 small tensors: ``--tensors`` and ``ls --tensors`` print far more than a pipe holds."""
    return _layer_pair(tmp_path_factory.mktemp("wide"), 1500)


def _first_line_then_close(*args: str | os.PathLike[str]) -> int:
    """Run a CLI, read one line of its stdout, close the pipe (as ``| head -1`` does), return its exit code."""
    import subprocess
    import sys

    from tests.conftest import subprocess_env

    env = subprocess_env()
    p = subprocess.Popen(
        [sys.executable, "-m", *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    assert p.stdout is not None and p.stdout.readline()
    p.stdout.close()
    _, err = p.communicate(timeout=120)
    assert b"Traceback" not in err and b"internal error" not in err, err
    return p.returncode


@pytest.mark.slow
def test_a_reader_that_goes_away_does_not_change_the_verdict(wide_pair):
    """``comparator A B --tensors | head -1`` under pipefail: the exit code is still the verdict (rich would exit 1)."""
    assert _first_line_then_close("comparator", *wide_pair, "--tensors") == EXIT_OK


@pytest.mark.slow
def test_a_reader_that_goes_away_is_sigpipe_not_a_bug(wide_pair):
    from dumper.cli.common import EXIT_BROKEN_PIPE

    assert _first_line_then_close("dumper", "ls", wide_pair[0], "--tensors") == EXIT_BROKEN_PIPE


def test_empty_tensors_are_said_and_never_counted_as_matched(tmp_path, capsys):
    import torch

    a = tmp_path / "a"
    with dumper.capture(None, a, model_name="empty"):
        dumper.dump("x", torch.ones(2, 4), layer=0, point="input", positions=[0, 1], sequence_ids=[0, 0])
        dumper.dump("e", torch.ones(0, 4), layer=1, point="input")
    b = tmp_path / "b"
    shutil.copytree(a, b)
    code = comparator_main([str(a), str(b), "--quiet"])
    assert code == EXIT_OK and capsys.readouterr().out.strip() == "PASS (1 empty tensors: not compared)"
    only = tmp_path / "only"
    with dumper.capture(None, only, model_name="empty"):
        dumper.dump("e", torch.ones(0, 4), layer=1, point="input")
    shutil.copytree(only, tmp_path / "only2")
    code, err = _run(capsys, only, tmp_path / "only2")
    assert code == EXIT_UNUSABLE and "zero tensors match" in err and "1 empty" in err


_WARNS_THEN = """
import sys, warnings
from dumper.cli.common import guarded_main
from dumper.errors import UsageError

def run(argv):
    warnings.warn("`torch_dtype` is deprecated", FutureWarning)  # what a library says while a model loads
    if argv and argv[0] == "fail":
        raise UsageError("baseline: no router point")
    print("PASS")
    return 0

sys.exit(guarded_main(run, sys.argv[1:]))
"""


@pytest.mark.parametrize("argv", [["fail"], ["fail", "--debug"], []])
def test_a_library_warning_never_precedes_the_error_line(tmp_path, argv):
    """An error is one line with nothing of a library's before it; ``--debug`` shows the warning, and a run that
    ends normally still shows it (after its output)."""
    import subprocess
    import sys

    from tests.conftest import subprocess_env

    r = subprocess.run(
        [sys.executable, "-c", _WARNS_THEN, *argv], capture_output=True, text=True, timeout=60, env=subprocess_env()
    )
    if argv == ["fail"]:
        assert r.returncode == EXIT_UNUSABLE and r.stderr == "error: baseline: no router point\n", r.stderr
    elif argv == ["fail", "--debug"]:
        assert r.returncode == EXIT_UNUSABLE and "FutureWarning" in r.stderr and "Traceback" in r.stderr
        assert r.stderr.rstrip().splitlines()[-1] == "error: baseline: no router point"
    else:
        assert r.returncode == EXIT_OK and r.stdout == "PASS\n" and "FutureWarning: `torch_dtype`" in r.stderr
