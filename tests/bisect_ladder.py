"""Ladders of builds for the bisection tests and bench: folders on ``PYTHONPATH`` whose start-up seeds a bug.

Each build is a folder holding a ``sitecustomize.py`` (Python runs it at start-up from ``sys.path``)
and a ``seed.json`` that says what it does to transformers' own ``LlamaDecoderLayer`` in every
process started with the folder on ``PYTHONPATH``:

- ``{}``: nothing (a good build);
- ``{"layer": L, "token": T}``: decoder layer L adds 0.5 to its output at sequence position T;
- ``{"chunked": L}``: decoder layer L adds 0.5 to the rows of a pass that does not start at
  position 0 (a chunked prefill's later chunks: a bug that a chunk size below the prompt finds);
- ``{"draft": L}``: decoder layer L adds 0.5 to the rows of draft index 2 and more of a speculative
  verify pass: rows 2 or more past the pass's first position, in a pass that continues earlier
  tokens (first position > 0). A prompt pass (first position 0, with or without the drafts
  transformers appends to it) and a one-row decode step are untouched. A chunked prefill's later
  chunks are hit from their third row on too: keep chunking out of a draft ladder's command;
- ``{"broken": "why"}``: the interpreter stops at start-up with ``why`` (a build that cannot run).

The bugs are tensor code without data-dependent Python branches (whether a layer is buggy is fixed
by its index), so torch.compile traces them. Checked by hand once with plain forward hooks on the
tiny-llama preset: with ``{"layer": 2, "token": 20}`` layer 2's output differs from the clean
model's at position 20 only, and layer 3's input from position 20 on. With ``{"draft": 2}`` in a
``--speculative ngram:k=3`` run of :data:`SPEC_PROMPT` (12 new tokens; the hook on layer 2 kept its
output and ``position_ids`` per call): the prompt pass (positions 0-33) equals the clean run's; the
first verify pass (34-36, 2 drafts, both kept) differs by exactly 0.5 at position 36 (draft index 2)
only; that row chooses the next token, so the runs part there (clean: passes of 4 rows from 37, 41,
42; seeded: one-row decode steps at 37 and 38, untouched, then passes of 4 rows from 39, 40, 43, hit
at draft indices 2 and 3). The comparator names layer 3's input at token 36, verify step 0, draft
index 2.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

__all__ = ["SITECUSTOMIZE", "make_build", "ladder", "dump_command", "PROMPT", "SPEC_PROMPT"]

PROMPT = ",".join(str(t) for t in range(3, 43))
"""The 40-token prompt every ladder run dumps."""

SPEC_PROMPT = ",".join(str(t) for t in [1] + [5, 9, 14, 22, 31] * 5 + [5, 5, 176, 288, 324, 324, 324, 324])
"""A 34-token prompt for ``--speculative`` ladders: a repeated pattern, then the first 8 tokens of the tiny-llama
preset's own greedy decode of it, which go on repeating 324. Prompt lookup copies the 324s, the model keeps them: with
``ngram:k=3`` and 12 new tokens the steps keep 2, 3, 0 and 2 drafts (the first kept row of draft index 2 is 36)."""

SITECUSTOMIZE = '''\
"""A build of a bisection test ladder (tests/bisect_ladder.py): seeds what seed.json says."""
import json, os

_seed = json.load(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "seed.json")))
if "broken" in _seed:
    raise SystemExit(_seed["broken"])
if _seed:
    import torch
    from transformers.models.llama import modeling_llama as _m

    _forward = _m.LlamaDecoderLayer.forward
    _layer = next(_seed[k] for k in ("layer", "chunked", "draft") if k in _seed)

    def _seeded(self, hidden_states, *args, **kwargs):
        out = _forward(self, hidden_states, *args, **kwargs)
        h = out[0] if isinstance(out, tuple) else out
        if self.self_attn.layer_idx == _layer:  # fixed per layer: no data branch
            pos = kwargs.get("position_ids")
            if pos is None:
                pos = torch.arange(h.shape[1], device=h.device)[None]
            if "chunked" in _seed:
                hit = (pos[:, :1] > 0).expand(-1, h.shape[1])  # a pass that continues an earlier one
            elif "draft" in _seed:  # draft index >= 2 of a pass that continues an earlier one (a verify pass)
                hit = (pos - pos[:, :1] >= 2) & (pos[:, :1] > 0)
            else:
                hit = pos == _seed["token"]
            h = h + 0.5 * hit[..., None].to(h.dtype)
        return (h, *out[1:]) if isinstance(out, tuple) else h

    _m.LlamaDecoderLayer.forward = _seeded
'''


def make_build(folder: Path, seed: dict) -> Path:
    """One build: ``folder`` with the seeding ``sitecustomize.py`` and its ``seed.json``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    (folder / "seed.json").write_text(json.dumps(seed))
    return folder


def ladder(
    root: Path,
    n: int,
    *,
    bad_from: int,
    broken: tuple[int, ...] = (),
    layer: int = 2,
    token: int = 20,
    bug: dict | None = None,
) -> list[str]:
    """``n`` builds under ``root``, oldest first: clean before ``bad_from``, the bug from it on (``bug``, a seed;
    default the layer bug ``{"layer": layer, "token": token}``), and the ``broken`` ones unable to start. Returns the
    builds file's lines (the folders)."""
    out = []
    for i in range(n):
        seed = (
            {"broken": f"build {i}: cannot start (ImportError: libdriftscope_{i}.so)"}
            if i in broken
            else (bug if bug is not None else {"layer": layer, "token": token})
            if i >= bad_from
            else {}
        )
        out.append(str(make_build(root / f"b{i:03d}", seed)))
    return out


def dump_command(extra: str = "", *, prompt: str = PROMPT) -> str:
    """The ``--run`` template: the tiny-llama preset dumped with ``{build}`` first on ``PYTHONPATH``."""
    return (
        f"PYTHONPATH={{build}}${{PYTHONPATH:+:$PYTHONPATH}} {shlex.quote(sys.executable)} "
        "-m dumper run --model tiny-llama --layers all "
        f"--input-ids {prompt} --out {{out}} --quiet {extra}"
    ).strip()
