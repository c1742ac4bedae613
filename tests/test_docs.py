"""The docs hold up: README.md and docs/*.md link only to what exists, and their commands run.

Two checks, on the Markdown as text:

- every link to a local file resolves (relative to the page), and every ``#anchor``, to the same
  page or another one, names a heading of that page by GitHub's slug rule (lowercase, spaces to
  ``-``, punctuation other than ``-`` and ``_`` dropped; a repeated heading gets ``-1``, ``-2``);
- every command in a fenced ``bash`` block that starts with ``python -m dumper`` or ``python -m
  comparator`` parses with today's CLI: :func:`dumper.cli.main.build_parser` and
  :func:`comparator.cli.main.build_parser` (which parses the compare command line and every
  subcommand) are called in-process on it, as ``shlex`` splits it, after backslash-continued lines
  are joined, ``$ `` prompts and leading ``NAME=value`` environment assignments are stripped, and
  ``$NAME`` of a variable set earlier in the same block is substituted.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from dumper.errors import UsageError

ROOT = Path(__file__).resolve().parent.parent
PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))

UNRESOLVABLE = {
    "${v%%:*}": "a bash pattern expansion of a for-loop variable: each iteration of the loop passes other "
    "flags, which only bash computes (the loop's values are the plain flags listed in its `for` line)",
}
"""Shell substitutions a command may hold that this test cannot resolve, and why; a command holding one
is skipped, one holding any other unresolved ``$`` fails."""

_FENCE = re.compile(r"^(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_CODE_SPAN = re.compile(r"(`+).*?\1")
_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
_VARIABLE = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")
_OPERATORS = {"&&", "||", "|", ";", "&"}
_REDIRECTS = re.compile(r"\d*(>|>>|<)(&\d+)?")


def prose_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of every line outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line.lstrip()):
            fenced = not fenced
        elif not fenced:
            yield number, line


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: its rendered text (code spans and links as their text), lowercased,
    everything but letters, digits, ``-``, ``_`` and spaces dropped, spaces to ``-``."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").lower()
    return "".join(c for c in text if c.isalnum() or c in "-_ ").replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every anchor ``page`` defines, repeated headings numbered as GitHub numbers them."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for _, line in prose_lines(page.read_text(encoding="utf-8")):
        m = _HEADING.match(line)
        if m:
            base = slug(m[2])
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(f"{base}-{n}" if n else base)
    return out


@dataclass(frozen=True)
class Link:
    page: Path
    line: int
    target: str

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}: ({self.target})"


def local_links() -> list[Link]:
    """Every link of the pages that is not to a URL (code spans are not links)."""
    out = []
    for page in PAGES:
        for number, line in prose_lines(page.read_text(encoding="utf-8")):
            for m in _LINK.finditer(_CODE_SPAN.sub("", line)):
                if not re.match(r"[a-z][a-z0-9+.-]*:", m[1]):  # http:, https:, mailto: are not checked
                    out.append(Link(page, number, m[1]))
    return out


LINKS = local_links()


def test_the_pages_link_to_each_other() -> None:
    linked = {(link.page.parent / link.target.partition("#")[0]).resolve() for link in LINKS}
    assert len(PAGES) > 5 and len(LINKS) > 50, "README.md and docs/*.md: too few pages or links found"
    assert not [p for p in PAGES[1:] if p.resolve() not in linked], "a docs page nothing links to"


@pytest.mark.parametrize("link", LINKS, ids=str)
def test_local_link_resolves(link: Link) -> None:
    path, _, anchor = link.target.partition("#")
    target = (link.page.parent / path).resolve() if path else link.page
    assert target.exists(), f"{link}: no such file {target}"
    assert target.is_relative_to(ROOT), f"{link}: points outside the repository"
    if anchor:
        assert target.suffix == ".md", f"{link}: an anchor into a file that is not a Markdown page"
        assert anchor in anchors(target), f"{link}: {target.relative_to(ROOT)} has no heading #{anchor}"


@dataclass(frozen=True)
class Command:
    page: Path
    line: int
    cli: str
    argv: tuple[str, ...]
    skip: str = ""

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}: python -m {self.cli} {shlex.join(self.argv)}"


def bash_blocks(text: str) -> Iterator[tuple[int, list[tuple[int, str]]]]:
    """(first line number, [(line number, line)]) of every fenced ``bash`` block, continued lines joined."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```bash":
            start, body, i = i + 1, [], i + 1
            while i < len(lines) and not lines[i].strip().startswith("```"):
                number, line = i + 1, lines[i]
                while line.endswith("\\") and i + 1 < len(lines):
                    i += 1
                    line = line[:-1] + " " + lines[i].strip()
                body.append((number, line))
                i += 1
            yield start, body
        i += 1


