"""The decode path on a GPU: the CLI's decode on CUDA, and the tap under CUDA graphs replayed per decode step.

vLLM replays one CUDA graph per decode batch size; the tap's copies are recorded in those graphs
and repeated at every replay, which runs no Python. ``test_cuda_graph_decode_*`` builds the same
shape of run from torch alone: a static KV cache, each decode step one replay of a graph that
``torch.compile(mode="reduce-overhead")`` captured for that batch size (1, 2 and 4 rows), the
rows read back after each replay with the step's positions and sequences. Marked ``gpu``
(``bash .ci/gpu-check`` runs them); they skip without CUDA.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import dumper
from comparator import compare_dumps
from dumper.format import load_manifest
from dumper.format.reader import DumpReader
from dumper.prefill.decode import decode_meta
from tests.conftest import run_cli, tiny_llama

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graphs)"),
]

PROMPT, STEPS = 12, 6


def test_the_cli_decodes_on_cuda_bit_exactly_and_its_counterpart_passes(tmp_path):
    prompts = [[1, 5, 9, 22, 40, 7, 8, 9, 10, 11, 12], [1, 7, 8, 33, 44]]
    ids = [a for p in prompts for a in ("--input-ids", ",".join(map(str, p)))]
    common = ("--device", "cuda", "--layers", "all", "--logprobs", "--top-k", "2", "--quiet")
    r = run_cli(
        "dumper",
        "run",
        *ids,
        "--new-tokens",
        str(STEPS),
        "--batch-size",
        "2",
        "--observer-check",
        *common,
        "--out",
        tmp_path / "d",
    )
    assert r.returncode == 0 and r.stdout.startswith("observer check: bit-exact"), r.stdout + r.stderr
    r = run_cli("dumper", "run", *ids, "--new-tokens", str(STEPS), "--compile", *common, "--out", tmp_path / "c")
    assert r.returncode == 0, r.stdout + r.stderr
    r = run_cli("dumper", "run", "--tokens-from", tmp_path / "d", *common, "--out", tmp_path / "p")
    assert r.returncode == 0, r.stdout + r.stderr
    for target in ("d", "c"):
        r = run_cli("comparator", tmp_path / "p", tmp_path / target, "--quiet", "--json", tmp_path / "v.json")
        assert r.returncode == 0, r.stdout + r.stderr
        v = json.loads((tmp_path / "v.json").read_text())
        assert v["decode"]["passed"] and v["decode"]["steps"] == 2 * (STEPS - 1), v["decode"]
    assert load_manifest(tmp_path / "d").extra["generated_ids"] == load_manifest(tmp_path / "c").extra["generated_ids"]


def _decode(model, step_fn, prompts: torch.Tensor, out, *, graphs: bool) -> tuple[torch.Tensor, list[int]]:
    """Prefill ``prompts`` [B, PROMPT] eagerly into a static KV cache, then greedy-decode STEPS - 1 fed steps
    through ``step_fn`` (one token per row; with ``graphs`` three rounds, the last one captured). Returns
    the last round's logits of every step [steps, B, V] and the generated tokens of row 0. The cache is
    one object for all rounds, as vLLM's is, so that the last round replays the graphs the second recorded."""
    from transformers import StaticCache

    rounds = 3 if graphs else 1  # reduce-overhead: warm-up, record, replay
    cache = StaticCache(config=model.config, max_cache_len=PROMPT + STEPS)  # one address: graphs replay on it
    for r in range(rounds):
        last = r == rounds - 1
        cap = dumper.capture(model, out, layers="all") if last and out is not None else None
        logits, tokens = [], []
        with torch.inference_mode(), cap or _nothing():
            cache.reset()
            pos = torch.arange(PROMPT, device=prompts.device)
            step = model(
                input_ids=prompts,
                cache_position=pos,
                position_ids=pos[None].expand(len(prompts), -1),
                past_key_values=cache,
                use_cache=True,
            ).logits[:, -1]
            for s in range(STEPS - 1):
                token = step.argmax(-1)
                tokens.append(int(token[0]))
                pos = torch.tensor([PROMPT + s], device=prompts.device)
                if cap is not None:
                    cap.set_pass_meta(decode_meta(s))
                step = (
                    step_fn(
                        input_ids=token[:, None],
                        cache_position=pos,
                        position_ids=pos[None].expand(len(prompts), -1),
                        past_key_values=cache,
                        use_cache=True,
                    )
                    .logits[:, -1]
                    .clone()
                )
                logits.append(step)
    return torch.stack(logits), tokens


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


@pytest.mark.parametrize("batch", [1, 2, 4])
def test_cuda_graph_decode_records_each_step_at_its_position(tmp_path, batch):
    _graph_decode(tmp_path, batch, "cuda")


def _graph_decode(tmp_path, batch: int, device: str) -> None:
    model, _ = tiny_llama()
    model = model.to(device).eval()
    prompts = torch.randint(3, 200, (batch, PROMPT), generator=torch.Generator().manual_seed(batch)).to(device)
    eager, tokens = _decode(model, model, prompts, tmp_path / "eager", graphs=False)
    torch.compiler.reset()
    plain = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    ref, _ = _decode(model, plain, prompts, None, graphs=True)
    torch.compiler.reset()
    dumper.tap(model, layers="all", max_tokens=batch * PROMPT)
    tapped = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)

    def step_fn(**kw):  # the module call runs the capture's hooks; its forward is the compiled graph
        model.forward = tapped
        try:
            return model(**kw)
        finally:
            del model.forward

    graphs, graph_tokens = _decode(model, step_fn, prompts, tmp_path / "graphs", graphs=True)
    assert torch.equal(graphs, ref), "the tap changed the CUDA-graph decode's logits"
    assert graph_tokens == tokens
    assert (graphs - eager).abs().max() < 1e-3
    for name in ("model.layers.0.self_attn.input", "model.layers.7.self_attn.input"):
        a, b = _rows_by_key(tmp_path / "eager", name), _rows_by_key(tmp_path / "graphs", name)
        assert a.keys() == b.keys()
        assert {k[1] for k in a} == set(range(PROMPT + STEPS - 1))
        assert len({k[0] for k in a}) == batch
        for key, row in a.items():
            rel = float(((row - b[key]) ** 2).sum() / ((row**2).sum() + (b[key] ** 2).sum()))
            assert rel < 1e-9, (name, key, rel)
    phases = {t.meta.get("decode_step") for t in load_manifest(tmp_path / "graphs").tensors}
    assert phases == {None, *range(STEPS - 1)}
    v = compare_dumps(tmp_path / "eager", tmp_path / "graphs")
    assert v.passed and v.matched > 0


def _rows_by_key(path, name: str) -> dict[tuple[int, int], np.ndarray]:
    """Every row of ``name`` in a dump, by (sequence, position)."""
    reader, out = DumpReader(path), {}
    for t in load_manifest(path).tensors:
        if t.name != name:
            continue
        rows = reader.rows(t).astype("float64")
        seqs, pos = t.row_sequence_ids(), t.row_positions()
        for i in range(rows.shape[0]):
            out[int(seqs[i]), int(pos[i])] = rows[i]
    return out
