"""``python -m dumper run|ls``: thin CLI over :func:`dumper.run.run_dump` and :mod:`dumper.format`."""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Sequence

from .cliutil import Parser, guarded_main
from .errors import EXIT_OK, UsageError
from .format import Manifest, load_manifest

__all__ = ["main", "build_parser"]



def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m dumper", description="Capture hidden states of a model into a dump directory.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    r = sub.add_parser("run", help="teacher-forced prefill of prompts with capture on")
    r.add_argument("--model", default="tiny-llama", help="local HF model directory or preset (tiny-llama, tiny-qwen2)")
    r.add_argument("--out", required=True, help="dump directory to create")
    src = r.add_mutually_exclusive_group()
    src.add_argument("--prompt", action="append", default=None, help="prompt text (repeatable)")
    src.add_argument("--prompts", metavar="FILE.jsonl", help='JSONL: {"text": ...} or {"input_ids": [...]} per line')
    src.add_argument("--input-ids", action="append", default=None, help="comma-separated token ids (repeatable)")
    r.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    r.add_argument("--attn", default="eager", choices=["eager", "sdpa"], help="attention implementation")
    r.add_argument("--layers", default=None,
                   help="layer spec: all, first, last, every:N, 3, -1, 2..5 (default first,last,every:8)")
    r.add_argument("--modules", default=None, help="fnmatch pattern of modules to hook instead of self-attention")
    r.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    r.add_argument("--seed", type=int, default=0, help="seed for preset weights (default 0)")
    r.add_argument("--chunk-size", type=int, default=None,
                   help="prefill in chunks of N tokens through the KV cache (one forward pass per chunk)")
    r.add_argument("--batch-size", type=int, default=1, help="prompts per forward pass, padded (default 1)")
    r.add_argument("--padding-side", default="right", choices=["right", "left"], help="where batches are padded")
    ls = sub.add_parser("ls", help="show what a dump holds")
    ls.add_argument("dir", help="dump directory")
    ls.add_argument("--tensors", action="store_true", help="list every tensor")
    return p


def _cmd_run(args: argparse.Namespace) -> int:
    from .run import RunConfig, parse_input_ids, read_prompts_file, run_dump

    prompts: tuple[str, ...] = tuple(args.prompt or ())
    ids = parse_input_ids(args.input_ids or ())
    if args.prompts:
        texts, file_ids = read_prompts_file(args.prompts)
        prompts, ids = tuple(texts), tuple(tuple(s) for s in file_ids)
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise UsageError(f"--device {args.device}: CUDA is not available on this machine")
    cfg = RunConfig(out=args.out, model=args.model, prompts=prompts, input_ids=ids, dtype=args.dtype,
                    attn=args.attn, layers=args.layers, modules=args.modules, device=args.device, seed=args.seed,
                    chunk_size=args.chunk_size, batch_size=args.batch_size, padding_side=args.padding_side)
    manifest = run_dump(cfg)
    layers = manifest.capture_signature.get("layers", [])
    print(f"wrote {args.out}: {len(manifest.tensors)} tensors, layers {layers}, "
          f"{len({t.forward_pass for t in manifest.tensors})} forward passes")
    return EXIT_OK


def describe(manifest: Manifest, *, tensors: bool = False) -> str:
    """A human summary of a dump (what ``python -m dumper ls`` prints)."""
    ts = manifest.tensors
    lines = [
        f"format {manifest.format_version}, created {manifest.created_at}",
        f"model: {manifest.model}",
        f"capture_signature: {manifest.capture_signature}",
        f"environment: {manifest.environment}",
        f"tensors: {len(ts)} in {len(manifest.files)} files, "
        f"{sum(t.nbytes for t in ts) / 2**20:.1f} MiB",
        f"layers: {sorted({t.layer for t in ts if t.layer is not None})}",
        f"forward passes: {len({t.forward_pass for t in ts})}, ranks: {sorted({t.rank for t in ts})}",
    ]
    names = Counter(t.name for t in ts)
    lines.append("names: " + ", ".join(f"{n} (x{c})" for n, c in sorted(names.items())[:12])
                 + (" ..." if len(names) > 12 else ""))
    if tensors:
        for t in ts:
            pos = t.row_positions()
            span = f"tokens {pos.min()}..{pos.max()}" if pos is not None and pos.size else "no positions"
            lines.append(f"  {t.name}  pass={t.forward_pass} rank={t.rank} layer={t.layer} "
                         f"{t.dtype}{list(t.shape)} {span}  [{t.file}]")
    return "\n".join(lines)


def run(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "run":
        return _cmd_run(args)
    print(describe(load_manifest(args.dir), tensors=args.tensors))
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point: user errors become one line on stderr and a distinct exit code."""
    return guarded_main(run, argv)