def segments(tokens: list[str]) -> Iterator[list[str]]:
    """The simple commands of a tokenized line: split at ``&&``, ``|``, ``;``..., redirections dropped."""
    current: list[str] = []
    it = iter(tokens)
    for t in it:
        if t in _OPERATORS:
            yield current
            current = []
        elif _REDIRECTS.fullmatch(t):
            next(it, None)
        else:
            current.append(t)
    yield current


def block_commands(page: Path, body: list[tuple[int, str]]) -> Iterator[Command]:
    """The ``python -m dumper|comparator`` commands of one bash block, variables set in it substituted."""
    variables: dict[str, str] = {}
    pending: tuple[int, str] | None = None  # a line whose quote closes on a later line
    for number, line in body:
        if pending is not None:
            number, line = pending[0], pending[1] + "\n" + line
        line = line.strip().removeprefix("$ ")
        skip = next((f"{s}: {why}" for s, why in UNRESOLVABLE.items() if s in line), "")
        if not skip:
            line = _VARIABLE.sub(lambda m: variables.get(m[1] or m[2], m[0]), line)
        try:
            tokens = shlex.split(line, comments=True) if not skip else line.split()
        except ValueError:  # no closing quotation yet
            pending = (number, line)
            continue
        pending = None
        for words in segments(tokens):
            if len(words) == 1 and _ASSIGNMENT.match(words[0]):  # NAME=value on its own: a shell variable
                name, _, value = words[0].partition("=")
                variables[name] = value
            while words and _ASSIGNMENT.match(words[0]):  # FOO=1 python -m ...: the command's environment
                words = words[1:]
            if len(words) >= 3 and words[:2] == ["python", "-m"] and words[2] in ("dumper", "comparator"):
                yield Command(page, number, words[2], tuple(words[3:]), skip)


def doc_commands() -> list[Command]:
    return [
        c
        for page in PAGES
        for _, body in bash_blocks(page.read_text(encoding="utf-8"))
        for c in block_commands(page, body)
    ]


COMMANDS = doc_commands()


def parser_of(cli: str) -> Callable[[], object]:
    if cli == "dumper":
        from dumper.cli.main import build_parser
    else:
        from comparator.cli.main import build_parser
    return build_parser


def test_the_quick_start_is_among_the_commands() -> None:
    readme = [c for c in COMMANDS if c.page.name == "README.md"]
    assert {"dumper", "comparator"} <= {c.cli for c in readme}, "README.md: the quick start's commands were not found"
    assert len(COMMANDS) > 40, f"only {len(COMMANDS)} commands found in the docs' bash blocks"


def test_ci_runs_the_readme_test_command() -> None:
    """``.ci/run`` runs exactly the README's test command (the bash block that runs pytest)."""
    ci = [
        line
        for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
        if "pytest" in line and not line.startswith("#")
    ]
    readme = [
        line
        for _, body in bash_blocks(PAGES[0].read_text(encoding="utf-8"))
        for _, line in body
        if "python -m pytest" in line
    ]
    assert len(ci) == 1 and ci == readme, f".ci/run runs {ci}, the README says {readme}"


@pytest.mark.parametrize("command", COMMANDS, ids=str)
def test_doc_command_parses(command: Command, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if command.skip:
        pytest.skip(f"{command}: {command.skip}")
    monkeypatch.chdir(tmp_path)  # the paths a command names exist nowhere, whatever the checkout holds
    assert not [w for w in command.argv if "$" in w], f"{command}: a shell substitution this test cannot resolve"
    parser = parser_of(command.cli)()
    try:
        parser.parse_args(list(command.argv))  # type: ignore[attr-defined]
    except UsageError as e:
        pytest.fail(f"{command}: does not parse: {e}")
    except SystemExit as e:
        if e.code not in (0, None):
            pytest.fail(f"{command}: does not parse (exit {e.code})")
