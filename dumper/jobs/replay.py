"""Replay: run each decoder layer of a model under test on the baseline's own residual input.

A normal comparison shows the error a layer's input has accumulated from every layer before
it. Replay separates what a layer adds by itself: decoder layer ``k`` of the model under test
is fed the baseline's captured residual input of layer ``k`` (the ``residual`` point, see
:mod:`dumper.hooks.layers`), with the positions, causal mask and rotary embeddings the model's own
forward would give it, and its output is recorded as the residual of layer ``k+1``
(``model.norm.residual`` after the last layer). Comparing that dump with the baseline gives,
at layer ``k+1``, the error layer ``k`` introduces, with nothing inherited.

Example::

    from dumper.jobs.replay import ReplayConfig, replay
    replay(ReplayConfig(model="ckpt/", baseline="dumps/base", out="dumps/replay"))
    # python -m comparator dumps/base dumps/replay

The baseline must hold the ``residual`` point of consecutive layers (``python -m dumper run
--points residual --layers all``) for whole prefills (positions ``0..n-1`` of each sequence,
in one pass or in chunks and batches: rows are reassembled by position and sequence id). Where
it holds the ``router`` point too, each replayed MoE layer records its routing, and
``force_routing`` replays them with the baseline's expert choice (:mod:`dumper.jobs.replay_routing`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from dumper.errors import (
    DriftscopeError,
    ModelError,
    ModelMismatchError,
    NotComparableError,
    UsageError,
    error_reason,
)
from dumper.format import (
    PAD_SEQUENCE,
    DumpReader,
    Manifest,
    TensorRecord,
    encode_runs,
    load_manifest,
)
from dumper.format.dtypes import FLOAT_CODES
from dumper.format.points import RESIDUAL
from dumper.hooks.capture import Capture
from dumper.hooks.families import family_for
from dumper.hooks.fingerprint import environment_fingerprint, model_identity
from dumper.hooks.layers import ROUTER, find_decoder_layers
from dumper.jobs.replay_routing import (
    LayerRecords,
    LayerRows,
    baseline_routing,
    check_baseline_rows,
    check_force,
    check_model_routes,
    layer_routing,
    routed_layers,
)
from dumper.prefill.presets import load_model, model_label
from dumper.progress import ProgressFn

__all__ = [
    "ReplayConfig",
    "replay",
    "replay_model",
    "residual_plan",
    "point_plan",
    "sequence_lengths",
    "sequence_rows",
    "layer_kwargs",
    "layer_parts",
    "check_replay_model",
]


@dataclass(frozen=True)
class ReplayConfig:
    """What ``python -m dumper replay`` does: the model under test (as for ``dumper run``), the baseline, the output."""

    model: str
    baseline: str
    out: str
    dtype: str = "float32"
    attn: str = "eager"
    device: str = "cpu"
    seed: int = 0
    force_routing: str | None = None
    """None, ``"ids"`` or ``"all"``: replay MoE layers with the baseline's expert ids (and weights); see
    :mod:`dumper.jobs.replay_routing`."""


def residual_plan(manifest: Manifest, where: str) -> dict[int, tuple[str, list[TensorRecord]]]:
    """layer -> (name, records) of the baseline's ``residual`` point (:func:`point_plan`)."""
    return point_plan(manifest, where, RESIDUAL, f"--points input,{RESIDUAL}")


def point_plan(manifest: Manifest, where: str, point: str, points: str) -> dict[int, tuple[str, list[TensorRecord]]]:
    """layer -> (name, records) of the baseline's ``point`` (rank 0: every rank holds the whole rows).

    Raises :class:`UsageError` when there is none, naming the dump and the fix (``points``: the flag to re-run with).
    """
    plan: dict[int, tuple[str, list[TensorRecord]]] = {}
    for rec in manifest.tensors:
        if rec.point != point or rec.layer is None or rec.rank != 0:
            continue
        name, recs = plan.setdefault(rec.layer, (rec.name, []))
        if name != rec.name:
            raise NotComparableError(f"{where}: layer {rec.layer} holds two {point} tensors ({name}, {rec.name})")
        if rec.positions is None or rec.sequence_ids is None or rec.shard_dim is not None or rec.sketch is not None:
            raise NotComparableError(
                f"{where}: {rec.name} (pass {rec.forward_pass}) has no row positions or is "
                "sharded or sketched; replay needs whole rows labelled by position and sequence"
            )
        recs.append(rec)
    if not plan:
        raise UsageError(
            f"{where}: the baseline holds no {point!r} point; re-run it with "
            f"`python -m dumper run ... {points} --layers all`"
        )
    return dict(sorted(plan.items()))


