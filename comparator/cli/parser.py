"""The parser of ``python -m comparator``: a default command, or a subcommand named by the first word.

``python -m comparator BASELINE TARGET [options]`` compares two dumps: its options are the
top-level parser's own. A first word that names a subcommand (``logprobs``, ``store``, ...) hands
the rest of the line to that subcommand's parser, a real argparse subparser, so ``--help`` lists
every subcommand with the first sentence of its own description. Only the first word chooses, as
it always did: a dump directory named like a command is given as ``./store``. A first word that
reads as a command but is neither one nor an existing path is refused in one line (a typo such
as ``logprob`` must not be compared as a dump directory).

``CommandParser.parse_args(argv)`` parses any valid command line (``--debug`` included, which
:func:`~dumper.cli.common.guarded_main` takes out before) and raises
:class:`~dumper.errors.UsageError` on an invalid one, running nothing.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

from dumper.cli.common import Parser, split_debug

__all__ = ["CommandParser", "add_command", "summary", "COMMAND_DEST"]

COMMAND_DEST = "subcommand"
"""The attribute of a parsed command line naming its command (the default command's name without a subcommand)."""
_WORD = re.compile(r"[a-z][a-z0-9]*(?:-[a-z0-9]+)*\Z")
"""A first word that reads as a command rather than a path: lowercase letters and digits, inner dashes."""


def summary(description: str) -> str:
    """The first sentence of ``description``, without its period: a subcommand's line in ``--help``."""
    return re.split(r"(?<=\.)\s", description.strip(), maxsplit=1)[0].removesuffix(".")


def add_command(
    sub: argparse._SubParsersAction | None, name: str, description: str, *, prefix: str = "python -m comparator"
) -> argparse.ArgumentParser:
    """The parser of subcommand ``name``: a subparser of ``sub`` (listed by :func:`summary` of its
    description), or with ``sub`` None a parser of its own, ``prog`` ``"{prefix} {name}"``."""
    if sub is None:
        return Parser(prog=f"{prefix} {name}", description=description)
    return sub.add_parser(name, help=summary(description), description=description)


class CommandParser(Parser):
    """The default command's options, and subcommands (:attr:`commands`) chosen by the first word."""

    def __init__(self, *, prog: str, default: str, usage: str, description: str) -> None:
        super().__init__(prog=prog, usage=usage, description=description)
        self.default = default
        group = self.add_argument_group("commands", f"{prog} COMMAND --help shows a command's options")
        self.commands = Parser(prog=prog, add_help=False).add_subparsers(
            dest=COMMAND_DEST, metavar="COMMAND", prog=prog, parser_class=Parser
        )
        # listed in --help, never parsed as a positional argument of the default command
        group._group_actions.append(self.commands)
        self._action_groups.insert(0, self._action_groups.pop())  # the commands first

    def _route(
        self,
        args: Sequence[str] | None,
        namespace: argparse.Namespace | None,
    ) -> tuple[argparse.ArgumentParser | None, list[str], argparse.Namespace]:
        """(the subcommand's parser or None for the default command, the rest of ``args``, the namespace)."""
        argv, _ = split_debug(list(sys.argv[1:] if args is None else args))
        namespace = argparse.Namespace() if namespace is None else namespace
        command = self.commands.choices.get(argv[0]) if argv else None
        setattr(namespace, COMMAND_DEST, argv[0] if command is not None else self.default)
        if command is not None:
            return command, argv[1:], namespace
        if argv and _WORD.match(argv[0]) and not os.path.exists(argv[0]):
            close = difflib.get_close_matches(argv[0], list(self.commands.choices), n=1)
            self.error(
                f"{argv[0]!r} is neither a command ({', '.join(self.commands.choices)}) nor an existing "
                f"dump directory{f'; did you mean {close[0]!r}?' if close else ''}"
            )
        return None, argv, namespace

    def parse_known_args(
        self,
        args: Sequence[str] | None = None,
        namespace: Any = None,
    ) -> tuple[argparse.Namespace, list[str]]:
        command, rest, namespace = self._route(args, namespace)
        if command is None:
            return super().parse_known_args(rest, namespace)
        return command.parse_known_args(rest, namespace)

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> argparse.Namespace:
        """``args`` parsed by the subcommand its first word names (its errors under its own name), else
        by the default command."""
        command, rest, namespace = self._route(args, namespace)
        if command is None:
            return super().parse_args(rest, namespace)
        return command.parse_args(rest, namespace)
