"""Op-by-op capture of one half of a decoder layer: every dispatched op, judged against its float64 reference.

- :mod:`~dumper.hooks.drill.record`: :class:`~dumper.hooks.drill.record.OpRecorder`, the dispatch mode;
- :mod:`~dumper.hooks.drill.reference`: each op's float64 reference (aten ops rerun; engines' custom ops
  registered by name, :func:`~dumper.hooks.drill.reference.register_reference`);
- :mod:`~dumper.hooks.drill.rounding`: the rounding an op of a dtype and size predicts, per token row;
- :mod:`~dumper.hooks.drill.repro`: the standalone repro of one op (``repro.py`` + ``inputs.safetensors``).
"""

from dumper.hooks.drill.record import DEFAULT_FACTOR, OpRecorder, ReproCase
from dumper.hooks.drill.reference import register_reference

__all__ = ["OpRecorder", "ReproCase", "DEFAULT_FACTOR", "register_reference"]
