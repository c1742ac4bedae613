"""The session's shared vLLM base run (:func:`tests.dumper.engines.test_engine_vllm.base_runs`)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def vllm_base(tmp_path_factory):
    """The fp32, bf16 and other dense-checkpoint jobs of one vLLM worker and the HF fp32 reference, once per
    session, for every module that compares against them."""
    from tests.dumper.engines.test_engine_vllm import base_runs

    return base_runs(tmp_path_factory)
