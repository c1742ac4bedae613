"""The flags several ``python -m dumper`` commands share, each defined once here with one default.

Flags the comparator's commands take too are :mod:`dumper.cli.common`'s; a live server's are
:mod:`dumper.server.flags`'. ``sweep`` takes ``run``'s flags for what stays fixed across its cells:
with ``from_baseline`` a flag whose value the baseline dump records (the dtype, the seed, the
layers, the capture points) is left unset, and the sweep takes the baseline's.
"""

from __future__ import annotations

import argparse

from dumper.cli.common import top_k_flag
from dumper.cli.values import seed_value
from dumper.engines import ENGINES
from dumper.errors import UsageError
from dumper.format.dtypes import MODEL_DTYPES

__all__ = [
    "model_flag",
    "model_setting_flags",
    "baseline_flag",
    "engine_flags",
    "layers_flag",
    "points_flag",
    "padding_side_flag",
    "logprob_flags",
    "save_logits_flag",
    "check_logprob_options",
    "NEEDS_LOGPROBS",
    "MODEL_HELP",
]

MODEL_HELP = "local HF model directory or preset (tiny-llama, tiny-qwen2)"
"""``--model``'s help where the model is loaded here (``run`` adds the files of its other engines)."""
NEEDS_LOGPROBS = "{flag} needs --logprobs"
"""The one line for a logprob option (``--top-k``, ``--save-logits``, ...) given without ``--logprobs``."""
_FROM_BASELINE = "default: the baseline's"


def _default(value: object, from_baseline: bool) -> tuple[object, str]:
    """(the flag's default, its help's words for it): ``value``, or unset and the baseline's with ``from_baseline``."""
    return (None, _FROM_BASELINE) if from_baseline else (value, f"default {value}")


def model_flag(p: argparse.ArgumentParser, help: str = MODEL_HELP) -> None:
    """``--model``: the model the command loads and runs (default the ``tiny-llama`` preset)."""
    p.add_argument("--model", default="tiny-llama", help=help)


def model_setting_flags(p: argparse.ArgumentParser, *, from_baseline: bool = False) -> None:
    """``--dtype``, ``--attn``, ``--device``, ``--seed``: how the model is loaded (float32, eager, cpu, seed 0)."""
    dtype, dtype_text = _default("float32", from_baseline)
    seed, seed_text = _default(0, from_baseline)
    p.add_argument("--dtype", default=dtype, choices=list(MODEL_DTYPES), help=f"model dtype ({dtype_text})")
    p.add_argument(
        "--attn", default="eager", choices=["eager", "sdpa"], help="attention implementation (default eager)"
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (default cpu)")
    p.add_argument("--seed", type=seed_value, default=seed, help=f"seed for preset weights ({seed_text})")


def baseline_flag(p: argparse.ArgumentParser, help: str) -> None:
    """``--baseline DUMP`` (required): the trusted dump the command works from; ``help`` says what it needs to hold."""
    p.add_argument("--baseline", required=True, help=help)


def engine_flags(p: argparse.ArgumentParser, engine_arg_help: str) -> None:
    """``--engine`` (default transformers) and ``--engine-arg KEY=VALUE``, whose help says what a setting applies to."""
    p.add_argument(
        "--engine",
        default="transformers",
        choices=list(ENGINES),
        help="inference engine that runs the job (default transformers, in this process)",
    )
    p.add_argument("--engine-arg", action="append", default=None, metavar="KEY=VALUE", help=engine_arg_help)


def layers_flag(p: argparse.ArgumentParser, *, from_baseline: bool = False) -> None:
    """``--layers SPEC``: the decoder layers captured (unset: ``first,last,every:8``, or the baseline's)."""
    text = _FROM_BASELINE if from_baseline else "default first,last,every:8"  # unset either way: the job picks them
    p.add_argument(
        "--layers", default=None, help=f"layer spec: all, first, last, every:N, 3, -1, 2..5, -3..-1 ({text})"
    )


def points_flag(p: argparse.ArgumentParser, *, from_baseline: bool = False) -> None:
    """``--points``: the capture points, comma-separated (default ``input``, or the baseline's)."""
    points, text = _default("input", from_baseline)
    p.add_argument(
        "--points",
        default=points,
        help=f"capture points, comma-separated ({text}): input (self-attention input, after the "
        "layer's norm), residual (decoder layer input, before its norm, and the final norm's input), "
        "k_cache and v_cache (the key and value rows the layer stored in its KV cache; vLLM and transformers), "
        "attn_output (what attention adds, before the residual add), mlp_input (after the "
        "post-attention norm), mlp_output (what the MLP or MoE block adds), "
        "router (MoE layers' gate logits, chosen experts and their weights)",
    )


def padding_side_flag(p: argparse.ArgumentParser) -> None:
    """``--padding-side right|left``: where a batch's shorter prompts are padded (default right)."""
    p.add_argument(
        "--padding-side", default="right", choices=["right", "left"], help="where batches are padded (default right)"
    )


def logprob_flags(p: argparse.ArgumentParser, help: str) -> None:
    """``--logprobs`` (``help`` says what the command records) and ``--top-k``, which needs it."""
    p.add_argument("--logprobs", action="store_true", help=help)
    top_k_flag(p)


def save_logits_flag(p: argparse.ArgumentParser) -> None:
    """``--save-logits``: with ``--logprobs``, the full logits rows too (what a full-distribution KL reads)."""
    p.add_argument(
        "--save-logits", action="store_true", help="with --logprobs: also dump the full logits rows (for KL)"
    )


def check_logprob_options(args: argparse.Namespace, *flags: str) -> None:
    """Refuse the first of ``flags`` (``"--top-k"``, ...) that was given without ``--logprobs``, in one line."""
    if args.logprobs:
        return
    for flag in flags:
        if getattr(args, flag.removeprefix("--").replace("-", "_")):
            raise UsageError(NEEDS_LOGPROBS.format(flag=flag))
