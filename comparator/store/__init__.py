"""Golden baselines for CI: a run store that only compares comparable runs and never launders a regression.

Example::

    from comparator.store import RunStore, select_baseline
    from dumper.format import load_manifest

    store = RunStore("ci-store")                         # a local directory, or s3://, gcs://, hf://, memory://
    m = load_manifest("dumps/nightly")
    base = select_baseline(store, m.model["name"], m.capture_signature, m.environment)
    print(base.run_id if base else "no baseline yet")

:func:`comparator.store.regress.regress` (also ``comparator.regress``) does the whole job: select,
compare, store the run labelled; ``python -m comparator regress`` and ``store`` are its CLI
(:mod:`comparator.cli.store`).

Modules: :mod:`~comparator.store.runstore` (:class:`RunStore`: put, get, list, promote, prune),
:mod:`~comparator.store.record` and :mod:`~comparator.store.types` (what a stored run holds),
:mod:`~comparator.store.select` (which run is the baseline), :mod:`~comparator.store.environment`
(which environment fields must match),
:mod:`~comparator.store.regress`, and the bytes: :mod:`~comparator.store.backend` (the
:class:`~comparator.store.backend_base.Backend` interface and the local directory) and
:mod:`~comparator.store.fsspec_backend` (any fsspec URL). A new storage backend is one
:class:`~comparator.store.backend_base.Backend` subclass, picked in :func:`~comparator.store.backend.open_backend`.

Names. In this package a **run** is one dump stored in a store, in its folder ``runs/<run_id>/``:

* :class:`RunRecord` is its ``run.json`` (label, run group, baseline, verdict summary): its
  :class:`Label` (:mod:`~comparator.store.labels`) and the typed parts in
  :mod:`~comparator.store.types`, :class:`RunSummary`, :class:`Calibration`, :class:`Promotion`;
* :class:`RunEntry` is one listed folder under ``runs/``, with its record if readable and its
  :class:`RunStatus` (complete, incomplete, corrupt or staging);
* a run's **model** (``RunRecord.model``, ``regress(model=...)``, ``--model`` of ``regress`` and
  ``store ls``) is its *run group*: the name runs are filed under and baselines picked from. It is
  not the *threshold row* that ``python -m comparator A B --model`` names in
  ``configs/logprob_thresholds.json``.

Not to be confused with: :class:`dumper.format.TensorRecord` (one tensor's entry in a dump's
manifest), :func:`comparator.logprobs.sources.engine_json.parse_record` (one engine response
line), ``Capture.record`` (the hooks storing one tensor), :func:`dumper.format.encode_runs`
(run-length encoding of positions) and ``python -m dumper run`` (a prefill job that writes a dump).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from comparator.exports import lazy_exports

_EXPORTS = {
    "COMPARED_ENV_FIELDS": "comparator.store.environment",
    "EnvDifference": "comparator.store.environment",
    "env_differences": "comparator.store.environment",
    "EnvMismatchError": "comparator.store.errors",
    "NoBaselineError": "comparator.store.errors",
    "StoreError": "comparator.store.errors",
    "RunEntry": "comparator.store.record",
    "RunStatus": "comparator.store.record",
    "RunRecord": "comparator.store.record",
    "StoredNoise": "comparator.store.record",
    "STAGING_GRACE_S": "comparator.store.runstore",
    "PruneResult": "comparator.store.runstore",
    "RunStore": "comparator.store.runstore",
    "candidates": "comparator.store.select",
    "current_baselines": "comparator.store.select",
    "select_baseline": "comparator.store.select",
    "LABELS": "comparator.store.labels",
    "Calibration": "comparator.store.types",
    "Label": "comparator.store.labels",
    "Promotion": "comparator.store.types",
    "RunSummary": "comparator.store.types",
}
"""Public name -> the module that defines it, imported on first use (PEP 562), as in :mod:`comparator`: the
comparator's command line parses ``regress`` and ``store`` flags without loading the store (fsspec)."""

__all__ = [
    "RunStore",
    "RunRecord",
    "RunEntry",
    "RunStatus",
    "Label",
    "RunSummary",
    "Calibration",
    "Promotion",
    "PruneResult",
    "StoredNoise",
    "select_baseline",
    "candidates",
    "current_baselines",
    "env_differences",
    "EnvDifference",
    "COMPARED_ENV_FIELDS",
    "LABELS",
    "STAGING_GRACE_S",
    "StoreError",
    "NoBaselineError",
    "EnvMismatchError",
]

if TYPE_CHECKING:
    from comparator.store.environment import COMPARED_ENV_FIELDS, EnvDifference, env_differences
    from comparator.store.errors import EnvMismatchError, NoBaselineError, StoreError
    from comparator.store.labels import LABELS, Label
    from comparator.store.record import RunEntry, RunRecord, RunStatus, StoredNoise
    from comparator.store.runstore import STAGING_GRACE_S, PruneResult, RunStore
    from comparator.store.select import candidates, current_baselines, select_baseline
    from comparator.store.types import Calibration, Promotion, RunSummary


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
