"""The KV cache points ``k_cache``/``v_cache`` in compiled vLLM on a real trained model: cost, bytes, fp8 error.

SmolLM2-135M-Instruct (:mod:`tests.real_model`, its float32 HF directory run as bfloat16) on its three real
prompts (50, 68 and 48 tokens), every layer, a prefill and ``--new-tokens`` greedy decode steps per prompt (the
job ``python -m dumper run --engine vllm --new-tokens N --layers all`` runs). Each engine is built in a worker
process of its own through :mod:`dumper.engines.vllm.engine` (``engine_kwargs``, ``load_llm``, ``dump_llm``: what
the CLI runs), vLLM's default mode (multiprocess, compiled). The tap's points are part of the compiled model
(``additional_config``), so each set of points is its own engine: all of them are started side by side first
(their start and compile time is not measured here), then the jobs run on the kept engines.

1. Capture cost. Three engines: (a) *plain*, no tap (``engine_kwargs(..., tap=False)``: ``LLM.generate`` of the
   job); (b) tapped with ``--points input``; (c) tapped with ``--points input,k_cache,v_cache``; (b) and (c) run
   the whole dump (``dump_llm``: marked generate, the ranks' parts, the joined dump and its manifest). After one
   warm-up of each, ``--reps`` rounds run (a), (b), (c) and (c)'s engine unmarked (*c idle*: the tapped engine
   recording nothing) in turn, so that a busy machine hits them alike. Reported: medians and minima, and the
   ratios (c)/(a), (c)/(b), (b)/(a) of medians (and of minima).
2. Bytes per token per layer of the cache points, from the dump's manifest (each record's stored bytes, a
   sketch's norms included) over (recorded tokens x layers): (c)'s full rows (bf16), the fp8 engine's (stored as
   dequantized float32) and ``--sketch K`` (an engine of its own, ``enforce_eager`` to spare a compile: the bytes
   do not depend on it). The ``input`` point and the whole dump's data files for comparison.
3. fp8 KV error. (c)'s dump (``kv_cache_dtype=auto``, a bf16 cache) against the same job on an engine with
   ``kv_cache_dtype=fp8`` (compiled; vLLM-CPU keeps fp8 caches with AVX-512; scale 1.0 per layer). Rows align by
   (sequence, position); a sequence whose greedy tokens differ between the two is cut at its first differing
   position (later rows have other inputs). Per layer and point: rel_diff ``|x-y|^2/(|x|^2+|y|^2)`` over the
   tensor, the largest per-token rel_diff, and for the cache points the median and largest fp8 rounding that
   :func:`comparator.hidden.kv_cache.fp8_rounding` predicts from the auto rows (float8_e4m3fn, its defaults) and
   the largest measured/predicted over the rows. Beside it the comparator's rule, each token's upstream drift
   allowed: measured / (fp8 rounding at the engine's scale + ``DRIFT_GAIN`` x that token's ``input`` rel_diff at
   the layer), as far as this checkout's :mod:`comparator.hidden.kv_cache` has them (else the best scale, gain 1):
   later layers' rows carry the drift of every fp8 attention before them. Its maximum is the benign ratio that
   ``FP8_FACTOR`` must stay above. At the first layer (both sides' inputs identical) each stored fp8 element is
   checked against the auto element cast to e4m3 at the layer's scale, rounded to nearest and toward zero. The
   comparator's own verdict of the pair (``compare_dumps``: its fp8 table) is printed last.

The whole bench takes about 6-8 minutes on 2 shared cores, most of it the five engine starts (vLLM-CPU 0.32
recompiles each compiled engine: its AOT compile cache fails to load, "'function' object has no attribute
'finalize_loading'").

Writes ``kv_cache_bench.json`` and ``kv_cache_bench.md`` into ``--out`` (the dumps stay in ``--out/dumps``) and
prints the markdown.

    python bench/bench_kv_cache.py --out DIR [--reps 9] [--new-tokens 8] [--sketch 64]
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import math
import shutil
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine_worker import Worker, reply  # noqa: E402

from tests.real_model import missing, real_prompt_ids, smollm2_dir  # noqa: E402

KV_POINTS = "input,k_cache,v_cache"
CACHE = ("k_cache", "v_cache")


# -- the worker: one engine per process ---------------------------------------------------------


def _worker(spec: dict[str, Any]) -> None:
    """Start one engine (timed), then answer each stdin line: ``{"op": "plain"}`` times the job's generate without
    a capture, ``{"op": "dump", "out": DIR}`` the whole dump into ``DIR``."""
    try:
        from dumper.engines.base import hf_identity, job_sequences
        from dumper.engines.vllm.engine import _generate, dump_llm, engine_kwargs, load_llm
        from dumper.format.sketch import SketchSpec
        from dumper.prefill.run import RunConfig

        ckpt = Path(spec["model"])
        engine_args = tuple((k, str(spec[k])) for k in ("kv_cache_dtype", "enforce_eager") if spec.get(k))
        cfg = RunConfig(
            out=str(ckpt.parent / "unused"),
            model=str(ckpt),
            input_ids=tuple(map(tuple, spec["ids"])),
            layers="all",
            points=tuple((spec["points"] or "input").split(",")),
            dtype="bfloat16",
            engine="vllm",
            new_tokens=spec["new_tokens"],
            engine_args=engine_args,
            sketch=SketchSpec(spec["sketch"]) if spec.get("sketch") else None,
        )
        identity = hf_identity(ckpt, cfg.model)
        seqs = job_sequences(cfg, ckpt, int(identity.get("vocab_size") or 0))
        t = time.perf_counter()
        llm = load_llm(engine_kwargs(cfg, ckpt, seqs, tap=spec["points"] is not None))
        reply({"start": time.perf_counter() - t})
    except Exception as e:  # noqa: BLE001 - reported by the parent
        return reply({"error": f"{type(e).__name__}: {str(e).strip()[:300]}", "trace": traceback.format_exc()[-2000:]})
    for line in sys.stdin:
        req = json.loads(line)
        try:
            if req["op"] == "plain":
                llm.reset_prefix_cache()  # as dump_llm does first
                t = time.perf_counter()
                _generate(llm, cfg, seqs)
                dt = time.perf_counter() - t
            else:
                out = Path(req["out"])
                shutil.rmtree(out, ignore_errors=True)
                t = time.perf_counter()
                dump_llm(llm, dataclasses.replace(cfg, out=str(out)), seqs, ckpt, identity=identity)
                dt = time.perf_counter() - t
            reply({"seconds": dt})
        except Exception as e:  # noqa: BLE001 - reported by the parent
            reply({"error": f"{type(e).__name__}: {str(e).strip()[:300]}", "trace": traceback.format_exc()[-2000:]})


# -- 1. capture cost ------------------------------------------------------------------------------


def capture_cost(workers: dict[str, Worker], dumps: Path, reps: int) -> dict[str, Any]:
    """Time (a) plain, (b) input, (c) kv and (c) idle in turn, ``reps`` rounds after one warm-up."""
    jobs = {
        "a plain": (workers["plain"], "plain", None),
        "b input": (workers["input"], "dump", dumps / "timed-input"),
        "c kv": (workers["kv"], "dump", dumps / "timed-kv"),
        "c idle": (workers["kv"], "plain", None),
    }
    for w, op, out in jobs.values():  # warm-up: each path's first-call costs
        w.run(op, out=out)
    samples: dict[str, list[float]] = {k: [] for k in jobs}
    for _ in range(reps):
        for key, (w, op, out) in jobs.items():
            samples[key].append(float(w.run(op, out=out)["seconds"]))
    med = {k: statistics.median(v) for k, v in samples.items()}
    low = {k: min(v) for k, v in samples.items()}
    ratios = {
        "c/a": (med["c kv"] / med["a plain"], low["c kv"] / low["a plain"]),
        "c/b": (med["c kv"] / med["b input"], low["c kv"] / low["b input"]),
        "b/a": (med["b input"] / med["a plain"], low["b input"] / low["a plain"]),
        "c idle/a": (med["c idle"] / med["a plain"], low["c idle"] / low["a plain"]),
    }
    return {"samples": samples, "median": med, "min": low, "ratios": ratios}


# -- 2. bytes -------------------------------------------------------------------------------------


def dump_bytes(dump: Path) -> dict[str, Any]:
    """Per point: stored bytes of its records / (recorded tokens x layers); the data files' likewise (all points)."""
    from dumper.errors import DriftscopeError
    from dumper.format import Manifest, load_manifest

    refused = None
    try:
        m = load_manifest(dump)
    except DriftscopeError as e:  # the manifest as written, unchecked: its bytes are still what was stored
        refused = str(e)
        m = Manifest.from_json(json.loads((dump / "manifest.json").read_text()))
    layers = sorted({t.layer for t in m.tensors if t.layer is not None})
    first = layers[0]
    out: dict[str, Any] = {"layers": len(layers)}
    tokens = 0
    for point in ("input", *CACHE):
        recs = [t for t in m.tensors if t.point == point]
        rows = sum(t.rows for t in recs if t.layer == first)
        tokens = tokens or rows
        width = {t.shape[-1] for t in recs}
        source = {t.sketch["hidden"] for t in recs if t.sketch is not None}
        out[point] = {
            "bytes": sum(t.nbytes for t in recs),
            "tokens": rows,
            "per_token_layer": sum(t.nbytes for t in recs) / max(rows * len(layers), 1),
            "dtype": sorted({t.dtype for t in recs}),
            "width": sorted(width),
            "sketch_of": sorted(source),
        }
    kv = sum(out[p]["bytes"] for p in CACHE)
    out["kv"] = {"bytes": kv, "per_token_layer": kv / max(tokens * len(layers), 1)}
    files = sum(m.files.values())
    out["files"] = {"bytes": files, "per_token_layer": files / max(tokens * len(layers), 1)}
    out["tokens"] = tokens
    kvx = m.extra.get("kv_cache") or {}
    out["readback"] = {k: kvx.get("readback", {}).get(k) for k in ("checked", "failed")}
    out["cache_dtype"] = kvx.get("dtype")
    out["refused_on_load"] = refused
    return out


