"""What both CLIs share: an argument parser whose errors are one line, and the error-to-exit mapping."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence

from dumper.errors import EXIT_INTERNAL, EXIT_UNUSABLE, DriftscopeError, UsageError
from dumper.format.files import printable
from dumper.settings import env_settings

__all__ = ["Parser", "guarded_main", "DEBUG_FLAG", "silence_stdout", "EXIT_BROKEN_PIPE", "add_import_sglang_flags",
           "split_debug"]

EXIT_BROKEN_PIPE = 141
"""What a shell reports for a process killed by SIGPIPE (128 + 13): the reader of stdout went away."""
DEBUG_FLAG = "--debug"
"""Accepted anywhere on either CLI's command line: print the traceback of an internal error."""


class Parser(argparse.ArgumentParser):
    """``argparse`` that raises :class:`UsageError` (one line, exit 2) instead of printing usage."""

    def error(self, message: str) -> None:
        raise UsageError(f"{self.prog}: {message}")

    def format_help(self) -> str:
        return super().format_help() + (f"\n{DEBUG_FLAG} (anywhere): print the traceback of an internal error "
                                        "(also DRIFTSCOPE_DEBUG=1)\n")


def split_debug(argv: Sequence[str]) -> tuple[list[str], bool]:
    """Remove ``--debug`` from the options (not after ``--``, where it would be a positional)."""
    out, debug = [], False
    for i, a in enumerate(argv):
        if a == "--":
            out.extend(argv[i:])
            break
        if a == DEBUG_FLAG:
            debug = True
        else:
            out.append(a)
    return out, debug


@contextlib.contextmanager
def _debug_env(debug: bool) -> Iterator[None]:
    """``DRIFTSCOPE_DEBUG=1`` for the run when ``--debug`` asked for it (what an engine's processes print while it
    starts is then shown, :mod:`dumper.engines.held_output`); as it was, after."""
    before = os.environ.get("DRIFTSCOPE_DEBUG")
    if debug:
        os.environ["DRIFTSCOPE_DEBUG"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("DRIFTSCOPE_DEBUG", None)
        else:
            os.environ["DRIFTSCOPE_DEBUG"] = before


def guarded_main(run: Callable[[Sequence[str] | None], int], argv: Sequence[str] | None = None) -> int:
    """Call ``run(argv)`` and map what it raises to an exit code and one line on stderr.

    User errors (:class:`DriftscopeError`, an ``OSError`` on a named file) exit 2 or their own
    code; anything else is a bug in driftscope and exits 3 with a line asking for a report. The
    line has its control characters escaped (:func:`~dumper.format.files.printable`), so a name
    taken from a hostile file cannot drive the terminal. The traceback is printed only with
    ``--debug`` or ``DRIFTSCOPE_DEBUG=1``.

    Python warnings raised during the run (a library's FutureWarning while a model loads, say) are
    held back: shown after a run that ends normally, dropped before an error's one line (shown with
    ``--debug``), so nothing of a library's reaches the terminal ahead of driftscope's verdict.
    """
    args, debug = split_debug(list(sys.argv[1:] if argv is None else argv))
    held: list[warnings.WarningMessage] = []
    try:
        debug = debug or env_settings().debug
        with warnings.catch_warnings(record=True) as held, _debug_env(debug):
            rc = run(args)
        _show(held)
        return rc
    except DriftscopeError as e:
        if debug:
            _show(held)
            traceback.print_exc()
        print(f"error: {printable(str(e))}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `python -m dumper ls D | head`: not a bug, not a divergence
        silence_stdout()
        return EXIT_BROKEN_PIPE
    except OSError as e:
        if e.filename is None:  # not about a file the user named: a bug, not bad input
            return _internal(e, debug)
        if debug:
            traceback.print_exc()
        print(f"error: {printable(f'{e.filename}: {e.strerror or e}')}", file=sys.stderr)
        return EXIT_UNUSABLE
    except BaseException as e:  # noqa: BLE001 - the last line of defence: never exit 1 for a crash
        if isinstance(e, SystemExit):
            _show(held)  # argparse's own exits (--help, a bad flag) are no job's errors
            raise
        if debug:
            _show(held)
        return _internal(e, debug)


def _show(held: list[warnings.WarningMessage]) -> None:
    """Show warnings that :func:`guarded_main` held back, as Python would have shown them."""
    for w in held:
        warnings.showwarning(w.message, w.category, w.filename, w.lineno, w.file, w.line)


def _internal(e: BaseException, debug: bool) -> int:
    if debug:
        traceback.print_exc()
    detail = printable(" ".join(str(e).split())[:300])
    print(f"internal error: {type(e).__name__}{': ' + detail if detail else ''} -- this is a bug in driftscope; "
          f"please report it{'' if debug else ' (rerun with --debug for the traceback)'}", file=sys.stderr)
    return EXIT_INTERNAL


def silence_stdout() -> None:
    """Point stdout at /dev/null once its reader went away, so later writes and the exit flush cannot fail."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


def add_import_sglang_flags(p: argparse.ArgumentParser) -> None:
    """The flags of ``python -m comparator import-sglang``, defined once: the comparator's parser lists
    them (torch-free ``--help``), :func:`dumper.engines.sglang.main_import` parses them to run it."""
    p.add_argument("src", help="SGLang dump directory (DUMPER_DIR/EXP_NAME, holding the .pt files)")
    p.add_argument("--out", required=True, help="driftscope dump directory to create")
    p.add_argument("--name", action="append", default=[], metavar="SGLANG=DRIFTSCOPE",
                   help="map an SGLang tensor name to a driftscope name, {layer} = its layer_id (repeatable), "
                        "e.g. attn_in=model.layers.{layer}.self_attn.input")
    p.add_argument("--checkpoint", help="HF checkpoint directory of the run: its config gives the model identity")
