"""Drill: one half of one decoder layer of the engine under test, run on the baseline's input, op by op.

The comparison names the layer, the half (attention or MLP) and the token; the drill names the op.
The engine's own module for that half (vLLM's layer in its worker, eager, with its custom ops; or
transformers' module) runs on the baseline's recorded input rows of one sequence, so whatever error
came from upstream is gone and only this half's own error remains. Under a dispatch mode every op
it dispatches is recorded in order and judged against its own float64 reference, relative to the
rounding its dtype predicts (:mod:`dumper.hooks.drill`); the first op far beyond its rounding is
named, and ``repro`` writes a standalone repro of it.

Example::

    from dumper.jobs.drill import DrillConfig, drill
    log = drill(DrillConfig(baseline="dumps/base", out="drills/b", model="ckpt/", engine="vllm",
                            dtype="bfloat16", from_report="report.json", repro="repro/"))
    print(log.summary())
    # layer 2 MLP: _C.silu_and_mul (model.layers.2.mlp.act_fn, [41, 3072] ...) is 340x its rounding at token 20; ...

The baseline needs the half's input point of whole prefills: ``input`` for the attention half,
``mlp_input`` for the MLP half (``--points input,attn_output,mlp_input,mlp_output``); with the
output point too, the log's ``half_check`` says how far the drilled half's output is from the
baseline's (what the half adds by itself, as ``replay --split`` measures it).
"""

from __future__ import annotations

import datetime
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dumper.errors import ModelError, NotComparableError, UsageError, error_reason
from dumper.format import DumpReader, Manifest, load_manifest
from dumper.format.atomic import check_new_dir
from dumper.format.drill import DrillLog, load_drill
from dumper.format.points import ATTN_OUTPUT, INPUT, MLP_INPUT, MLP_OUTPUT
from dumper.hooks.drill.record import DEFAULT_FACTOR, OpRecorder, write_log
from dumper.hooks.drill.repro import write_repro
from dumper.jobs.replay import point_plan, sequence_lengths, sequence_rows
from dumper.progress import ProgressFn

__all__ = [
    "DrillConfig",
    "DrillTarget",
    "drill",
    "drill_halves",
    "baseline_rows",
    "target_of_report",
    "ENGINES",
    "HALF_POINTS",
]

ENGINES = ("transformers", "vllm")
"""The engines the drill runs on (llama.cpp is refused in one line: :data:`_LLAMA_CPP`)."""
HALF_POINTS = {"attn": (INPUT, ATTN_OUTPUT), "mlp": (MLP_INPUT, MLP_OUTPUT)}
"""Each half: the baseline point holding its input and the one holding its output."""
_POINTS_FLAG = "--points input,attn_output,mlp_input,mlp_output"
_LLAMA_CPP = (
    "drill --engine llama.cpp: llama.cpp computes its graph in ggml's C code, which llama-cpp-python does not "
    "let a caller feed one layer's input or dispatch op by op; drill the same checkpoint with --engine vllm or "
    "transformers"
)


@dataclass(frozen=True)
class DrillTarget:
    """Which half of which layer to drill, on which sequence, and the positions whose rows the log keeps."""

    layer: int
    half: str
    sequence: int | None = None
    tokens: tuple[int, ...] = ()
    token: int | None = None
    """The token the comparison named (kept in the log's header; the drill judges every row)."""


