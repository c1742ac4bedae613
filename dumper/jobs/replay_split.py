"""Split replay: each half of a decoder layer, attention and MLP, run on the baseline's own input of that half.

:mod:`dumper.jobs.replay` separates what a whole layer adds from what it inherits. Split
replay goes one step further: layer ``k``'s attention of the model under test runs on the
baseline's attention input (``model.layers.k.self_attn.input``, after the input norm) with the
positions, causal mask and rotary embeddings of a prefill, and its MLP (or MoE block) on the
baseline's MLP input (``model.layers.k.mlp.input``). Each half's output is compared with the
baseline's output of that half (``self_attn.output``, ``mlp.output``), so each number is the
error that half adds by itself: ``layer 2: attention adds 3.1e-14, MLP adds 2.0e-04 (the cause)``.

With a ``reference`` model (``--reference float64``: the model under test's checkpoint loaded in
float32, so a bfloat16 target's reference keeps the full-precision weights), each half also runs
in float64 (a float64 copy of the reference's module on the baseline's inputs, without hooks),
and both sides' outputs are measured against it: which
side rounds further from exact, the baseline's or the target's, not only that they differ. The
reference is the module under test's own code: it judges precision, not a logic error that code
shares. Rotary tables are computed as transformers computes them (float32).

The baseline needs ``--points input,attn_output,mlp_input,mlp_output`` for whole prefills.
The dump written holds the target's half outputs under the baseline's names, so
``python -m comparator BASELINE OUT`` judges them too. An MoE block runs with its own router and,
where the baseline holds the ``router`` point, records its routing (the comparator's routing
verdict then shows the tokens the block alone routes otherwise); with ``force_routing`` it runs
with the baseline's expert choice (:mod:`dumper.jobs.replay_routing`, as whole-layer replay does),
and so does its float64 reference: what the MLP half then adds is the experts' math alone.

Example::

    from dumper.jobs.replay_split import split_replay_model
    halves = split_replay_model(model, "dumps/base", "dumps/split", reference="float64")
    [f"layer {h.layer}: {h}" for h in halves]   # ["layer 2: MLP adds 8.1e-09 (the cause) [vs float64: ...]", ...]
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from comparator import rel_diff
from dumper.errors import ModelError, UsageError, error_reason
from dumper.format import DumpReader, Manifest, TensorRecord, load_manifest
from dumper.format.points import ATTN_OUTPUT, INPUT, MLP_INPUT, MLP_OUTPUT, ROUTER
from dumper.hooks.capture import Capture
from dumper.hooks.families import family_for
from dumper.hooks.fingerprint import environment_fingerprint, model_identity
from dumper.hooks.layers import find_decoder_layers, named_child
from dumper.jobs.replay import (
    ReplayConfig,
    check_replay_model,
    decoder_stack,
    layer_kwargs,
    layer_parts,
    point_plan,
    sequence_lengths,
    sequence_rows,
)
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

__all__ = ["HALVES", "REFERENCES", "CAUSE_FACTOR", "HalfError", "split_replay", "split_replay_model"]

HALVES = (("attention", INPUT, ATTN_OUTPUT), ("MLP", MLP_INPUT, MLP_OUTPUT))
"""Each half of a layer: its name, the point holding its input and the point holding its output."""
REFERENCES = ("float64",)
"""High-precision references a split replay can measure both sides against."""
CAUSE_FACTOR = 10.0
"""A half is a layer's cause when its error is this many times the other half's (and not 0)."""
_POINTS_FLAG = "--points input,attn_output,mlp_input,mlp_output"


@dataclass(frozen=True)
class HalfError:
    """What one half of one layer adds by itself: the target's output against the baseline's output of that half
    (``rel_diff``, whole tensor over every sequence), and, with a reference, each side's against the reference."""

    layer: int
    half: str
    name: str
    rel_diff: float
    baseline_vs_reference: float | None = None
    target_vs_reference: float | None = None
    cause: bool = False
    forced: str | None = None
    """An MoE block run with the baseline's expert choice: ``ids`` or ``all`` (:data:`dumper.jobs.replay_routing.
    FORCE_MODES`); None: with its own router's."""

    def __str__(self) -> str:
        forced = f" (the baseline's experts, {self.forced})" if self.forced else ""
        text = f"{self.half}{forced} adds {self.rel_diff:.2g}" + (" (the cause)" if self.cause else "")
        b, t = self.baseline_vs_reference, self.target_vs_reference
        if b is not None and t is not None:
            off = (
                "target's"
                if t > 0 and t >= CAUSE_FACTOR * b
                else "baseline's"
                if b > 0 and b >= CAUSE_FACTOR * t
                else None
            )
            text += f" [vs float64: baseline {b:.2g}, target {t:.2g}" + (f": the {off} is off]" if off else "]")
        return text


