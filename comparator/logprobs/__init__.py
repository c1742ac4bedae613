"""Logprob-level comparison: per-token logprob errors, the k3 KL estimate, top-k errors, full KL.

The hidden-state comparison says *where* two engines start to differ; this module says *whether
the difference matters* for the model's predictions. Both runs score the same fixed tokens
(teacher forcing), so position ``i`` of one run is directly comparable with position ``i`` of the
other. Three granularities:

- the actual token's logprob, one number per position: MSE / RMSE / max abs error, and
  k3 = (e^d - 1) - d with d = log q - log p (target minus reference), whose expectation under
  the reference distribution is KL(P_ref || P_target) and which is d^2/2 for small d;
- the top-k logprobs (if both engines returned them): max and mean |d| over tokens in both lists;
- full logits rows (if available): exact KL(P_ref || P_target) per position, its percentiles
  (llama.cpp style) and top-1 agreement.

Each family has a mean-type number (is the whole run shifted?) and a max-type number with its
(request, position) (did one position break?). Positions follow SGLang's ``input_token_logprobs``
convention: ``logprobs[i] = log p(token_ids[i] | token_ids[:i])``, and a logits row or top-k list
"at position i" is the distribution that predicts ``token_ids[i]``.

All arithmetic is float64. NaN/Inf: a position where both sides hold the same value (the same
NaN, or -inf on both) is no difference; any other non-finite difference counts as an infinite
error, so no threshold passes it.

The checked metrics and their thresholds are judging's: the metric table
(:mod:`comparator.judging.logprob_metrics`), fixed thresholds (explicit > ``DRIFTSCOPE_LOGPROB_<NAME>``
> ``configs/logprob_thresholds.json``, :mod:`comparator.judging.logprob_thresholds`) and thresholds
derived from a calibration (:func:`comparator.judging.noise_thresholds.resolve_logprob_thresholds`).

Mean-type values carry a standard error (llama.cpp's ``mean_and_uncertainty``,
:func:`comparator.logprobs.llama_stats.mean_se`): ``mean_abs_err_se``, ``k3_mean_se`` and the llama
statistics' ``kl_mean_se``.

The package, one module per concern: :mod:`~comparator.logprobs.types` (the data),
:mod:`~comparator.logprobs.align` (matching requests and positions),
:mod:`~comparator.logprobs.metrics` (per-token metrics, the one k3),
:mod:`~comparator.logprobs.kl` (full distributions; :mod:`~comparator.logprobs.kl_stream` from disk),
:mod:`~comparator.logprobs.llama_stats` (llama-perplexity's statistics),
:mod:`~comparator.logprobs.verdict` (every metric of the table, the decision),
:mod:`comparator.logprobs.sources` (where logprobs come from: dumps, engine JSONL, llama.cpp files) and
:mod:`~comparator.logprobs.judge` (a verdict from two sources).

Example::

    from comparator.judging.logprob_thresholds import LogprobThresholds
    from comparator.logprobs import SequenceLogprobs, compare_logprobs
    a = SequenceLogprobs("r0", (5, 7, 9), (None, -1.0, -2.0))
    b = SequenceLogprobs("r0", (5, 7, 9), (None, -1.1, -2.0))
    verdict = compare_logprobs([a], [b], LogprobThresholds.resolve("tiny-llama"))
    verdict.mse, verdict.max_abs_err.position    # 0.005, 1
"""

from __future__ import annotations

from comparator.exports import lazy_exports

# each name loads its module on first use: a comparison of dumps without logprobs loads none of them
_EXPORTS = {
    "align_samples": "comparator.logprobs.align",
    "check_lengths": "comparator.logprobs.align",
    "kl_percentiles": "comparator.logprobs.kl",
    "kl_rows": "comparator.logprobs.kl",
    "logits_kl": "comparator.logprobs.kl",
    "top1_agreement": "comparator.logprobs.kl",
    "GREEDY_K3_NOTE": "comparator.logprobs.metrics",
    "ErrorStats": "comparator.logprobs.metrics",
    "K3Stats": "comparator.logprobs.metrics",
    "K3Summary": "comparator.logprobs.metrics",
    "TopKStats": "comparator.logprobs.metrics",
    "k3": "comparator.logprobs.metrics",
    "k3_stats": "comparator.logprobs.metrics",
    "k3_summary": "comparator.logprobs.metrics",
    "logprob_errors": "comparator.logprobs.metrics",
    "topk_errors": "comparator.logprobs.metrics",
    "UNKNOWN_TOKEN": "comparator.logprobs.types",
    "AlignedSample": "comparator.logprobs.types",
    "Alignment": "comparator.logprobs.types",
    "KlPass": "comparator.logprobs.types",
    "KlResult": "comparator.logprobs.types",
    "Located": "comparator.logprobs.types",
    "PositionSeries": "comparator.logprobs.types",
    "SequenceLogprobs": "comparator.logprobs.types",
    "TopK": "comparator.logprobs.types",
    "LogprobVerdict": "comparator.logprobs.types",
    "compare_logprobs": "comparator.logprobs.verdict",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

__all__ = [
    "UNKNOWN_TOKEN",
    "GREEDY_K3_NOTE",
    "TopK",
    "SequenceLogprobs",
    "AlignedSample",
    "Alignment",
    "Located",
    "ErrorStats",
    "K3Stats",
    "K3Summary",
    "TopKStats",
    "LogprobVerdict",
    "PositionSeries",
    "k3",
    "k3_summary",
    "align_samples",
    "check_lengths",
    "logprob_errors",
    "k3_stats",
    "topk_errors",
    "kl_rows",
    "top1_agreement",
    "kl_percentiles",
    "compare_logprobs",
    "KlResult",
    "KlPass",
    "logits_kl",
]
