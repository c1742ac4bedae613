"""The ONNX side of the ORT GenAI adapter: read a builder-made model and run it with hidden states exposed.

ONNX Runtime GenAI returns only logits. The hidden states come from the same ``model.onnx``,
run by plain ``onnxruntime`` with the tensors of the HF capture point added as graph outputs:
for layer ``i``, output 0 of the node ``/model/layers.{i}/input_layernorm/...`` (a
``SimplifiedLayerNormalization``, or from layer 1 on a ``SkipSimplifiedLayerNormalization``
whose output 0 is the normalized state and output 3 the residual sum). That is the RMSNorm'd
hidden state fed to the attention projections, which HF's ``self_attn`` pre-hook sees.

The edited graph is serialized in memory and its external weights are read in place
(``session.model_external_initializers_file_folder_path``), so the user's model directory
is never written and no weights are copied.

Example::

    model = read_ort_model("ort_dir")
    runner = HiddenRunner(model, layers=[0, 3])
    hidden, logits, past = runner.run([1, 469, 474], start=0, past=None)   # hidden[3]: [3, hidden]
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dumper.errors import DumpError, ModelError, UsageError, error_reason
from dumper.format.files import check_plain_name, parse_json, read_regular_file, regular_file_in, show
from dumper.modeldir import CONFIG_LIMIT

__all__ = ["GENAI_CONFIG", "HiddenRunner", "OrtModel", "attn_input_tensors", "read_ort_model"]

GENAI_CONFIG = "genai_config.json"
_NORM_OPS = (
    "SimplifiedLayerNormalization",
    "SkipSimplifiedLayerNormalization",
    "LayerNormalization",
    "SkipLayerNormalization",
    "RMSNormalization",
)
_ONNX_DTYPES = {1: "float32", 10: "float16", 16: "bfloat16", 11: "float64"}
_FORMAT = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64"}
_NUMPY = {
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
}
_PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}


@dataclass
class OrtModel:
    """What ``genai_config.json`` and the graph of ``model.onnx`` (read without its weights) say."""

    dir: Path
    onnx_path: Path
    decoder: dict[str, Any]
    vocab_size: int
    graph: Any = field(repr=False)  # onnx.ModelProto, initializers left external
    providers: tuple[str, ...] = ("cpu",)

    @property
    def num_layers(self) -> int:
        return int(self.decoder["num_hidden_layers"])

    @property
    def activation_dtype(self) -> str:
        """The dtype the graph computes in: that of its ``logits`` output (fixed when it was built)."""
        name = self.decoder.get("outputs", {}).get("logits", "logits")
        out = next((o for o in self.graph.graph.output if o.name == name), None)
        if out is None:
            raise ModelError(f"{self.onnx_path}: the graph has no {name!r} output that genai_config.json names")
        return _ONNX_DTYPES.get(out.type.tensor_type.elem_type, f"onnx-type-{out.type.tensor_type.elem_type}")

    def quantization(self) -> dict[str, int]:
        """``bits``, ``block_size`` and ``accuracy_level`` of the graph's MatMulNBits, or {} when it has none."""
        for node in self.graph.graph.node:
            if node.op_type == "MatMulNBits":
                import onnx

                attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
                return {k: int(attrs[k]) for k in ("bits", "block_size", "accuracy_level") if k in attrs}
        return {}

    def weights_format(self) -> str:
        """``onnx:int8`` / ``onnx:int4`` for MatMulNBits weights, ``onnx:qdq`` for QDQ, else ``onnx:<dtype>``."""
        quant = self.quantization()
        if quant:
            return f"onnx:int{quant.get('bits', '?')}"
        if any(n.op_type == "DequantizeLinear" for n in self.graph.graph.node):
            return "onnx:qdq"
        inits = {i.name: i.data_type for i in self.graph.graph.initializer}
        for node in self.graph.graph.node:
            if node.op_type == "MatMul" and node.name.startswith("/model/layers.") and node.input[1] in inits:
                return f"onnx:{_FORMAT.get(_ONNX_DTYPES.get(inits[node.input[1]], ''), 'unknown')}"
        return f"onnx:{_FORMAT.get(self.activation_dtype, 'unknown')}"