def _float64(t: torch.Tensor) -> np.ndarray:
    """``t`` as a float64 array on the host, for the comparator's whole-tensor :func:`comparator.rel_diff`."""
    return t.detach().to("cpu", torch.float64).numpy()


def _halves_of(layer: nn.Module, model: nn.Module) -> dict[str, nn.Module]:
    """The attention and MLP children of a decoder layer, as the model's family names them."""
    family = family_for(model)
    out = {}
    for half, names in (("attention", family.attention_names), ("MLP", family.mlp_names)):
        child = named_child(layer, names)
        if child is None:
            raise UsageError(
                f"replay --split: a decoder layer of {model_label(model)} has no {half} child ({', '.join(names)})"
            )
        out[half] = child[1]
    return out


def _run_half(half: str, module: nn.Module, stack: nn.Module, k: int, hidden: torch.Tensor) -> torch.Tensor:
    """One half on ``hidden`` [1, n, d]: attention with a prefill's positions, mask and rotary; the MLP on its own."""
    try:
        y = module(hidden_states=hidden, **layer_kwargs(stack, k, hidden)) if half == "attention" else module(hidden)
    except Exception as e:  # noqa: BLE001 - the model's own code
        raise ModelError(
            f"{model_label(stack)}: layer {k}'s {half} failed on the baseline's rows ({error_reason(e)})"
        ) from e
    y = y[0] if isinstance(y, tuple) else y
    return y.reshape(-1, y.shape[-1])


def _plans(base: Manifest, where: str) -> dict[str, dict[int, tuple[str, list[TensorRecord]]]]:
    return {point: point_plan(base, where, point, _POINTS_FLAG) for _, i, o in HALVES for point in (i, o)}


_Routing = tuple[LayerRecords | None, LayerRows | None, str | None]
"""One MLP half's routing: the baseline's records of its layer and their rows (None: none), and the force mode."""


def _routing_plan(
    reader: DumpReader,
    where: str,
    model: nn.Module,
    layers: dict[int, nn.Module],
    plans: dict[str, Any],
    mode: str | None,
) -> dict[int, _Routing]:
    """The routing of each MLP half (of ``layers``, by index) whose MoE block the baseline recorded the routing of,
    every row checked before any half runs (and, forcing, a row for every replayed token)."""
    routing = baseline_routing(reader)
    check_model_routes(model, mode, routing, layers, where)
    lengths = {k: sequence_lengths(where, *plans[MLP_INPUT][k]) for k in layers}
    rows = check_baseline_rows(reader, routing, layers, lengths if mode is not None else None)
    return {k: (routing[k], rows[k], mode) for k in routed_layers(routing, layers)}