@dataclass(frozen=True)
class DrillConfig:
    """What ``python -m dumper drill`` does."""

    baseline: str
    out: str
    model: str = "tiny-llama"
    engine: str = "transformers"
    dtype: str = "float32"
    attn: str = "eager"
    device: str = "cpu"
    seed: int = 0
    layer: int | None = None
    half: str | None = None
    from_report: str | None = None
    sequence: int | None = None
    tokens: tuple[int, ...] = ()
    factor: float = DEFAULT_FACTOR
    repro: str | None = None
    engine_args: tuple[tuple[str, str], ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.engine == "llama.cpp":
            raise UsageError(_LLAMA_CPP)
        if self.engine not in ENGINES:
            raise UsageError(f"drill --engine {self.engine}: the drill runs on {' and '.join(ENGINES)}")
        if (self.from_report is None) == (self.layer is None or self.half is None):
            raise UsageError("drill: give --from-report REPORT.json, or --layer L with --half attn|mlp (not both)")
        if self.half is not None and self.half not in HALF_POINTS:
            raise UsageError(f"drill --half {self.half}: choose attn or mlp")
        if self.layer is not None and self.layer < 0:
            raise UsageError(f"drill --layer {self.layer}: a layer index is >= 0")
        if not (math.isfinite(self.factor) and self.factor > 0):
            raise UsageError(f"drill --factor {self.factor}: a positive number")


def target_of_report(report: str | Path, manifest: Manifest) -> DrillTarget:
    """The half a comparison report's first divergent tensor belongs to: ``attn_output`` -> the attention half,
    ``mlp_output`` -> the MLP half; refused in one line for a point between the halves (or no divergence)."""
    path = Path(report)
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UsageError(f"{path}: not a comparison report ({error_reason(e)})") from None
    fd = raw.get("first_divergent") if isinstance(raw, dict) else None
    if not isinstance(fd, dict):
        raise UsageError(f"{path}: the report names no divergence (first_divergent is empty): nothing to drill")
    name, layer = fd.get("name"), fd.get("layer")
    if not isinstance(name, str) or type(layer) is not int:
        raise UsageError(f"{path}: first_divergent has no tensor name and layer")
    point = next((r.point for r in manifest.tensors if r.name == name), None)
    half = {ATTN_OUTPUT: "attn", MLP_OUTPUT: "mlp"}.get(point or "")
    if half is None:
        raise UsageError(
            f"{path}: the first divergent tensor {name} is the {point or 'unknown'} point, not a half's output "
            "(attn_output, mlp_output): compare dumps with the sub-layer points "
            f"({_POINTS_FLAG}), or drill --layer {layer} --half attn|mlp"
        )
    seq, token = fd.get("sequence"), fd.get("token")
    return DrillTarget(
        layer,
        half,
        sequence=seq if type(seq) is int else None,
        token=token if type(token) is int else None,
    )


def _target(cfg: DrillConfig, manifest: Manifest) -> DrillTarget:
    if cfg.from_report is not None:
        t = target_of_report(cfg.from_report, manifest)
        return replace(t, sequence=cfg.sequence if cfg.sequence is not None else t.sequence, tokens=cfg.tokens)
    assert cfg.layer is not None and cfg.half is not None
    return DrillTarget(cfg.layer, cfg.half, sequence=cfg.sequence, tokens=cfg.tokens)


def baseline_rows(
    baseline: str | Path, target: DrillTarget, manifest: Manifest | None = None
) -> tuple[int, torch.Tensor, torch.Tensor | None, str]:
    """The drilled sequence, its baseline input rows of the half [n, d], its output rows (None: not recorded) and the
    output tensor's name; refused in one line when the baseline lacks the half's input of a whole prefill.
    ``manifest``: the baseline's, when the caller has read it already."""
    where = str(baseline)
    manifest = load_manifest(baseline) if manifest is None else manifest
    reader = DumpReader(baseline, manifest)
    point_in, point_out = HALF_POINTS[target.half]
    plan = point_plan(manifest, where, point_in, _POINTS_FLAG)
    if target.layer not in plan:
        raise UsageError(f"{where}: holds no {point_in} point of layer {target.layer} (layers {sorted(plan)})")
    name, recs = plan[target.layer]
    lengths = sequence_lengths(where, name, recs)
    seq = target.sequence if target.sequence is not None else min(lengths)
    if seq not in lengths:
        raise UsageError(f"{where}: holds no sequence {seq} at {name} (sequences {sorted(lengths)})")
    rows = sequence_rows(reader, name, recs)[seq]
    out_rows, out_name = None, ""
    try:
        out_plan = point_plan(manifest, where, point_out, _POINTS_FLAG)
    except (UsageError, NotComparableError):
        out_plan = {}
    if target.layer in out_plan:
        out_name, out_recs = out_plan[target.layer]
        out_rows = sequence_rows(reader, out_name, out_recs).get(seq)
    return seq, rows, out_rows, out_name


def _token_ids(manifest: Manifest, seq: int, n: int) -> list[int]:
    """The tokens of sequence ``seq``'s first ``n`` positions, as the baseline ran them (prompt, then what it fed
    back); zeros where the manifest does not list them (the half's input is the baseline's rows either way)."""
    prompts = manifest.extra.get("input_ids") or []
    generated = manifest.extra.get("generated_ids") or []
    ids: list[int] = []
    if 0 <= seq < len(prompts):
        ids = list(prompts[seq]) + (list(generated[seq]) if seq < len(generated) and generated[seq] else [])
    ids = [int(i) for i in ids[:n]]
    return ids + [0] * (n - len(ids))


def _half_check(y: torch.Tensor, base_out: torch.Tensor | None, name: str) -> dict[str, Any] | None:
    """How far the drilled half's output is from the baseline's output of that half (rel_diff, whole and per token)."""
    if base_out is None:
        return None
    from comparator import pair_stats

    a = base_out.to(torch.float64).reshape(base_out.shape[0], -1).numpy()
    b = y.detach().to("cpu", torch.float64).reshape(a.shape[0], -1).numpy()
    if a.shape != b.shape:
        return {"point": name, "note": f"shapes differ: baseline {list(a.shape)}, drill {list(b.shape)}"}
    stats = pair_stats(np.ascontiguousarray(a), np.ascontiguousarray(b), "F64")
    per = np.asarray(stats.token_rel_diff, dtype=np.float64)
    worst = int(np.argmax(np.nan_to_num(per, nan=np.inf))) if per.size else None
    return {
        "point": name,
        "rel_diff": _finite(stats.rel_diff),
        "worst_token": worst,
        "worst": _finite(float(per[worst])) if worst is not None else None,
    }


def _finite(v: float) -> float | str:
    return v if math.isfinite(v) else "inf"


def _run_transformers(
    cfg: DrillConfig, halves: list[tuple[int, str, torch.Tensor]], recorder_for: Any
) -> list[tuple[OpRecorder, torch.Tensor, dict[str, Any]]]:
    """transformers' own module of each half ``(layer, half, x)`` on ``x`` [n, d] (attention with a prefill's
    positions, mask and rotary embeddings), one model loaded for all of them."""
    import transformers

    from dumper.hooks.drill.record import half_module
    from dumper.hooks.families import family_for
    from dumper.jobs.replay import decoder_stack, layer_kwargs
    from dumper.prefill.presets import load_model, model_label

    model, _ = load_model(cfg.model, dtype=cfg.dtype, attn=cfg.attn, device=cfg.device, seed=cfg.seed)
    family, stack = family_for(model), decoder_stack(model)
    param = next(model.parameters())
    out = []
    for layer, half, x in halves:
        path, module = half_module(model, layer, half, family, model_label(model))
        hidden = x.to(param.device, param.dtype)[None]  # [1, n, d]
        kwargs = layer_kwargs(stack, layer, hidden) if half == "attn" else {}
        rec = recorder_for(path)
        try:
            with torch.inference_mode(), rec.watch(module, path), rec:
                y = module(hidden_states=hidden, **kwargs) if half == "attn" else module(hidden)
        except Exception as e:  # noqa: BLE001 - the model's own code
            raise ModelError(f"{model_label(model)}: {path} failed on the baseline's rows ({error_reason(e)})") from e
        y = y[0] if isinstance(y, tuple) else y
        info = {"engine": "transformers", "engine_version": transformers.__version__, "module": path}
        out.append((rec, y.reshape(-1, y.shape[-1]), info))
    return out


def drill(cfg: DrillConfig, *, progress: ProgressFn | None = None) -> DrillLog:
    """Run ``cfg``'s drill, write its log to ``cfg.out`` (and the repro to ``cfg.repro``), and return the log."""
    manifest = load_manifest(cfg.baseline)
    return drill_halves(cfg, [_target(cfg, manifest)], [cfg.out], manifest=manifest, progress=progress)[0]


def drill_halves(
    cfg: DrillConfig,
    targets: Sequence[DrillTarget],
    outs: Sequence[str | Path],
    *,
    manifest: Manifest | None = None,
    progress: ProgressFn | None = None,
) -> list[DrillLog]:
    """Drill each of ``targets`` (one sequence for all) on one engine start, writing each log to its ``outs`` entry
    (``cfg.out`` is not used; ``cfg.repro``: the repro of the first target's named op). Every half gets the
    baseline's own input rows, so all halves of a model can be drilled in one forward. ``manifest``: the
    baseline's, when the caller has read it already."""
    if len(targets) != len(outs) or not targets:
        raise UsageError("drill: one output directory per half")
    manifest = load_manifest(cfg.baseline) if manifest is None else manifest
    plans = [baseline_rows(cfg.baseline, t, manifest) for t in targets]
    seq = plans[0][0]
    if any(p[0] != seq for p in plans):
        raise UsageError("drill: the halves drilled together must be of one sequence")
    n = int(plans[0][1].shape[0])
    tokens = list(targets[0].tokens) or list(range(n))
    bad = [t for t in tokens if not 0 <= t < n]
    if bad:
        raise UsageError(f"drill --tokens {bad}: sequence {seq} of {cfg.baseline} has positions 0..{n - 1}")
    for out in outs:  # refused before any engine starts
        check_new_dir(out, "--out")
    if cfg.repro is not None:
        check_new_dir(cfg.repro, "--repro")
    state: dict[str, Any] = {}

    def recorder_for(path: str) -> OpRecorder:
        return OpRecorder(half_path=path, positions=list(range(n)), tokens=tokens, factor=cfg.factor, state=state)

    halves = [(t.layer, t.half, p[1]) for t, p in zip(targets, plans, strict=True)]
    if cfg.engine == "vllm":
        from dumper.engines.vllm.drill import run_halves

        runs = run_halves(cfg, halves, _token_ids(manifest, seq, n), recorder_for, state)
    else:
        runs = _run_transformers(cfg, halves, recorder_for)
    logs = []
    for i, (target, plan, (rec, y, info), out) in enumerate(zip(targets, plans, runs, outs, strict=True)):
        if not rec.entries:
            raise ModelError(f"drill: {info.get('module')} dispatched no op on the baseline's rows")
        header = {
            **info,
            "model": cfg.model,
            "dtype": cfg.dtype,
            "device": cfg.device,
            "layer": target.layer,
            "half": target.half,
            "sequence": seq,
            "positions": n,
            "token": target.token,
            "baseline": str(cfg.baseline),
            "torch_version": torch.__version__,
            "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "half_check": _half_check(y, plan[2], plan[3]),
            "first_beyond": None if rec.first is None else rec.first.entry.index,
        }
        write_log(out, header, rec)
        if i == 0 and cfg.repro is not None and rec.first is not None:
            write_repro(rec.first, cfg.repro, factor=cfg.factor, state=state)
        logs.append(load_drill(out))
        if progress is not None:
            progress(i + 1, len(targets))
    return logs
