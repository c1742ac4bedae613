"""A replay refuses what it cannot replay before it runs any layer: nothing written, one line, no library noise.

Each refusal used to be found when the replay reached the layer concerned, after the layers
before it had run: an attention kind replay cannot mask, and (forcing the baseline's experts) a
replayed token the baseline's routing has no row for.
"""

from __future__ import annotations

import json

import pytest
import torch

import dumper
from dumper.errors import NotComparableError, UsageError
from dumper.format import MANIFEST_NAME, ROUTER_IDS
from dumper.jobs.replay import replay_model
from tests.moe_models import build_moe


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    root = tmp_path_factory.mktemp("upfront")
    model = build_moe("mixtral")
    with torch.no_grad(), dumper.capture(model, root / "base", layers="all", points=("residual", "router")):
        model(torch.arange(3, 19).view(1, 16))
    return root / "base"


def test_an_attention_kind_replay_cannot_mask_is_refused_before_any_layer_runs(baseline, tmp_path):
    model = build_moe("mixtral")
    layers = model.config.num_hidden_layers
    model.config.layer_types = ["full_attention"] * (layers - 1) + ["chunked_attention"]
    with pytest.raises(UsageError, match=f"layer {layers - 1} of .* uses 'chunked_attention' attention"):
        replay_model(model, baseline, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_forcing_without_a_routing_row_for_a_replayed_token_is_refused_before_any_layer_runs(baseline, tmp_path):
    """The last MoE layer's routing records lose their last row (positions and sequence ids rewritten as padding
    in the manifest): forcing has no baseline choice for token 15 there."""
    bad = tmp_path / "bad"
    import shutil

    shutil.copytree(baseline, bad)
    m = json.loads((bad / MANIFEST_NAME).read_text())
    last = max(t["layer"] for t in m["tensors"] if t["name"].endswith(ROUTER_IDS))
    for t in m["tensors"]:
        if t["layer"] == last and ".router." in t["name"]:
            t["sequence_ids"] = [[0, 15], [-1, 1]]  # runs (value, count): the last row is padding now
    (bad / MANIFEST_NAME).write_text(json.dumps(m))
    with pytest.raises(NotComparableError, match=f"routing of layer {last} has no row for position 15 of sequence 0"):
        replay_model(build_moe("mixtral"), bad, tmp_path / "out", force_routing="ids")
    assert not (tmp_path / "out").exists()
    replay_model(build_moe("mixtral"), bad, tmp_path / "plain")  # without forcing, nothing is missing
