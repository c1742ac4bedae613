"""The job's inputs without torch: the built-in prompts, ``--prompts`` JSONL files and ``--input-ids``.

Kept apart from :mod:`dumper.prefill.run` so that clients that only send prompts (``python -m
comparator collect``, ``selfcheck --server``) start without importing torch.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from dumper.errors import UsageError

__all__ = ["BUILTIN_PROMPTS", "read_prompts_file", "parse_input_ids"]

BUILTIN_PROMPTS = (
    "The quick brown fox jumps over the lazy dog. Inference engines change daily: a new attention "
    "backend, a fused kernel, another chunked-prefill cut. Each can shift the numerics without any error.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\nprint([fib(i) for i in range(10)])",
)


def read_prompts_file(path: str | Path) -> tuple[list[str], list[list[int]]]:
    """Read JSONL prompts: each line ``{"text": ...}`` (or ``"prompt"``) or ``{"input_ids": [...]}``."""
    texts: list[str] = []
    ids: list[list[int]] = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise UsageError(f"{path}: cannot read prompts file ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise UsageError(f"{path}: not UTF-8 text (byte {e.start})") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        except RecursionError:
            raise UsageError(f"{path}:{n}: JSON nested too deeply") from None
        if isinstance(obj, dict) and isinstance(obj.get("input_ids"), list):
            bad = [i for i in obj["input_ids"] if not isinstance(i, int) or isinstance(i, bool)]
            if bad:
                raise UsageError(f"{path}:{n}: input_ids must be integers, got {json.dumps(bad[0])[:40]}")
            ids.append(list(obj["input_ids"]))
        elif isinstance(obj, dict) and isinstance(obj.get("text", obj.get("prompt")), str):
            texts.append(obj.get("text", obj.get("prompt")))
        else:
            raise UsageError(f'{path}:{n}: expected {{"text": "..."}} or {{"input_ids": [...]}}')
    if not texts and not ids:
        raise UsageError(f"{path}: no prompts in file")
    return texts, ids


def parse_input_ids(spec: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """``["1,2,3", "4,5"]`` -> ((1, 2, 3), (4, 5)); one sequence per ``--input-ids`` flag."""
    out = []
    for s in spec:
        try:
            out.append(tuple(int(t) for t in s.split(",")))  # "1,,2" is a typo, not two tokens
        except ValueError:
            raise UsageError(f"--input-ids {s!r}: expected comma-separated integers") from None
    return tuple(out)