# -- 3. fp8 error ---------------------------------------------------------------------------------


def _token_at(extra: dict[str, Any], seq: int, pos: int) -> int:
    ids = extra["input_ids"][seq]
    return ids[pos] if pos < len(ids) else extra["generated_ids"][seq][pos - len(ids)]


def _cut(a: dict[str, Any], b: dict[str, Any]) -> dict[int, int]:
    """Sequence -> its first position whose token differs between the two jobs (rows from there on differ by
    input, not by the cache); sequences that agree throughout are absent."""
    cut = {}
    for s, ids in enumerate(a["input_ids"]):
        n = len(ids) + len(a.get("generated_ids", [[]])[s])
        for p in range(n):
            if _token_at(a, s, p) != _token_at(b, s, p):
                cut[s] = p
                break
    return cut


def _rows(reader: Any, layer: int, point: str) -> dict[tuple[int, int], Any]:
    import numpy as np

    from dumper.format import to_float64

    out = {}
    for rec in reader.manifest.tensors:
        if rec.layer == layer and rec.point == point and rec.rank == 0:
            rows = to_float64(np.asarray(reader.rows(rec)), rec.dtype)
            for s, p, r in zip(rec.row_sequence_ids(), rec.row_positions(), rows, strict=True):
                out[int(s), int(p)] = r
    return out