def _read_config(path: Path) -> dict[str, Any]:
    """``genai_config.json``, read as untrusted (non-blocking, size-capped, bounded parse), its counts checked."""
    cfg_path = path / GENAI_CONFIG
    if not path.is_dir() or not os.path.lexists(cfg_path):
        raise UsageError(
            f"{path}: not an ONNX Runtime GenAI model directory (no {GENAI_CONFIG}); build one with "
            "python -m onnxruntime_genai.models.builder -i HF_DIR -o OUT -p fp32 -e cpu"
        )
    try:
        cfg = parse_json(read_regular_file(cfg_path, CONFIG_LIMIT, GENAI_CONFIG), str(cfg_path), GENAI_CONFIG)
        for field, value in (
            ("model.decoder.num_hidden_layers", cfg["model"]["decoder"]["num_hidden_layers"]),
            ("model.vocab_size", cfg["model"]["vocab_size"]),
        ):
            if type(value) is not int or not 0 < value < 2**31:  # validate now, not mid-run
                raise ValueError(f"{field}: a count {show(value)}, expected an integer in [1, 2^31)")
        filename = cfg["model"]["decoder"].get("filename", "model.onnx")
        regular_file_in(
            path,
            check_plain_name(filename, str(cfg_path), "model.decoder.filename"),
            missing="the decoder graph genai_config.json names is not there",
        )
        return cfg
    except DumpError as e:  # the untrusted-file helpers' one-line errors
        raise UsageError(str(e)) from None
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise UsageError(f"{cfg_path}: not a decoder genai config (missing or bad {error_reason(e)})") from None


def read_ort_model(path: str | Path) -> OrtModel:
    """Read ``path``'s genai_config.json and the graph of its decoder model (weights stay on disk)."""
    import onnx

    path = Path(path)
    cfg = _read_config(path)
    decoder = cfg["model"]["decoder"]
    onnx_path = path / str(decoder.get("filename", "model.onnx"))
    try:
        graph = onnx.load(str(onnx_path), load_external_data=False)
    except Exception as e:  # noqa: BLE001 - the load boundary: a missing or corrupt graph is the user's
        raise ModelError(f"{onnx_path}: cannot read the ONNX graph ({error_reason(e)})") from None
    options = decoder.get("session_options", {}).get("provider_options", []) or []
    providers = tuple(k for opt in options if isinstance(opt, dict) for k in opt) or ("cpu",)
    return OrtModel(path, onnx_path, decoder, int(cfg["model"]["vocab_size"]), graph, providers)


def attn_input_tensors(model: OrtModel, layers: Sequence[int]) -> dict[int, tuple[str, int]]:
    """Layer -> (tensor name, ONNX elem type) of the self-attention input: output 0 of its input_layernorm node."""
    inits = {i.name: i.data_type for i in model.graph.graph.initializer}
    found: dict[int, tuple[str, int]] = {}
    for node in model.graph.graph.node:
        if node.op_type not in _NORM_OPS or "/input_layernorm/" not in node.name:
            continue
        head = node.name.split("/input_layernorm/")[0]
        if not head.startswith("/model/layers.") or not head[len("/model/layers.") :].isdigit():
            continue
        layer = int(head[len("/model/layers.") :])
        scale = node.input[2] if node.op_type.startswith("Skip") else node.input[1]  # the gamma: the output's type
        found[layer] = (node.output[0], inits.get(scale, 1))
    missing = [i for i in layers if i not in found]
    if missing:
        raise ModelError(
            f"{model.onnx_path}: no input_layernorm node for layer {missing[0]} (expected "
            f"/model/layers.{missing[0]}/input_layernorm/... as ONNX Runtime GenAI's builder names it); "
            "cannot capture its self-attention input"
        )
    return {i: found[i] for i in layers}


