"""The tree is formatted and linted by ruff, by the rules ``pyproject.toml`` states (``[tool.ruff]``).

The ruff version is pinned in the ``test`` extra, since formatting changes between versions; with
another one installed the check skips on a developer machine and fails under ``CI=true``.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT


def _ruff() -> list[str]:
    pin = re.search(r'"ruff==([^"]+)"', (ROOT / "pyproject.toml").read_text())
    assert pin, "pyproject.toml's test extra pins ruff"
    try:
        have = importlib.metadata.version("ruff")
    except importlib.metadata.PackageNotFoundError:
        have = None
    if have != pin.group(1):
        why = f"ruff {pin.group(1)} is not installed (found {have}): pip install -e '.[test]'"
        pytest.fail(why) if os.environ.get("CI") == "true" else pytest.skip(why)
    return [sys.executable, "-m", "ruff"]


@pytest.mark.parametrize(
    "command", [["format", "--check"], ["check", "--output-format", "concise"]], ids=["format", "check"]
)
def test_ruff_passes_on_the_tree(command: list[str]) -> None:
    done = subprocess.run([*_ruff(), *command, "."], cwd=ROOT, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