def sequence_lengths(where: str, name: str, recs: list[TensorRecord]) -> dict[int, int]:
    """sequence id -> its row count, from the manifest alone: refused unless every record is a float dtype and each
    sequence's positions are exactly one prefill ``0..n-1`` (checked for every layer before a replay runs any)."""
    found: dict[int, list[np.ndarray]] = defaultdict(list)
    for rec in recs:
        if rec.dtype not in FLOAT_CODES:
            raise NotComparableError(f"{where}: {name} is stored as {rec.dtype}, not a float dtype")
        pos, seq = rec.row_positions(), rec.row_sequence_ids()
        assert pos is not None and seq is not None  # point_plan checked
        for s in np.unique(seq[seq != PAD_SEQUENCE]).tolist():
            found[s].append(pos[seq == s])
    out = {}
    for s, parts in sorted(found.items()):
        pos = np.sort(np.concatenate(parts))
        if not np.array_equal(pos, np.arange(pos.size)):
            runs = encode_runs(pos, step=1)
            raise NotComparableError(
                f"{where}: {name} holds positions {', '.join(f'{a}..{a + c - 1}' for a, c in runs[:4])}"
                f"{' ...' if len(runs) > 4 else ''} of sequence {s}, not one prefill 0..{pos.size - 1}; replay runs "
                "a layer on whole sequences from position 0 (a decode step or a partial capture cannot be replayed)"
            )
        out[s] = pos.size
    return out


def sequence_rows(reader: DumpReader, name: str, recs: list[TensorRecord]) -> dict[int, torch.Tensor]:
    """sequence id -> its rows [n, hidden] in position order, reassembled from chunks and batches
    (:func:`sequence_lengths` checked the records)."""
    parts: dict[int, list[tuple[np.ndarray, np.ndarray]]] = defaultdict(list)
    for rec in recs:
        rows = reader.rows(rec)
        pos = rec.row_positions()
        seq = rec.row_sequence_ids()
        assert pos is not None and seq is not None  # point_plan checked
        for s in np.unique(seq[seq != PAD_SEQUENCE]).tolist():
            sel = seq == s
            parts[s].append((pos[sel], rows[sel]))
    out = {}
    for s, found in sorted(parts.items()):
        order = np.argsort(np.concatenate([p for p, _ in found]), kind="stable")
        stored = np.concatenate([r for _, r in found])[order]
        dtype = recs[0].dtype
        t = torch.from_numpy(stored.view(np.int16) if dtype == "BF16" else stored)
        out[s] = t.view(torch.bfloat16) if dtype == "BF16" else t
    return out


def layer_parts(stack: nn.Module, layer_index: int) -> tuple[nn.Module, Any]:
    """The stack's rotary embedding and the mask maker of layer ``layer_index``; refused in one line when replay
    cannot build them (checked for every layer before a replay runs any)."""
    from transformers import masking_utils

    rotary = getattr(stack, "rotary_emb", None)
    if not isinstance(rotary, nn.Module):
        raise UsageError(
            f"replay: {type(stack).__name__} has no rotary_emb; replay supports transformers "
            "decoders with rotary position embeddings (Llama, Qwen2, Mistral, ...)"
        )
    kind = (getattr(stack.config, "layer_types", None) or ["full_attention"] * (layer_index + 1))[layer_index]
    make = {
        "full_attention": masking_utils.create_causal_mask,
        "sliding_attention": masking_utils.create_sliding_window_causal_mask,
    }.get(kind)
    if make is None:
        raise UsageError(
            f"replay: layer {layer_index} of {type(stack).__name__} uses {kind!r} attention; "
            "replay builds full and sliding-window causal masks only"
        )
    return rotary, make


