"""A standalone repro of one op: ``repro.py``, ``inputs.safetensors`` and ``repro.json``, for the op's owner.

:func:`write_repro` writes, for the first op a drill found beyond its rounding (:class:`~dumper.hooks.
drill.record.ReproCase`), the op's exact inputs (shapes, dtypes, strides; written arguments as they
were before the call), the output the engine computed, the float64 reference, and a script that runs
with torch alone (plus the engine's package for a custom op): it calls the op again on the inputs,
recomputes an aten op's float64 reference itself (a custom op's is the stored one), and prints the
error against the rounding its dtype predicts. It exits 1 while the op is beyond its rounding, 0 once
it is not (a fixed kernel), and 2 with one line naming the file when the directory is unusable.

Ops that hold engine state the arguments do not carry are rebuilt from what the drill kept: vLLM's
oneDNN GEMM (``_C.onednn_mm``) gets a handle made from the stored weight. An op that needs the
engine's forward context (vLLM's opaque attention op) cannot run alone: its repro compares the stored
output with the stored reference and says so.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from dumper.errors import UsageError
from dumper.format.atomic import atomic_dir
from dumper.hooks.drill.record import ReproCase, encode_value
from dumper.hooks.drill.reference import arg as call_arg
from dumper.hooks.drill.reference import written_args

__all__ = ["write_repro", "REPRO_SCRIPT", "REPRO_INPUTS", "REPRO_META"]

REPRO_SCRIPT = "repro.py"
REPRO_INPUTS = "inputs.safetensors"
REPRO_META = "repro.json"
_IMPORTS = {"_C": ["vllm._custom_ops"], "vllm": ["vllm.model_executor.layers.attention.attention"]}
"""What to import so that an op namespace is registered (vLLM's custom ops)."""
_NOT_STANDALONE = {
    "vllm::unified_attention_with_output": "reads the paged KV cache through vLLM's forward context",
}


def _encode(v: Any, tensors: dict[str, torch.Tensor], prefix: str) -> Any:
    """An argument as JSON, its tensors stored under ``prefix...`` in ``tensors``."""
    if isinstance(v, torch.Tensor):
        tensors[prefix] = v.detach().to("cpu").contiguous()
        return {"tensor": prefix, "shape": list(v.shape), "stride": list(v.stride()), "dtype": str(v.dtype)[6:]}
    if isinstance(v, list | tuple) and any(isinstance(x, torch.Tensor) for x in v):
        return {"list": [_encode(x, tensors, f"{prefix}.{i}") for i, x in enumerate(v)]}
    return {"value": encode_value(v)}


def _recipe(case: ReproCase, state: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, Any] | None:
    """How to rebuild engine state an op's arguments only point to (None: the arguments are enough)."""
    if case.func._schema.name != "_C::onednn_mm":
        return None
    handle = call_arg(case.args, case.kwargs, case.func, 3, "handler")
    w = state.get("weights", {}).get(int(handle.reshape(-1)[0]))
    if w is None:
        raise UsageError("--repro: the oneDNN GEMM's weight was not kept, so its handle cannot be rebuilt")
    tensors["state.weight"] = w.detach().to("cpu").contiguous()
    return {"kind": "onednn_mm", "weight": "state.weight", "handler_arg": 3}


def write_repro(case: ReproCase, out: str | Path, *, factor: float, state: dict[str, Any] | None = None) -> Path:
    """Write the repro of ``case`` to directory ``out`` (created; refused when it exists and is not empty)."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    schema = case.func._schema
    args = [_encode(a, tensors, f"in.{i}") for i, a in enumerate(case.args)]
    kwargs = {k: _encode(v, tensors, f"in.{k}") for k, v in case.kwargs.items()}
    for j, (o, r) in enumerate(zip(case.observed, case.reference, strict=False)):
        tensors[f"observed.{j}"] = o.detach().to("cpu").contiguous()
        tensors[f"reference.{j}"] = r.detach().to("cpu", torch.float64).contiguous()
        mag = case.mags[j] if j < len(case.mags) else None
        if mag is not None:
            tensors[f"magnitude.{j}"] = mag.detach().to("cpu", torch.float64).contiguous()
    entry = case.entry
    n_rows = entry.outputs[0].shape[entry.token_dim] if entry.token_dim is not None else None
    namespace = schema.name.split("::")[0]
    meta = {
        "op": entry.op,
        "schema": str(schema),
        "namespace": namespace,
        "imports": _IMPORTS.get(namespace, []),
        "path": entry.path,
        "args": args,
        "kwargs": kwargs,
        "written": [i for i, _ in written_args(case.func)],
        "outputs": len(case.observed),
        "reference": entry.reference,
        "recompute_reference": namespace in ("aten", "prims"),
        "size": entry.size,
        "factor": factor,
        "ratio": entry.ratio if entry.ratio is not None and entry.ratio != float("inf") else "inf",
        "token": entry.ratio_token,
        "rows": n_rows,
        "recipe": _recipe(case, state or {}, tensors),
        "standalone": _NOT_STANDALONE.get(schema.name),
    }
    with atomic_dir(out, "--repro") as tmp:
        save_file(tensors, str(tmp / REPRO_INPUTS))
        (tmp / REPRO_SCRIPT).write_text(REPRO_SOURCE)
        (tmp / REPRO_META).write_text(json.dumps(meta, indent=1))
    return Path(out)


REPRO_SOURCE = r'''"""A standalone repro of one op a driftscope drill found beyond its rounding (dumper drill).

Run: python repro.py [--device cpu|cuda]. Needs torch (and, for a custom op, the engine's package).
Exit 1: the op is still beyond its rounding; 0: within it; 2: this directory is unusable.
"""

import argparse
import json
import math
import struct
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
U = {"float64": 2.0**-53, "float32": 2.0**-24, "bfloat16": 2.0**-8, "float16": 2.0**-11}
DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}


def die(path, problem):
    print(f"{path}: {' '.join(str(problem).split())}", file=sys.stderr)  # one line, whatever the reason says
    sys.exit(2)


def load_tensors(path):
    """A safetensors file read with torch alone."""
    try:
        raw = path.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + n])
        if not isinstance(header, dict):
            raise ValueError("its header is not an object")
    except (OSError, ValueError, struct.error) as e:
        die(path, f"not a safetensors file ({e})")
    data = raw[8 + n :]
    out = {}
    for key, spec in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype = DTYPES[spec["dtype"]]
            a, b = spec["data_offsets"]
            shape = [int(s) for s in spec["shape"]]
            count = math.prod(shape)
            size = torch.empty((), dtype=dtype).element_size()
            if not 0 <= a <= b <= len(data) or b - a != count * size:
                die(path, f"{key}: its bytes do not match its shape {shape}")
            t = torch.frombuffer(bytearray(data[a:b]), dtype=dtype) if count else torch.empty(0, dtype=dtype)
            out[key] = t.reshape(shape)
        except (KeyError, TypeError, ValueError) as e:
            die(path, f"{key}: bad entry ({e})")
    return out


def build(spec, tensors, device, where):
    """An argument from repro.json: a tensor with its strides, a list, or a plain value."""
    if not isinstance(spec, dict) or len(spec) == 0:
        die(HERE / "repro.json", f"{where} is not an argument")
    if "tensor" in spec:
        key = spec["tensor"]
        if key not in tensors:
            die(HERE / "inputs.safetensors", f"{key} ({where}) is missing")
        t = tensors[key]
        shape, stride = list(spec.get("shape", [])), list(spec.get("stride", []))
        if list(t.shape) != shape:
            die(HERE / "inputs.safetensors", f"{key} has shape {list(t.shape)}, repro.json says {shape}")
        if str(t.dtype)[6:] != spec.get("dtype", str(t.dtype)[6:]):
            die(HERE / "inputs.safetensors", f"{key} is {str(t.dtype)[6:]}, repro.json says {spec['dtype']}")
        if len(stride) != len(shape):
            die(HERE / "repro.json", f"{where}: {len(stride)} strides for the {len(shape)} dimensions of {key}")
        t = t.to(device)
        if 0 in stride or stride == list(t.stride()):
            return t.clone()
        out = torch.empty_strided(shape, stride, dtype=t.dtype, device=device)
        out.copy_(t)
        return out
    if "list" in spec:
        return [build(s, tensors, device, f"{where}[{i}]") for i, s in enumerate(spec["list"])]
    value = spec.get("value")
    if isinstance(value, dict) and "dtype" in value:
        return getattr(torch, value["dtype"])
    if isinstance(value, dict) and "device" in value:
        return torch.device(device)
    if isinstance(value, dict) and "float" in value:
        return float(value["float"])
    if isinstance(value, dict) and "enum" in value:
        return getattr(torch, value["enum"])
    if isinstance(value, dict):
        die(HERE / "repro.json", f"{where} ({value.get('repr', value)}) cannot be rebuilt outside the engine")
    return value


def up(x):
    if isinstance(x, torch.Tensor):
        return x.to(torch.float64) if x.is_floating_point() else x.clone()
    if isinstance(x, list):
        return [up(v) for v in x]
    if isinstance(x, torch.dtype) and x.is_floating_point:
        return torch.float64
    return x


def ratio_rows(out, ref, mag, size, rows):
    """rms(out - ref) / rms(u(out) |ref| + u(acc) sqrt(K) mag) per token row (driftscope's rounding model)."""
    o, r = out.to(torch.float64), ref.to(out.device, torch.float64)
    same = (o == r) | (torch.isnan(o) & torch.isnan(r))
    err = torch.where(same, torch.zeros_like(o), o - r)
    fr = torch.where(same | ~torch.isfinite(r), torch.zeros_like(r), r)
    m = fr.abs() if mag is None else mag.to(o.device, torch.float64).abs()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    acc = U["float64"] if out.dtype == torch.float64 else U["float32"]
    bound = U[str(out.dtype)[6:]] * fr.abs() + acc * math.sqrt(size) * m
    dim = next((d for d, s in enumerate(o.shape) if s == rows), None) if rows and rows > 1 else (0 if rows else None)
    if dim is None:
        err, bound = err.reshape(1, -1), bound.reshape(1, -1)
    else:
        err, bound = err.movedim(dim, 0).reshape(o.shape[dim], -1), bound.movedim(dim, 0).reshape(o.shape[dim], -1)
    bad = ~torch.isfinite(err)
    num = torch.where(bad, torch.zeros_like(err), err).square().sum(1)
    den = bound.square().sum(1)
    ratio = torch.where(den > 0, (num / torch.where(den > 0, den, torch.ones_like(den))).sqrt(), num.sqrt() * math.inf)
    ratio = torch.where(num == 0, torch.zeros_like(ratio), ratio)
    return torch.where(bad.any(1), torch.full_like(ratio, math.inf), ratio)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-d", "--device", default="cpu", help="where the op runs again (cpu, cuda, ...)")
    device = p.parse_args().device
    try:
        meta = json.loads((HERE / "repro.json").read_text())
        op, args_spec, kwargs_spec = meta["op"], meta["args"], meta["kwargs"]
        n_out, size, factor = int(meta["outputs"]), int(meta["size"]), float(meta["factor"])
        if meta.get("rows") is not None and type(meta["rows"]) is not int:
            raise TypeError(f"rows {meta['rows']!r} is not a row count")
    except (OSError, ValueError, KeyError, TypeError) as e:
        die(HERE / "repro.json", f"unreadable ({e})")
    tensors = load_tensors(HERE / "inputs.safetensors")
    refs = []
    for j in range(n_out):
        if f"reference.{j}" not in tensors:
            die(HERE / "inputs.safetensors", f"reference.{j} is missing")
        if torch.isnan(tensors[f"reference.{j}"]).any():
            die(HERE / "inputs.safetensors", f"reference.{j} holds NaN: it cannot judge the op")
        refs.append(tensors[f"reference.{j}"])
    for module in meta.get("imports", []):
        try:
            __import__(module)
        except ImportError as e:
            die(HERE / "repro.json", f"{op} is a custom op of {module.split('.')[0]}, which is not installed ({e})")
    args = [build(s, tensors, device, f"args[{i}]") for i, s in enumerate(args_spec)]
    kwargs = {k: build(s, tensors, device, f"kwargs.{k}") for k, s in kwargs_spec.items()}
    try:
        ns, name, overload = op.split(".")
        func = getattr(getattr(getattr(torch.ops, ns), name), overload)
    except (AttributeError, ValueError, RuntimeError) as e:
        die(HERE / "repro.json", f"op {op!r} is not an op of this torch ({e})")
    if meta.get("standalone"):
        outs = [tensors.get(f"observed.{j}") for j in range(n_out)]
        print(f"{op} {meta['standalone']}: it cannot run outside the engine; the output the engine computed is judged")
    else:
        recipe = meta.get("recipe")
        keep = None
        if recipe and recipe.get("kind") == "onednn_mm":
            from vllm import _custom_ops as ops

            w = build({"tensor": recipe["weight"], "shape": list(tensors[recipe["weight"]].shape),
                       "stride": list(tensors[recipe["weight"]].stride())}, tensors, device, "recipe.weight")
            keep = ops.create_onednn_mm(w.t(), 32)
            args[recipe["handler_arg"]] = keep.handler_tensor
        result = func(*args, **kwargs)
        written = [args[i] for i in meta.get("written", []) if i < len(args)]
        returned = [] if written else ([result] if isinstance(result, torch.Tensor) else list(result or []))
        outs = (written + [r for r in returned if isinstance(r, torch.Tensor)])[:n_out]
        if meta.get("recompute_reference"):
            up_args = [up(a) for a in args]
            for i in meta.get("written", []):  # an in-place op's reference starts from the stored input
                up_args[i] = up(build(args_spec[i], tensors, device, f"args[{i}]"))
            up_kwargs = {k: up(v) for k, v in kwargs.items()}
            r = func(*up_args, **up_kwargs)
            rw = [up_args[i] for i in meta.get("written", [])]
            rr = [r] if isinstance(r, torch.Tensor) else [x for x in (r or []) if isinstance(x, torch.Tensor)]
            refs = (rw + rr)[:n_out]
    worst, row = 0.0, None
    for j, (o, r) in enumerate(zip(outs, refs)):
        if o is None or not o.is_floating_point():
            continue
        mag = tensors.get(f"magnitude.{j}")
        rr = ratio_rows(o, r, mag, size, meta.get("rows"))
        i = int(torch.argmax(torch.nan_to_num(rr, nan=math.inf)))
        if not float(rr[i]) <= worst:
            worst, row = float(rr[i]), i
        err = (o.to(torch.float64) - r.to(o.device, torch.float64)).abs()
        print(f"output {j}: {list(o.shape)} {str(o.dtype)[6:]}, max |error| {float(err.max()):.3g}, "
              f"{float(rr.max()):.3g}x its rounding (largest at row {i})")
    verdict = "BEYOND" if not worst <= factor else "within"
    print(f"{op} at {meta.get('path')}: {worst:.3g}x its rounding (the drill measured {meta.get('ratio')}x at token "
          f"{meta.get('token')}): {verdict} {factor:g}x")
    sys.exit(1 if verdict == "BEYOND" else 0)


if __name__ == "__main__":
    main()
'''
