"""Fuzzing the run store: hostile run records, entry kinds and names against the real CLI.

Each example copies a real store (two real runs stored by ``regress``), adds a *victim*: a clone
of its latest run under a newer id, so that ``regress`` would pick it if it trusted it. Then it
mutates the victim's ``run.json`` (types, keys, huge values, deep nesting, bytes), turns entries
of the victim into other kinds (directory, FIFO, file, symlink out of the store, dangling link,
missing), renames it, and adds odd entries under ``runs/``. Properties, for ``store ls``,
``store show``, ``store prune``, ``store promote`` and ``regress`` run in-process through
:func:`comparator.cli.main.main`:

* the exit code is 0, 1 or 2, never 3 (a crash), and nothing blocks (a FIFO is never opened);
* nothing under the sentinel ``outside/`` folder is opened (an audit hook watches ``open``), and
  ``store prune --keep 0`` and ``store promote`` change nothing there;
* a victim that does not list as complete is never selected: ``regress`` passes against the
  previous run.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from comparator.cli.main import main
from comparator.store import RunStore
from comparator.store.runid import new_run_id
from dumper.format import load_manifest
from tests.comparator.store.test_store_boundary import become, clone_run, make_store, no_hang, opens_under
from tests.storeutil import synth_dump

RECORD_KEYS = (
    "format_version",
    "run_id",
    "created_at",
    "model",
    "pass_label",
    "baseline_run",
    "summary",
    "capture_signature",
    "environment",
    "model_identity",
    "dump_format_version",
    "dump_created_at",
    "promoted",
    "surprise",
)
SUMMARY_KEYS = ("passed", "matched", "first_divergent", "logprobs_passed", "threshold", "token_threshold", "error")
TARGETS = (".", "run.json", "COMPLETE", "report.json", "dump", "dump/manifest.json", "dump/DATA")
KINDS = ("dir", "fifo", "file", "symlink-out", "dangling", "missing")

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=False)
    | st.text(max_size=12)
    | st.sampled_from(
        [
            "baseline",
            "passed",
            "failed",
            "../../outside",
            "/etc/passwd",
            "m[/]",
            "\udcff",
            "20261130T094716.302031123Z-a1b2c3",
        ]
    ),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
    max_leaves=10,
)
huge = st.sampled_from(["long-string", "deep", "wide"]).map(
    lambda k: {"long-string": "x" * 2_000_000, "deep": json.loads("[" * 200 + "]" * 200), "wide": list(range(50_000))}[
        k
    ]
)
record_ops = st.one_of(
    st.tuples(st.just("set"), st.sampled_from(RECORD_KEYS), json_values | huge),
    st.tuples(st.just("drop"), st.sampled_from(RECORD_KEYS), st.none()),
    st.tuples(st.just("summary"), st.sampled_from(SUMMARY_KEYS), json_values),
    st.tuples(
        st.just("bytes"),
        st.none(),
        st.binary(max_size=48)
        | st.sampled_from([b"[" * 50_000, b"NaN", b'{"format_version": 1e400}', b"\xef\xbb\xbf{}", b"1" * 5000]),
    ),
)
names = st.one_of(
    st.text(st.characters(blacklist_characters="/\0", blacklist_categories=("Cs",)), min_size=1, max_size=10).filter(
        lambda n: n not in (".", "..")
    ),
    st.sampled_from(
        ["[bold]x", "m[/", "a\nb", "\udcff\udcfe", ".tmp-x", ".trash-20261130T094716.302031123Z-a1b2c3-00"]
    ),
    st.builds(lambda t: new_run_id(t)[0], st.integers(min_value=15 * 10**17, max_value=25 * 10**17)),
)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    a, a2, a3 = (synth_dump(root / n) for n in ("a", "a2", "a3"))
    store, base, passed = make_store(root, a, a2)
    return {"root": root, "store": store, "base": base, "passed": passed, "run": a3}


def _tree(top: Path) -> set[str]:
    """Every path under ``top`` (symlinks not followed): what a prune through a link would delete."""
    return {os.path.join(folder, n) for folder, dirs, files in os.walk(top) for n in (*dirs, *files)}


def _mutate_record(path: Path, ops: list[tuple]) -> None:
    d = json.loads(path.read_text())
    raw = None
    for op, key, value in ops:
        if op == "set":
            d[key] = value
        elif op == "drop":
            d.pop(key, None)
        elif op == "summary":
            d["summary"] = {**(d["summary"] if isinstance(d.get("summary"), dict) else {}), key: value}
        else:
            raw = value
    path.write_bytes(raw if raw is not None else json.dumps(d).encode())


def _apply(
    store: Path,
    victim: str,
    outside: Path,
    ops: list[tuple],
    kinds: list[tuple[str, str]],
    rename: str | None,
    extras: list[tuple[str, str]],
) -> str:
    """Mutate the victim run and add odd entries; the victim's name afterwards."""
    runs = store / "runs"
    _mutate_record(runs / victim / "run.json", ops)
    (data,) = load_manifest(runs / victim / "dump").files
    for target, kind in kinds:
        path = runs / victim / target.replace("DATA", data) if target != "." else runs / victim
        if not os.path.lexists(path) and kind != "missing":
            continue  # its folder became something else already
        if kind == "missing":
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            elif os.path.lexists(path):
                path.unlink()
        else:
            become(path, kind, outside)
    if rename is not None and os.path.lexists(runs / victim) and not os.path.lexists(runs / rename):
        os.rename(runs / victim, runs / rename)
        victim = rename
    for name, kind in extras:
        if not os.path.lexists(runs / name):
            (runs / name).write_text("x")
            become(runs / name, kind if kind != "missing" else "dir", outside)
    return victim


