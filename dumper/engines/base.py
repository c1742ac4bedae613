"""What every engine adapter shares: the job's token ids, the engine's identity, and a dump writer.

An adapter module has one entry point, ``run_dump(cfg: RunConfig, *, progress=None) -> Manifest``.
It runs ``cfg``'s job (the same token ids, layers and logprob settings as the HF job) through
its engine and writes through :class:`EngineDump`, which names tensors as the HF capture does
(``model.layers.{i}.self_attn.input``, capture point ``input``), keeps absolute positions and
per-prompt sequence ids taken from the engine's batch, and records the logprobs in the form
the comparator reads (:mod:`dumper.format`'s ``LOGPROB_*`` names). So an engine dump and an HF
dump of the same checkpoint compare with ``python -m comparator HF_DUMP ENGINE_DUMP``.

Example (inside an adapter)::

    with EngineDump(cfg, info, identity, num_layers=4, seqs=seqs) as out:
        out.hidden(layer, x, positions, sequence_ids)   # x [tokens, hidden], flattened batch
        out.step()                                       # one engine forward pass done
        out.logits(seq_id, seqs[seq_id], logits)         # [len, V]: row i predicts token i+1
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from dumper.errors import UsageError
from dumper.format import Manifest, load_manifest
from dumper.format.decode import GENERATED_IDS, NEW_TOKENS
from dumper.format.files import printable
from dumper.format.points import MLP_INPUT, MLP_OUTPUT, record_name
from dumper.hooks.capture import Capture
from dumper.hooks.fingerprint import config_identity
from dumper.hooks.layers import ATTN_INPUT, parse_layer_spec
from dumper.prefill.decode import decode_meta
from dumper.prefill.logprob_records import record_logprobs, record_next_logprobs, record_token_logprobs
from dumper.prefill.run import RunConfig, check_scored_positions, prompt_token_ids

__all__ = [
    "EngineInfo",
    "EngineDump",
    "EngineArg",
    "attn_input_name",
    "point_name",
    "hf_identity",
    "job_sequences",
    "check_checkpoint_dir",
    "check_engine_args",
]

EngineValue = str | int | bool


@dataclass(frozen=True)
class EngineArg:
    """One ``--engine-arg`` key of an engine's ``ENGINE_ARGS`` table: the values it takes, and its help.

    ``kind``: ``"choice"`` (one of ``choices``, any case), ``"int"`` (``low`` .. ``high``),
    ``"bool"`` (true or false, any case) or ``"path"`` (a non-empty path, checked where it is used).
    """

    help: str
    kind: Literal["choice", "int", "bool", "path"] = "choice"
    choices: tuple[str, ...] = ()
    low: int = 1
    high: int = (1 << 31) - 1

    def allowed(self) -> str:
        """The values it takes, for messages: ``one of f32, f16``, ``true or false``, ..."""
        if self.kind == "choice":
            return f"one of {', '.join(self.choices)}"
        if self.kind == "bool":
            return "true or false"
        if self.kind == "int":
            return (
                f"a positive integer (at most {self.high})"
                if self.low == 1
                else f"an integer from {self.low} to {self.high}"
            )
        return "a path"

    def parse(self, key: str, value: str) -> EngineValue:
        """``value`` as this key's type (a choice lowercased); a one-line :class:`UsageError` naming it otherwise."""
        v = value.strip().lower()
        if self.kind == "choice" and v in self.choices:
            return v
        if self.kind == "bool" and v in ("true", "false"):
            return v == "true"
        if self.kind == "int" and v.isascii() and v.isdigit() and len(v) <= 19 and self.low <= int(v) <= self.high:
            return int(v)
        if self.kind == "path" and value and "\0" not in value:
            return value
        shown = printable(value if len(value) <= 80 else value[:77] + "...")
        raise UsageError(f"--engine-arg {printable(key)}={shown}: expected {self.allowed()} ({self.help})")


def check_engine_args(cfg: RunConfig, table: dict[str, EngineArg]) -> dict[str, EngineValue]:
    """Every ``--engine-arg`` of ``cfg`` checked against ``cfg.engine``'s ``table``: its key and its value.

    Returns each given key's parsed value (the last one given wins). Needs no engine: it runs
    before the engine is imported (:func:`dumper.engines.run_engine`), and again in the adapter.
    """
    values: dict[str, EngineValue] = {}
    for key, value in cfg.engine_args:
        if key not in table:
            takes = "; ".join(f"{k}={a.allowed()} ({a.help})" for k, a in table.items()) or "none"
            raise UsageError(
                f"--engine-arg {printable(key)}: --engine {cfg.engine} does not take it (it takes: {takes})"
            )
        values[key] = table[key].parse(key, value)
    return values


LAYER_PREFIX = "model.layers"
"""The HF capture's decoder-layer list (Llama-family module path): layer ``i`` is ``model.layers.{i}``."""


