"""The uncalibrated onset on real dumps: rounding is not a step (issue 34's defect, fixed by the rounding floor).

A one-pass prefill against a prefill in chunks of 5 (tiny Llama, fp32): the first positions are
bit-identical and the rest differ at fp32 rounding. Judged by a per-token threshold tight enough to
fail the largest rounding, the onset must be that first failing token: the jump from exact zeros to
rounding (16 decades on a log scale) is not where a divergence starts.
"""

from __future__ import annotations

import numpy as np
import pytest

from comparator import CompareConfig, compare_dumps
from comparator.hidden.onset import rounding_floor
from dumper.jobs.run import RunConfig, run_dump

pytestmark = pytest.mark.slow


def test_rounding_after_bit_identical_positions_is_no_onset(tmp_path):
    run_dump(RunConfig(out=str(tmp_path / "base"), layers="all"))
    run_dump(RunConfig(out=str(tmp_path / "c5"), layers="all", chunk_size=5))
    values: dict[tuple[str, int | None], np.ndarray] = {}
    compare_dumps(tmp_path / "base", tmp_path / "c5",
                  token_sink=lambda t, v, _: values.__setitem__((t.name, t.sequence), v))
    first = values["model.layers.1.self_attn.input", 0]
    assert first[0] == 0 and first.max() > 0  # exact at the start, rounding later: the case
    worst = max(float(v.max()) for v in values.values())
    assert worst < 10 * rounding_floor(["F32"]), "benign chunking left more than rounding: not this test's case"
    report = compare_dumps(tmp_path / "base", tmp_path / "c5", CompareConfig(threshold=1.0, token_threshold=worst / 2))
    fd = report.first_divergent
    assert fd is not None and fd.token is not None
    assert fd.onset == fd.token and fd.onset_layer == fd.layer, (fd.token, fd.onset, fd.onset_method, fd.layer,
                                                                 fd.onset_layer, fd.onset_layer_method)
