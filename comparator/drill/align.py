"""Which op of A meets which op of B: planned from the two op lists alone, no rows read.

Ops meet by module path and slot (their position among that path's ops), never by their index in
the log: a build that fuses two ops, or splits one, shifts every later index but leaves the other
paths' slots as they were. Where the two sides dispatched different ops at one path (other names,
or another count), only the module's output is paired: the last op there with stored rows on each
side (the last with a hash where either side stores none).

Example::

    plans = align_ops(log_a.ops, log_b.ops)
    [(p.path, p.pairing.value, len(p.pairs)) for p in plans]
    # [("model.layers.2.mlp.gate_proj", "slots", 1), ("model.layers.2.mlp.act_fn", "output", 1), ...]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from comparator.drill.types import Pairing
from dumper.format.drill import OpEntry

__all__ = ["PathPlan", "align_ops", "path_order"]


@dataclass(frozen=True)
class PathPlan:
    """One module path: the ops each side dispatched there (slot order) and the pairs to compare."""

    path: str
    ops_a: tuple[OpEntry, ...]
    ops_b: tuple[OpEntry, ...]
    pairing: Pairing
    pairs: tuple[tuple[OpEntry, OpEntry], ...]

    @property
    def same_ops(self) -> bool:
        return [o.op for o in self.ops_a] == [o.op for o in self.ops_b]


def path_order(paths_a: Sequence[str], paths_b: Sequence[str]) -> list[str]:
    """Every path of either side once: A's in A's order, each path only B has right after the path it follows in B
    (at the front when it comes first there)."""
    order = list(dict.fromkeys(paths_a))
    seen = set(order)
    after: str | None = None
    for path in dict.fromkeys(paths_b):
        if path not in seen:
            order.insert(0 if after is None else order.index(after) + 1, path)
            seen.add(path)
        after = path
    return order


def _by_path(ops: Sequence[OpEntry]) -> dict[str, list[OpEntry]]:
    out: dict[str, list[OpEntry]] = {}
    for op in ops:
        out.setdefault(op.path, []).append(op)
    for group in out.values():
        group.sort(key=lambda o: o.slot)
    return out


def _holds(op: OpEntry) -> bool:
    """Whether the log keeps anything of ``op``'s output (a view or memory not yet written: nothing to compare)."""
    return op.rows is not None or op.hash is not None


def _last(ops: Sequence[OpEntry], keep: Callable[[OpEntry], bool]) -> OpEntry | None:
    return next((o for o in reversed(ops) if keep(o)), None)


def _output_pair(ops_a: Sequence[OpEntry], ops_b: Sequence[OpEntry]) -> tuple[OpEntry, OpEntry] | None:
    """The module's output on each side: the last op with rows, else the last with a hash (None: a side has none)."""
    for keep in (lambda o: o.rows is not None, lambda o: o.hash is not None):
        a, b = _last(ops_a, keep), _last(ops_b, keep)
        if a is not None and b is not None:
            return a, b
    return None


def align_ops(ops_a: Sequence[OpEntry], ops_b: Sequence[OpEntry]) -> list[PathPlan]:
    """The plan of every path of either side, in :func:`path_order`."""
    by_a, by_b = _by_path(ops_a), _by_path(ops_b)
    plans = []
    for path in path_order([o.path for o in ops_a], [o.path for o in ops_b]):
        a, b = tuple(by_a.get(path, ())), tuple(by_b.get(path, ()))
        if not a or not b:
            plans.append(PathPlan(path, a, b, Pairing.NONE, ()))
        elif [o.op for o in a] == [o.op for o in b]:
            pairs = tuple((x, y) for x, y in zip(a, b, strict=True) if _holds(x) or _holds(y))
            plans.append(PathPlan(path, a, b, Pairing.SLOTS, pairs))
        else:
            pair = _output_pair(a, b)
            plans.append(
                PathPlan(path, a, b, Pairing.NONE if pair is None else Pairing.OUTPUT, (pair,) if pair else ())
            )
    return plans