def split_replay_model(
    model: nn.Module,
    baseline: str | Path,
    out: str | Path,
    *,
    reference: nn.Module | None = None,
    model_name: str | None = None,
    dtype: str | None = None,
    attn: str | None = None,
    force_routing: str | None = None,
    progress: ProgressFn | None = None,
) -> list[HalfError]:
    """Run each half of every layer the baseline holds both ends of on the baseline's input of that half; write
    the outputs to ``out`` (the baseline's names) and return each half's error, in layer order. ``reference``:
    the model whose halves, in float64, each side is measured against (the same architecture; None: none).
    ``force_routing``: run MoE blocks with the baseline's expert choice (``ids`` or ``all``, as :func:`dumper.jobs.
    replay.replay_model`)."""
    base = load_manifest(baseline)
    where, reader = str(baseline), DumpReader(baseline, base)
    check_force(base, where, force_routing)
    plans = _plans(base, where)
    stack_name, layer_list = find_decoder_layers(model, family_for(model).attention_names)
    stack = decoder_stack(model)
    check_replay_model(base, model, len(layer_list), where)
    jobs = [(k, half, i, o) for k in range(len(layer_list)) for half, i, o in HALVES if k in plans[i] and k in plans[o]]
    if not jobs:
        raise UsageError(
            f"{where}: no layer holds both the input and the output of its attention or MLP; re-run "
            f"the baseline with {_POINTS_FLAG} --layers all"
        )
    for k, _, i, _ in jobs:  # whatever a half would refuse, refused before any runs
        sequence_lengths(where, *plans[i][k])
        layer_parts(stack, k)
    routing = _routing_plan(
        reader, where, model, {k: layer_list[k] for k, half, *_ in jobs if half == "MLP"}, plans, force_routing
    )
    param = next(model.parameters())
    identity = model_identity(model, model_name)
    signature = {
        "layers": sorted({k for k, *_ in jobs}),
        "points": [ATTN_OUTPUT, MLP_OUTPUT, *([ROUTER] if routing else [])],
        "num_layers": len(layer_list),
        "world_size": 1,
        "dtype": dtype or str(param.dtype)[6:],
        "modules": [f"{stack_name}.{k}" for k in sorted({k for k, *_ in jobs})],
    }
    extra = {
        "job": "replay",
        "input_ids": base.extra.get("input_ids", []),
        "dtype": dtype,
        "attn": attn,
        "replay": {
            "baseline": where,
            "split": True,
            "reference": None if reference is None else "float64",
            "layers": sorted({k for k, *_ in jobs}),
            "force_routing": force_routing,
        },
    }
    env = environment_fingerprint(param.device, attn or getattr(model.config, "_attn_implementation", None))
    found: list[HalfError] = []
    ref_stack = None if reference is None else decoder_stack(reference)
    with (
        torch.inference_mode(),
        Capture(
            None, out, model_name=identity["name"], extra=extra, identity=identity, signature=signature, environment=env
        ) as cap,
    ):
        for done, (k, half, i, o) in enumerate(jobs, 1):
            exact = (
                None
                if ref_stack is None
                else (_float64_copy(_halves_of(_layer(reference, k), reference)[half]), ref_stack)
            )
            found.append(
                _replay_half(
                    cap,
                    reader,
                    plans,
                    (k, half, i, o),
                    stack,
                    layer_list[k],
                    model,
                    param,
                    exact,
                    routing.get(k) if half == "MLP" else None,
                )
            )
            if progress is not None:
                progress(done, len(jobs))
    return _with_causes(found)


