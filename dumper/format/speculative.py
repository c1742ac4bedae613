"""``extra.speculative``: the verify passes of a speculative decode, which draft rows the target kept.

A ``python -m dumper run --new-tokens N --speculative SPEC`` dump records every verify pass. In a
verify pass a sequence feeds its last accepted token (draft index 0) at position ``p`` and the ``k``
draft tokens the proposer made (draft indices ``1..k``) at ``p+1 .. p+k``, in one forward pass; the
target keeps the drafts up to the first it disagrees with and rejects the rest. Rejected rows are
recorded too, then computed again in the next pass at the same positions, so a position may appear
in several passes; the manifest says which rows count::

    {"setting": "ngram:k=3", "method": "ngram", "num_speculative_tokens": 3, "config": {...},
     "steps":    [[[forward_pass, position, proposed, accepted], ...] per sequence],
     "rejected": [[[forward_pass, first_position, count], ...] per sequence],
     "engine_steps": [{"drafted": [...], "accepted": [...]} per sequence]}   # where the engine reports them

- ``steps``: per sequence, one entry per decode pass, in order: the pass (``forward_pass`` of its
  records), the position of its draft index 0, the drafts it fed (``proposed``; 0: a plain decode
  step, the proposer had nothing) and how many the target kept (``accepted``). Steps tile the fed
  tokens: the next step starts at ``position + accepted + 1``, the first at the prompt's length, and
  the last covers the token before the last generated one (that token is chosen but never fed).
  Drafts past the ``N`` tokens asked for are neither recorded nor counted.
- ``rejected``: per sequence, the rows of each step whose drafts the target rejected, apart: the
  draft index ``accepted + 1 .. proposed`` rows, as (pass, first position, count).
- ``engine_steps`` (vLLM): the engine's own count of each step that proposed drafts, in order, as
  it reports them per request; the dumper checks ``steps`` against them (the last step's drafts
  past the output count there, not in ``steps``).

A row of sequence ``s`` at position ``q >= len(prompt)`` in pass ``f`` belongs to the step of ``s``
whose pass is ``f``; its draft index is ``q - position``; it is kept when ``q <= position + accepted``.
Every comparison reads only kept rows (:func:`rejected_ranges`); the rejected ones stay in the dump
for a reader that asks for them. Checked on load (:func:`check_speculative_extra`,
:func:`check_speculative_records`), so that counts that do not add up are one
:class:`~dumper.errors.CorruptDumpError` naming the field.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dumper.format.files import bad_field
from dumper.format.rowspans import row_spans

__all__ = [
    "SPECULATIVE_KEY",
    "Step",
    "steps_of",
    "rejected_ranges",
    "hidden_rows",
    "derive_steps",
    "speculative_extra",
    "step_at",
    "check_speculative_extra",
    "check_speculative_records",
]

SPECULATIVE_KEY = "speculative"
"""``extra`` key of a speculative decode dump."""
_FIELDS = ("steps", "rejected")
_ENGINE = ("drafted", "accepted")


@dataclass(frozen=True)
class Step:
    """One decode pass of one sequence: its ``forward_pass``, the ``position`` of draft index 0, the drafts fed
    (``proposed``) and kept (``accepted``)."""

    forward_pass: int
    position: int
    proposed: int
    accepted: int

    @property
    def kept_end(self) -> int:
        """The position after the step's last kept row."""
        return self.position + self.accepted + 1

    def to_json(self) -> list[int]:
        return [self.forward_pass, self.position, self.proposed, self.accepted]

    @classmethod
    def from_json(cls, entry: Sequence[int]) -> Step:
        """A checked ``steps`` entry (:func:`check_speculative_extra`)."""
        return cls(*(int(v) for v in entry))


def steps_of(extra: Mapping[str, Any]) -> list[list[Step]] | None:
    """Per sequence, its decode steps (None: not a speculative dump). The extra is a checked one."""
    spec = extra.get(SPECULATIVE_KEY)
    if spec is None:
        return None
    return [[Step.from_json(entry) for entry in seq] for seq in spec["steps"]]


def step_at(steps: Sequence[Step], position: int) -> tuple[int, Step] | None:
    """(index, step) of the step whose kept rows hold ``position`` (None: a prompt position, or past the steps)."""
    lo = bisect.bisect_right(steps, position, key=lambda st: st.position)  # steps tile the kept positions in order
    if lo == 0 or position >= steps[lo - 1].kept_end:
        return None
    return lo - 1, steps[lo - 1]


def rejected_ranges(extra: Mapping[str, Any]) -> dict[tuple[int, int], tuple[int, int]]:
    """``(forward_pass, sequence) -> (first, end)``: the positions of the rejected rows of each verify pass."""
    spec = extra.get(SPECULATIVE_KEY)
    if spec is None:
        return {}
    return {(f, s): (p, p + n) for s, seq in enumerate(spec["rejected"]) for f, p, n in seq if n > 0}


