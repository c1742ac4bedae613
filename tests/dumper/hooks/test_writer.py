"""The background ShardWriter on real tensors and real files: what it writes, how it splits, how it fails.

Every shard is read back with the safetensors library itself (and with the dump reader where a
manifest is the point), so a writer and a reader that agreed on a private mistake would still fail.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import dumper
from dumper.errors import DriftscopeError, DumpError, IncompleteDumpError
from dumper.format import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    DumpReader,
    Manifest,
    TensorRecord,
    data_file_name,
    file_mode,
    load_manifest,
    to_float64,
    write_manifest,
)
from dumper.hooks.writer import ShardWriter, snapshot
from tests.conftest import subprocess_env


def _on_disk(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def test_shards_hold_exactly_what_was_put_split_by_size_and_pass(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    passes = [  # 4 KiB each: with shard_bytes 6 KiB a shard closes at its second tensor
        {
            "a": torch.randn(32, 32, generator=g),
            "b": torch.randint(0, 1000, (16, 32), generator=g),
            "c": torch.randn(64, 32, generator=g).half(),
        },
        {"d": torch.randn(16, 64, generator=g), "e": torch.rand(4096, generator=g) > 0.5},
    ]
    shard_bytes = 6 << 10
    w = ShardWriter(tmp_path, rank=3, shard_bytes=shard_bytes)
    for p, tensors in enumerate(passes):
        for key, t in tensors.items():
            w.put(p, key, t)
        w.end_pass()
    w.close()

    # the grouping the contract gives: in put order, a shard closes once it reaches shard_bytes, a pass never
    # shares a shard with another
    expected: dict[str, list[str]] = {}
    for p, tensors in enumerate(passes):
        shard, size = 0, 0
        for key, t in tensors.items():
            expected.setdefault(data_file_name(3, p, shard), []).append(key)
            size += _nbytes(t)
            if size >= shard_bytes:
                shard, size = shard + 1, 0
    assert expected == {
        "r3-p000000-000.safetensors": ["a", "b"],
        "r3-p000000-001.safetensors": ["c"],
        "r3-p000001-000.safetensors": ["d", "e"],
    }
    assert _on_disk(tmp_path) == sorted(expected)  # no temp file left behind
    assert w.files == {name: (tmp_path / name).stat().st_size for name in expected}
    for name, keys in expected.items():
        loaded = load_file(tmp_path / name)
        assert sorted(loaded) == sorted(keys)
        p = int(name.split("-p")[1][:6])
        for key in keys:
            assert w.locations[(p, key)] == name
            assert loaded[key].dtype == passes[p][key].dtype and torch.equal(loaded[key], passes[p][key])
        assert (tmp_path / name).stat().st_mode & 0o777 == file_mode()  # the umask's, not safetensors' 0600


def test_a_put_is_a_snapshot_and_back_pressure_never_deadlocks_or_loses_a_tensor(tmp_path: Path) -> None:
    """A queue of two tensors and shards of 1 MiB: the producer waits on bytes the writer holds in an
    unfinished shard, so the writer must write that shard early instead of waiting for more."""
    x = torch.arange(1024, dtype=torch.float32)  # 4 KiB
    w = ShardWriter(tmp_path, rank=0, shard_bytes=1 << 20, max_queued_bytes=8 << 10)

    def produce() -> None:
        for i in range(40):
            w.put(0, f"t{i}", x)
            x.add_(1)  # the model's next in-place op must not reach what was put
        w.close()

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    producer.join(timeout=120)
    assert not producer.is_alive(), "the producer is stuck waiting on the writer"
    loaded: dict[str, torch.Tensor] = {}
    for name in _on_disk(tmp_path):
        assert name.startswith("r0-p000000-")  # one pass, however many shards
        loaded.update(load_file(tmp_path / name))
    assert sorted(loaded) == sorted(f"t{i}" for i in range(40)) and len(w.files) > 1
    for i in range(40):
        assert torch.equal(loaded[f"t{i}"], torch.arange(1024, dtype=torch.float32) + i)


def test_an_owned_tensor_is_taken_as_it_is_and_any_other_is_copied(tmp_path: Path) -> None:
    """Copy once: the kept rows of a pass (a fresh tensor only the capture holds) go to the writer as they are;
    a view of a live buffer (the tap's sink, a user's tensor) is copied, so that the next pass cannot reach it."""
    fresh, live = torch.arange(12.0).reshape(3, 4), torch.arange(24.0).reshape(6, 4)
    assert snapshot(fresh, owned=True)[0].data_ptr() == fresh.data_ptr()  # the same memory, no copy
    for t, owned in ((live[:3], False), (live[::2], True), (live.t(), True)):  # a view; two not contiguous
        copy = snapshot(t, owned=owned)[0]
        assert copy.data_ptr() != t.data_ptr() and copy.is_contiguous() and torch.equal(copy, t)
    w = ShardWriter(tmp_path, rank=0)
    w.put(0, "kept", fresh, owned=True)
    w.put(0, "sink", live[:3])
    live.zero_()  # the sink's next pass
    w.close()
    got = load_file(tmp_path / data_file_name(0, 0, 0))
    assert torch.equal(got["kept"], torch.arange(12.0).reshape(3, 4))
    assert torch.equal(got["sink"], torch.arange(12.0).reshape(3, 4))


def test_bf16_is_stored_as_its_raw_bits_and_reads_back_exactly(tmp_path: Path) -> None:
    bits = np.array(
        [0x0000, 0x8000, 0x3F80, 0xBF80, 0x7F80, 0xFF80, 0x7FC1, 0xFFA5, 0x0001, 0x7F7F, 0x4049, 0xC2F7],
        dtype=np.uint16,
    )  # +-0, +-1, +-inf, two NaN payloads, subnormal, max, ...
    t = torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16).reshape(3, 4)
    w = ShardWriter(tmp_path, rank=0)
    w.put(0, "x", t)
    w.close()
    name = data_file_name(0, 0, 0)
    with safe_open(tmp_path / name, framework="pt") as f:
        back = f.get_tensor("x")
    assert back.dtype == torch.bfloat16 and torch.equal(back.view(torch.int16), t.view(torch.int16))

    rec = TensorRecord(name="x", file=name, key="x", shape=(3, 4), dtype="BF16", forward_pass=0)
    write_manifest(
        tmp_path,
        Manifest(
            format_version=FORMAT_VERSION,
            created_at=dt.datetime.now(dt.timezone.utc).isoformat(),
            model={},
            capture_signature={},
            environment={},
            files=dict(w.files),
            tensors=(rec,),
        ),
    )
    reader = DumpReader(tmp_path)
    raw = reader.array(load_manifest(tmp_path).tensors[0])
    assert raw.dtype == np.uint16 and np.array_equal(raw.reshape(-1), bits)  # the bits, NaN payloads included
    with np.errstate(invalid="ignore"):  # 0xFFA5 is a signalling NaN: widening it raises the invalid flag
        wide = to_float64(raw, "BF16")
    finite = np.isfinite(wide)
    assert np.array_equal(wide[finite], t.double().numpy()[finite])
    assert np.array_equal(np.isnan(wide), torch.isnan(t).numpy())


_FULL_DISK = textwrap.dedent("""
    import json, resource, signal, sys, torch
    from pathlib import Path
    from dumper.hooks.writer import ShardWriter

    out = Path(sys.argv[1])
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG, as on a full disk
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    w = ShardWriter(out, rank=0)
    w.put(0, "small", torch.ones(64))              # 256 bytes: pass 0 fits
    w.end_pass()
    w.put(1, "big", torch.ones(1 << 16))           # 256 KiB: pass 1 fails half written
    errors = []
    try:
        w.close()
    except BaseException as e:
        errors.append([[c.__name__ for c in type(e).__mro__], str(e)])
    try:
        w.put(2, "after", torch.ones(4))
    except BaseException as e:
        errors.append([[c.__name__ for c in type(e).__mro__], str(e)])
    print(json.dumps({"errors": errors, "files": w.files}))
