"""What benign routing variation looks like, per MoE layer, and the rules a routing difference is judged by.

A flip (a token whose top-k expert set differs between baseline and target) is benign when the
baseline's *margin* (the lowest chosen expert's score minus the highest unchosen one's) is small
enough that noise could have swapped the two experts:

- **calibrated** (a noise file with a ``router`` section, from ``python -m comparator calibrate``): the
  unit is the largest per-token router-score change benign re-runs showed at that layer
  (:attr:`RouterNoise.score`); a flip is benign when its margin is at most ``factor`` units, and
  the layer's flip rate may be at most ``factor`` x the calibrated one (at least ``factor`` /
  the calibration's tokens);
- **margin rule** (no noise file, or the layer is not in it): the unit is
  :func:`margin_rule` x the RMS of the token's router scores, by the less precise dtype of the
  two runs; a flip is benign when its margin is at most one unit.

The combine weights of tokens whose experts agree are judged by their largest ``|Δw|``: against
``factor`` x the calibrated weight noise, else :func:`weight_rule`. The fixed rules are documented
in ``docs/routing.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from comparator.judging.fields import bad, integer, items, number, record
from dumper.format.jsonfloat import to_json_float

__all__ = [
    "RouterNoise",
    "MARGIN_RULE",
    "WEIGHT_RULE",
    "SCORE_FLOOR",
    "WEIGHT_FLOOR",
    "margin_rule",
    "weight_rule",
    "router_noise_from_json",
    "router_noise_to_json",
]

MARGIN_RULE: Mapping[str, float] = {"float64": 1e-6, "float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}
"""Fixed margin rule: a flip is benign when margin <= this x RMS(the token's router scores), by dtype."""
WEIGHT_RULE: Mapping[str, float] = {"float64": 1e-6, "float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}
"""Fixed combine-weight limit (max |Δw| over tokens whose experts agree), by dtype."""
SCORE_FLOOR = 1e-7
"""The smallest calibrated score unit: bit-identical benign runs still leave a flip a finite noise ratio."""
WEIGHT_FLOOR = 1e-7
"""The smallest calibrated weight noise a limit is derived from."""
_KEYS = ("layer", "score", "flip_rate", "weight", "tokens")
_PRECISION = ("float64", "float32", "float16", "bfloat16")


def _lowest(dtypes: tuple[str | None, ...]) -> str:
    """The least precise of ``dtypes`` (unknown ones count as float32)."""
    known = [d if d in _PRECISION else "float32" for d in dtypes]
    return max(known or ["float32"], key=_PRECISION.index)


def margin_rule(*dtypes: str | None) -> float:
    """The fixed margin rule's relative unit for runs of these dtypes (the least precise decides)."""
    return MARGIN_RULE[_lowest(dtypes)]


def weight_rule(*dtypes: str | None) -> float:
    """The fixed combine-weight limit for runs of these dtypes (the least precise decides)."""
    return WEIGHT_RULE[_lowest(dtypes)]


@dataclass(frozen=True)
class RouterNoise:
    """Benign routing variation of one MoE layer, over every variant (largest values)."""

    layer: int
    score: float
    """Largest per-token max |Δ score| over all experts (router logits, or the selection scores where recorded)."""
    flip_rate: float
    """Largest fraction of tokens whose expert set flipped in one variant."""
    weight: float
    """Largest |Δw| on tokens whose experts agreed."""
    tokens: int
    """Tokens compared, all variants together."""

    def to_json(self) -> dict[str, Any]:
        return {
            "layer": self.layer,
            "score": to_json_float(self.score),
            "flip_rate": to_json_float(self.flip_rate),
            "weight": to_json_float(self.weight),
            "tokens": self.tokens,
        }

    @classmethod
    def from_json(cls, d: Any, where: str, field: str) -> RouterNoise:
        d = record(d, where, field, _KEYS)
        return cls(
            layer=integer(d["layer"], where, f"{field}.layer"),
            score=number(d["score"], where, f"{field}.score"),
            flip_rate=number(d["flip_rate"], where, f"{field}.flip_rate", high=1.0),
            weight=number(d["weight"], where, f"{field}.weight", high=2.0),
            tokens=integer(d["tokens"], where, f"{field}.tokens"),
        )


def router_noise_to_json(noise: Mapping[int, RouterNoise]) -> list[dict[str, Any]]:
    return [noise[k].to_json() for k in sorted(noise)]


def router_noise_from_json(v: Any, where: str) -> dict[int, RouterNoise]:
    """A noise file's ``router`` list: one entry per layer, each once."""
    out: dict[int, RouterNoise] = {}
    for i, e in enumerate(items(v, where, "router")):
        n = RouterNoise.from_json(e, where, f"router[{i}]")
        if n.layer in out:
            raise bad(where, f"router[{i}].layer", "each layer once", n.layer)
        out[n.layer] = n
    return out
