"""Dumps at fsspec URLs, on fsspec's in-memory filesystem (the real S3 API server: ``test_remote_s3.py``).

A dump uploaded to a URL reads back as the same dump; a prefix without its manifest (a writer
killed before it), a manifest entry that leaves the prefix and a file whose size is not the one
the manifest gives are refused in one line, as their local twins are; nothing under the prefix
that the manifest does not list is read.
"""

from __future__ import annotations

import json
import shutil
import uuid

import fsspec
import pytest

from comparator import compare_dumps
from dumper.errors import CorruptDumpError, DumpError, IncompleteDumpError
from dumper.format import MANIFEST_NAME, load_manifest
from dumper.format.remote import fetched, is_url, upload_dump, writing
from tests.conftest import run_cli


@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    root = tmp_path_factory.mktemp("remote")
    r = run_cli("dumper", "run", "--out", root / "a", "--layers", "all", "--quiet")
    assert r.returncode == 0, r.stderr
    return root / "a"


@pytest.fixture
def url():
    name = f"memory://driftscope-test-{uuid.uuid4().hex}/dumps/a"
    yield name
    fsspec.filesystem("memory").rm(name.split("://")[1].split("/")[0], recursive=True)


def test_only_other_filesystems_are_urls():
    assert is_url("s3://b/p") and is_url("gcs://b") and is_url("memory://x")
    assert not is_url("/tmp/x") and not is_url("dumps/a") and not is_url("file:///tmp/x")


def test_an_uploaded_dump_reads_back_as_the_same_dump(dump, url):
    upload_dump(dump, url)
    with fetched(url) as local:
        assert load_manifest(local) == load_manifest(dump)
        report = compare_dumps(dump, local)
    assert report.passed and report.matched == len(load_manifest(dump).tensors) and report.matched > 0
    assert not local.exists()  # the local copy is gone with the block


def test_a_prefix_without_its_manifest_is_never_a_complete_dump(dump, url):
    fs = fsspec.filesystem("memory")
    for name in load_manifest(dump).files:  # a writer killed after its data, before its manifest
        fs.pipe_file(f"{url}/{name}", (dump / name).read_bytes())
    with pytest.raises(IncompleteDumpError, match="not a complete dump"):
        with fetched(url):
            pass


@pytest.mark.parametrize(
    "lie,words",
    [
        ("outside", "plain"),
        ("longer", "longer than the"),
        ("shorter", "but the manifest says"),
        ("missing", "listed in the manifest but missing"),
    ],
)
def test_a_hostile_remote_manifest_is_refused_in_one_line(dump, url, lie, words):
    fs = fsspec.filesystem("memory")
    raw = json.loads((dump / MANIFEST_NAME).read_text())
    name = sorted(raw["files"])[0]
    data = (dump / name).read_bytes()
    for other in raw["files"]:
        fs.pipe_file(f"{url}/{other}", (dump / other).read_bytes())
    if lie == "outside":
        raw["files"] = {f"../x/{name}": raw["files"].pop(name), **raw["files"]}
        fs.pipe_file(url.rsplit("/", 1)[0] + f"/x/{name}", data)
    elif lie == "longer":
        fs.pipe_file(f"{url}/{name}", data + b"\0" * 64)
    elif lie == "shorter":
        fs.pipe_file(f"{url}/{name}", data[:-64])
    else:
        fs.rm_file(f"{url}/{name}")
    fs.pipe_file(f"{url}/{MANIFEST_NAME}", json.dumps(raw).encode())
    with pytest.raises(CorruptDumpError, match=words) as e:
        with fetched(url):
            pass
    assert "\n" not in str(e.value)


def test_writing_to_a_url_uploads_the_manifest_last_and_never_over_a_dump(dump, url):
    with writing(url) as out:
        shutil.copytree(dump, out)
    assert fsspec.filesystem("memory").exists(f"{url}/{MANIFEST_NAME}")
    with pytest.raises(DumpError, match="already holds a complete dump"):
        with writing(url):
            pass
    other = url + "-failed"
    with pytest.raises(RuntimeError), writing(other) as out:
        shutil.copytree(dump, out)
        raise RuntimeError("the run failed")
    assert not fsspec.filesystem("memory").exists(other)  # nothing uploaded for a run that failed
