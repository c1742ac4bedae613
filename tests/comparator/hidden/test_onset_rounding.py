"""The uncalibrated onset on real dumps: rounding is not a step (issue 34's defect, fixed by the rounding floor).

Two prefills of the tiny Llama (fp32) that share their first chunk of 5 tokens, computed the same way on both
sides (the same call on an empty KV cache): the baseline takes the rest in one pass, the target in chunks of 5.
The first 5 positions are bit-identical by construction, on any CPU (which positions two different layouts
happen to round equally is the CPU's choice), and the rest differ at fp32 rounding. Judged by a per-token
threshold tight enough to fail the largest rounding, the onset must be that first failing token: the jump
from exact zeros to rounding (16 decades on a log scale) is not where a divergence starts.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import dumper
from comparator import CompareConfig, compare_dumps
from comparator.hidden.onset import rounding_floor
from dumper.prefill.forward import cache_kwarg, cache_length, call_model
from dumper.prefill.presets import load_model
from dumper.prefill.run import RunConfig, prompt_token_ids

pytestmark = pytest.mark.slow

FIRST = 5
"""Tokens of the first chunk, the same computation on both sides."""


def _prefill(out: Path, rest: int | None) -> None:
    """Dump a prefill of the default prompts: a first chunk of :data:`FIRST` tokens, then chunks of ``rest``
    tokens (None: the rest in one pass), through the KV cache."""
    model, tokenizer = load_model("tiny-llama")
    seqs = prompt_token_ids(RunConfig(out=str(out)), tokenizer, int(model.get_input_embeddings().num_embeddings))
    kw = cache_kwarg(model)
    with torch.inference_mode(), dumper.capture(model, out, layers="all") as cap:
        for i, seq in enumerate(seqs):
            cap.set_sequence_ids([i])
            ids, cache = torch.tensor([seq]), None
            bounds = [0, FIRST, *range(FIRST + (rest or len(seq)), len(seq), rest or len(seq)), len(seq)]
            for start, end in zip(bounds, bounds[1:]):
                result = call_model(
                    model,
                    input_ids=ids[:, start:end],
                    position_ids=torch.arange(start, end)[None],
                    use_cache=True,
                    **{kw: cache},
                )
                cache = cache_length(result)[0]


def test_rounding_after_bit_identical_positions_is_no_onset(tmp_path):
    _prefill(tmp_path / "base", None)
    _prefill(tmp_path / "c5", 5)
    values: dict[tuple[str, int | None], np.ndarray] = {}
    compare_dumps(
        tmp_path / "base", tmp_path / "c5", token_sink=lambda t, v, _: values.__setitem__((t.name, t.sequence), v)
    )
    assert all(not v[:FIRST].any() for v in values.values())  # one computation on both sides: exact
    assert values["model.layers.1.self_attn.input", 0].max() > 0  # rounding after it: the case
    worst = max(float(v.max()) for v in values.values())
    assert worst < 10 * rounding_floor(["F32"]), "benign chunking left more than rounding: not this test's case"
    # tight enough to fail the largest rounding, never at a tensor's jump (its first value past the exact zeros,
    # where an onset that took the zeros for a low run would be placed): the first failing token lies past it
    jumps = [float(v[np.flatnonzero(v)[0]]) for v in values.values() if v.any()]
    threshold = max(worst / 2, *jumps)
    assert worst > threshold, "the largest rounding sits at a jump: this run cannot tell the onset from it"
    report = compare_dumps(tmp_path / "base", tmp_path / "c5", CompareConfig(threshold=1.0, token_threshold=threshold))
    fd = report.first_divergent
    assert fd is not None and fd.token is not None
    assert fd.onset == fd.token and fd.onset_layer == fd.layer, (
        fd.token,
        fd.onset,
        fd.onset_method,
        fd.layer,
        fd.onset_layer,
        fd.onset_layer_method,
    )