def decoder_stack(model: nn.Module) -> nn.Module:
    """The decoder stack (``model.model``): what holds the rotary embedding and the config the masks read."""
    return model.get_submodule(find_decoder_layers(model, family_for(model).attention_names)[0].rpartition(".")[0])


def layer_kwargs(stack: nn.Module, layer_index: int, hidden: torch.Tensor) -> dict[str, Any]:
    """What a transformers decoder stack passes decoder layer ``layer_index`` for a prefill of ``hidden`` [1, n, d].

    Positions ``0..n-1``, the causal mask built by transformers' own mask utilities from the
    stack's config (the sliding-window one for a ``sliding_attention`` layer), and the rotary
    embeddings of the stack's own ``rotary_emb``: what its forward computes without a cache.
    """
    config = stack.config
    rotary, make = layer_parts(stack, layer_index)
    position_ids = torch.arange(hidden.shape[1], device=hidden.device)[None]  # [1, n]
    mask = make(
        config=config, inputs_embeds=hidden, attention_mask=None, past_key_values=None, position_ids=position_ids
    )
    return {"attention_mask": mask, "position_ids": position_ids, "position_embeddings": rotary(hidden, position_ids)}


def check_replay_model(baseline: Manifest, model: nn.Module, num_layers: int, where: str) -> None:
    """Refuse a model whose layer count or hidden size differs from the baseline's (its rows would not fit)."""
    base_layers = baseline.model.get("num_layers", baseline.capture_signature.get("num_layers"))
    ident = model_identity(model)
    for what, b, m in (
        ("num_layers", base_layers, num_layers),
        ("hidden_size", baseline.model.get("hidden_size"), ident.get("hidden_size")),
    ):
        if b is not None and m is not None and b != m:
            raise ModelMismatchError(
                f"{where}: the baseline's model has {what} {b}, {model_label(model)} has {m}; "
                "replay needs the model the baseline was dumped from (or a variant of it)"
            )


def replay_model(
    model: nn.Module,
    baseline: str | Path,
    out: str | Path,
    *,
    model_name: str | None = None,
    dtype: str | None = None,
    attn: str | None = None,
    force_routing: str | None = None,
    progress: ProgressFn | None = None,
) -> Manifest:
    """:func:`replay` with the model under test already in hand (say, one with a bug injected).

    Writes a dump whose ``model.layers.{k+1}.residual`` (layer ``k+1``, point ``residual``) is
    decoder layer ``k`` run on the baseline's ``model.layers.{k}.residual``, for every ``k``
    whose input and counterpart (the next layer's residual, or the final norm's) the baseline
    holds. The output is stored in the dtype the model computes in; the manifest's ``extra``
    says ``{"replay": {"baseline": ..., "layers": [k, ...], "force_routing": ...}}``. MoE layers
    whose routing the baseline holds record theirs, forced as ``force_routing`` says
    (:class:`ReplayConfig`).
    """
    base = load_manifest(baseline)
    check_force(base, str(baseline), force_routing)
    reader = DumpReader(baseline, base)
    plan, routing = residual_plan(base, str(baseline)), baseline_routing(reader)
    stack_name, layer_list = find_decoder_layers(model, family_for(model).attention_names)
    stack = model.get_submodule(stack_name.rpartition(".")[0])
    check_replay_model(base, model, len(layer_list), f"{baseline}")
    run = [k for k in plan if k + 1 in plan and k < len(layer_list)]
    if not run:
        raise UsageError(
            f"{baseline}: no layer has both its residual input and the next one's ({sorted(plan)}); "
            f"re-run the baseline with --points {RESIDUAL} --layers all"
        )
    replayed = {k: layer_list[k] for k in run}
    check_model_routes(model, force_routing, routing, replayed, str(baseline))
    # everything a layer's replay would refuse, refused before any runs: its rows, its mask, its routing rows
    lengths = {k: sequence_lengths(str(baseline), *plan[k]) for k in run}
    for k in run:
        layer_parts(stack, k)
    routing_rows = check_baseline_rows(reader, routing, replayed, lengths if force_routing is not None else None)
    param = next(model.parameters())
    identity = model_identity(model, model_name)
    signature = {
        "layers": sorted(k + 1 for k in run if k + 1 < len(layer_list)),
        "modules": [f"{stack_name}.{k}" for k in run],
        "points": [RESIDUAL, *([ROUTER] if routed_layers(routing, replayed) else [])],
        "num_layers": len(layer_list),
        "world_size": 1,
        "dtype": dtype or str(param.dtype)[6:],
    }
    extra = {
        "job": "replay",
        "input_ids": base.extra.get("input_ids", []),
        "dtype": dtype,
        "attn": attn,
        "replay": {
            "baseline": str(baseline),
            "layers": run,
            "force_routing": force_routing,
            "skipped": [k for k in plan if k not in run and k < len(layer_list)],
        },
    }
    env = environment_fingerprint(param.device, attn or getattr(model.config, "_attn_implementation", None))
    with (
        torch.inference_mode(),
        Capture(
            None, out, model_name=identity["name"], extra=extra, identity=identity, signature=signature, environment=env
        ) as cap,
    ):
        for done, k in enumerate(run, 1):
            _replay_layer(
                cap, reader, plan, k, stack, layer_list[k], param, (routing.get(k), routing_rows.get(k), force_routing)
            )
            if progress is not None:
                progress(done, len(run))
    return load_manifest(out)


