"""driftscope comparator: compare two dumps and name the first divergent layer and token.

Example::

    from comparator import CompareConfig, compare_dumps
    from comparator.reports.files import write_json
    report = compare_dumps("dumps/eager", "dumps/sdpa", CompareConfig())
    if not report:
        fd = report.first_divergent
        print(f"diverged at layer {fd.layer}, token {fd.token}")
    write_json(report, "report.json")

Golden baselines for CI (a run store, see :mod:`comparator.store`)::

    from comparator import regress
    result = regress("dumps/nightly", "s3://bucket/driftscope", bootstrap=False)
    raise SystemExit(result.exit_code)      # 0 passed, 1 divergence, 2 unusable
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from comparator.exports import lazy_exports

_EXPORTS = {
    "compare_dumps": "comparator.hidden.compare",
    "compare_logprobs": "comparator.logprobs",
    "compare_logprob_sources": "comparator.logprobs.judge",
    "SequenceLogprobs": "comparator.logprobs",
    "LogprobThresholds": "comparator.judging.logprob_thresholds",
    "LogprobVerdict": "comparator.logprobs",
    "CompareConfig": "comparator.config",
    "Report": "comparator.hidden.types",
    "TensorComparison": "comparator.hidden.types",
    "FirstDivergence": "comparator.hidden.types",
    "Heatmap": "comparator.hidden.types",
    "ReplicaMismatch": "comparator.hidden.types",
    "LayerSummary": "comparator.hidden.types",
    "PairStats": "comparator.hidden.metrics",
    "pair_stats": "comparator.hidden.metrics",
    "rel_diff": "comparator.hidden.metrics",
    "regress": "comparator.store.regress",
    "RegressResult": "comparator.store.regress",
    "RunStore": "comparator.store",
    "select_baseline": "comparator.store",
    "calibrate": "comparator.noise.calibrate",
    "NoiseModel": "comparator.judging.noise",
    "load_noise": "comparator.noise.file",
    "save_noise": "comparator.noise.file",
    "BASELINE_NOISE": "comparator.noise.file",
    "TopK": "comparator.logprobs.types",
    "parse_record": "comparator.logprobs.sources.engine_json",
    "score_prompt": "comparator.logprobs.sources.collect",
    "k3_summary": "comparator.logprobs.metrics",
    "GREEDY_K3_NOTE": "comparator.logprobs.metrics",
    "Outcome": "comparator.outcome",
    "status": "comparator.outcome",
    "clause": "comparator.outcome",
    "format_float": "comparator.formatting",
    "PASS": "comparator.outcome",
    "DIVERGED": "comparator.outcome",
    "write_json": "comparator.reports.files",
    "threshold_flags": "comparator.cli.args",
    "stdout_console": "comparator.cli.args",
}
"""Public name -> the module that defines it, imported on first use (PEP 562), so that
``python -m comparator`` and a library user load only what they touch."""

__all__ = [
    "compare_dumps",
    "compare_logprobs",
    "compare_logprob_sources",
    "SequenceLogprobs",
    "LogprobThresholds",
    "LogprobVerdict",
    "CompareConfig",
    "Report",
    "TensorComparison",
    "FirstDivergence",
    "Heatmap",
    "ReplicaMismatch",
    "LayerSummary",
    "PairStats",
    "pair_stats",
    "rel_diff",
    "regress",
    "RegressResult",
    "RunStore",
    "select_baseline",
    "calibrate",
    "NoiseModel",
    "load_noise",
    "save_noise",
    "BASELINE_NOISE",
    "TopK",
    "parse_record",
    "score_prompt",
    "k3_summary",
    "GREEDY_K3_NOTE",
    "Outcome",
    "status",
    "clause",
    "format_float",
    "PASS",
    "DIVERGED",
    "write_json",
    "threshold_flags",
    "stdout_console",
]

if TYPE_CHECKING:
    from comparator.cli.args import stdout_console, threshold_flags
    from comparator.config import CompareConfig
    from comparator.formatting import format_float
    from comparator.hidden.compare import compare_dumps
    from comparator.hidden.metrics import PairStats, pair_stats, rel_diff
    from comparator.hidden.types import (
        FirstDivergence,
        Heatmap,
        LayerSummary,
        ReplicaMismatch,
        Report,
        TensorComparison,
    )
    from comparator.judging.logprob_thresholds import LogprobThresholds
    from comparator.judging.noise import NoiseModel
    from comparator.logprobs import LogprobVerdict, SequenceLogprobs, compare_logprobs
    from comparator.logprobs.judge import compare_logprob_sources
    from comparator.logprobs.metrics import GREEDY_K3_NOTE, k3_summary
    from comparator.logprobs.sources.collect import score_prompt
    from comparator.logprobs.sources.engine_json import parse_record
    from comparator.logprobs.types import TopK
    from comparator.noise.calibrate import calibrate
    from comparator.noise.file import BASELINE_NOISE, load_noise, save_noise
    from comparator.outcome import DIVERGED, PASS, Outcome, clause, status
    from comparator.reports.files import write_json
    from comparator.store import RunStore, select_baseline
    from comparator.store.regress import RegressResult, regress


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
