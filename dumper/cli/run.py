"""``python -m dumper run``: one dump of one job (any engine), or with ``--calibrate`` a baseline with its noise."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from dumper.cli.common import out_flag, prompt_source_flags, quiet_flag
from dumper.cli.flags import (
    MODEL_HELP,
    check_logprob_options,
    engine_flags,
    layers_flag,
    logprob_flags,
    model_flag,
    model_setting_flags,
    padding_side_flag,
    points_flag,
    save_logits_flag,
)
from dumper.cli.values import check_device, engine_args, sketch_spec
from dumper.errors import EXIT_DIVERGED, EXIT_OK, UsageError
from dumper.prefill.speculative import parse_speculative

__all__ = ["add_run", "cmd_run"]


def add_run(sub: argparse._SubParsersAction) -> None:
    """``run``: the flags of :class:`dumper.prefill.run.RunConfig`."""
    r = sub.add_parser("run", help="teacher-forced prefill of prompts with capture on")
    model_flag(
        r, help=f"{MODEL_HELP}; a .gguf file for llama.cpp, an ONNX Runtime GenAI model directory for onnxruntime-genai"
    )
    engine_flags(
        r, engine_arg_help="engine-specific setting (repeatable); see each engine's section in docs/engines.md"
    )
    out_flag(r)
    prompt_source_flags(r)
    model_setting_flags(r)
    layers_flag(r)
    r.add_argument("--modules", default=None, help="fnmatch pattern of modules to hook instead of self-attention")
    points_flag(r)
    r.add_argument(
        "--chunk-size",
        type=int,
        default=None,
        help="prefill in chunks of N tokens through the KV cache (one forward pass per chunk)",
    )
    r.add_argument("--batch-size", type=int, default=1, help="prompts per forward pass, padded (default 1)")
    padding_side_flag(r)
    r.add_argument(
        "--new-tokens",
        type=int,
        default=0,
        metavar="N",
        help="after each prompt pass, greedy-decode N tokens (temperature 0, no stop at EOS) and record "
        "every decode step's rows at their positions (docs/decode.md; transformers, vllm, llama.cpp)",
    )
    r.add_argument(
        "--speculative",
        metavar="SPEC",
        default=None,
        help="with --new-tokens: decode with the engine's speculative decoding (ngram:k=3: n-gram prompt lookup, "
        "k drafts per step) and record every verify pass, draft indices and rejected rows apart (docs/decode.md)",
    )
    r.add_argument(
        "--tokens-from",
        metavar="DUMP",
        default=None,
        help="the prefill counterpart of a --new-tokens dump: each of its prompts plus the tokens its "
        "decode fed back, so the two dumps hold the same positions (any engine)",
    )
    logprob_flags(r, help="also record input-token logprobs")
    r.add_argument(
        "--logprob-start-len",
        type=int,
        default=0,
        help="with --logprobs: first input position to return (SGLang's logprob_start_len)",
    )
    save_logits_flag(r)
    r.add_argument(
        "--compile",
        action="store_true",
        help="transformers: run the model under torch.compile, captured through driftscope's tap",
    )
    r.add_argument(
        "--sketch",
        type=int,
        default=None,
        metavar="K",
        help="store each hidden-state row as a K-dim seeded random projection plus its exact squared norm "
        "instead of whole (K/hidden of the bytes; per-token rel_diff estimated within ~sqrt(2/K))",
    )
    r.add_argument(
        "--sketch-seed",
        type=int,
        default=None,
        help="with --sketch: the projection's seed (default 0); "
        "sketches compare only with the same --sketch and --sketch-seed",
    )
    r.add_argument(
        "--calibrate",
        action="store_true",
        help="also re-run the prompts as the engine's benign variants (transformers: the other attention "
        "kernel, a chunked prefill, a padded batch) and store the baseline's noise in OUT/NOISE.json: "
        "python -m comparator OUT TARGET then judges by it (docs/calibration.md)",
    )
    r.add_argument(
        "--observer-check",
        action="store_true",
        help="with --logprobs (transformers, vllm): run the job again with nothing of driftscope on the "
        "model and check that its logprobs (and --save-logits rows) are bit-identical to the dump's; "
        "prints one line, records extra.observer in the manifest, exits 1 when capture changed them",
    )
    quiet_flag(r)


def cmd_run(args: argparse.Namespace) -> int:
    from dumper.format.remote import writing
    from dumper.prefill.logprob_records import LogprobSpec
    from dumper.prefill.observer import OBSERVER_KEY, ObserverResult
    from dumper.prompts import parse_input_ids, read_prompts_file

    prompts: tuple[str, ...] = tuple(args.prompt or ())
    ids = parse_input_ids(args.input_ids or ())
    if args.prompts:
        texts, file_ids = read_prompts_file(args.prompts)
        prompts, ids = tuple(texts), tuple(tuple(s) for s in file_ids)
    check_device(args.device)
    check_logprob_options(args, "--top-k", "--logprob-start-len", "--save-logits")
    if args.top_k < 0 or args.logprob_start_len < 0:
        raise UsageError("--top-k and --logprob-start-len must be >= 0")
    spec = (
        LogprobSpec(top_k=args.top_k, start_len=args.logprob_start_len, save_logits=args.save_logits)
        if args.logprobs
        else None
    )
    if args.calibrate:
        if args.observer_check:
            raise UsageError("--calibrate and --observer-check: run the observer check on its own")
        from comparator import BASELINE_NOISE
        from dumper.jobs.calibrated import record_calibrated

        manifest, noise = record_calibrated(
            _run_config(args, prompts, ids, spec, args.out),
            lambda cfg: _run_job(args, cfg),
            say=(lambda _: None) if args.quiet else print,
        )
        for line in (noise.identical_warning(), noise.holdout_warning(3.0)):  # 3: the comparator's default factor
            if line:
                print(f"warning: {line}", file=sys.stderr)
    else:
        with writing(args.out) as out:  # a URL: made in a local staging directory, uploaded manifest last
            manifest = _run_dump(args, prompts, ids, spec, out)
    layers = manifest.capture_signature.get("layers", [])
    if not args.quiet:
        print(
            f"wrote {args.out}: {len(manifest.tensors)} tensors, layers {layers}, "
            f"{len({t.forward_pass for t in manifest.tensors})} forward passes"
        )
        if args.calibrate:
            print(
                f"calibrated from {len(noise.variants)} benign variants: {args.out}/{BASELINE_NOISE} (python -m "
                f"comparator {args.out} TARGET judges by it)"
            )
    if not args.observer_check:
        return EXIT_OK
    observed = ObserverResult.from_json(manifest.extra[OBSERVER_KEY])
    print(observed.summary())  # the verdict asked for: printed with --quiet too
    return EXIT_OK if observed else EXIT_DIVERGED


def _run_dump(args: argparse.Namespace, prompts: tuple[str, ...], ids: Any, spec: Any, out: str) -> Any:
    """Dump as ``args`` says into ``out`` (a local directory); its manifest."""
    return _run_job(args, _run_config(args, prompts, ids, spec, out))


def _run_job(args: argparse.Namespace, cfg: Any) -> Any:
    """Run the job ``cfg`` through its engine, with a progress bar unless ``--quiet``; its manifest."""
    from dumper.engines import run_engine
    from dumper.progress import progress_bar

    with progress_bar(not args.quiet, "dumping", unit="tokens") as progress:
        return run_engine(cfg, engine=args.engine, progress=progress)


def _run_config(args: argparse.Namespace, prompts: tuple[str, ...], ids: Any, spec: Any, out: str) -> Any:
    """The job ``args`` describe, writing into ``out``."""
    from dumper.hooks.layers import parse_points
    from dumper.prefill.run import RunConfig

    cfg = RunConfig(
        out=out,
        model=args.model,
        prompts=prompts,
        input_ids=ids,
        dtype=args.dtype,
        attn=args.attn,
        layers=args.layers,
        modules=args.modules,
        points=parse_points(args.points),
        device=args.device,
        seed=args.seed,
        chunk_size=args.chunk_size,
        batch_size=args.batch_size,
        padding_side=args.padding_side,
        logprobs=spec,
        engine=args.engine,
        engine_args=engine_args(args.engine_arg or ()),
        compile=args.compile,
        observer_check=args.observer_check,
        sketch=sketch_spec(args.sketch, args.sketch_seed),
        new_tokens=args.new_tokens,
        speculative=None if args.speculative is None else parse_speculative(args.speculative),
    )
    if args.tokens_from is not None:
        from dumper.prefill.run import tokens_from

        cfg = tokens_from(cfg, args.tokens_from)
    return cfg