def _toward_zero(x: Any, dtype: Any, scale: float) -> Any:
    """``x`` (float64 numpy) rounded toward zero onto ``dtype`` (fp8) at ``scale``: the largest magnitude not above."""
    import numpy as np
    import torch

    q = (torch.from_numpy(x / scale).to(torch.float32)).to(dtype)
    up = torch.from_numpy(np.abs(q.to(torch.float64).numpy()) > np.abs(x / scale))
    bits = q.view(torch.uint8)
    q = torch.where(up, bits - 1, bits).view(dtype)  # sign-magnitude: one code down is the next smaller magnitude
    return q.to(torch.float64).numpy() * scale


def write_check(x: Any, y: Any, scale: float) -> dict[str, Any]:
    """How the fp8 side's rows ``y`` relate to the auto side's ``x`` where both were written from the same values
    (the first layer): elementwise against round-to-nearest-even and round-toward-zero at the layer's scale, and the
    largest measured / predicted per row under each."""
    import numpy as np
    import torch

    from comparator.hidden.kv_cache import fp8_rounding

    fp8 = torch.float8_e4m3fn
    rne = torch.from_numpy(x / scale).to(torch.float32).to(fp8).to(torch.float64).numpy() * scale
    rtz = _toward_zero(x, fp8, scale)

    def rd(a: Any, b: Any) -> Any:
        den = (a**2).sum(axis=1) + (b**2).sum(axis=1)
        return np.where(den > 0, ((a - b) ** 2).sum(axis=1) / np.maximum(den, 1e-300), 0.0)

    meas = rd(x, y)
    best = fp8_rounding(torch.from_numpy(x), fp8).numpy()
    best_rne = fp8_rounding(torch.from_numpy(x), fp8, toward_zero=False).numpy()
    return {
        "elements": int(x.size),
        "equal_rne": float((y == rne).mean()),
        "equal_toward_zero": float((y == rtz).mean()),
        "magnitude_above_input": float((np.abs(y) > np.abs(x)).mean()),
        "magnitude_below_input": float((np.abs(y) < np.abs(x)).mean()),
        "ratio_max_best_scale": float((meas / np.maximum(best, 1e-12)).max()),
        "ratio_max_best_scale_rne": float((meas / np.maximum(best_rne, 1e-12)).max()),
        "ratio_max_rne": float((meas / np.maximum(rd(x, rne), 1e-12)).max()),
        "ratio_max_toward_zero": float((meas / np.maximum(rd(x, rtz), 1e-12)).max()),
        "ratio_median_best_scale": float(np.median(meas / np.maximum(best, 1e-12))),
    }


