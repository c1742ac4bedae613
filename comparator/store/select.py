"""Baseline selection: only comparable runs, never a failed one, the latest that remains.

The rules come from SGLang's ``precision_baseline_store`` as the seed describes it:

* only runs with the same model and the same ``capture_signature`` (exact JSON equality) are
  candidates: tensors captured differently are never forced into a comparison;
* runs labelled ``failed`` are never selected: a failed run that became the next baseline
  would launder a lasting regression (the next, unchanged buggy run would pass against it);
  nor are ``bisect`` runs: an old build a bisection tested is evidence, not the latest good run;
* of the remaining ``baseline`` and ``passed`` runs the latest wins;
* runs from another environment (see :mod:`.environment`) are not comparable either; when
  every candidate comes from another environment, selection refuses and names the fields.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol, runtime_checkable

from comparator.store.environment import describe_differences, env_differences, env_key
from comparator.store.errors import EnvMismatchError
from comparator.store.record import RunEntry, RunRecord, signature_key

__all__ = ["select_baseline", "candidates", "current_baselines", "Listable"]


@runtime_checkable
class Listable(Protocol):
    """Anything that lists run entries, e.g. a :class:`~comparator.store.RunStore`."""

    def runs(self) -> list[RunEntry]: ...


def _entries(store: Listable | Iterable[RunEntry]) -> list[RunEntry]:
    return store.runs() if isinstance(store, Listable) else list(store)


def candidates(store: Listable | Iterable[RunEntry], model: str, signature: Mapping[str, Any]) -> list[RunRecord]:
    """Complete ``baseline`` and ``passed`` runs of ``model`` with exactly this capture signature, oldest first."""
    sig = signature_key(signature)
    recs = [e.record for e in _entries(store) if e.complete and e.record is not None]
    return sorted(
        (r for r in recs if r.model == model and r.label.selectable and signature_key(r.capture_signature) == sig),
        key=lambda r: r.run_id,
    )


def select_baseline(
    store: Listable | Iterable[RunEntry],
    model: str,
    signature: Mapping[str, Any],
    environment: Mapping[str, Any],
    *,
    allow_env_mismatch: bool = False,
) -> RunRecord | None:
    """The run a new run of ``model`` with ``signature`` from ``environment`` is compared against.

    Args:
        store: a :class:`RunStore`, or entries already listed from one.
        model: the model name runs are grouped by.
        signature: the new run's capture signature; only exactly equal ones are candidates.
        environment: the new run's environment fingerprint (a dump manifest's ``environment``).
        allow_env_mismatch: when no candidate comes from this environment, take the latest
            candidate anyway instead of raising.

    Returns the latest complete run with the same model, signature and environment labelled
    ``baseline`` or ``passed``, or ``None`` when no run of this model and signature exists.

    Raises:
        EnvMismatchError: candidates exist, but none from this environment (and
            ``allow_env_mismatch`` is false); the message names the differing fields.
    """
    cands = candidates(store, model, signature)
    if not cands:
        return None
    key = env_key(environment)
    same_env = [r for r in cands if env_key(r.environment) == key]
    if same_env:
        return same_env[-1]
    latest = cands[-1]
    if allow_env_mismatch:
        return latest
    diffs = env_differences(latest.environment, environment)
    raise EnvMismatchError(
        f"no baseline of model {model!r} from this environment: the latest comparable run {latest.run_id} "
        f"differs in {describe_differences(diffs)}; a baseline from other hardware or software is meaningless, "
        f"so record a new baseline for this environment with --bootstrap, or compare anyway with "
        f"--allow-env-mismatch",
        tuple(diffs),
    )


def current_baselines(store: Listable | Iterable[RunEntry]) -> dict[str, RunRecord]:
    """The run :func:`select_baseline` picks for each (model, signature, environment) in the store, by run id."""
    latest: dict[tuple[str, str, tuple[Any, ...]], RunRecord] = {}
    for e in _entries(store):
        r = e.record
        if not e.complete or r is None or not r.label.selectable:
            continue
        k = (r.model, signature_key(r.capture_signature), env_key(r.environment))
        if k not in latest or r.run_id > latest[k].run_id:
            latest[k] = r
    return {r.run_id: r for r in latest.values()}