def attn_input_name(layer: int) -> str:
    """The HF capture's name for layer ``layer``'s self-attention input (Llama-family module path)."""
    return point_name(layer, ATTN_INPUT)


def point_name(layer: int, point: str) -> str:
    """The HF capture's name for layer ``layer``'s capture point ``point`` (Llama-family module paths:
    ``self_attn`` for the attention's points, ``mlp`` for the MLP's, :mod:`dumper.format.points`)."""
    module = "mlp" if point in (MLP_INPUT, MLP_OUTPUT) else "self_attn"
    return record_name(f"{LAYER_PREFIX}.{layer}.{module}", point)


@dataclass(frozen=True)
class EngineInfo:
    """Which engine computed a dump and how: recorded in the manifest's ``environment`` and ``extra``.

    ``settings`` holds what changes numerics besides the weights (dtype, KV-cache dtype,
    attention backend, thread count, ...); scalars only, so the store can match environments.
    """

    name: str
    version: str | None
    checkpoint: str
    settings: dict[str, str | int | float | bool | None] = field(default_factory=dict)

    def environment(self) -> dict[str, Any]:
        return {
            "engine": self.name,
            "engine_version": self.version,
            **{f"engine_{k}": v for k, v in self.settings.items()},
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "version": self.version,
            "checkpoint": self.checkpoint,
            "settings": dict(self.settings),
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> EngineInfo:
        """Inverse of :meth:`to_json`: the ``engine`` entry of a dump manifest's ``extra``."""
        version = d.get("version")
        return cls(
            name=str(d["name"]),
            version=None if version is None else str(version),
            checkpoint=str(d["checkpoint"]),
            settings=dict(d.get("settings") or {}),
        )


def check_checkpoint_dir(path: str, engine: str) -> Path:
    """``path`` as an HF checkpoint directory that passes :func:`dumper.modeldir.check_model_dir`.

    No directory or no ``config.json`` is a :class:`UsageError`; a directory that fails a check
    (custom code, a FIFO, a config too large) a :class:`~dumper.errors.ModelError` naming the file.
    """
    from dumper.modeldir import check_model_dir

    p = Path(path)
    if not p.is_dir() or not os.path.lexists(p / "config.json"):
        raise UsageError(f"{path}: --engine {engine} needs a local HF checkpoint directory (with config.json)")
    check_model_dir(p)
    return p


def hf_identity(checkpoint: str | os.PathLike[str], name: str | None = None, **extra: Any) -> dict[str, Any]:
    """The model identity an HF dump of ``checkpoint`` records, read from its config alone (no weights).

    ``architecture`` is the config's first ``architectures`` entry (the class HF builds),
    ``config_hash`` hashes the same ``to_dict()`` as :func:`dumper.hooks.fingerprint.model_identity`,
    so the comparator's identity check agrees with the HF dump. ``weights_hash`` is None:
    the engine holds its own copy of the weights.
    """
    from dumper.modeldir import load_config

    config = load_config(checkpoint)
    arch = (getattr(config, "architectures", None) or [None])[0]
    return {**config_identity(config, name or str(checkpoint), arch), "weights_hash": None, **extra}


def job_sequences(cfg: RunConfig, checkpoint: str | os.PathLike[str] | None, vocab_size: int) -> list[list[int]]:
    """The token ids of ``cfg``'s prompts: ``--input-ids`` as given, text through the checkpoint's HF tokenizer.

    Every engine is fed these ids (never its own tokenizer's split of the text), so that
    positions line up with the HF dump of the same prompts.
    """
    from dumper.tokenizers import load_tokenizer

    texts = bool(cfg.prompts) or not cfg.input_ids  # the built-in prompts are text too
    tok = load_tokenizer(str(checkpoint)) if texts and checkpoint is not None else None
    seqs = prompt_token_ids(cfg, tok, vocab_size)
    check_scored_positions(cfg, seqs)
    return seqs


class EngineDump:
    """A model-less :class:`Capture` that records engine tensors under the HF capture's names.

    Only layers in ``cfg.layers`` (default ``first,last,every:8``) are kept by :meth:`hidden`,
    so adapters may offer every layer. Logprobs follow ``cfg.logprobs``: none when it is None.
    """

    def __init__(
        self,
        cfg: RunConfig,
        info: EngineInfo,
        identity: dict[str, Any],
        *,
        num_layers: int,
        seqs: Sequence[Sequence[int]],
        extra: dict[str, Any] | None = None,
    ) -> None:
        self.cfg = cfg
        self.layers = parse_layer_spec(cfg.layers, num_layers)
        self._keep = set(self.layers)
        self.spec = cfg.logprobs
        job = {
            "job": "prefill",
            "input_ids": [list(s) for s in seqs],
            "dtype": cfg.dtype,
            "chunk_size": cfg.chunk_size,
            "batch_size": cfg.batch_size,
            "logprobs": None if cfg.logprobs is None else vars(cfg.logprobs),
            "engine": info.to_json(),
            **(extra or {}),
            **cfg.extra,
        }
        signature = {
            "layers": self.layers,
            "modules": [attn_input_name(i)[: -len(ATTN_INPUT) - 1] for i in self.layers],
            "points": [ATTN_INPUT],
            "num_layers": num_layers,
            "world_size": 1,
            "dtype": cfg.dtype,
        }
        self._cap = Capture(
            None,
            cfg.out,
            model_name=identity.get("name"),
            extra=json.loads(json.dumps(job)),
            identity=identity,
            signature=signature,
            environment=info.environment(),
            sketch=cfg.sketch,
        )
        self._cap.world_size, self._cap.rank = 1, 0

    def __enter__(self) -> EngineDump:
        self._cap.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._cap.__exit__(*exc)

    def manifest(self) -> Manifest:
        return load_manifest(self.cfg.out)

    def wants(self, layer: int) -> bool:
        """Whether :meth:`hidden` keeps ``layer`` (adapters skip copying the others off the engine)."""
        return layer in self._keep

    def step(self) -> None:
        """End one engine forward pass; the next record starts another."""
        self._cap.step()

    def decode_step(self, step: int | None) -> None:
        """The following records belong to decode step ``step`` (``None``: no longer; :mod:`dumper.prefill.decode`)."""
        self._cap.set_pass_meta(None if step is None else decode_meta(step))

    def next_logprobs(
        self, logits: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor, sequence_ids: Sequence[int]
    ) -> None:
        """Record the logprob (and top-k) of each ``targets[r]`` at ``positions[r]`` from ``logits[r]``: the tokens a
        greedy decode chose (:func:`dumper.prefill.logprob_records.record_next_logprobs`)."""
        if self.spec is not None:
            record_next_logprobs(self._cap, logits, targets, positions, sequence_ids, self.spec)

    def generated(self, generated: Sequence[Sequence[int]]) -> None:
        """Say in the manifest what a ``--new-tokens`` job generated, per sequence (:mod:`dumper.format.decode`)."""
        self._cap.extra.update(
            {"job": "decode", NEW_TOKENS: self.cfg.new_tokens, GENERATED_IDS: [list(map(int, g)) for g in generated]}
        )

    def hidden(
        self, layer: int, x: torch.Tensor, positions: Any, sequence_ids: Any, *, point: str = ATTN_INPUT
    ) -> None:
        """Record layer ``layer``'s ``point`` ``x`` [tokens, hidden] of the current pass (default: its self-attention
        input), under the HF capture's name for it (:func:`point_name`).

        ``positions`` and ``sequence_ids`` give each row's absolute position and prompt index.
        """
        if layer in self._keep:
            self._cap.record(
                point_name(layer, point),
                x.detach().reshape(-1, x.shape[-1]),
                layer=layer,
                point=point,
                positions=positions,
                sequence_ids=sequence_ids,
            )

    def router(self, layer: int, parts: dict[str, torch.Tensor], positions: Any, sequence_ids: Any) -> None:
        """Record MoE layer ``layer``'s routing ``parts`` (``{ROUTER_LOGITS: [tokens, E], ...}``) of the current pass,
        rows as :meth:`hidden`'s (:meth:`dumper.hooks.capture.Capture.record_router` names and casts them)."""
        if layer in self._keep:
            self._cap.record_router(
                f"{LAYER_PREFIX}.{layer}", layer, parts, positions=positions, sequence_ids=sequence_ids
            )

    def logits(self, seq_id: int, ids: Sequence[int], logits: torch.Tensor, first: int = 0) -> None:
        """Record the logprobs of prompt ``seq_id`` from logits rows for positions ``first .. first+n-1``.

        Row ``r`` (position ``p = first + r``) is the distribution of token ``p + 1``; rows past
        the prompt's end or at/below ``--logprob-start-len`` are dropped, as in the HF job
        (:func:`dumper.prefill.logprob_records.record_logprobs` does the work for both).
        """
        if self.spec is None:
            return
        rows = logits[: max(0, len(ids) - first)]  # no row at or past the prompt's end
        ids_t = torch.as_tensor([list(ids)], dtype=torch.int64, device=logits.device)
        record_logprobs(
            self._cap,
            rows[None],
            ids_t,
            torch.ones_like(ids_t),
            torch.arange(len(ids), device=logits.device)[None],
            first,
            [seq_id],
            self.spec,
        )

    def token_logprobs(
        self, seq_id: int, positions: Any, token_ids: Any, logprobs: Any, top_ids: Any = None, top_logprobs: Any = None
    ) -> None:
        """Record logprobs the engine computed itself
        (see :func:`dumper.prefill.logprob_records.record_token_logprobs`)."""
        positions = torch.as_tensor(positions, dtype=torch.int64).reshape(-1)
        record_token_logprobs(
            self._cap, positions, torch.full_like(positions, seq_id), token_ids, logprobs, top_ids, top_logprobs
        )
