"""The on-disk dump format: the one package the dumper writes with and the comparator reads with (no torch).

A dump is a directory::

    dump/
      manifest.json                  # written last, atomically: its presence means "complete"
      r0-p000000-000.safetensors     # rank 0, forward pass 0, shard 0
      r0-p000001-000.safetensors
      ...

Tensors live in safetensors files (no pickle). Each data file is written under a temporary
name, fsynced and renamed before the manifest that lists it is written, so a crash never
leaves a manifest pointing at missing bytes. The manifest indexes every tensor with its
canonical name, file, shape, dtype, layer index, forward-pass index, rank, and the absolute
token position and sequence id of each row. Row metadata is run-length encoded
(``[[start, count], ...]``) and decoded only in :mod:`dumper.format.manifest`.

A dump is untrusted input when it is read: :func:`load_manifest` and :class:`DumpReader` run
every manifest, safetensors header and file they name through :mod:`dumper.format.validate` and
:mod:`dumper.format.files` first, so a broken or hostile dump is a one-line
:class:`~dumper.errors.CorruptDumpError`. Files are created with the user's umask
(``0o666 & ~umask``), so a dump is as readable as any file the user writes.

The modules, one concern each:

* :mod:`~dumper.format.manifest`: schema constants, :class:`TensorRecord`, :class:`Manifest`,
  the run-length row metadata, :func:`load_manifest` / :func:`write_manifest`;
* :mod:`~dumper.format.reader`: :class:`DumpReader`, :func:`open_tensor`, :func:`to_float64`;
* :mod:`~dumper.format.dtypes`: the one dtype table (:data:`STORAGE_DTYPES` and the rest);
* :mod:`~dumper.format.validate`: checks on manifests and safetensors headers;
* :mod:`~dumper.format.files`: generic checks on untrusted files (bounded JSON, plain names, containment);
* :mod:`~dumper.format.atomic`: atomic, durable writes (:func:`atomic_path`, :func:`write_json_atomic`);
* :mod:`~dumper.format.describe`: the human summary of a dump (``python -m dumper ls``, ``store show``);
* :mod:`~dumper.format.remote`: dumps at fsspec URLs: written manifest last, copied down only as far
  as the manifest vouches; :mod:`~dumper.format.remote_read`: a dump at a URL read in place, by ranges.

Example::

    from dumper.format import load_manifest, open_tensor
    m = load_manifest("dumps/a")
    for rec in m.tensors:
        arr = open_tensor("dumps/a", rec)   # memory-mapped, raw storage dtype
"""

from __future__ import annotations

from dumper.format.atomic import atomic_path, dir_mode, file_mode, fsync_dir, write_json_atomic
from dumper.format.dtypes import STORAGE_DTYPES
from dumper.format.manifest import (
    FORMAT_VERSION,
    LOGITS,
    LOGITS_POINT,
    LOGPROB_NAMES,
    LOGPROB_POINT,
    LOGPROB_TOKEN_ID,
    LOGPROB_TOP_ID,
    LOGPROB_TOP_VALUE,
    LOGPROB_VALUE,
    MANIFEST_NAME,
    PAD_SEQUENCE,
    ROUTER_CHOICE_POINT,
    ROUTER_IDS,
    ROUTER_LOGITS,
    ROUTER_POINT,
    ROUTER_POINTS,
    ROUTER_SCORES,
    ROUTER_WEIGHTS,
    Manifest,
    TensorRecord,
    data_file_name,
    decode_positions,
    decode_runs,
    encode_positions,
    encode_runs,
    load_manifest,
    router_name,
    write_manifest,
)
from dumper.format.reader import DumpReader, open_tensor, to_float64

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "TensorRecord",
    "Manifest",
    "encode_runs",
    "decode_runs",
    "encode_positions",
    "decode_positions",
    "data_file_name",
    "atomic_path",
    "write_json_atomic",
    "fsync_dir",
    "file_mode",
    "dir_mode",
    "load_manifest",
    "write_manifest",
    "open_tensor",
    "STORAGE_DTYPES",
    "PAD_SEQUENCE",
    "LOGPROB_POINT",
    "LOGITS_POINT",
    "LOGPROB_TOKEN_ID",
    "LOGPROB_VALUE",
    "LOGPROB_TOP_ID",
    "LOGPROB_TOP_VALUE",
    "LOGITS",
    "LOGPROB_NAMES",
    "ROUTER_POINT",
    "ROUTER_POINTS",
    "ROUTER_CHOICE_POINT",
    "ROUTER_LOGITS",
    "ROUTER_IDS",
    "ROUTER_WEIGHTS",
    "ROUTER_SCORES",
    "router_name",
    "to_float64",
    "DumpReader",
]