def _replay_layer(
    cap: Capture,
    reader: DumpReader,
    plan: dict[int, tuple[str, list[TensorRecord]]],
    k: int,
    stack: nn.Module,
    layer: nn.Module,
    param: torch.Tensor,
    routing: tuple[LayerRecords | None, LayerRows | None, str | None],
) -> None:
    """Run decoder ``layer`` (index ``k``) on each baseline sequence and record its output as layer ``k+1``'s residual.

    ``routing``: the baseline's routing records of layer ``k`` and their rows (None: none), and the force mode;
    the layer's routing is recorded in the same pass (:func:`dumper.jobs.replay_routing.layer_routing`).
    """
    outs = []
    positions = []
    sequences = []
    with layer_routing(reader, *routing[:2], layer, routing[2]) as routers:
        for s, rows in sequence_rows(reader, *plan[k]).items():
            hidden = rows.to(param.device, param.dtype, non_blocking=True)[None]  # [1, n, hidden]
            for router in routers:
                router.begin(s, rows.shape[0])
            try:
                y = layer(hidden, **layer_kwargs(stack, k, hidden))
            except DriftscopeError:  # a routing row the baseline lacks: already one line
                raise
            except Exception as e:  # noqa: BLE001 - the model's own layer code
                raise ModelError(
                    f"{model_label(stack)}: decoder layer {k} failed on the baseline's rows ({error_reason(e)})"
                ) from e
            y = y[0] if isinstance(y, tuple) else y
            outs.append(y.reshape(-1, y.shape[-1]))  # [n, hidden]
            positions.append(np.arange(rows.shape[0]))
            sequences.append(np.full(rows.shape[0], s))
    pos, seq = np.concatenate(positions), np.concatenate(sequences)
    cap.record(plan[k + 1][0], torch.cat(outs), layer=k + 1, point=RESIDUAL, positions=pos, sequence_ids=seq)
    for router in routers:
        router.record(cap, pos, seq)
    cap.step()


def replay(cfg: ReplayConfig, *, progress: ProgressFn | None = None) -> Manifest:
    """Load ``cfg.model`` as ``dumper run`` does (preset or HF directory) and :func:`replay_model` it.

    The baseline is checked for the ``residual`` point (and, to force routing, the ``router``
    point) first, so that a wrong one costs no model load.
    """
    base = load_manifest(cfg.baseline)
    residual_plan(base, cfg.baseline)
    check_force(base, cfg.baseline, cfg.force_routing)
    model, _ = load_model(cfg.model, dtype=cfg.dtype, attn=cfg.attn, device=cfg.device, seed=cfg.seed)
    return replay_model(
        model,
        cfg.baseline,
        cfg.out,
        model_name=cfg.model,
        dtype=cfg.dtype,
        attn=cfg.attn,
        force_routing=cfg.force_routing,
        progress=progress,
    )