def fp8_error(auto: Path, fp8: Path) -> dict[str, Any]:
    """Per layer and point: rel_diff, largest per-token rel_diff, predicted fp8 rounding, measured/predicted."""
    import numpy as np
    import torch

    from comparator.hidden import kv_cache as kvc
    from comparator.hidden.kv_cache import FP8_FACTOR, fp8_rounding
    from dumper.format import DumpReader

    # the comparator's rule as this checkout has it: rounding at the engine's scale (where fp8_rounding takes one)
    # plus DRIFT_GAIN (where it has one; else 1) x the token's input rel_diff at the layer
    at_scale = "scale" in inspect.signature(fp8_rounding).parameters
    gain = float(getattr(kvc, "DRIFT_GAIN", 1.0))
    ra, rf = DumpReader(auto), DumpReader(fp8)
    scales = (rf.manifest.extra.get("kv_cache") or {}).get("scales") or {}
    cut = _cut(ra.manifest.extra, rf.manifest.extra)
    layers = sorted({t.layer for t in ra.manifest.tensors if t.layer is not None})
    table, all_ratios, all_drift, writes = [], [], [], {}
    for layer in layers:
        drift: dict[tuple[int, int], float] = {}  # (sequence, position) -> that token's input rel_diff at this layer
        for point in ("input", *CACHE):
            xa, xf = _rows(ra, layer, point), _rows(rf, layer, point)
            keys = sorted(k for k in xa.keys() & xf.keys() if k[1] < cut.get(k[0], 1 << 30))
            x = np.stack([xa[k] for k in keys])
            y = np.stack([xf[k] for k in keys])
            diff = ((x - y) ** 2).sum(axis=1)
            den = (x**2).sum(axis=1) + (y**2).sum(axis=1)
            per = np.where(den > 0, diff / np.maximum(den, 1e-300), 0.0)
            row: dict[str, Any] = {
                "layer": layer,
                "point": point,
                "rows": len(keys),
                "rel_diff": float(diff.sum() / den.sum()),
                "max_token_rel_diff": float(per.max()),
                "worst_token": list(keys[int(per.argmax())]),
            }
            if point == "input":
                drift = {k: float(v) for k, v in zip(keys, per, strict=True)}
            scale = float((scales.get(str(layer)) or [1.0, 1.0])[CACHE.index(point)]) if point in CACHE else 1.0
            if point in CACHE and layer == layers[0]:
                writes[point] = write_check(x, y, scale)
            if point in CACHE:
                pred = fp8_rounding(torch.from_numpy(x), torch.float8_e4m3fn).numpy()
                ratio = np.where(per > 0, per / np.maximum(pred, 1e-12), 0.0)
                # the comparator's rule: the token's own upstream drift allowed on top of rounding
                base = fp8_rounding(torch.from_numpy(x), torch.float8_e4m3fn, scale=scale).numpy() if at_scale else pred
                allowed = base + gain * np.array([drift.get(k, 0.0) for k in keys])
                with_drift = np.where(per > 0, per / np.maximum(allowed, 1e-12), 0.0)
                i = int(ratio.argmax())
                j = int(with_drift.argmax())
                all_ratios.append(ratio)
                all_drift.append(with_drift)
                row.update(
                    ratio_drift_max=float(with_drift[j]),
                    ratio_drift_at=list(keys[j]),
                    predicted_median=float(np.median(pred)),
                    predicted_max=float(pred.max()),
                    ratio_max=float(ratio[i]),
                    ratio_median=float(np.median(ratio)),
                    ratio_at=list(keys[i]),
                    rows_over_factor=int((ratio > FP8_FACTOR).sum()),
                )
            table.append(row)
    ratios = np.concatenate(all_ratios)
    drifts = np.concatenate(all_drift)
    cache_rows = [r for r in table if r["point"] in CACHE]
    worst = max(cache_rows, key=lambda r: r["ratio_max"])
    return {
        "cut": {str(k): v for k, v in cut.items()},
        "generated_equal": ra.manifest.extra.get("generated_ids") == rf.manifest.extra.get("generated_ids"),
        "table": table,
        "first_layer_write": writes,
        "fp8_factor": FP8_FACTOR,
        "ratio": {
            "max": float(ratios.max()),
            "p99": float(np.quantile(ratios, 0.99)),
            "p50": float(np.median(ratios)),
            "rows": int(ratios.size),
            "over_factor": int((ratios > FP8_FACTOR).sum()),
            "worst": {k: worst[k] for k in ("layer", "point", "ratio_at")},
            "by_point": {p: float(max(r["ratio_max"] for r in cache_rows if r["point"] == p)) for p in CACHE},
            "layer0": float(max(r["ratio_max"] for r in cache_rows if r["layer"] == layers[0])),
            "with_drift_max": float(drifts.max()),
            "with_drift_p99": float(np.quantile(drifts, 0.99)),
            "with_drift_over_factor": int((drifts > FP8_FACTOR).sum()),
            "rule": {"rounding_at_engine_scale": at_scale, "drift_gain": gain},
        },
    }


