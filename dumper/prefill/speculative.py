"""``--speculative SPEC``: the engine's own speculative decoding, named the same way for every engine.

SPEC is ``METHOD[:KEY=VALUE,...]`` (``;`` may separate the keys too, as a sweep's grid needs). The
one method every engine here runs is n-gram prompt lookup:

- ``ngram:k=3`` (``k``: drafts per step; ``max``/``min``: the longest and shortest n-gram matched,
  default 3 and 1). vLLM runs it as ``speculative_config={"method": "ngram",
  "num_speculative_tokens": k, "prompt_lookup_max": max, "prompt_lookup_min": min}``; transformers
  as ``generate(prompt_lookup_num_tokens=k, max_matching_ngram_size=max)``.

What the dump records of it is :mod:`dumper.format.speculative`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dumper.errors import UsageError

__all__ = ["SpeculativeSpec", "parse_speculative", "METHODS"]

METHODS = ("ngram",)
"""The speculative methods ``--speculative`` takes."""
_KEYS = {"k": "num_speculative_tokens", "max": "prompt_lookup_max", "min": "prompt_lookup_min"}


@dataclass(frozen=True)
class SpeculativeSpec:
    """A parsed ``--speculative``: the ``setting`` as given, the ``method`` and its drafts per step ``k``."""

    setting: str
    method: str
    k: int
    lookup_max: int = 3
    lookup_min: int = 1

    def vllm_config(self) -> dict[str, Any]:
        """vLLM's ``speculative_config``."""
        return {
            "method": self.method,
            "num_speculative_tokens": self.k,
            "prompt_lookup_max": self.lookup_max,
            "prompt_lookup_min": self.lookup_min,
        }

    def hf_kwargs(self) -> dict[str, Any]:
        """transformers' ``generate`` arguments for prompt lookup."""
        return {"prompt_lookup_num_tokens": self.k, "max_matching_ngram_size": self.lookup_max}


def parse_speculative(text: str) -> SpeculativeSpec:
    """``ngram:k=3[,max=3,min=1]`` as a :class:`SpeculativeSpec`; anything else is one :class:`UsageError` line."""
    method, _, rest = text.strip().partition(":")
    if method not in METHODS:
        raise UsageError(
            f"--speculative {text!r}: unknown method {method!r}; it takes {', '.join(METHODS)} "
            "(e.g. ngram:k=3; draft models and EAGLE/MTP heads are not recorded yet)"
        )
    values: dict[str, int] = {}
    for item in filter(None, (p.strip() for p in rest.replace(";", ",").split(","))):
        key, eq, value = item.partition("=")
        if not eq or key not in _KEYS:
            raise UsageError(f"--speculative {text!r}: {item!r} is not one of {', '.join(f'{k}=N' for k in _KEYS)}")
        try:
            values[key] = int(value)
        except ValueError:
            raise UsageError(f"--speculative {text!r}: {key} must be an integer, got {value!r}") from None
        if not 1 <= values[key] <= 64:
            raise UsageError(f"--speculative {text!r}: {key} must be in 1..64, got {values[key]}")
    if "k" not in values:
        raise UsageError(f"--speculative {text!r}: say how many drafts per step, e.g. {method}:k=3")
    lo, hi = values.get("min", 1), values.get("max", 3)
    if lo > hi:
        raise UsageError(f"--speculative {text!r}: min={lo} is more than max={hi}")
    return SpeculativeSpec(text.strip(), method, values["k"], hi, lo)