def hidden_rows(records: Iterable[Any]) -> Iterator[tuple[int, int, int]]:
    """``(forward_pass, sequence, position)`` of every row of the first hidden-state record of each pass (all of a
    pass's hidden records hold the same rows; logprob records, with no layer, are not rows of a pass)."""
    seen: set[int] = set()
    for rec in records:
        if rec.layer is None or rec.forward_pass in seen or not rec.positions or not rec.sequence_ids:
            continue
        seen.add(rec.forward_pass)
        for _, s, p, n in row_spans(rec.positions, rec.sequence_ids):
            yield from ((rec.forward_pass, s, q) for q in range(p, p + n))


def derive_steps(rows: Iterable[tuple[int, int, int]], prompt_lengths: Sequence[int]) -> list[list[Step]]:
    """Each sequence's steps from the decode rows a run recorded: ``(forward_pass, sequence, position)`` triples.

    The rows of one pass of one sequence are its draft indices ``0..proposed``; the next pass starts
    at the first position the target did not keep, so ``accepted`` is the gap to it. The last step
    keeps every row it recorded (rows past the output are not recorded).
    """
    spans: list[dict[int, list[int]]] = [{} for _ in prompt_lengths]
    for f, s, q in rows:
        if 0 <= s < len(spans) and q >= prompt_lengths[s]:
            lo_hi = spans[s].setdefault(f, [q, q])
            lo_hi[0], lo_hi[1] = min(lo_hi[0], q), max(lo_hi[1], q)
    out: list[list[Step]] = []
    for by_pass in spans:
        passes = sorted(by_pass)
        seq: list[Step] = []
        for j, f in enumerate(passes):
            lo, hi = by_pass[f]
            nxt = by_pass[passes[j + 1]][0] if j + 1 < len(passes) else hi + 1
            seq.append(Step(f, lo, hi - lo, min(hi - lo, nxt - lo - 1)))
        out.append(seq)
    return out


def speculative_extra(
    setting: str,
    config: Mapping[str, Any],
    steps: list[list[Step]],
    *,
    engine_steps: list[dict[str, list[int]]] | None = None,
) -> dict[str, Any]:
    """The ``extra.speculative`` entry of a run with ``setting`` (the engine's ``config``) and these steps;
    ``engine_steps``: the engine's own per-request counts, where it reports them."""
    return {
        **({"engine_steps": engine_steps} if engine_steps is not None else {}),
        "setting": setting,
        "method": config.get("method"),
        "num_speculative_tokens": config.get("num_speculative_tokens"),
        "config": dict(config),
        "steps": [[st.to_json() for st in seq] for seq in steps],
        "rejected": [
            [[st.forward_pass, st.kept_end, st.proposed - st.accepted] for st in seq if st.proposed > st.accepted]
            for seq in steps
        ],
    }


def _ints(v: Any, n: int) -> bool:
    return type(v) is list and len(v) == n and all(type(x) is int and x >= 0 for x in v)


def check_speculative_extra(extra: dict, where: str) -> None:
    """``extra.speculative`` if present: the fields of the module doc, and counts that add up.

    Per sequence: ``accepted <= proposed <= num_speculative_tokens``; passes increasing; the first
    step at the prompt's length; each next step at ``position + accepted + 1``; the last covering
    the fed tokens (``new_tokens - 1`` of them); and ``rejected`` exactly the rows each step did not
    keep, so that no row is both kept and rejected.
    """
    spec = extra.get(SPECULATIVE_KEY)
    if spec is None:
        return
    f = f"extra.{SPECULATIVE_KEY}"
    if type(spec) is not dict:
        raise bad_field(where, f, "an object", spec)
    inputs = extra.get("input_ids") or []
    k = spec.get("num_speculative_tokens")
    if k is not None and (type(k) is not int or k < 1):
        raise bad_field(where, f"{f}.num_speculative_tokens", "an integer >= 1 or null", k)
    if not isinstance(spec.get("setting"), str):
        raise bad_field(where, f"{f}.setting", "a string", spec.get("setting"))
    for key in _FIELDS:
        lists = spec.get(key)
        if type(lists) is not list or len(lists) != len(inputs) or not all(type(x) is list for x in lists):
            raise bad_field(where, f"{f}.{key}", f"a list of {len(inputs)} lists (one per input)", lists)
    engine = spec.get("engine_steps")
    if engine is not None:
        if type(engine) is not list or len(engine) != len(inputs):
            raise bad_field(where, f"{f}.engine_steps", f"a list of {len(inputs)} objects (one per input)", engine)
        for s, e in enumerate(engine):
            if (
                type(e) is not dict
                or not all(type(e.get(n)) is list and all(type(x) is int and x >= 0 for x in e[n]) for n in _ENGINE)
                or len(e["drafted"]) != len(e["accepted"])
                or any(a > d for a, d in zip(e["accepted"], e["drafted"], strict=True))
            ):
                raise bad_field(
                    where,
                    f"{f}.engine_steps[{s}]",
                    "drafted and accepted counts, one each per step, accepted <= drafted",
                    e,
                )
    new = extra.get("new_tokens")
    for s, seq in enumerate(spec["steps"]):
        _check_steps(seq, spec["rejected"][s], len(inputs[s]), new, k, where, f, s)