def comparator_verdict(auto: Path, fp8: Path) -> dict[str, Any]:
    """``compare_dumps(auto, fp8)``: its verdict, outcome and fp8 table's largest ratio (and where)."""
    from comparator import compare_dumps
    from comparator.outcome import sentence

    t = time.perf_counter()
    report = compare_dumps(auto, fp8)
    kv = report.kv_cache
    rows = list(kv.fp8) if kv is not None else []
    worst = max(rows, key=lambda r: -1.0 if math.isnan(r.ratio) else r.ratio, default=None)
    return {
        "seconds": time.perf_counter() - t,
        "passed": bool(report.passed),
        "sentence": sentence(report),
        "kv_passed": None if kv is None else bool(kv.passed),
        "fp8_side": None if kv is None else kv.fp8_side,
        "sentences": [] if kv is None else kv.sentences(),
        "ratio_max": None if worst is None else round(worst.ratio, 2),
        "worst": None if worst is None else {"layer": worst.layer, "point": worst.point, "token": worst.token},
        "rows_over": sum(r.rows_over for r in rows),
        "table": [r.to_json() for r in rows],
    }


# -- the report -----------------------------------------------------------------------------------


def markdown(res: dict[str, Any]) -> str:
    job = res["job"]
    lines = [
        "# KV cache points in compiled vLLM: SmolLM2-135M-Instruct, bfloat16",
        "",
        f"Job: {len(job['prompt_tokens'])} prompts of {job['prompt_tokens']} tokens, prefill + "
        f"{job['new_tokens']} greedy tokens, all {job['layers']} layers; vLLM {job['vllm']}, default (compiled, "
        "multiprocess) engines started side by side before timing "
        f"({', '.join(f'{k} {v:.0f} s' for k, v in res['engine_start_s'].items())}; not in the timings).",
    ]
    cost = res.get("cost")
    if cost:
        lines += [
            "",
            f"## 1. Capture cost (median and min of {res['reps']} interleaved runs, seconds)",
            "",
            "| run | engine | median s | min s | runs |",
            "|---|---|---:|---:|---|",
        ]
        what = {
            "a plain": "no tap, `LLM.generate`",
            "b input": "`--points input`, whole dump",
            "c kv": f"`--points {KV_POINTS}`, whole dump",
            "c idle": "(c)'s engine, nothing marked",
        }
        for k, v in cost["samples"].items():
            lines.append(
                f"| {k} | {what[k]} | {cost['median'][k]:.3f} | {cost['min'][k]:.3f} | "
                + " ".join(f"{x:.2f}" for x in v)
                + " |"
            )
        lines += ["", "| ratio | of medians | of minima |", "|---|---:|---:|"]
        for k, (m, lo) in cost["ratios"].items():
            lines.append(f"| {k} | {m:.3f} | {lo:.3f} |")
    by = res.get("bytes")
    if by:
        lines += [
            "",
            "## 2. Bytes per token per layer (manifest: stored record bytes / (tokens x layers))",
            "",
            "| dump | cache dtype | stored | tokens | k_cache | v_cache | k+v | input | all data files |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|",
        ]
        for name, b in by.items():
            k = b["k_cache"]
            stored = f"{'/'.join(k['dtype'])} x{'/'.join(map(str, k['width']))}" + (
                f" (sketch of {'/'.join(map(str, k['sketch_of']))})" if k["sketch_of"] else ""
            )
            lines.append(
                f"| {name} | {b['cache_dtype']} | {stored} | {b['tokens']} | {k['per_token_layer']:.0f} | "
                f"{b['v_cache']['per_token_layer']:.0f} | {b['kv']['per_token_layer']:.0f} | "
                f"{b['input']['per_token_layer']:.0f} | {b['files']['per_token_layer']:.0f} |"
            )
        for n, b in by.items():
            if b["refused_on_load"]:
                lines += [
                    "",
                    f"**{n}: the dump's manifest is refused on load** ({b['refused_on_load']}); bytes above "
                    "are from its manifest as written.",
                ]
        lines.append("")
        lines.append(
            "Read-back check: "
            + "; ".join(f"{n} {b['readback']['failed']} failed of {b['readback']['checked']}" for n, b in by.items())
        )
    err = res.get("fp8")
    if err:
        r = err["ratio"]
        cut = ", ".join(f"seq {s} from position {p}" for s, p in err["cut"].items()) or "none"
        lines += [
            "",
            "## 3. fp8 KV cache vs auto (bf16), compiled, per layer",
            "",
            f"Greedy tokens equal: {err['generated_equal']}; rows cut where the tokens differ: {cut}.",
            "",
            "**Benign measured/predicted (predicted: `fp8_rounding(auto rows, torch.float8_e4m3fn)`, its defaults): "
            f"max {r['max']:.2f} (layer {r['worst']['layer']} {r['worst']['point']}, seq/pos "
            f"{r['worst']['ratio_at']}), p99 {r['p99']:.2f}, median {r['p50']:.2f} over {r['rows']} cache rows; "
            f"k_cache max {r['by_point']['k_cache']:.2f}, v_cache max {r['by_point']['v_cache']:.2f}, first layer "
            f"(identical inputs) max {r['layer0']:.2f}; {r['over_factor']} rows above FP8_FACTOR = "
            f"{err['fp8_factor']:g}.**",
            "",
            "**The comparator's rule, each token's upstream drift allowed (measured / (fp8_rounding at "
            f"{'the engine' if r['rule']['rounding_at_engine_scale'] else 'the best'}'s scale + "
            f"{r['rule']['drift_gain']:g} x that token's `input` rel_diff at the layer)): max "
            f"{r['with_drift_max']:.2f}, p99 {r['with_drift_p99']:.2f}; {r['with_drift_over_factor']} rows above "
            f"{err['fp8_factor']:g}.**",
            "",
            "| layer | input rel_diff | input max tok | k rel_diff | k max tok | k pred med | k pred max | k max ratio "
            "| k max ratio w/ drift | v rel_diff | v max tok | v pred med | v pred max | v max ratio "
            "| v max ratio w/ drift |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        by_layer: dict[int, dict[str, dict[str, Any]]] = {}
        for row in err["table"]:
            by_layer.setdefault(row["layer"], {})[row["point"]] = row
        for layer, pts in sorted(by_layer.items()):
            cells = [f"{layer}", f"{pts['input']['rel_diff']:.2e}", f"{pts['input']['max_token_rel_diff']:.2e}"]
            for p in CACHE:
                c = pts[p]
                cells += [
                    f"{c['rel_diff']:.2e}",
                    f"{c['max_token_rel_diff']:.2e}",
                    f"{c['predicted_median']:.2e}",
                    f"{c['predicted_max']:.2e}",
                    f"{c['ratio_max']:.2f}",
                    f"{c['ratio_drift_max']:.2f}",
                ]
            lines.append("| " + " | ".join(cells) + " |")
        first = err["table"][0]
        lines += [
            "",
            f"First layer ({first['layer']}; input rel_diff {first['rel_diff']:.1e}: both sides wrote the cache from "
            "the same values), the fp8 side's elements against the auto side's cast to e4m3 at the layer's scale:",
            "",
            "| point | elements | = round-to-nearest | = toward zero | magnitude above input | below input "
            "| max ratio vs fp8_rounding (default) | vs fp8_rounding(toward_zero=False) | vs RNE at the layer's scale "
            "| vs toward zero at the layer's scale |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for p, w in err["first_layer_write"].items():
            lines.append(
                f"| {p} | {w['elements']} | {w['equal_rne']:.4f} | {w['equal_toward_zero']:.4f} | "
                f"{w['magnitude_above_input']:.4f} | {w['magnitude_below_input']:.4f} | "
                f"{w['ratio_max_best_scale']:.2f} | {w['ratio_max_best_scale_rne']:.2f} | {w['ratio_max_rne']:.2f} | "
                f"{w['ratio_max_toward_zero']:.2f} |"
            )
    comp = res.get("comparator")
    if comp:
        worst = comp["worst"] or {}
        lines += [
            "",
            f"Comparator (`compare_dumps(auto, fp8)`, {comp['seconds']:.1f} s): passed {comp['passed']}: "
            f"{comp['sentence'].rstrip('.')}. KV cache verdict passed {comp['kv_passed']} (fp8 side "
            f"{comp['fp8_side']}); its fp8 table's largest ratio {comp['ratio_max']} at layer {worst.get('layer')} "
            f"{worst.get('point')} token {worst.get('token')}; {comp['rows_over']} rows over the factor."
            + ("".join(f"\n- {s}" for s in comp["sentences"])),
        ]
    for name, e in (res.get("errors") or {}).items():
        lines += ["", f"Dump {name} failed: {e}"]
    lines += ["", f"Bench wall time: {res['wall_s']:.0f} s."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="a folder for the results, the dumps and the engines' logs")
    ap.add_argument("--reps", type=int, default=9, help="timed rounds of part 1 (default 9)")
    ap.add_argument("--new-tokens", type=int, default=8, help="greedy tokens per prompt (default 8)")
    ap.add_argument("--sketch", type=int, default=64, help="K of the sketched dump (0: none; default 64)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return _worker(json.loads(args.worker))
    if args.out is None:
        ap.error("--out is required")
    if missing():
        sys.exit(f"error: {missing()}")
    t_all = time.perf_counter()
    out = args.out
    dumps = out / "dumps"
    dumps.mkdir(parents=True, exist_ok=True)
    model, ids = smollm2_dir(), real_prompt_ids()
    base = {"model": str(model), "ids": ids, "new_tokens": args.new_tokens}
    specs = {
        "plain": {"points": None},
        "input": {"points": "input"},
        "kv": {"points": KV_POINTS},
        "fp8": {"points": KV_POINTS, "kv_cache_dtype": "fp8"},
        **({"sketch": {"points": KV_POINTS, "sketch": args.sketch, "enforce_eager": "true"}} if args.sketch else {}),
    }
    import vllm

    config = json.loads((model / "config.json").read_text())
    res: dict[str, Any] = {
        "job": {
            "model": str(model),
            "prompt_tokens": [len(s) for s in ids],
            "new_tokens": args.new_tokens,
            "layers": config["num_hidden_layers"],
            "vllm": vllm.__version__,
            "sketch": args.sketch or None,
        },
        "reps": args.reps,
    }
    print(f"starting {len(specs)} engines side by side: {', '.join(specs)}", flush=True)
    workers = {name: Worker(name, {**base, **spec}, out / "logs", __file__) for name, spec in specs.items()}
    try:
        ok = {name: w.ready() for name, w in workers.items()}
        res["engine_start_s"] = {n: w.start_s for n, w in workers.items() if w.start_s is not None}
        print(f"engines up after {time.perf_counter() - t_all:.0f} s: {res['engine_start_s']}", flush=True)
        if ok["plain"] and ok["input"] and ok["kv"]:
            res["cost"] = capture_cost(workers, dumps, args.reps)
            print(f"part 1 done at {time.perf_counter() - t_all:.0f} s", flush=True)
        for name in ("kv", "fp8", "sketch"):
            if name in workers and ok[name]:
                try:
                    workers[name].run("dump", out=dumps / name)
                except RuntimeError as e:
                    res.setdefault("errors", {})[name] = str(e).splitlines()[0]
                    print(f"dump {name} FAILED: {str(e).splitlines()[0]}", flush=True)
    finally:
        for w in workers.values():
            w.close()
    print(f"dumps done at {time.perf_counter() - t_all:.0f} s", flush=True)
    have = {n: dumps / n for n in ("kv", "fp8", "sketch") if (dumps / n / "manifest.json").is_file()}
    names = {"kv": "auto (c)", "fp8": "fp8", "sketch": f"auto, --sketch {args.sketch}"}
    res["bytes"] = {names[n]: dump_bytes(d) for n, d in have.items()}
    if "kv" in have and "fp8" in have:
        res["fp8"] = fp8_error(have["kv"], have["fp8"])
        try:
            res["comparator"] = comparator_verdict(have["kv"], have["fp8"])
        except Exception as e:  # noqa: BLE001 - the bench's own numbers stand without it
            res["comparator_error"] = f"{type(e).__name__}: {e}"
            print(f"compare_dumps failed: {traceback.format_exc()}")
    res["wall_s"] = time.perf_counter() - t_all
    text = markdown(res)
    (out / "kv_cache_bench.json").write_text(json.dumps(res, indent=1, default=str))
    (out / "kv_cache_bench.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
