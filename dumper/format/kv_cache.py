"""``extra.kv_cache``: how a dump's ``k_cache``/``v_cache`` rows were stored, and its read-back check.

Written by the capture (:mod:`dumper.hooks.kv_cache`), read by the comparator. Checked on load, so
that a hostile or damaged manifest is one :class:`~dumper.errors.CorruptDumpError` naming the field::

    {"dtype": "auto" | "fp8" | ..., "stored_dtype": "float32", "num_kv_heads": 2, "head_dim": 32,
     "block_size": 128 | null, "tensor_parallel_size": 1, "scales": {"3": [k_scale, v_scale]},
     "readback": {"checked": 608, "failed": 0, "failures": [{"layer", "point", "sequence",
                  "query_position", "read_position", "written_by": {"sequence", "position"}, "rank"}]}}

A cache record's last dim must be ``num_kv_heads x head_dim``, or that divided by the tensor-parallel
size for a record sharded over ranks (each rank holds its heads).
"""

from __future__ import annotations

import math
from typing import Any

from dumper.format.files import bad_field
from dumper.format.points import CACHE_POINTS, FP8_CACHE_DTYPES

__all__ = ["KV_CACHE_KEY", "CACHE_DTYPES", "STORED_DTYPES", "check_kv_extra", "check_kv_records"]

KV_CACHE_KEY = "kv_cache"
CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", *FP8_CACHE_DTYPES)
"""The cache dtypes a dump may say its engine ran."""
STORED_DTYPES = ("float32", "bfloat16", "float16", "float64")
"""The dtypes cache rows are stored in (an fp8 cache's rows are dequantized to float32)."""
_INTS = ("num_kv_heads", "head_dim", "tensor_parallel_size")


def _pos_int(v: Any) -> bool:
    return type(v) is int and v > 0


def _count(v: Any) -> bool:
    return type(v) is int and v >= 0


def check_kv_extra(extra: dict, where: str) -> None:
    """``extra.kv_cache`` if present: the fields and types of the module doc."""
    kv = extra.get(KV_CACHE_KEY)
    if kv is None:
        return
    f = f"extra.{KV_CACHE_KEY}"
    if type(kv) is not dict:
        raise bad_field(where, f, "an object", kv)
    if kv.get("dtype") not in CACHE_DTYPES:
        raise bad_field(where, f"{f}.dtype", f"one of {', '.join(CACHE_DTYPES)}", kv.get("dtype"))
    if kv.get("stored_dtype") not in STORED_DTYPES:
        raise bad_field(where, f"{f}.stored_dtype", f"one of {', '.join(STORED_DTYPES)}", kv.get("stored_dtype"))
    for key in _INTS:
        if not _pos_int(kv.get(key)):
            raise bad_field(where, f"{f}.{key}", "an integer > 0", kv.get(key))
    if kv.get("block_size") is not None and not _pos_int(kv["block_size"]):
        raise bad_field(where, f"{f}.block_size", "an integer > 0 or null (not paged)", kv["block_size"])
    if kv["num_kv_heads"] % kv["tensor_parallel_size"]:
        raise bad_field(
            where,
            f"{f}.num_kv_heads",
            f"a multiple of tensor_parallel_size {kv['tensor_parallel_size']}",
            kv["num_kv_heads"],
        )
    scales = kv.get("scales")
    if scales is not None:
        if type(scales) is not dict:
            raise bad_field(where, f"{f}.scales", "an object of layer -> [k_scale, v_scale]", scales)
        for layer, pair in scales.items():
            if (
                not layer.isdigit()
                or type(pair) is not list
                or len(pair) != 2
                or not all(type(s) in (int, float) and math.isfinite(s) and s > 0 for s in pair)
            ):
                raise bad_field(where, f"{f}.scales[{layer!r}]", "[k_scale, v_scale], finite and > 0", pair)
    _check_readback(kv.get("readback"), where, f"{f}.readback")


def _check_readback(rb: Any, where: str, f: str) -> None:
    if rb is None:
        return
    if type(rb) is not dict:
        raise bad_field(where, f, "an object", rb)
    for key in ("checked", "failed"):
        if not _count(rb.get(key)):
            raise bad_field(where, f"{f}.{key}", "an integer >= 0", rb.get(key))
    if rb["failed"] > rb["checked"]:
        raise bad_field(where, f"{f}.failed", f"at most checked ({rb['checked']})", rb["failed"])
    fails = rb.get("failures", [])
    if type(fails) is not list or len(fails) > rb["failed"]:
        raise bad_field(where, f"{f}.failures", f"a list of at most {rb['failed']} failures", fails)
    for i, x in enumerate(fails):
        g = f"{f}.failures[{i}]"
        if type(x) is not dict:
            raise bad_field(where, g, "an object", x)
        for key in ("layer", "sequence", "query_position", "read_position"):
            if not _count(x.get(key)):
                raise bad_field(where, f"{g}.{key}", "an integer >= 0", x.get(key))
        if x.get("point") not in CACHE_POINTS:
            raise bad_field(where, f"{g}.point", " or ".join(CACHE_POINTS), x.get("point"))
        if "rank" in x and not _count(x["rank"]):
            raise bad_field(where, f"{g}.rank", "an integer >= 0", x["rank"])
        by = x.get("written_by")
        if by is not None and (
            type(by) is not dict or not _count(by.get("sequence")) or not _count(by.get("position"))
        ):
            raise bad_field(where, f"{g}.written_by", "an object of sequence and position, integers >= 0", by)


def check_kv_records(raw: dict, where: str) -> None:
    """Each cache record's width against ``extra.kv_cache`` (and a dump with cache records must say its layout)."""
    kv = (raw.get("extra") or {}).get(KV_CACHE_KEY)
    for i, d in enumerate(raw["tensors"]):
        if d.get("point") not in CACHE_POINTS:
            continue
        if kv is None:
            raise bad_field(
                where, f"extra.{KV_CACHE_KEY}", f"the cache layout, as tensors[{i}] is a {d['point']} record", None
            )
        sketch = d.get("sketch")
        width = sketch["hidden"] if isinstance(sketch, dict) else d["shape"][-1] if d.get("shape") else 0
        sharded = d.get("shard_dim") is not None
        heads = kv["num_kv_heads"] // (kv["tensor_parallel_size"] if sharded else 1)
        rank = f", one rank of {kv['tensor_parallel_size']}" if sharded else ""
        if width != heads * kv["head_dim"]:
            raise bad_field(
                where,
                f"extra.{KV_CACHE_KEY}.num_kv_heads",
                f"heads x head_dim {kv['head_dim']} = tensors[{i}]'s row width {width} ({d['name']}{rank})",
                kv["num_kv_heads"],
            )