class HiddenRunner:
    """Runs ``model.onnx`` with plain onnxruntime, returning the capture tensors besides logits and KV."""

    def __init__(self, model: OrtModel, layers: Sequence[int]) -> None:
        import onnx
        import onnxruntime as ort

        self.model = model
        self.tensors = attn_input_tensors(model, layers)
        graph = onnx.ModelProto()
        graph.CopyFrom(model.graph)
        have = {o.name for o in graph.graph.output}
        for name, elem in self.tensors.values():
            if name not in have:
                graph.graph.output.append(onnx.helper.make_tensor_value_info(name, elem, None))
        opts = ort.SessionOptions()
        opts.add_session_config_entry(
            "session.model_external_initializers_file_folder_path", str(model.onnx_path.parent)
        )
        providers = [_PROVIDERS[p] for p in model.providers if p in _PROVIDERS]
        unknown = [p for p in model.providers if p not in _PROVIDERS]
        if unknown:
            raise UsageError(
                f"{model.dir}: execution provider {unknown[0]!r} in {GENAI_CONFIG}; hidden-state capture "
                f"runs the graph with plain onnxruntime, for {', '.join(_PROVIDERS)} only"
            )
        try:
            self.session = ort.InferenceSession(graph.SerializeToString(), opts, providers=providers)
        except Exception as e:  # noqa: BLE001 - onnxruntime refusing the user's graph
            raise ModelError(f"{model.onnx_path}: onnxruntime cannot load it ({error_reason(e)})") from None
        self.inputs = {i.name: i for i in self.session.get_inputs()}
        self.output_names = [o.name for o in self.session.get_outputs()]
        self._kv = self._kv_names()

    def _kv_names(self) -> dict[str, str]:
        """Present output name -> the past input it feeds on the next chunk."""
        ins, outs = self.model.decoder.get("inputs", {}), self.model.decoder.get("outputs", {})
        pairs = {}
        for i in range(self.model.num_layers):
            for kind in ("key", "value"):
                past, present = ins.get(f"past_{kind}_names"), outs.get(f"present_{kind}_names")
                if past and present:
                    pairs[present % i] = past % i
        return pairs

    def _empty_past(self, name: str) -> np.ndarray:
        """A zero-length KV input: [batch 1, kv heads, 0 past tokens, head size] from the declared shape."""
        arg = self.inputs[name]
        fill = {
            0: 1,
            1: int(self.model.decoder.get("num_key_value_heads", 0)),
            2: 0,
            3: int(self.model.decoder.get("head_size", 0)),
        }
        shape = [d if isinstance(d, int) and k != 2 else fill.get(k, 0) for k, d in enumerate(arg.shape)]
        return np.zeros(shape, dtype=self._np_type(name))

    def _np_type(self, name: str) -> Any:
        kind = self.inputs[name].type
        if kind not in _NUMPY:
            raise ModelError(f"{self.model.onnx_path}: input {name!r} has type {kind}, which this adapter cannot feed")
        return _NUMPY[kind]

    def _feeds(self, ids: Sequence[int], start: int, past: dict[str, np.ndarray] | None) -> dict[str, np.ndarray]:
        names = self.model.decoder.get("inputs", {})
        past_inputs = set(self._kv.values())
        feeds: dict[str, np.ndarray] = {}
        for name in self.inputs:
            if name == names.get("input_ids", "input_ids"):
                feeds[name] = np.asarray([ids], dtype=self._np_type(name))
            elif name == names.get("attention_mask", "attention_mask"):
                feeds[name] = np.ones((1, start + len(ids)), dtype=self._np_type(name))
            elif name == names.get("position_ids", "position_ids"):
                feeds[name] = np.arange(start, start + len(ids), dtype=self._np_type(name))[None]
            elif name in past_inputs:
                feeds[name] = past[name] if past is not None else self._empty_past(name)
            else:
                raise ModelError(
                    f"{self.model.onnx_path}: graph input {name!r} is not one this adapter feeds "
                    "(input_ids, attention_mask, position_ids, past key/values)"
                )
        return feeds

    def run(
        self, ids: Sequence[int], start: int, past: dict[str, np.ndarray] | None
    ) -> tuple[dict[int, np.ndarray], np.ndarray, dict[str, np.ndarray]]:
        """One pass over ``ids`` at positions ``start..``: (layer -> [n, hidden], logits [n, V], KV for the next)."""
        try:
            values = dict(zip(self.output_names, self.session.run(None, self._feeds(ids, start, past)), strict=True))
        except (ModelError, UsageError):
            raise
        except Exception as e:  # noqa: BLE001 - the forward boundary, as for HF models
            raise ModelError(f"{self.model.onnx_path}: onnxruntime's forward pass failed ({error_reason(e)})") from None
        hidden = {layer: values[name][0] for layer, (name, _) in self.tensors.items()}
        logits_name = self.model.decoder.get("outputs", {}).get("logits", "logits")
        nxt = {past_name: values[present] for present, past_name in self._kv.items()}
        return hidden, values[logits_name][0], nxt
