"""What both CLIs share: an argument parser whose errors are one line, the error-to-exit mapping, and the flags
both CLIs take (``--out``, ``--quiet``, ``--json``, the prompt flags, ``--top-k``), each defined once here.

Flags only the dumper's commands take are :mod:`dumper.cli.flags`'s, only the comparator's
:mod:`comparator.cli.args`', and a live server's (``--server``, ``--api``, ``--timeout``, ...)
:mod:`dumper.server.flags`', next to the checks of their values.
"""

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

__all__ = [
    "Parser",
    "guarded_main",
    "DEBUG_FLAG",
    "silence_stdout",
    "EXIT_BROKEN_PIPE",
    "add_import_sglang_flags",
    "split_debug",
    "out_flag",
    "quiet_flag",
    "json_flag",
    "prompt_flag",
    "input_ids_flag",
    "prompt_source_flags",
    "top_k_flag",
    "DUMP_OUT_HELP",
    "QUIET_HELP",
]

EXIT_BROKEN_PIPE = 141
"""What a shell reports for a process killed by SIGPIPE (128 + 13): the reader of stdout went away."""
DEBUG_FLAG = "--debug"
"""Accepted anywhere on either CLI's command line: print the traceback of an internal error."""


class Parser(argparse.ArgumentParser):
    """``argparse`` that raises :class:`UsageError` (one line, exit 2) instead of printing usage."""

    def error(self, message: str) -> None:
        raise UsageError(f"{self.prog}: {message}")

    def format_help(self) -> str:
        return super().format_help() + (
            f"\n{DEBUG_FLAG} (anywhere): print the traceback of an internal error (also DRIFTSCOPE_DEBUG=1)\n"
        )


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
    print(
        f"internal error: {type(e).__name__}{': ' + detail if detail else ''} -- this is a bug in driftscope; "
        f"please report it{'' if debug else ' (rerun with --debug for the traceback)'}",
        file=sys.stderr,
    )
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
    out_flag(p, help="driftscope dump directory to create")
    p.add_argument(
        "--name",
        action="append",
        default=[],
        metavar="SGLANG=DRIFTSCOPE",
        help="map an SGLang tensor name to a driftscope name, {layer} = its layer_id (repeatable), "
        "e.g. attn_in=model.layers.{layer}.self_attn.input",
    )
    p.add_argument("--checkpoint", help="HF checkpoint directory of the run: its config gives the model identity")


DUMP_OUT_HELP = "dump directory to create"
"""``--out``'s help where the command writes a dump (``dumper run``, ``replay``, ``collect``)."""
QUIET_HELP = "no progress bar and no summary line"
"""``--quiet``'s help where the command draws a progress bar and ends with a summary line."""


def out_flag(p: argparse._ActionsContainer, help: str = DUMP_OUT_HELP, metavar: str | None = None) -> None:
    """``--out`` (required): what the command writes, which ``help`` names (a dump, a noise file, a JSONL file)."""
    p.add_argument("--out", required=True, metavar=metavar, help=help)


def quiet_flag(p: argparse._ActionsContainer, help: str = QUIET_HELP) -> None:
    """``--quiet``: print less; ``help`` says what the command still prints."""
    p.add_argument("--quiet", action="store_true", help=help)


def json_flag(p: argparse._ActionsContainer, what: str) -> None:
    """``--json FILE``: also write ``what`` (e.g. "the report") as JSON to FILE."""
    p.add_argument("--json", metavar="FILE", help=f"write {what} as JSON")


def factor_flag(p: argparse._ActionsContainer, *, default: float | None, help: str) -> None:
    """``--factor F``: a drill's limit, in multiples of the rounding an op's dtype predicts (``dumper drill``: an
    op beyond it is named; ``comparator drill``: two builds' outputs differing beyond it fail)."""
    p.add_argument("--factor", type=float, default=default, metavar="F", help=help)


def prompt_flag(p: argparse._ActionsContainer, help: str = "prompt text (repeatable)") -> None:
    """``--prompt TEXT`` (repeatable; ``None`` when not given, so a command can tell its own default apart)."""
    p.add_argument("--prompt", action="append", default=None, help=help)


def input_ids_flag(p: argparse._ActionsContainer) -> None:
    """``--input-ids 1,2,3`` (repeatable): prompts given as token ids, for a model without a tokenizer."""
    p.add_argument("--input-ids", action="append", default=None, help="comma-separated token ids (repeatable)")


def prompt_source_flags(p: argparse.ArgumentParser, prompt_help: str = "prompt text (repeatable)") -> None:
    """One of ``--prompt``, ``--prompts FILE.jsonl``, ``--input-ids``: where a job's prompts come from."""
    src = p.add_mutually_exclusive_group()
    prompt_flag(src, help=prompt_help)
    src.add_argument("--prompts", metavar="FILE.jsonl", help='JSONL: {"text": ...} or {"input_ids": [...]} per line')
    input_ids_flag(src)


def top_k_flag(
    p: argparse._ActionsContainer, help: str = "with --logprobs: record the top-K logprobs per position"
) -> None:
    """``--top-k K`` (default 0): how many of each position's top logprobs to record besides the actual token."""
    p.add_argument("--top-k", type=int, default=0, help=help)
