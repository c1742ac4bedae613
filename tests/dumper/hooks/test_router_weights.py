"""Each family's router weights: applied to a router's own logits and ids, its own weights, bit for bit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dumper.errors import UsageError
from dumper.hooks.router_weights import WEIGHTS, combine_weights
from dumper.hooks.routing import ROUTERS, find_routers
from tests.moe_models import FAMILIES, build_moe


def test_every_router_driftscope_reads_has_its_weights():
    assert set(WEIGHTS) == set(ROUTERS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_combine_weights_reproduce_the_routers_own(family, dtype):
    model = build_moe(family, dtype=dtype)
    seen: list[tuple[nn.Module, tuple[torch.Tensor, ...]]] = []
    handles = [
        m.register_forward_hook(lambda mod, args, out: seen.append((mod, out)))
        for layer in model.model.layers
        for m, _ in find_routers(layer)
    ]
    with torch.no_grad():
        model(torch.randint(3, 256, (2, 17), generator=torch.Generator().manual_seed(1)))
    for h in handles:
        h.remove()
    assert seen
    for module, (logits, weights, ids) in seen:
        got = combine_weights(module, logits, ids)
        assert got.dtype == weights.dtype and torch.equal(got, weights), type(module).__name__
        # other experts get other weights (the choice is not baked in): the reversed slots, reversed weights
        assert torch.equal(combine_weights(module, logits, ids.flip(1)), weights.flip(1))


def test_an_unknown_router_is_refused():
    with pytest.raises(UsageError, match="Linear: driftscope does not know how this router weights its experts"):
        combine_weights(nn.Linear(4, 4), torch.zeros(2, 4), torch.zeros(2, 2, dtype=torch.int64))