def _replay_half(
    cap: Capture,
    reader: DumpReader,
    plans: dict[str, Any],
    job: tuple[int, str, str, str],
    stack: nn.Module,
    layer: nn.Module,
    model: nn.Module,
    param: torch.Tensor,
    exact: tuple[nn.Module, nn.Module] | None,
    routing: _Routing | None,
) -> HalfError:
    """One half of layer ``k`` on every baseline sequence: record its output, and measure it (and the baseline's)
    against the baseline's output and, given ``exact`` (the float64 reference half and its stack, whose rotary
    tables it uses), against that. ``routing``: an MoE block's routing, recorded (and forced, on the reference too)."""
    k, half, i, o = job
    module = _halves_of(layer, model)[half]
    inputs, expected = sequence_rows(reader, *plans[i][k]), sequence_rows(reader, *plans[o][k])
    outs = []
    refs = []
    bases = []
    positions = []
    sequences = []
    entry, rows_b, mode = routing or (None, None, None)
    forced_ref = entry if exact is not None and mode is not None else None  # the reference takes the same experts
    with (
        layer_routing(reader, entry, rows_b, module, mode) as routers,
        layer_routing(reader, forced_ref, rows_b, exact[0] if exact else module, mode) as ref,
    ):
        for s, rows in inputs.items():
            for r in (*routers, *ref):
                r.begin(s, rows.shape[0])
            hidden = rows.to(param.device, param.dtype, non_blocking=True)[None]  # [1, n, hidden]
            outs.append(_run_half(half, module, stack, k, hidden))
            if exact is not None:
                refs.append(
                    _run_half(
                        half, exact[0], exact[1], k, rows.to(param.device, torch.float64, non_blocking=True)[None]
                    )
                )
            bases.append(expected[s].to(param.device, non_blocking=True))
            positions.append(np.arange(rows.shape[0]))
            sequences.append(np.full(rows.shape[0], s))
    got, want = torch.cat(outs), torch.cat(bases)
    pos, seq = np.concatenate(positions), np.concatenate(sequences)
    cap.record(plans[o][k][0], got, layer=k, point=o, positions=pos, sequence_ids=seq)
    for r in routers:
        r.record(cap, pos, seq)
    cap.step()
    got64, want64 = _float64(got), _float64(want)
    ref64 = _float64(torch.cat(refs)) if refs else None
    return HalfError(
        layer=k,
        half=half,
        name=plans[o][k][0],
        rel_diff=rel_diff(got64, want64),
        baseline_vs_reference=None if ref64 is None else rel_diff(want64, ref64),
        target_vs_reference=None if ref64 is None else rel_diff(got64, ref64),
        forced=mode if routers else None,
    )


def _layer(model: nn.Module, k: int) -> nn.Module:
    return find_decoder_layers(model, family_for(model).attention_names)[1][k]


def _float64_copy(module: nn.Module) -> nn.Module:
    """A float64 copy of ``module`` without its hooks (a capture's tap or hooks do not run in the reference); MoE
    experts run transformers' plain per-expert loop there (its grouped_mm kernels have no float64)."""
    exact = copy.deepcopy(module).to(torch.float64)
    for m in exact.modules():
        m._forward_hooks.clear()
        m._forward_pre_hooks.clear()
        config = getattr(m, "config", None)  # the copy's own config (deep-copied with it)
        if getattr(config, "_experts_implementation", None) not in (None, "eager"):
            config._experts_implementation = "eager"  # type: ignore[union-attr]
    return exact


def _with_causes(found: list[HalfError]) -> list[HalfError]:
    """Mark, per layer, the half whose error is :data:`CAUSE_FACTOR` times the other's."""
    out = []
    for h in found:
        other = next((o for o in found if o.layer == h.layer and o.half != h.half), None)
        cause = other is not None and h.rel_diff > 0 and h.rel_diff >= CAUSE_FACTOR * other.rel_diff
        out.append(HalfError(**{**h.__dict__, "cause": cause}))
    return out


def split_replay(
    cfg: ReplayConfig, *, reference: str | None = None, progress: ProgressFn | None = None
) -> list[HalfError]:
    """Load ``cfg.model`` as ``dumper run`` does and :func:`split_replay_model` it; the baseline's points are checked
    first, so that a wrong baseline costs no model load."""
    if reference is not None and reference not in REFERENCES:
        raise UsageError(f"--reference {reference}: choose one of {', '.join(REFERENCES)}")
    base = load_manifest(cfg.baseline)
    _plans(base, cfg.baseline)
    check_force(base, cfg.baseline, cfg.force_routing)
    model, _ = load_model(cfg.model, dtype=cfg.dtype, attn=cfg.attn, device=cfg.device, seed=cfg.seed)
    exact = None
    if reference is not None:  # full-precision weights: the checkpoint (or preset) in float32, run in float64
        exact = (
            model
            if cfg.dtype == "float32"
            else load_model(cfg.model, dtype="float32", attn="eager", device=cfg.device, seed=cfg.seed)[0]
        )
    return split_replay_model(
        model,
        cfg.baseline,
        cfg.out,
        reference=exact,
        model_name=cfg.model,
        dtype=cfg.dtype,
        attn=cfg.attn,
        force_routing=cfg.force_routing,
        progress=progress,
    )