@pytest.mark.slow
@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.just([]) | st.lists(record_ops, max_size=3),  # a sound record half the time: then its entries count
    kinds=st.lists(st.tuples(st.sampled_from(TARGETS), st.sampled_from(KINDS)), max_size=2),
    rename=st.integers(0, 3).flatmap(lambda i: names if i == 0 else st.none()),
    extras=st.lists(st.tuples(names, st.sampled_from(KINDS)), max_size=3),
)
def test_hostile_stores_exit_0_1_or_2_read_nothing_outside_and_never_pick_a_corrupt_run(
    pristine, ops, kinds, rename, extras
):
    work = Path(tempfile.mkdtemp(dir=pristine["root"]))
    try:
        store, outside = work / "store", work / "outside"
        shutil.copytree(pristine["store"], store, symlinks=True)
        outside.mkdir()
        (outside / "secret").write_text("never read me")
        victim = _apply(store, clone_run(store, pristine["passed"]), outside, ops, kinds, rename, extras)
        before = _tree(outside)
        with no_hang(30), opens_under(outside) as opened:
            entries = {e.name: e for e in RunStore(store).runs()}
            codes = [
                main(["store", "ls", str(store)]),
                main(["store", "show", str(store), victim]),
                main(["store", "prune", str(store), "--keep", "1", "--dry-run"]),
                main(
                    ["regress", str(pristine["run"]), "--store", str(store), "--quiet", "--json", str(work / "r.json")]
                ),
            ]
            codes += [
                main(["store", "promote", str(store), victim]),
                main(["store", "prune", str(store), "--keep", "0"]),
            ]
        assert all(c in (0, 1, 2) for c in codes), codes
        assert opened == [], opened
        assert _tree(outside) == before and (outside / "secret").read_text() == "never read me"
        victim_entry = entries.get(victim)
        event(f"victim {victim_entry.status if victim_entry else 'gone'}; exit codes {codes}")
        if victim_entry is None or not victim_entry.complete:
            result = json.loads((work / "r.json").read_text())
            assert codes[3] == 0 and result["baseline_run"] == pristine["passed"], (victim_entry, result)
    finally:
        shutil.rmtree(work, ignore_errors=True)