def _check_steps(seq: list, rejected: list, prompt: int, new: Any, k: int | None, where: str, f: str, s: int) -> None:
    at, last_pass = prompt, -1
    steps = []
    for t, entry in enumerate(seq):
        field = f"{f}.steps[{s}][{t}]"
        if not _ints(entry, 4):
            raise bad_field(where, field, "[forward_pass, position, proposed, accepted], integers >= 0", entry)
        st = Step.from_json(entry)
        if st.accepted > st.proposed:
            raise bad_field(where, field, f"an accepted count at most the proposed count {st.proposed}", entry)
        if k is not None and st.proposed > k:
            raise bad_field(where, field, f"at most num_speculative_tokens {k} proposed", entry)
        if st.forward_pass <= last_pass:
            raise bad_field(where, field, f"a forward pass after {last_pass} (steps in order)", entry)
        if st.position != at:
            raise bad_field(
                where, field, f"position {at} (the drafts before it do not add up: the prompt and kept rows)", entry
            )
        at, last_pass = st.kept_end, st.forward_pass
        steps.append(st)
    if type(new) is int and new >= 1 and at != prompt + new - 1:
        raise bad_field(
            where, f"{f}.steps[{s}]", f"steps that keep {new - 1} fed tokens (new_tokens {new})", at - prompt
        )
    want = {st.forward_pass: st for st in steps}
    listed = set()
    for j, entry in enumerate(rejected):
        field = f"{f}.rejected[{s}][{j}]"
        if not _ints(entry, 3):
            raise bad_field(where, field, "[forward_pass, first_position, count], integers >= 0", entry)
        fp, first, count = entry
        st = want.get(fp)
        if st is None:
            raise bad_field(where, field, "the pass of one of the sequence's steps", entry)
        if first < st.kept_end or count == 0:
            raise bad_field(
                where,
                field,
                f"rows after the kept ones (position {st.kept_end} on): a row both kept and rejected",
                entry,
            )
        if first != st.kept_end or count != st.proposed - st.accepted or fp in listed:
            raise bad_field(
                where, field, f"[{fp}, {st.kept_end}, {st.proposed - st.accepted}] (the step's rejected drafts)", entry
            )
        listed.add(fp)
    for st in steps:
        if st.proposed > st.accepted and st.forward_pass not in listed:
            raise bad_field(
                where, f"{f}.rejected[{s}]", f"the rejected rows of pass {st.forward_pass} listed", rejected
            )


def check_speculative_records(raw: dict, where: str) -> None:
    """Every decode row of a speculative dump lies in a step of its sequence: its pass is listed in ``steps`` and its
    position within the step's rows (draft indices ``0..proposed``)."""
    extra = raw.get("extra") or {}
    spec = extra.get(SPECULATIVE_KEY)
    if spec is None:
        return
    inputs = extra.get("input_ids") or []
    spans = {
        (e[0], s): (e[1], e[1] + e[2] + 1) for s, seq in enumerate(spec["steps"]) for e in seq
    }  # (pass, seq) -> [first, end) of the step's rows
    for i, d in enumerate(raw["tensors"]):
        pos_runs, seq_runs = d.get("positions"), d.get("sequence_ids")
        if not pos_runs or not seq_runs or d.get("layer") is None:  # logprob records: no pass's rows
            continue
        held: dict[int, list[int]] = {}  # sequence -> [lowest, highest] decode position the record holds
        for _, s, p, n in row_spans(pos_runs, seq_runs):
            if 0 <= s < len(inputs) and p + n > len(inputs[s]):
                lo_hi = held.setdefault(s, [max(p, len(inputs[s])), p + n - 1])
                lo_hi[0], lo_hi[1] = min(lo_hi[0], max(p, len(inputs[s]))), max(lo_hi[1], p + n - 1)
        for s, (lo, hi) in held.items():
            span = spans.get((d["forward_pass"], s))
            if span is None:
                raise bad_field(
                    where,
                    f"tensors[{i}].forward_pass",
                    f"a pass extra.{SPECULATIVE_KEY}.steps[{s}] lists (it holds decode rows of sequence {s})",
                    d["forward_pass"],
                )
            if lo < span[0] or hi >= span[1]:
                raise bad_field(
                    where,
                    f"tensors[{i}].positions",
                    f"sequence {s}'s rows of pass {d['forward_pass']} within positions {span[0]}..{span[1] - 1}",
                    [lo, hi],
                )
