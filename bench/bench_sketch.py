"""Sketch dumps (``capture(sketch=K)``, ``dumper run --sketch K``): size, estimate spread, capture time, projection
cost, precision floor and comparator throughput, against full dumps measured in the same run.

Six sections (``--sections``, default all):

1. bytes: bytes per token per layer of one capture point (``input``, every layer) in real dumps (the data files'
   sizes from ``manifest.files``, headers included, over tokens x layers), full vs ``K`` = 32, 64, 256, hidden
   1024 / 4096 / 7168 in bf16 and fp32; next to the computed value (``hidden x itemsize``; ``4K + 8``). The model
   is a seeded Llama with a narrow attention and MLP (one head of 64, intermediate 64), so that hidden 7168 is
   cheap; the dump's size depends only on the captured rows.
2. spread: over ``--pairs`` row pairs shaped like hidden states (outlier channels) with relative differences
   drawn log-uniformly in [1e-4, 3e-2] (dense noise scaled by |x|, or concentrated on a few channels), the
   per-token estimate ``||R x - R y||^2 / (||x||^2 + ||y||^2)`` (the capture's float32 projections and float64
   norms, what the comparator computes) over the true rel_diff: std, percentiles, next to sqrt(2/K).
3. capture time: a seeded HF Llama (hidden 1024 / 2048 / 4096, ``--layers``, ``--tokens``, SDPA, fp32 then bf16)
   runs a prefill plain, under a full capture and under a sketch capture per ``--ks`` (``layers="all"``,
   ``points=input,residual``), in rotating order, after one small warm-up capture of each (R is cached per
   process, so the timed captures do not build it); the captured times span the whole ``with dumper.capture(...)``
   block, closing (drain, fsync, manifest) included. Medians and ratios sketch/full, full/plain. Where the time
   goes, from the same runs (3a): inside the hooks (``Capture.record``), the Sketcher call and, inside it, its
   ``torch.mm`` (projection) and ``torch.linalg.vector_norm`` (norms) calls, closing the capture, and the writer
   thread's own time writing files; these clocks wrap the library's functions while section 3 runs (``_Probe``).
   Then a pass's own work alone, without the forward (3c): the records' snapshots and one fsynced file (full)
   against the Sketcher, snapshots and one small fsynced file, and against the Sketcher as it was before row
   blocks and vector_norm. Then the norm alone (3b), a record of why the Sketcher uses vector_norm: the
   reference ``x.double().square().sum(-1)`` against ``vector_norm(x, dtype=float64)**2``, whole or in 2 MiB row
   blocks, each timed (interleaved medians) and checked against a near-exact sum (numpy longdouble of exact
   float64 squares): its largest error in units of float64's unit roundoff u = 2^-53, exact enough when within
   (hidden-1) u, the bound of a float64 sum of positive terms (which the reference obeys).
4. projection cost: the dense Rademacher matmul (``x @ R^T``, float32; whole, and in the library's 2 MiB row
   blocks) vs a subsampled randomized
   Hadamard transform (random signs, Walsh-Hadamard on the next power of two, K coordinates kept), written here
   twice: the textbook butterfly (log2 P add/sub stages) and a two-factor Kronecker form as matmuls that computes
   only the kept coordinates in its last factor. ms per 1k rows; and the one-off cost of generating R.
5. precision floor: the same model and input run twice (fp32 eager, and the model cast to bf16): per-token
   rel_diff of full vs full, full vs sketch (the capture's float32 projection against the comparator's float64
   projection of the full rows) and sketch vs sketch, max and median over every token of every hidden-state
   tensor (``compare_dumps``' per-token values); and the benign noise of eager vs SDPA attention, full vs full
   (and as estimated sketch vs sketch), so that the floor reads as a ratio below benign noise. 5b: the floor of
   the projection alone by hidden size, and what a float64 projection at capture would leave.
6. comparator throughput: ``compare_dumps`` wall time on dumps of a narrow seeded Llama (hidden 4096,
   ``--cmp-tokens``, ``--cmp-layers``, points input,residual; eager attention as baseline, SDPA as target), full vs
   full, sketch vs sketch and full vs sketch (the full side projected in float64 on the fly) per ``--ks``: seconds,
   GB/s of one full dump's data bytes, ratios to full vs full. The dumps are in the page cache (just written).

    python bench/bench_sketch.py [--quick] [--json out.json] [--sections 1,2,3,4,5,6] [--reps 3] [--threads N]

Timings are medians over repeats (some tables also give minima, the runs least disturbed by other processes);
the machine may be shared, so compare the ratios measured in one run. On an oversubscribed machine every
multi-threaded torch op can wait a scheduler slice for a descheduled worker thread, which penalizes the many small
ops of a sketch far more than a full capture's few copies: ``--threads 1`` shows the costs without that.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

import dumper  # noqa: E402
import dumper.hooks.sketch as hooks_sketch  # noqa: E402
from comparator import CompareConfig, compare_dumps  # noqa: E402
from dumper.format import load_manifest  # noqa: E402
from dumper.format.atomic import atomic_path  # noqa: E402
from dumper.format.sketch import SketchSpec, hash_keys, mix32, project  # noqa: E402
from dumper.hooks.sketch import Sketcher, sign_matrix  # noqa: E402
from dumper.hooks.writer import ShardWriter, snapshot  # noqa: E402

U64 = 2.0**-53
REF = "reference x.double().square().sum(-1)"
med = statistics.median


def _dtype(name: str) -> torch.dtype:
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def _llama(hidden: int, layers: int, *, vocab: int, narrow: bool = False, attn: str = "sdpa") -> torch.nn.Module:
    """A seeded HF Llama from a config; ``narrow``: one attention head of 64 and an MLP of 64 (cheap at any hidden)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kw: dict[str, Any] = (
        dict(intermediate_size=64, num_attention_heads=1, num_key_value_heads=1, head_dim=64)
        if narrow
        else dict(
            intermediate_size=hidden * 11 // 4,
            num_attention_heads=hidden // 64,
            num_key_value_heads=max(1, hidden // 128),
        )
    )
    config = AutoConfig.for_model(
        "llama", vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, max_position_embeddings=8192, **kw
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()


def _ids(vocab: int, tokens: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, vocab, (1, tokens), generator=torch.Generator().manual_seed(seed))


def _capture(model: torch.nn.Module, ids: torch.Tensor, out: Path, *, points: str, sketch: int | None) -> Path:
    with torch.inference_mode(), dumper.capture(model, out, layers="all", points=points, sketch=sketch):
        model(input_ids=ids, use_cache=False)
    return out


def _table(title: str, header: list[str], rows: list[list[Any]]) -> None:
    cells = [[str(c) for c in header]] + [[c if isinstance(c, str) else _fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    print(f"\n{title}")
    for j, r in enumerate(cells):
        print("  " + "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if j == 0:
            print("  " + "  ".join("-" * w for w in widths))


def _fmt(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if v == 0 or not math.isfinite(v):
            return f"{v:g}"
        return f"{v:.3e}" if abs(v) < 1e-2 or abs(v) >= 1e5 else f"{v:.3f}"
    return str(v)


def _timeit(
    fns: dict[str, Callable[[], Any]], reps: int, *, fastest: dict[str, float] | None = None
) -> dict[str, float]:
    """Median seconds of each function, the functions interleaved (one warm-up call each first); ``fastest``, if
    given, receives each one's minimum (the least disturbed by other processes)."""
    for f in fns.values():
        f()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    if fastest is not None:
        fastest.update({k: min(v) for k, v in times.items()})
    return {k: med(v) for k, v in times.items()}


# --------------------------------------------------------------------------------------------- 1. bytes
def section_bytes(args: argparse.Namespace, root: Path) -> list[dict[str, Any]]:
    tokens, layers, vocab = (128, 2, 256) if args.quick else (512, 4, 256)
    ids = _ids(vocab, tokens)
    results, rows = [], []
    for hidden in (1024, 4096, 7168):
        base = _llama(hidden, layers, vocab=vocab, narrow=True, attn="eager")
        for dname in ("bf16", "fp32"):
            model = base.to(_dtype(dname))
            full = None
            for k in (None, 32, 64, 256):
                out = _capture(model, ids, root / f"bytes-{hidden}-{dname}-{k}", points="input", sketch=k)
                man = load_manifest(out)
                data = sum(man.files.values())
                measured = data / (tokens * layers)
                computed = hidden * torch.finfo(_dtype(dname)).bits // 8 if k is None else 4 * k + 8
                manifest_bytes = (out / "manifest.json").stat().st_size
                full = measured if k is None else full
                r = dict(
                    hidden=hidden,
                    dtype=dname,
                    k=k,
                    tokens=tokens,
                    layers=layers,
                    data_bytes=data,
                    measured_per_token_layer=measured,
                    computed_per_token_layer=computed,
                    manifest_json_bytes=manifest_bytes,
                    full_over_this=full / measured,
                )
                results.append(r)
                rows.append(
                    [
                        str(hidden),
                        dname,
                        "full" if k is None else f"K={k}",
                        measured,
                        computed,
                        measured - computed,
                        r["full_over_this"],
                        manifest_bytes,
                    ]
                )
                shutil.rmtree(out, ignore_errors=True)
        del base, model
    _table(
        f"1. bytes per token per layer, one capture point (input), {tokens} tokens x {layers} layers "
        "(data files from manifest.files; header bytes included)",
        ["hidden", "dtype", "dump", "measured B", "computed B", "header B", "full / this", "manifest.json B"],
        rows,
    )
    return results


# --------------------------------------------------------------------------------------------- 2. spread
def _pairs(n: int, hidden: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows shaped like hidden states and perturbed copies; returns (x, y, dense) with dense: which pairs' difference
    is spread over every channel (the rest differ on 1-8 channels only)."""
    scale = torch.ones(hidden)
    scale[torch.randperm(hidden, generator=gen)[: max(1, hidden // 512)]] = 30.0  # massive-activation channels
    x = torch.randn(n, hidden, generator=gen) * scale
    eps = 10 ** (torch.rand(n, 1, generator=gen) * (math.log10(3e-2) + 4) - 4)  # relative difference 1e-4..3e-2
    dense = torch.rand(n, generator=gen) < 0.8
    noise = torch.randn(n, hidden, generator=gen) * (x.abs() + 0.3)
    sparse = torch.zeros(n, hidden)
    cols = torch.randint(0, hidden, (n, 8), generator=gen)
    few = torch.randint(1, 9, (n, 1), generator=gen)
    vals = torch.randn(n, 8, generator=gen) * (torch.arange(8)[None, :] < few)
    sparse.scatter_add_(1, cols, vals)
    d = torch.where(dense[:, None], noise, sparse)
    d = d * (eps * x.norm(dim=1, keepdim=True) / d.norm(dim=1, keepdim=True).clamp_min(1e-30))
    return x, (x + d).to(torch.float32), dense


def section_spread(args: argparse.Namespace) -> list[dict[str, Any]]:
    n, hidden, block = (2000, 1024, 1000) if args.quick else (args.pairs, 4096, 2000)
    ks = (16, 32, 64, 128, 256)
    sketchers = {k: Sketcher(SketchSpec(k=k, seed=0)) for k in ks}
    ratios: dict[int, list[np.ndarray]] = {k: [] for k in ks}
    dense_all, true_all, kurt_all = [], [], []
    gen = torch.Generator().manual_seed(7)
    for start in range(0, n, block):
        x, y, dense = _pairs(min(block, n - start), hidden, gen)
        xd, yd = x.double(), y.double()
        norms = xd.square().sum(-1) + yd.square().sum(-1)
        dd = (xd - yd).square()
        true = dd.sum(-1) / norms
        kurt_all.append((dd.square().sum(-1) / dd.sum(-1).square()).numpy())  # sum d^4 / ||d||^4
        dense_all.append(dense.numpy())
        true_all.append(true.numpy())
        for k, sk in sketchers.items():
            (px, nx), (py, ny) = sk(x), sk(y)
            est = (px.double() - py.double()).square().sum(-1) / (nx + ny)
            ratios[k].append((est / true).numpy())
    dense_m, true_v, kurt = np.concatenate(dense_all), np.concatenate(true_all), np.concatenate(kurt_all)
    results, rows = [], []
    for k in ks:
        r = np.concatenate(ratios[k])
        spread = math.sqrt(2 / k)
        # Var(||R d||^2 / ||d||^2) = (2/K) (1 - sum d^4 / ||d||^4) for independent signs: below 2/K when d is peaked
        predicted = math.sqrt(float(np.mean(2 / k * (1 - kurt))))
        res = dict(
            k=k,
            pairs=n,
            hidden=hidden,
            sqrt_2_over_k=spread,
            predicted_std=predicted,
            std=float(r.std()),
            mean=float(r.mean()),
            std_dense=float(r[dense_m].std()),
            std_sparse=float(r[~dense_m].std()),
            p1=float(np.percentile(r, 1)),
            p99=float(np.percentile(r, 99)),
            max_abs_dev=float(np.abs(r - 1).max()),
        )
        results.append(res)
        rows.append(
            [
                str(k),
                res["sqrt_2_over_k"],
                predicted,
                res["std"],
                res["std"] / spread,
                res["std_dense"],
                res["std_sparse"],
                res["mean"],
                res["p1"],
                res["p99"],
            ]
        )
    _table(
        f"2. per-token estimate / true rel_diff, {n} pairs, hidden {hidden} (true rel_diff "
        f"{np.percentile(true_v, 1):.1e}..{np.percentile(true_v, 99):.1e}; "
        f"{dense_m.mean():.0%} dense differences, the rest on 1-8 channels)",
        ["K", "sqrt(2/K)", "predicted std", "std", "std/sqrt(2/K)", "std dense", "std sparse", "mean", "p1", "p99"],
        rows,
    )
    return results


# --------------------------------------------------------------------------------------------- 3. capture time
class _Probe:
    """Clocks on a capture's parts, summed until ``take()``: ``record`` (``Capture.record``, the hooks' work on the
    forward path), ``sketch`` (``Sketcher.__call__``), inside a Sketcher call only ``mm`` (``torch.mm``: the
    projection) and ``norm`` (``torch.linalg.vector_norm``: the norms), ``sign`` (building R: a cache miss) and
    ``writer`` (``ShardWriter._write``, the writer thread's files). ``torch.mm`` and ``vector_norm`` are wrapped for
    the process while installed, but counted only on a thread that is inside a Sketcher call."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.lock = threading.Lock()
        self.inside = threading.local()
        self.saved = (
            dumper.Capture.record,
            ShardWriter._write,
            hooks_sketch.sign_matrix,
            Sketcher.__call__,
            torch.mm,
            torch.linalg.vector_norm,
        )
        record, write, sign, call, mm, vn = self.saved
        dumper.Capture.record = self._timed("record", record)
        ShardWriter._write = self._timed("writer", write)
        hooks_sketch.sign_matrix = self._timed("sign", sign)
        Sketcher.__call__ = self._timed("sketch", call, sets_inside=True)
        torch.mm = self._timed("mm", mm, only_inside=True)
        torch.linalg.vector_norm = self._timed("norm", vn, only_inside=True)

    def _timed(self, name: str, fn: Callable, *, sets_inside: bool = False, only_inside: bool = False) -> Callable:
        inside = self.inside

        def wrapper(*a: Any, **kw: Any) -> Any:
            if only_inside and not getattr(inside, "on", False):
                return fn(*a, **kw)
            if sets_inside:
                inside.on = True
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.add(name, time.perf_counter() - t0)
                if sets_inside:
                    inside.on = False

        return wrapper

    def remove(self) -> None:
        (
            dumper.Capture.record,
            ShardWriter._write,
            hooks_sketch.sign_matrix,
            Sketcher.__call__,
            torch.mm,
            torch.linalg.vector_norm,
        ) = self.saved

    def add(self, name: str, dt: float) -> None:
        with self.lock:
            self.sums[name] = self.sums.get(name, 0.0) + dt

    def take(self) -> dict[str, float]:
        with self.lock:
            s, self.sums = self.sums, {}
        return s


def _vn(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(x, dim=-1, dtype=torch.float64) ** 2


def _blocked(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """``fn`` over row blocks of about ``BLOCK_BYTES`` float32 bytes, as the library's Sketcher on a CPU."""

    def run(x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        step = max(1, hooks_sketch.BLOCK_BYTES // (4 * x2.shape[1]))
        return torch.cat([fn(c) for c in x2.split(step)]).reshape(x.shape[:-1])

    return run


def _reference_norm(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float64).square().sum(dim=-1)


NORMS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    REF: _reference_norm,
    "linalg.vector_norm(x, dtype=f64)**2": _vn,
    "reference, 2 MiB row blocks": _blocked(_reference_norm),
    "vector_norm**2, 2 MiB row blocks (library)": _blocked(_vn),
}
"""The squared norms, each way (3b): the reference (the Sketcher's before vector_norm) and what replaced it."""


def _previous_sketch(x: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The Sketcher before blocks and vector_norm: the whole tensor widened and projected, then the reference norms."""
    return x.to(torch.float32) @ m, _reference_norm(x)


def _near_exact_sq(x: torch.Tensor) -> np.ndarray:
    """Squared norms of rows, nearly exact: float64 squares of float32-representable values are exact (<= 48
    significant bits), summed in numpy longdouble (64-bit significand on x86)."""
    a = x.reshape(-1, x.shape[-1]).to(torch.float64).numpy()
    return np.square(a).astype(np.longdouble).sum(axis=1)


def _hidden_like(rows: int, hidden: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    scale = torch.ones(hidden)
    scale[torch.randperm(hidden, generator=gen)[: max(1, hidden // 512)]] = 30.0
    return (torch.randn(1, rows, hidden, generator=gen) * scale).to(dtype)


def section_norms(args: argparse.Namespace, hiddens: list[int], rows_n: int, records: int) -> list[dict[str, Any]]:
    """The squared norms of a pass's records (``records`` distinct tensors, as a capture meets them: not in cache),
    each way of :data:`NORMS`, timed per record; and each way's largest error."""
    reps = 3 if args.quick else 5
    results, rows = [], []
    for hidden in hiddens:
        for dname in ("fp32", "bf16"):
            xs = [_hidden_like(rows_n, hidden, _dtype(dname), seed=i) for i in range(records)]
            mins: dict[str, float] = {}
            times = _timeit({k: (lambda f=f: [f(x) for x in xs]) for k, f in NORMS.items()}, reps, fastest=mins)
            exact = _near_exact_sq(xs[0])
            ref_out = NORMS[REF](xs[0]).reshape(-1).numpy()
            for name, f in NORMS.items():
                out = f(xs[0]).reshape(-1).numpy()
                err = float(np.max(np.abs(out.astype(np.longdouble) - exact) / exact) / U64)
                vs_ref = float(np.max(np.abs(out - ref_out) / ref_out) / U64)
                ok = err <= hidden - 1
                r = dict(
                    hidden=hidden,
                    dtype=dname,
                    rows=rows_n,
                    method=name,
                    ms_per_record=times[name] * 1e3 / records,
                    vs_reference=times[name] / times[REF],
                    min_ms_per_record=mins[name] * 1e3 / records,
                    min_vs_reference=mins[name] / mins[REF],
                    max_err_u=err,
                    max_diff_from_reference_u=vs_ref,
                    bound_u=hidden - 1,
                    exact_enough=ok,
                )
                results.append(r)
                rows.append(
                    [
                        str(hidden),
                        dname,
                        name,
                        r["ms_per_record"],
                        r["vs_reference"],
                        r["min_ms_per_record"],
                        r["min_vs_reference"],
                        err,
                        vs_ref,
                        "yes" if ok else "NO",
                    ]
                )
    _table(
        f"3b. squared norms alone, ms per record of {rows_n} rows ({records} distinct records a pass, {reps} "
        "interleaved reps: median and min); error vs a near-exact sum in units of u = 2^-53; exact enough = within "
        "(hidden-1) u. In the library the blocks come straight after their projection, still in cache (3c)",
        [
            "hidden",
            "dtype",
            "norm computation",
            "median ms",
            "x reference",
            "min ms",
            "x reference",
            "max err (u)",
            "vs reference (u)",
            "exact enough",
        ],
        rows,
    )
    return results


def _settings(ks: list[int]) -> dict[str, int | None]:
    """The end-to-end settings: ``plain`` (no capture), ``full``, and a sketch per K (value: the sketch's K)."""
    return {"plain": None, "full": None, **{f"K={k}": k for k in ks}}


def _capture_runs(
    model: torch.nn.Module,
    hidden: int,
    dname: str,
    ids: torch.Tensor,
    reps: int,
    ks: list[int],
    root: Path,
    probe: _Probe,
) -> tuple[dict[str, list[float]], dict[str, list[dict[str, float]]]]:
    """Wall times of the settings, rotated each rep, and the captures' parts (the probe's sums, ``close`` and
    ``bytes``). One small capture of each setting first: the forward warmed and R built (cached for the process)."""
    settings = _settings(ks)
    names = list(settings)
    times: dict[str, list[float]] = {s: [] for s in names}
    parts: dict[str, list[dict[str, float]]] = {s: [] for s in names[1:]}
    with torch.inference_mode():
        model(input_ids=ids[:, :64], use_cache=False)
        for s in names[1:]:
            _capture(model, ids[:, :64], root / "warm-up", points="input,residual", sketch=settings[s])
            shutil.rmtree(root / "warm-up", ignore_errors=True)
        for rep in range(reps):
            n = rep % len(names)
            for s in names[n:] + names[:n]:  # rotate: cancels drift between settings
                out = root / f"cap-{hidden}-{dname}-{s.replace('=', '')}-{rep}"
                probe.take()
                t0 = t1 = time.perf_counter()
                if s == "plain":
                    model(input_ids=ids, use_cache=False)
                else:
                    with dumper.capture(model, out, layers="all", points="input,residual", sketch=settings[s]):
                        model(input_ids=ids, use_cache=False)
                        t1 = time.perf_counter()
                t2 = time.perf_counter()
                times[s].append(t2 - t0)
                if s != "plain":
                    p = probe.take()
                    p["close"] = t2 - t1
                    p["bytes"] = sum(load_manifest(out).files.values())
                    parts[s].append(p)
                shutil.rmtree(out, ignore_errors=True)
    return times, parts


def _write_fsynced(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """What the writer thread does with a shard: safetensors into a temp file, fsync, rename, fsync the folder."""
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp))


def _pass_parts(xs: list[torch.Tensor], path: Path, how: str, k: int | None, probe: _Probe) -> dict[str, float]:
    """One capture pass's work besides the forward, timed by part: one record per tensor of ``xs``, each snapshotted
    (``how`` = ``full``) or sketched under K = ``k`` (``library``: the Sketcher, its parts from the probe;
    ``previous``: :func:`_previous_sketch`) and what it keeps snapshotted, then all written as one fsynced file, as
    the writer does with a pass."""
    t: dict[str, float] = {"project": 0.0, "norm": 0.0, "other": 0.0, "snapshot": 0.0}
    kept: dict[str, torch.Tensor] = {}
    spec = SketchSpec(k=k) if k else None
    sketcher = Sketcher(spec) if spec else None
    m = sketcher.matrix(xs[0].shape[-1], xs[0].device) if sketcher else None
    probe.take()
    for i, x in enumerate(xs):
        if how == "full":
            t0 = time.perf_counter()
            kept[f"r{i}"] = snapshot(x)[0]
            t["snapshot"] += time.perf_counter() - t0
            continue
        if how == "library":
            proj, sq = sketcher(x)
        else:
            t0 = time.perf_counter()
            proj = x.to(torch.float32) @ m
            t1 = time.perf_counter()
            sq = _reference_norm(x)
            t["project"] += t1 - t0
            t["norm"] += time.perf_counter() - t1
        t0 = time.perf_counter()
        kept[f"r{i}"], kept[f"r{i}/sq_norm"] = snapshot(proj)[0], snapshot(sq.reshape(-1))[0]
        t["snapshot"] += time.perf_counter() - t0
    if how == "library":
        p = probe.take()
        t["project"], t["norm"] = p.get("mm", 0.0), p.get("norm", 0.0)
        t["other"] = p.get("sketch", 0.0) - t["project"] - t["norm"]
    t0 = time.perf_counter()
    _write_fsynced(path, kept)
    t["write"] = time.perf_counter() - t0
    t["total"] = sum(t.values())
    return t


def section_parts(
    args: argparse.Namespace, hiddens: list[int], ks: list[int], rows_n: int, records: int, root: Path, probe: _Probe
) -> list[dict[str, Any]]:
    """A capture pass's own work without the forward (see :func:`_pass_parts`), full vs sketch, rotated."""
    reps = 3 if args.quick else 5
    results, rows = [], []
    variants: dict[str, tuple[str, int | None]] = {"full": ("full", None)}
    for k in ks:
        variants[f"K={k}"] = ("library", k)
        variants[f"K={k} previous"] = ("previous", k)
    names = list(variants)
    for hidden in hiddens:
        for dname in ("fp32", "bf16"):
            xs = [_hidden_like(rows_n, hidden, _dtype(dname), seed=i) for i in range(records)]  # distinct, as in a pass
            parts: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
            for v in names:  # warm-up
                _pass_parts(xs, root / "parts.safetensors", *variants[v], probe)
            for rep in range(reps):
                n = rep % len(names)
                for v in names[n:] + names[:n]:  # rotated: a big fsync slows the next one, whichever that is
                    parts[v].append(_pass_parts(xs, root / "parts.safetensors", *variants[v], probe))
            for stat, f in (("median", med), ("min", min)):
                full_total = f([p["total"] for p in parts["full"]])
                for v in names:
                    q = {key: f([p[key] for p in parts[v]]) * 1e3 for key in parts[v][0]}
                    r = dict(
                        hidden=hidden,
                        dtype=dname,
                        rows=rows_n,
                        records=records,
                        stat=stat,
                        variant=v,
                        **q,
                        over_full=q["total"] / (full_total * 1e3),
                    )
                    results.append(r)
                    rows.append(
                        [
                            str(hidden),
                            dname,
                            stat,
                            v,
                            q["project"],
                            q["norm"],
                            q["other"],
                            q["snapshot"],
                            q["write"],
                            q["total"],
                            r["over_full"],
                        ]
                    )
    _table(
        f"3c. a capture pass's own work without the forward: {records} records of {rows_n} rows (ms; {reps} "
        "rotated reps, median and min): full = snapshot each + one fsynced file; K = the library's Sketcher "
        "(project = its torch.mm calls, norm = its vector_norm calls, other = the rest of the call: widening, "
        "allocation, squaring) + snapshot of what it keeps + one fsynced file; previous = the Sketcher before "
        "row blocks and vector_norm (x.float() @ R^T, then x.double().square().sum(-1)); R cached, as in a capture",
        ["hidden", "dtype", "stat", "capture", "project", "norm", "other", "snapshot", "write", "total", "/ full"],
        rows,
    )
    return results


def section_capture(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    hiddens = [1024] if args.quick else [int(h) for h in args.hiddens.split(",")]
    tokens, layers, reps = (256, 2, 2) if args.quick else (args.tokens, args.layers, args.reps)
    vocab, ks = 4096, [int(k) for k in args.ks.split(",")]
    settings = _settings(ks)
    sketches = [s for s in settings if settings[s]]
    ids = _ids(vocab, tokens)
    results, rows, parts_rows = [], [], []
    probe = _Probe()
    try:
        for hidden in hiddens:
            model = _llama(hidden, layers, vocab=vocab)
            for dname in ("fp32", "bf16"):
                model = model.to(_dtype(dname))
                times, parts = _capture_runs(model, hidden, dname, ids, reps, ks, root, probe)
                m = {s: med(v) for s, v in times.items()}
                pm = {
                    s: {
                        key: med([p.get(key, 0.0) for p in parts[s]])
                        for key in ("record", "sketch", "mm", "norm", "sign", "close", "writer", "bytes")
                    }
                    for s in parts
                }
                r = dict(
                    hidden=hidden,
                    dtype=dname,
                    tokens=tokens,
                    layers=layers,
                    ks=ks,
                    reps=reps,
                    seconds=m,
                    full_over_plain=m["full"] / m["plain"],
                    over_full={s: m[s] / m["full"] for s in sketches},
                    min_over_min_full={s: min(times[s]) / min(times["full"]) for s in sketches},
                    over_plain={s: m[s] / m["plain"] for s in list(settings)[1:]},
                    times=times,
                    parts=pm,
                )
                results.append(r)
                rows.append(
                    [
                        str(hidden),
                        dname,
                        *(m[s] for s in settings),
                        *r["over_full"].values(),
                        r["full_over_plain"],
                        *r["min_over_min_full"].values(),
                    ]
                )
                for s in list(settings)[1:]:
                    q = pm[s]
                    if settings[s] and q["sketch"] > 0 and q["mm"] == 0:
                        print(
                            "  warning: the probe saw no torch.mm inside Sketcher calls (3a's project/norm are "
                            "not measured)",
                            flush=True,
                        )
                    parts_rows.append(
                        [
                            str(hidden),
                            dname,
                            s,
                            q["bytes"] / 2**20,
                            q["record"] * 1e3,
                            q["sketch"] * 1e3,
                            q["mm"] * 1e3,
                            q["norm"] * 1e3,
                            (q["sketch"] - q["mm"] - q["norm"]) * 1e3,
                            q["sign"] * 1e3,
                            q["close"] * 1e3,
                            q["writer"] * 1e3,
                            (q["record"] + q["close"]) * 1e3,
                            (q["record"] + q["close"]) / m["plain"],
                        ]
                    )
                print(
                    f"  [capture] hidden {hidden} {dname}: " + ", ".join(f"{s} {v:.3f}s" for s, v in m.items()),
                    flush=True,
                )
            del model
        _table(
            f"3. capture time end to end (seconds, median of {reps}; the whole `with dumper.capture(...)` block, "
            f"closing included; points input,residual, layers all, {tokens} tokens, {layers} layers, SDPA; torch "
            f"threads {torch.get_num_threads()}; R already cached, as for every capture after a process's first)",
            [
                "hidden",
                "dtype",
                *(f"{s} s" for s in settings),
                *(f"{s}/full" for s in sketches),
                "full/plain",
                *(f"min: {s}/full" for s in sketches),
            ],
            rows,
        )
        _table(
            "3a. where the time goes (ms a capture, medians, same runs): record = inside Capture.record on the "
            "forward path (sketch: the Sketcher call + the small copies; full: the copy); sketch call = "
            "Sketcher.__call__, of which mm = its torch.mm (projection), norm = its vector_norm, other = the rest "
            "(widening bf16, allocation, squaring); sign R = building R (0: cached); close = after the forward "
            "(writer drain, fsync, manifest); writer = the writer thread's file writes (overlaps the forward); "
            "hooks+close = what the capture adds at least",
            [
                "hidden",
                "dtype",
                "capture",
                "MiB",
                "record",
                "sketch call",
                "mm",
                "norm",
                "other",
                "sign R",
                "close",
                "writer",
                "hooks+close",
                "/ plain",
            ],
            parts_rows,
        )
        parts = section_parts(args, hiddens, ks, tokens, 2 * layers + 1, root, probe)
    finally:
        probe.remove()
    norms = section_norms(args, hiddens, tokens, 2 * layers + 1)
    return dict(capture=results, parts=parts, norms=norms)


# --------------------------------------------------------------------------------------------- 4. projection cost
def _fwht_butterfly(y: torch.Tensor) -> torch.Tensor:
    """Unnormalized Walsh-Hadamard transform of the rows of ``y`` ``[n, P]`` (P a power of two), in log2 P stages."""
    n, p = y.shape
    h = 1
    while h < p:
        v = y.view(n, p // (2 * h), 2, h)
        y = torch.stack((v[:, :, 0] + v[:, :, 1], v[:, :, 0] - v[:, :, 1]), dim=2).view(n, p)
        h *= 2
    return y


def _hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


class SRHT:
    """Subsampled randomized Hadamard transform: ``x -> (H_P D x)[idx] / sqrt(K)`` (D: random signs from the same
    integer hash as R, x zero-padded to P = next power of two, idx: K distinct coordinates); ``E ||.||^2 = ||x||^2``
    as for the dense R."""

    def __init__(self, hidden: int, k: int, seed: int = 0) -> None:
        self.hidden, self.k = hidden, k
        self.p = 1 << (hidden - 1).bit_length()
        _, cols = hash_keys(seed, 1, hidden, lambda n: torch.arange(n, dtype=torch.int64))
        self.signs = 1.0 - 2.0 * ((mix32(cols ^ 0x5BD1E995) >> 31).to(torch.float32))
        self.idx = torch.randperm(self.p, generator=torch.Generator().manual_seed(seed))[:k].sort().values
        # Kronecker form H_P = H_a (x) H_b, y viewed [n, a, b]:
        # out[i, j] = sum_i' H_a[i, i'] sum_j' H_b[j, j'] y[i', j']
        # with b ~ sqrt(K): H_b on every row (n P 2b flops), then H_a only for the kept (i, j) (n (P/b) 2K flops)
        self.b = min(self.p, 1 << round(math.log2(math.sqrt(k))))
        self.a = self.p // self.b
        self.hb = _hadamard(self.b)
        ha = _hadamard(self.a)
        ia, jb = self.idx // self.b, self.idx % self.b
        self.groups = [
            (int(j), (jb == j).nonzero().view(-1), ha[ia[jb == j]].T.contiguous()) for j in jb.unique().tolist()
        ]  # inner column j: the kept coordinates on it, H_a's rows [a, m]
        self.scale = 1.0 / math.sqrt(k)

    def _padded(self, x: torch.Tensor) -> torch.Tensor:
        y = x * self.signs
        return torch.nn.functional.pad(y, (0, self.p - self.hidden)) if self.p != self.hidden else y

    def butterfly(self, x: torch.Tensor) -> torch.Tensor:
        return _fwht_butterfly(self._padded(x))[:, self.idx] * self.scale

    def kronecker(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        z = (self._padded(x).view(n * self.a, self.b) @ self.hb).view(n, self.a, self.b).permute(2, 0, 1).contiguous()
        out = torch.empty(n, self.k)
        for j, cols, ha_t in self.groups:
            out[:, cols] = z[j] @ ha_t
        return out * self.scale

    def matrix(self) -> torch.Tensor:
        """The explicit [K, hidden] matrix (for the correctness check)."""
        return (_hadamard(self.p)[self.idx][:, : self.hidden] * self.signs) * self.scale


def section_projection(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows_n, reps = (1024, 2) if args.quick else (4096, 3)
    results, rows = [], []
    for hidden in (1024, 4096, 7168):
        x = _hidden_like(rows_n, hidden, torch.float32).view(rows_n, hidden)
        for k in (64, 256):
            spec = SketchSpec(k=k)
            sign_s = _timeit({"sign": lambda: sign_matrix(spec, hidden)}, 3 if not args.quick else 1)["sign"]
            m = (sign_matrix(spec, hidden) * spec.scale).T.contiguous()  # what the library caches per process
            step = max(1, hooks_sketch.BLOCK_BYTES // (4 * hidden))
            s = SRHT(hidden, k)
            small = x[:8].double()
            ref = small @ s.matrix().double().T
            for f in (s.butterfly, s.kronecker):  # the fast forms compute the explicit transform
                assert torch.allclose(f(x[:8]).double(), ref, rtol=1e-4, atol=1e-3 * ref.abs().max().item())
            m64 = m.double()
            fast: dict[str, float] = {}
            t = _timeit(
                {
                    "dense": lambda: x @ m,
                    "dense blocked": lambda: [b @ m for b in x.split(step)],
                    "butterfly": lambda: s.butterfly(x),
                    "kronecker": lambda: s.kronecker(x),
                    "dense64": lambda: x.double() @ m64,
                },
                reps,
                fastest=fast,
            )
            per_k = {name: v * 1e3 * 1000 / rows_n for name, v in t.items()}
            r = dict(
                hidden=hidden,
                k=k,
                rows=rows_n,
                padded=s.p,
                dense_ms_per_1k=per_k["dense"],
                dense_blocked_ms_per_1k=per_k["dense blocked"],
                srht_butterfly_ms_per_1k=per_k["butterfly"],
                srht_kronecker_ms_per_1k=per_k["kronecker"],
                butterfly_over_dense=per_k["butterfly"] / per_k["dense"],
                kronecker_over_dense=per_k["kronecker"] / per_k["dense"],
                dense_gflops=2 * hidden * k * rows_n / t["dense"] / 1e9,
                sign_matrix_ms=sign_s * 1e3,
                dense_float64_ms_per_1k=per_k["dense64"],
                min_ms_per_1k={name: v * 1e3 * 1000 / rows_n for name, v in fast.items()},
            )
            results.append(r)
            rows.append(
                [
                    str(hidden),
                    str(k),
                    str(s.p),
                    per_k["dense"],
                    per_k["dense blocked"],
                    per_k["butterfly"],
                    per_k["kronecker"],
                    r["butterfly_over_dense"],
                    r["kronecker_over_dense"],
                    fast["butterfly"] / fast["dense"],
                    fast["kronecker"] / fast["dense"],
                    r["dense_gflops"],
                    r["sign_matrix_ms"],
                    per_k["dense64"],
                ]
            )
    _table(
        f"4. projection alone, float32 CPU, {rows_n} rows, ms per 1k rows (median of {reps}); dense blocked = in "
        "2 MiB row blocks, as the library; sign R = generating the dense K x hidden signs (once per process, K and "
        "width); dense f64 = the same matmul in float64",
        [
            "hidden",
            "K",
            "P",
            "dense",
            "dense blocked",
            "SRHT butterfly",
            "SRHT kronecker",
            "butterfly/dense",
            "kronecker/dense",
            "min: butterfly/dense",
            "min: kronecker/dense",
            "dense GFLOP/s",
            "sign R ms",
            "dense f64",
        ],
        rows,
    )
    return results


# --------------------------------------------------------------------------------------------- 5. precision floor
def _token_stats(baseline: Path, target: Path) -> dict[str, Any]:
    tokens: list[np.ndarray] = []
    report = compare_dumps(baseline, target, token_sink=lambda c, t, _: tokens.append(np.asarray(t, dtype=np.float64)))
    allt = np.concatenate(tokens) if tokens else np.zeros(0)
    return dict(
        max=float(allt.max()),
        median=float(np.median(allt)),
        rows=int(allt.size),
        tensors=len(report.tensors),
        max_token_rel_diff=max(t.metrics["max_token_rel_diff"] for t in report.tensors),
        max_tensor_rel_diff=max(t.metrics["rel_diff"] for t in report.tensors),
    )


def section_floor(args: argparse.Namespace, root: Path) -> list[dict[str, Any]]:
    hidden, layers, tokens, vocab, k = (512, 2, 128, 1024, 64) if args.quick else (1024, 4, 512, 4096, args.floor_k)
    ids = _ids(vocab, tokens)
    results, rows = [], []
    for dname in ("fp32", "bf16"):
        d = {}
        for attn in ("eager", "sdpa"):
            model = _llama(hidden, layers, vocab=vocab, attn=attn).to(_dtype(dname))
            runs = (
                (("full", None), ("full2", None), ("sketch", k), ("sketch2", k))
                if attn == "eager"
                else (("full", None), ("sketch", k))
            )
            for tag, kk in runs:
                d[f"{attn}-{tag}"] = _capture(
                    model, ids, root / f"floor-{dname}-{attn}-{tag}", points="input,residual", sketch=kk
                )
            del model
        pairs = [
            ("full vs full (eager, run twice)", "eager-full", "eager-full2"),
            ("full vs sketch (eager, run twice)", "eager-full", "eager-sketch"),
            ("sketch vs full (eager, run twice)", "eager-sketch", "eager-full"),
            ("sketch vs sketch (eager, run twice)", "eager-sketch", "eager-sketch2"),
            ("benign: full eager vs full sdpa", "eager-full", "sdpa-full"),
            ("benign: sketch eager vs sketch sdpa", "eager-sketch", "sdpa-sketch"),
        ]
        stats = {name: _token_stats(d[a], d[b]) for name, a, b in pairs}
        benign = stats["benign: full eager vs full sdpa"]
        for name, _, _ in pairs:
            s = stats[name]
            r = dict(
                dtype=dname,
                hidden=hidden,
                layers=layers,
                tokens=tokens,
                k=k,
                pair=name,
                **s,
                max_over_benign_max=s["max"] / benign["max"] if benign["max"] > 0 else math.nan,
                median_over_benign_median=s["median"] / benign["median"] if benign["median"] > 0 else math.nan,
            )
            results.append(r)
            rows.append(
                [
                    dname,
                    name,
                    s["max"],
                    s["median"],
                    r["max_over_benign_max"],
                    r["median_over_benign_median"],
                    s["max_tensor_rel_diff"],
                ]
            )
        for p in d.values():
            shutil.rmtree(p, ignore_errors=True)
    _table(
        f"5. precision floor: per-token rel_diff over every hidden-state row (input, residual; {layers} layers, "
        f"{tokens} tokens, hidden {hidden}, K={k}); ratios against the benign eager-vs-sdpa noise (full vs full)",
        [
            "dtype",
            "pair",
            "max token",
            "median token",
            "max / benign max",
            "median / benign median",
            "max tensor rel_diff",
        ],
        rows,
    )
    return dict(dumps=results, projection_floor=_projection_floor(args, k))


def _projection_floor(args: argparse.Namespace, k: int) -> list[dict[str, Any]]:
    """The full-vs-sketch floor of the projection alone: the capture's float32 ``x @ R^T`` against the comparator's
    float64 projection of the same rows, as per-token rel_diff (``||diff||^2 / (2 ||x||^2)``), by hidden size."""
    rows_n = 256 if args.quick else 2048
    results, rows = [], []
    for hidden in (1024, 4096, 7168):
        for dname in ("fp32", "bf16"):
            x = _hidden_like(rows_n, hidden, _dtype(dname), seed=3)
            proj32, sq = Sketcher(SketchSpec(k=k))(x)
            p64 = torch.from_numpy(project(x.reshape(-1, hidden).double().numpy(), SketchSpec(k=k)))
            tok = ((proj32.reshape(-1, k).double() - p64).square().sum(-1) / (2 * sq.reshape(-1))).numpy()
            # the same matmul in float64 on the capture side instead (what a float64 capture projection would give)
            m64 = (sign_matrix(SketchSpec(k=k), hidden).double() / math.sqrt(k)).T.contiguous()
            proj64 = x.reshape(-1, hidden).double() @ m64
            tok64 = ((proj64 - p64).square().sum(-1) / (2 * sq.reshape(-1))).numpy()
            r = dict(
                hidden=hidden,
                dtype=dname,
                k=k,
                rows=rows_n,
                max=float(tok.max()),
                median=float(np.median(tok)),
                float64_capture_max=float(tok64.max()),
                float64_capture_median=float(np.median(tok64)),
            )
            results.append(r)
            rows.append(
                [str(hidden), dname, r["max"], r["median"], r["float64_capture_max"], r["float64_capture_median"]]
            )
    _table(
        f"5b. floor of the float32 projection alone ({rows_n} hidden-like rows, K={k}): per-token rel_diff of "
        "the capture's float32 projection vs the comparator's float64 one; and were the capture to project in float64",
        ["hidden", "dtype", "max token", "median token", "f64 capture: max", "f64 capture: median"],
        rows,
    )
    return results


# --------------------------------------------------------------------------------------------- 6. comparator throughput
def section_compare(args: argparse.Namespace, root: Path) -> list[dict[str, Any]]:
    """``compare_dumps`` wall time, full vs full, sketch vs sketch and full (baseline) vs sketch (target), on dumps of
    a narrow seeded Llama (eager attention as baseline, SDPA as target: benign differences) in the page cache."""
    hidden, tokens, layers, reps = (1024, 512, 2, 2) if args.quick else (4096, args.cmp_tokens, args.cmp_layers, 3)
    ks = [int(k) for k in args.ks.split(",")]
    config = CompareConfig(threads=args.cmp_threads or args.threads or 2)
    ids = _ids(256, tokens)
    results, rows = [], []
    for dname in args.cmp_dtypes.split(","):
        d: dict[str, Path] = {}
        for attn in ("eager", "sdpa"):
            model = _llama(hidden, layers, vocab=256, narrow=True, attn=attn).to(_dtype(dname))
            for k in (None, *ks):
                tag = f"{attn}-{'full' if k is None else f'K{k}'}"
                d[tag] = _capture(model, ids, root / f"cmp-{dname}-{tag}", points="input,residual", sketch=k)
            del model
        full_bytes = sum(load_manifest(d["eager-full"]).files.values())
        pairs = {"full vs full": ("eager-full", "sdpa-full")}
        for k in ks:
            pairs[f"K={k} vs K={k}"] = (f"eager-K{k}", f"sdpa-K{k}")
            pairs[f"full vs K={k}"] = ("eager-full", f"sdpa-K{k}")
        mins: dict[str, float] = {}
        reports: dict[str, Any] = {}

        def run(name: str, a: str, b: str) -> None:
            reports[name] = compare_dumps(d[a], d[b], config)

        t = _timeit(
            {name: (lambda n=name, a=a, b=b: run(n, a, b)) for name, (a, b) in pairs.items()}, reps, fastest=mins
        )
        for name, (a, b) in pairs.items():
            read = sum(sum(load_manifest(d[x]).files.values()) for x in (a, b))
            r = dict(
                dtype=dname,
                hidden=hidden,
                tokens=tokens,
                layers=layers,
                threads=config.threads,
                pair=name,
                seconds=t[name],
                min_seconds=mins[name],
                full_dump_bytes=full_bytes,
                bytes_read=read,
                full_gb_per_s=full_bytes / t[name] / 1e9,
                over_full_vs_full=t[name] / t["full vs full"],
                min_over_full_vs_full=mins[name] / mins["full vs full"],
                tensors=len(reports[name].tensors),
                max_rel_diff=max(x.metrics["rel_diff"] for x in reports[name].tensors),
            )
            results.append(r)
            rows.append(
                [
                    dname,
                    name,
                    full_bytes / 2**20,
                    read / 2**20,
                    t[name],
                    r["full_gb_per_s"],
                    r["over_full_vs_full"],
                    r["min_over_full_vs_full"],
                    r["tensors"],
                    r["max_rel_diff"],
                ]
            )
        for p in d.values():
            shutil.rmtree(p, ignore_errors=True)
    _table(
        f"6. comparator throughput: compare_dumps wall time (median of {reps} after one warm-up, dumps in the page "
        f"cache; {config.threads} comparator threads), hidden {hidden}, {tokens} tokens, {layers} layers, points "
        f"input,residual; full MiB = one full dump's data; MiB read = both sides' data; GB/s = one full "
        "dump's data bytes / wall time; full vs K = the full baseline projected in float64 on the fly",
        [
            "dtype",
            "pair",
            "full MiB",
            "MiB read",
            "seconds",
            "full GB/s",
            "/ full vs full",
            "min: / full vs full",
            "tensors",
            "max rel_diff",
        ],
        rows,
    )
    return results


# --------------------------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a ~1 min smoke run (small sizes, few repeats)")
    ap.add_argument("--sections", default="1,2,3,4,5,6", help="which sections to run (comma-separated)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results as JSON here")
    ap.add_argument("--reps", type=int, default=3, help="section 3: repeats of each setting")
    ap.add_argument("--tokens", type=int, default=1024, help="section 3: prefill tokens")
    ap.add_argument("--layers", type=int, default=2, help="section 3: decoder layers")
    ap.add_argument("--hiddens", default="1024,2048,4096", help="section 3: hidden sizes")
    ap.add_argument("--ks", default="64,256", help="sections 3 and 6: the sketches' K")
    ap.add_argument("--floor-k", type=int, default=256, help="section 5: the sketch's K")
    ap.add_argument("--pairs", type=int, default=20000, help="section 2: row pairs")
    ap.add_argument("--cmp-tokens", type=int, default=2048, help="section 6: prefill tokens")
    ap.add_argument("--cmp-layers", type=int, default=4, help="section 6: decoder layers")
    ap.add_argument("--cmp-dtypes", default="fp32,bf16", help="section 6: dump dtypes (fp32, bf16; comma-separated)")
    ap.add_argument(
        "--cmp-threads",
        type=int,
        default=None,
        help="section 6: comparator threads (default: --threads if given, else CompareConfig's 2)",
    )
    ap.add_argument("--dir", type=Path, default=None, help="where dumps are written (default: a temporary folder)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sections = {int(s) for s in args.sections.split(",")}
    root = Path(tempfile.mkdtemp(prefix="driftscope-bench-sketch-", dir=args.dir))
    out: dict[str, Any] = dict(quick=args.quick, torch=torch.__version__, threads=torch.get_num_threads())
    t_all = time.perf_counter()
    try:
        for n, key, fn in (
            (1, "bytes", lambda: section_bytes(args, root)),
            (2, "spread", lambda: section_spread(args)),
            (3, "capture", lambda: section_capture(args, root)),
            (4, "projection", lambda: section_projection(args)),
            (5, "floor", lambda: section_floor(args, root)),
            (6, "compare", lambda: section_compare(args, root)),
        ):
            if n in sections:
                t0 = time.perf_counter()
                out[key] = fn()
                print(f"  (section {n}: {time.perf_counter() - t0:.1f} s)", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out["seconds"] = time.perf_counter() - t_all
    print(f"\ntotal {out['seconds']:.1f} s")
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1, default=str))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
