"""How each side ran (eager, compiled, CUDA graphs) and whether its capture was proven harmless.

A compiled engine is captured through the graph-safe tap (:mod:`dumper.hooks.tap`), which is
traced into the graph, so the probe could in principle change what the engine computes.
``dumper run --observer-check`` runs the job again without capture and records in the manifest
(``extra.observer``) whether the logprobs came out bit for bit the same. :func:`run_mode_notes`
turns both manifests into verdict notes:

- the sides ran in different modes: a difference may come from compilation, not from a bug;
- a side's observer check found its capture changed its numbers: its hidden states are suspect;
- a side ran compiled and was never checked.

A bit-exact check adds no note: notes are caveats, and a compiled side without a caveat is one
whose capture was checked. Where the mode comes from (the manifest contract): vLLM dumps
``extra.engine.settings.compiled`` / ``.cuda_graphs``; transformers dumps ``extra.compiled``
(they never use CUDA graphs). A side that records neither (older dumps, other engines) has
an unknown mode and gets no mode note. Manifests are user files: a value of the wrong type is
"unknown", and any text from them is escaped before it reaches a note.

Example::

    from comparator.judging.runmode import run_mode, run_mode_notes
    run_mode(manifest).describe()          # 'compiled (vLLM, CUDA graphs)'
    run_mode_notes(base_manifest, target_manifest)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dumper.format import Manifest
from dumper.format.files import printable, show

__all__ = ["RunMode", "run_mode", "run_mode_notes", "observer_note"]


@dataclass(frozen=True)
class RunMode:
    """How one side ran; None: the manifest does not say (or says it with the wrong type)."""

    compiled: bool | None
    cuda_graphs: bool | None
    engine: str
    """Who compiled: ``torch.compile`` for a transformers dump, else the engine's name (escaped)."""

    def describe(self) -> str:
        """``eager``, ``compiled (torch.compile)``, ``compiled (vLLM, CUDA graphs)``, ..."""
        graphs = ", CUDA graphs" if self.cuda_graphs else ""
        if self.compiled:
            return f"compiled ({self.engine}{graphs})"
        return f"eager ({self.engine}{graphs})" if graphs else "eager"


def _bool(v: Any) -> bool | None:
    return v if isinstance(v, bool) else None


def _engine_name(name: Any) -> str:
    if not isinstance(name, str) or not name:
        return "engine"
    return {"vllm": "vLLM"}.get(name, printable(name[:40]))


def run_mode(manifest: Manifest) -> RunMode:
    """The side's run mode from its manifest's ``extra`` (see the module docstring)."""
    extra = manifest.extra
    engine = extra.get("engine")
    if isinstance(engine, Mapping):
        settings = engine.get("settings")
        settings = settings if isinstance(settings, Mapping) else {}
        return RunMode(
            _bool(settings.get("compiled")), _bool(settings.get("cuda_graphs")), _engine_name(engine.get("name"))
        )
    compiled = _bool(extra.get("compiled"))
    return RunMode(compiled, None if compiled is None else False, "torch.compile")


def _value(v: Any) -> str:
    """A manifest value for a note: an integer as is, a float as ``%.3g`` (``nan``, ``inf``), anything
    else as its escaped, bounded JSON (a container only by its kind)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return f"a JSON {'object' if isinstance(v, Mapping) else 'list'}" if isinstance(v, (Mapping, list)) else show(v)
    if isinstance(v, int):
        return str(v) if abs(v) < 10**18 else "a huge integer"
    return f"{v:.3g}"


def _where(observer: Mapping[str, Any]) -> str:
    """``largest |Δ| X at sequence S, position P``, from what the record holds (possibly nothing)."""
    at = ", ".join(f"{k} {_value(observer[k])}" for k in ("sequence", "position") if observer.get(k) is not None)
    parts = [f"largest |Δ| {_value(observer['max_abs_diff'])}"] if observer.get("max_abs_diff") is not None else []
    return " ".join(parts + ([f"at {at}"] if at else []))


def observer_note(side: str, manifest: Manifest) -> str | None:
    """The note on ``side``'s capture: it changed the numbers, it was never checked (compiled
    sides only), its check is unreadable; None when proven bit-exact, or eager and unchecked."""
    observer = manifest.extra.get("observer")
    if observer is None or (isinstance(observer, Mapping) and observer.get("checked") is False):
        if not run_mode(manifest).compiled:
            return None
        return (
            f"{side} ran compiled and its capture was never checked against a probe-free run "
            "(dumper run --observer-check)"
        )
    exact = observer.get("bit_exact") if isinstance(observer, Mapping) else None
    if exact is True:
        return None
    if exact is False:
        where = _where(observer)
        return (
            f"{side}: capture changed its own numbers (observer check{f': {where}' if where else ''}); "
            "its hidden states may not be what the engine computes without the probe"
        )
    field, value = (
        ("extra.observer.bit_exact", observer.get("bit_exact"))
        if isinstance(observer, Mapping)
        else ("extra.observer", observer)
    )
    return f"{side}: unreadable observer check ({field} is {_value(value)}); its capture is not proven harmless"


def _mode_note(baseline: RunMode, target: RunMode) -> str | None:
    """Say how the sides ran when they ran differently (both modes known)."""
    if baseline.compiled is None or target.compiled is None:
        return None
    causes = []
    if baseline.compiled != target.compiled:
        causes.append("compilation")
    if (
        baseline.cuda_graphs is not None
        and target.cuda_graphs is not None
        and baseline.cuda_graphs != target.cuda_graphs
    ):
        causes.append("CUDA graphs")
    if not causes:
        return None
    return (
        f"baseline ran {baseline.describe()}, target {target.describe()}; "
        f"differences may come from {' and '.join(causes)}"
    )


def run_mode_notes(baseline: Manifest, target: Manifest) -> tuple[str, ...]:
    """The verdict's notes on how the sides ran and whether each capture was proven harmless."""
    notes = [
        _mode_note(run_mode(baseline), run_mode(target)),
        observer_note("baseline", baseline),
        observer_note("target", target),
    ]
    return tuple(n for n in notes if n is not None)
