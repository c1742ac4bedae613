"""Pass-row metadata (dumper.hooks.rows, read by the HF family) on real calls of the tiny Llama, checked
against positions and sequence ids worked out here from the inputs alone; and a user-registered
family that renames what the hooks read, used by ``dumper.capture`` without editing the library."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from transformers import DynamicCache

import dumper
from dumper.errors import UsageError
from dumper.format import PAD_SEQUENCE, load_manifest, open_tensor
from dumper.hooks import families
from dumper.hooks.rows import HFRows
from tests.conftest import tiny_llama

LENGTHS = (5, 3)
"""Two prompts of unequal length: the second one is padded."""


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama()[0]


def _batch(side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [2, 5] and mask [2, 5] of the two prompts, padded on ``side`` with token 0."""
    width = max(LENGTHS)
    ids, mask = torch.zeros(2, width, dtype=torch.int64), torch.zeros(2, width, dtype=torch.int64)
    for b, n in enumerate(LENGTHS):
        cols = slice(0, n) if side == "right" else slice(width - n, width)
        ids[b, cols] = torch.arange(10 + 20 * b, 10 + 20 * b + n)
        mask[b, cols] = 1
    return ids, mask


def _expected(mask: torch.Tensor, applied: np.ndarray, seq_ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Flat (positions, sequence ids) of a [batch, seq] pass: a token row keeps the position the model
    applied to it and its prompt's id; a padding row its column index and PAD_SEQUENCE."""
    pos, seq = [], []
    for b in range(mask.shape[0]):
        for c in range(mask.shape[1]):
            real = bool(mask[b, c])
            pos.append(int(applied[b, c]) if real else c)
            seq.append(seq_ids[b] if real else PAD_SEQUENCE)
    return np.array(pos), np.array(seq)


def _rows_of(out) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """(pass, positions, sequence ids) of each recorded tensor of a dump."""
    m = load_manifest(out)
    assert m.tensors
    return [(t.forward_pass, t.row_positions(), t.row_sequence_ids()) for t in m.tensors]


@pytest.mark.parametrize("side", ["right", "left"])
def test_a_padded_batch_labels_its_rows_with_the_positions_the_model_applied(tiny, tmp_path, side):
    ids, mask = _batch(side)
    with torch.no_grad(), dumper.capture(tiny, tmp_path / "d", layers="first,last"):
        tiny(input_ids=ids, attention_mask=mask)
    # no position_ids given: transformers applies positions 0..4 to every row (left padding included)
    applied = np.broadcast_to(np.arange(ids.shape[1]), ids.shape)
    want_pos, want_seq = _expected(mask, applied, [0, 1])
    for forward_pass, pos, seq in _rows_of(tmp_path / "d"):
        assert forward_pass == 0
        np.testing.assert_array_equal(pos, want_pos)
        np.testing.assert_array_equal(seq, want_seq)


def test_the_top_level_call_alone_reads_positions_from_the_mask(tiny):
    """Before any hooked module says otherwise, a left-padded row counts its real tokens from 0."""
    ids, mask = _batch("left")
    rows = families.HFFamily(tiny).pass_rows((), {"input_ids": ids, "attention_mask": mask})
    assert isinstance(rows, HFRows) and rows.shape == (2, 5)
    counted = np.array([[max(0, int(mask[b, : c + 1].sum()) - 1) for c in range(5)] for b in range(2)])
    want_pos, want_seq = _expected(mask, counted, [0, 1])
    np.testing.assert_array_equal(np.concatenate([np.arange(a, a + n) for a, n in rows.positions.runs]), want_pos)
    np.testing.assert_array_equal(np.concatenate([np.full(n, s) for s, n in rows.sequence_ids.runs]), want_seq)


def test_explicit_position_ids_win_over_the_mask(tiny, tmp_path):
    ids, mask = _batch("left")
    given = (mask.cumsum(1) - 1).clamp(min=0) + torch.tensor([[100], [7]])  # per row, shifted
    with torch.no_grad(), dumper.capture(tiny, tmp_path / "d", layers="first"):
        tiny(input_ids=ids, attention_mask=mask, position_ids=given)
    want_pos, want_seq = _expected(mask, given.numpy(), [0, 1])
    for _, pos, seq in _rows_of(tmp_path / "d"):
        np.testing.assert_array_equal(pos, want_pos)
        np.testing.assert_array_equal(seq, want_seq)


def test_a_chunked_second_pass_over_the_kv_cache_continues_both_sequences(tiny, tmp_path):
    ids, mask = _batch("right")
    cut = 2  # both prompts have tokens on each side of the cut
    cache = DynamicCache()
    with torch.no_grad(), dumper.capture(tiny, tmp_path / "d", layers="first"):
        tiny(input_ids=ids[:, :cut], attention_mask=mask[:, :cut], past_key_values=cache, use_cache=True)
        tiny(input_ids=ids[:, cut:], attention_mask=mask, past_key_values=cache, use_cache=True)
    columns = np.broadcast_to(np.arange(ids.shape[1]), ids.shape)  # the model applies past + column
    first = _expected(mask[:, :cut], columns[:, :cut], [0, 1])
    second_pos, second_seq = _expected(mask[:, cut:], columns[:, cut:], [0, 1])  # padding: the chunk's column
    got = _rows_of(tmp_path / "d")
    assert [p for p, _, _ in got] == [0, 1]
    np.testing.assert_array_equal(got[0][1], first[0])
    np.testing.assert_array_equal(got[0][2], first[1])
    np.testing.assert_array_equal(got[1][1], second_pos)
    np.testing.assert_array_equal(got[1][2], second_seq)  # the same sequences: no new ids


# -- a family of the user's own -------------------------------------------------------------------


class _Mixer(nn.Module):
    """An attention stand-in called as ``mixer(x=..., where=...)`` (no ``hidden_states``)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)

    def forward(self, *, x: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
        return self.proj(x) + where[..., None].to(x.dtype)


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.mixer = _Mixer(d)

    def forward(self, x: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
        return x + self.mixer(x=x * 2, where=where)


class _Toy(nn.Module):
    """Called as ``model(tok=..., where=...)``; its layers are ``blocks``, its final norm ``final``."""

    def __init__(self, n: int = 3, d: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, d)
        self.blocks = nn.ModuleList(_Block(d) for _ in range(n))
        self.final = nn.LayerNorm(d)

    def forward(self, *, tok: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
        x = self.embed(tok)
        for b in self.blocks:
            x = b(x, where)
        return self.final(x)


class _ToyFamily(families.HFFamily):
    """Only attributes change: the HF family's logic reads the toy's own names."""

    name = "toy"
    attention_names = ("mixer",)
    norm_names = ("final",)
    hidden_kwarg = "x"
    ids_kwarg = "tok"
    position_kwargs = ("where",)
    module_position_kwarg = "where"

    @classmethod
    def matches(cls, model):
        return isinstance(model, _Toy)


def test_a_user_family_renames_what_the_hooks_read_without_editing_the_library(tmp_path):
    torch.manual_seed(0)
    model = _Toy()
    tok = torch.tensor([[3, 4, 5, 6], [7, 8, 9, 1]])
    where = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]])  # the toy's own positions argument, per row
    seen: dict[str, torch.Tensor] = {}
    for i, b in enumerate(model.blocks):
        b.mixer.register_forward_pre_hook(
            lambda m, a, k, i=i: seen.__setitem__(f"blocks.{i}.mixer.input", k["x"].clone()), with_kwargs=True
        )
    with pytest.raises(UsageError, match="cannot find decoder layers"):
        dumper.capture(model, tmp_path / "before")  # the library alone does not know the toy
    families.register(_ToyFamily)
    try:
        with torch.no_grad(), dumper.capture(model, tmp_path / "d", layers="all", points="input,residual") as cap:
            assert cap.family.name == "toy"
            model(tok=tok, where=where)
    finally:
        families.unregister(_ToyFamily)
    assert families.family_for(model) is families.HFFamily
    m = load_manifest(tmp_path / "d")
    names = [t.name for t in m.tensors]
    assert sorted(names) == sorted([*seen, *(f"blocks.{i}.residual" for i in range(3)), "final.residual"])
    for t in m.tensors:
        np.testing.assert_array_equal(t.row_positions(), where.reshape(-1).numpy())
        np.testing.assert_array_equal(t.row_sequence_ids(), [0] * 4 + [1] * 4)
        if t.name in seen:  # the mixer's x= input, as it was called
            np.testing.assert_array_equal(open_tensor(tmp_path / "d", t), seen[t.name].reshape(2, 4, 8).numpy())
