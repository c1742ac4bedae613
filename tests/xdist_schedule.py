"""pytest-xdist scheduling for this suite (``python -m pytest -n 2``): whole modules, the heaviest first.

The suite's cost is engine start-up held in module- and session-scoped fixtures (a vLLM
worker serving many jobs, a compiled engine shared by a module's tests). xdist's default
``load`` scheduling deals single tests to workers, so such a fixture would be set up once
per worker that got one of its tests. Here a *work unit* is a whole test module, or a
group of modules that share one session fixture (:data:`GROUPS`), so every fixture is set
up once per run, as without xdist.

Units are dealt longest first (:data:`HEAVY`, in the order of their measured cost, then
the rest in collection order), so that the two cores end together rather than one
waiting for a 10-minute engine module dealt last. The list is a hint, not a contract: a
module missing from it only loses its place in the queue.
"""

from __future__ import annotations

import pytest

GROUPS: dict[str, tuple[str, ...]] = {
    # the vllm_base session fixture (tests/dumper/engines/conftest.py): one vLLM worker's dense jobs
    "vllm_base": (
        "tests/dumper/engines/test_engine_vllm.py",
        "tests/dumper/engines/test_vllm_compiled.py",
        "tests/dumper/engines/test_vllm_tp.py",
    ),
}
"""Modules that must share a worker, named by the group they form."""

HEAVY: tuple[str, ...] = (
    "vllm_base",
    "tests/dumper/jobs/test_vllm_sweep.py",
    "tests/dumper/engines/test_vllm_kv_cache.py",
    "tests/dumper/engines/test_vllm_speculative.py",
    "tests/dumper/engines/test_vllm_drill.py",
    "tests/dumper/jobs/test_observer_check.py",
    "tests/dumper/engines/test_vllm_router.py",
    "tests/dumper/jobs/test_fuzz_model_dir.py",
    "tests/comparator/bisect/test_bisect.py",
    "tests/dumper/engines/test_vllm_ray.py",
    "tests/dumper/engines/test_vllm_serve_capture.py",
    "tests/dumper/format/test_remote_s3.py",
    "tests/dumper/hooks/test_tap.py",
    "tests/dumper/engines/test_engine_llama_cpp.py",
    "tests/e2e/test_real_checkpoint.py",
    "tests/e2e/test_real_checkpoint_vllm.py",
)
"""Work units to deal first, longest first (the engine-start report and ``--durations`` say which)."""

_GROUP_OF = {module: group for group, modules in GROUPS.items() for module in modules}


def unit_of(nodeid: str) -> str:
    """The work unit of a test: its module's group, or its module."""
    module = nodeid.split("::", 1)[0]
    return _GROUP_OF.get(module, module)


def _rank(unit: str) -> int:
    return HEAVY.index(unit) if unit in HEAVY else len(HEAVY)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    if config.getoption("dist") != "load":  # the default of -n N; another --dist is the user's choice
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        """xdist's ``loadscope`` with :func:`unit_of` as the scope and the heaviest unit dealt first."""

        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

        def _assign_work_unit(self, node) -> None:
            first = min(self.workqueue, key=_rank)  # stable: ties keep collection order
            self.workqueue.move_to_end(first, last=False)
            super()._assign_work_unit(node)

    return ModuleScheduling(config, log)
