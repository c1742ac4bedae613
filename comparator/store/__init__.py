"""Golden baselines for CI: a run store that only compares comparable runs and never launders a regression.

Example::

    from comparator.store import RunStore, select_baseline
    from dumper.format import load_manifest

    store = RunStore("ci-store")                         # a local directory, or s3://, gcs://, hf://, memory://
    m = load_manifest("dumps/nightly")
    base = select_baseline(store, m.model["name"], m.capture_signature, m.environment)
    print(base.run_id if base else "no baseline yet")

:func:`comparator.store.regress` does the whole job: select, compare, store the run labelled.
"""

from comparator.store.environment import COMPARED_ENV_FIELDS, EnvDifference, env_differences
from comparator.store.errors import EnvMismatchError, NoBaselineError, StoreError
from comparator.store.record import LABELS, RunEntry, RunRecord, StoredNoise
from comparator.store.runstore import STAGING_GRACE_S, PruneResult, RunStore
from comparator.store.select import candidates, current_baselines, select_baseline

__all__ = [
    "RunStore",
    "RunRecord",
    "RunEntry",
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
