"""The dtype table: every dtype a dump stores, under each name it goes by (no torch).

A tensor's dtype crosses four vocabularies: the safetensors code in the manifest (``BF16``),
the numpy dtype its raw bytes are read as (bfloat16 as its ``uint16`` bits), torch's name
(``bfloat16``), and whether the comparator's float kernels take it. This module is the one
place they are written down; every other module looks them up here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = [
    "DType",
    "DTYPES",
    "STORAGE_DTYPES",
    "ITEMSIZES",
    "FLOAT_CODES",
    "INT_CODES",
    "MODEL_DTYPES",
    "FLOAT_NAMES",
    "MANTISSA_BITS",
    "unit_roundoff",
    "torch_codes",
    "torch_dtype",
]


@dataclass(frozen=True)
class DType:
    """One dtype a dump can store."""

    code: str
    """The safetensors code written in the manifest (``F32``, ``BF16``, ``I64``...)."""
    storage: np.dtype
    """Little-endian numpy dtype of the raw bytes (bfloat16: its ``uint16`` bit pattern)."""
    torch_name: str
    """The attribute of ``torch`` with this dtype (``float32``, ``bfloat16``...)."""
    mantissa_bits: int = 0
    """Significand bits of a float dtype, the implicit one included (0 for the others): which of
    two dtypes is the coarser."""

    @property
    def is_float(self) -> bool:
        """A floating-point dtype: the comparator's row kernels read it natively."""
        return self.torch_name.startswith(("float", "bfloat"))


DTYPES: Final[dict[str, DType]] = {
    d.code: d
    for d in (
        DType("F64", np.dtype("<f8"), "float64", 53),
        DType("F32", np.dtype("<f4"), "float32", 24),
        DType("F16", np.dtype("<f2"), "float16", 11),
        DType("BF16", np.dtype("<u2"), "bfloat16", 8),
        DType("I64", np.dtype("<i8"), "int64"),
        DType("I32", np.dtype("<i4"), "int32"),
        DType("I16", np.dtype("<i2"), "int16"),
        DType("I8", np.dtype("i1"), "int8"),
        DType("U8", np.dtype("u1"), "uint8"),
        DType("BOOL", np.dtype("?"), "bool"),
    )
}
"""Every dtype a dump can store, by safetensors code."""

STORAGE_DTYPES: Final[dict[str, np.dtype]] = {code: d.storage for code, d in DTYPES.items()}
"""safetensors code -> numpy storage dtype (bfloat16 is stored as its raw uint16 bits)."""

ITEMSIZES: Final[dict[str, int]] = {code: d.storage.itemsize for code, d in DTYPES.items()}
"""safetensors code -> bytes per element (what the validator checks sizes and offsets with)."""

FLOAT_CODES: Final = frozenset(code for code, d in DTYPES.items() if d.is_float)
"""Codes of the floating-point dtypes (``F64``, ``F32``, ``F16``, ``BF16``)."""

INT_CODES: Final = frozenset(code for code, d in DTYPES.items() if not d.is_float and code != "BOOL")
"""Codes of the integer dtypes (token ids are stored as one of these)."""

FLOAT_NAMES: Final = tuple(d.torch_name for d in DTYPES.values() if d.is_float)
"""torch names of the floating-point dtypes, widest first (``float64`` ... ``bfloat16``)."""

MANTISSA_BITS: Final[dict[str, int]] = {d.torch_name: d.mantissa_bits for d in DTYPES.values() if d.is_float}
"""torch name of a float dtype -> its significand bits (``bfloat16``: 8, ``float32``: 24)."""

_FLOAT8_MANTISSA: Final = {"float8_e4m3": 4, "float8_e5m2": 3}


def unit_roundoff(dtype: str) -> float:
    """Half a unit in the last place of 1.0 in ``dtype`` (torch's name: ``bfloat16`` 2^-8, ``float32`` 2^-24):
    the relative error of one rounding; 0 for integers and bool (exact); float32's for another float."""
    if dtype in MANTISSA_BITS:
        return 2.0 ** -MANTISSA_BITS[dtype]
    bits = next((b for prefix, b in _FLOAT8_MANTISSA.items() if dtype.startswith(prefix)), None)
    if bits is not None:
        return 2.0**-bits
    return 2.0 ** -MANTISSA_BITS["float32"] if dtype.startswith(("float", "bfloat")) else 0.0


MODEL_DTYPES: Final = ("float32", "bfloat16", "float16")
"""The dtypes a model may be run in (``--dtype`` of ``python -m dumper``)."""


def torch_codes() -> dict[torch.dtype, str]:
    """torch dtype -> safetensors code, for every dtype a dump can store (imports torch)."""
    import torch

    return {getattr(torch, d.torch_name): code for code, d in DTYPES.items()}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a :data:`MODEL_DTYPES` name (imports torch); KeyError for another name."""
    import torch

    if name not in MODEL_DTYPES:
        raise KeyError(name)
    return getattr(torch, name)