""")


@pytest.mark.skipif(sys.platform == "win32", reason="RLIMIT_FSIZE is POSIX")
def test_a_write_that_fails_half_way_leaves_no_file_that_looks_whole(tmp_path: Path) -> None:
    out = tmp_path / "d"
    out.mkdir()
    r = subprocess.run(
        [sys.executable, "-c", _FULL_DISK, str(out)], capture_output=True, text=True, timeout=300, env=subprocess_env()
    )
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert len(got["errors"]) == 2  # close() raised, and so does any later put()
    for mro, message in got["errors"]:
        assert "DumpError" in mro and "DriftscopeError" in mro and "Traceback" not in message
        assert message.startswith(f"{out}: writing the dump failed") and "too large" in message
    small = data_file_name(0, 0, 0)
    assert got["files"] == {small: (out / small).stat().st_size}
    assert _on_disk(out) == [small]  # no half-written shard under its name, no temp file
    assert torch.equal(load_file(out / small)["small"], torch.ones(64))


def test_an_interrupted_capture_writes_no_manifest(tmp_path: Path) -> None:
    out = tmp_path / "d"
    blocked = data_file_name(0, 1, 0)
    with pytest.raises(DumpError) as info:
        with dumper.capture(None, out):
            dumper.dump("x", torch.ones(2, 8), layer=0)
            dumper.step()
            (out / blocked).mkdir()  # pass 1's shard cannot be renamed into place
            dumper.dump("x", torch.zeros(2, 8), layer=0)
    assert isinstance(info.value, DriftscopeError) and f"{out / blocked}: exists and is not a regular file" in str(
        info.value
    )
    assert not (out / MANIFEST_NAME).exists() and not [n for n in _on_disk(out) if n.startswith(".")]
    with pytest.raises(IncompleteDumpError, match="incomplete dump"):
        load_manifest(out)
    assert torch.equal(load_file(out / data_file_name(0, 0, 0))["x"], torch.ones(2, 8))  # pass 0 is whole


def test_the_manifest_is_written_after_every_shard(tmp_path: Path) -> None:
    out = tmp_path / "d"
    with dumper.capture(None, out, shard_bytes=1 << 10):
        for _ in range(3):
            for layer in range(3):
                dumper.dump(f"model.layers.{layer}.self_attn.input", torch.randn(4, 64), layer=layer)
            dumper.step()
    m = load_manifest(out)
    assert len(m.files) > 3 and set(m.files) == set(_on_disk(out)) - {MANIFEST_NAME}
    last_shard = max((out / n).stat().st_mtime_ns for n in m.files)
    assert (out / MANIFEST_NAME).stat().st_mtime_ns >= last_shard
