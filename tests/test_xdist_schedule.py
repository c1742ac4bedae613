"""The suite's xdist scheduling (``tests/xdist_schedule.py``): whole modules, shared-fixture groups, heaviest first."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import ROOT
from tests.xdist_schedule import GROUPS, HEAVY, unit_of


def test_a_module_is_one_unit_and_a_group_of_modules_is_one() -> None:
    assert (
        unit_of("tests/a/test_x.py::test_one")
        == unit_of("tests/a/test_x.py::TestC::test_two[1]")
        == "tests/a/test_x.py"
    )
    for group, modules in GROUPS.items():
        assert {unit_of(f"{m}::test_any") for m in modules} == {group}


def test_the_modules_it_names_exist() -> None:  # a rename would silently drop a module from its group or place
    named = [m for modules in GROUPS.values() for m in modules] + [u for u in HEAVY if u not in GROUPS]
    assert [m for m in named if not (ROOT / m).is_file()] == []
    assert Path(__file__).relative_to(ROOT).as_posix() == unit_of(f"{Path(__file__).relative_to(ROOT).as_posix()}::t")
