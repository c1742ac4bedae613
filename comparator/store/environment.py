"""Which environment fingerprint fields make two runs incomparable, and how they are compared.

A golden baseline is only meaningful from the same hardware and software as the target (the
seed: logprobs and hidden states depend on the GPU model, the kernels and the torch version).
The dump manifest's ``environment`` records more than that; only the fields that change the
numbers a run computes are compared:

=================  ============================================================================
``torch``          kernels; compared with its local build tag (``2.4.0+cu121`` != ``2.4.0+cu124``)
``cuda``           CUDA runtime the torch build uses
``cudnn``          cuDNN version
``device_type``    ``cpu`` / ``cuda`` / ...
``device_name``    GPU model (``NVIDIA H100 80GB HBM3``); on CPU the processor or architecture
``machine``        CPU architecture (``x86_64`` vs ``aarch64`` take different SIMD paths)
``transformers``   model code (attention, RoPE, norms) changes between releases
``driftscope``     the dumper's prefill job (padding, positions, preset weights) may change
``python``         major.minor only: another minor version means other binary wheels; a patch
                   release (3.11.7 -> 3.11.9, which CI images pick up silently) does not count
=================  ============================================================================

Not compared: ``platform`` (the OS kernel build string changes with every OS update and does
not touch the numerics) and ``attn_implementation`` (a run configuration, and exactly the kind
of change a regression check is there to judge). The dump format version is compared apart:
the run record stores it, and a store only holds dumps of the current format.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["COMPARED_ENV_FIELDS", "EnvDifference", "env_differences", "env_key", "describe_differences"]


def _python_minor(v: Any) -> Any:
    if not isinstance(v, str):
        return v
    return ".".join(v.split(".")[:2])


def _same(v: Any) -> Any:
    return v


COMPARED_ENV_FIELDS: dict[str, Callable[[Any], Any]] = {
    "torch": _same,
    "cuda": _same,
    "cudnn": _same,
    "device_type": _same,
    "device_name": _same,
    "machine": _same,
    "transformers": _same,
    "driftscope": _same,
    "python": _python_minor,
}
"""Environment fields that must agree, each with the normalization applied before comparing."""


@dataclass(frozen=True)
class EnvDifference:
    """One compared environment field whose value differs between the baseline and the run."""

    field: str
    baseline: Any
    run: Any

    def __str__(self) -> str:
        return f"{self.field} {self.baseline!r} (baseline) vs {self.run!r} (this run)"

    def to_json(self) -> dict[str, Any]:
        return {"field": self.field, "baseline": self.baseline, "run": self.run}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> EnvDifference:
        """Inverse of :meth:`to_json` (the values are the environments' own JSON values)."""
        return cls(field=str(d["field"]), baseline=d["baseline"], run=d["run"])


def env_key(env: Mapping[str, Any]) -> tuple[Any, ...]:
    """The normalized compared fields: two environments are comparable iff their keys are equal."""
    return tuple(norm(env.get(name)) for name, norm in COMPARED_ENV_FIELDS.items())


def env_differences(baseline: Mapping[str, Any], run: Mapping[str, Any]) -> list[EnvDifference]:
    """The compared fields that differ (after normalization), in :data:`COMPARED_ENV_FIELDS` order."""
    return [
        EnvDifference(name, baseline.get(name), run.get(name))
        for name, norm in COMPARED_ENV_FIELDS.items()
        if norm(baseline.get(name)) != norm(run.get(name))
    ]


def describe_differences(diffs: list[EnvDifference] | tuple[EnvDifference, ...]) -> str:
    return "; ".join(str(d) for d in diffs)
