"""make_shards.py writing to and indexing in an object store (issue 39, item 3), against the
real S3-compatible server of tests/conftest.py (moto's server mode on 127.0.0.1): shards
built into s3:// read as their local twin, a failed upload leaves the old set whole, and
--index of a prefix names its shards relative to a manifest in the store, or by URL in a
local one."""
import json
import os

import pytest

from helpers import make_shards_in_process, write_shardwriter
from pipeline.data import remote, storage
from pipeline.data.manifest import resolve
from pipeline.data.stream import MixedStream

BUILD = ["--synthetic", "--datasets", "mnist", "--splits", "train", "--limit", "300", "--maxcount", "50",
         "--workers", "1", "--quiet"]


def make_shards(*args):
    p = make_shards_in_process(args)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    return p


def keys(src, name="mnist"):
    return [k for b in MixedStream([src], {name: 1}, 10, seed=5) for k in b["key"]]


def read_json(url):
    return json.loads(remote.fetch(url))


def test_shards_written_to_s3_read_as_the_same_build_written_locally(s3_bucket, tmp_path):
    make_shards(*BUILD, "--out", tmp_path / "local")
    p = make_shards(*BUILD, "--out", f"s3://{s3_bucket}/p")
    assert f"s3://{s3_bucket}/p/" in p.stdout
    names = storage.keys(f"s3://{s3_bucket}/p")
    assert names == sorted(["mnist-train.json"] + [f"mnist-train-{i:06d}.tar" for i in range(6)])
    assert read_json(f"s3://{s3_bucket}/p/mnist-train.json") == json.loads((tmp_path / "local/mnist-train.json")
                                                                            .read_text())
    remote_src = resolve("mnist", f"s3://{s3_bucket}/p/", "train")
    assert all(remote.kind(u) == "store" for u in remote_src.urls)
    local = keys(resolve("mnist", str(tmp_path / "local"), "train"))
    assert len(local) == 300 and keys(remote_src) == local
    verify = make_shards_in_process(["--verify", "--out", f"s3://{s3_bucket}/p"])
    assert verify.returncode == 0 and "OK" in verify.stdout, verify.stdout + verify.stderr


def test_a_rebuild_whose_upload_fails_leaves_the_old_set_readable(s3_bucket, monkeypatch):
    out = f"s3://{s3_bucket}/p"
    make_shards(*BUILD, "--out", out)
    before = {n: remote.fetch(storage.join(out, n)) for n in storage.keys(out)}
    old_keys = keys(resolve("mnist", out + "/", "train"))
    real_put, calls = storage.Writer.put, []

    def failing_put(self, local, name):
        calls.append(name)
        if len(calls) == 3:
            raise OSError("the network went away (injected)")
        return real_put(self, local, name)

    monkeypatch.setattr(storage.Writer, "put", failing_put)
    p = make_shards_in_process([*BUILD, "--seed", "1", "--out", out])  # other bytes in every shard
    assert p.returncode == 2 and "injected" in p.stderr, p.stdout + p.stderr
    assert len(calls) == 3 and all(".tmp-" in c for c in calls)
    assert {n: remote.fetch(storage.join(out, n)) for n in storage.keys(out)} == before  # no *.tmp*, no lock
    assert keys(resolve("mnist", out + "/", "train")) == old_keys

    monkeypatch.setattr(storage.Writer, "put", real_put)  # the same rebuild, uninterrupted, replaces the set
    p = make_shards(*BUILD, "--seed", "1", "--out", out)
    assert "replaced mnist-train.json" in p.stdout and "6 of its shards rewritten" in p.stdout
    assert not any(".tmp" in n or n.startswith(".") for n in storage.keys(out))
    new = keys(resolve("mnist", out + "/", "train"))
    assert len(new) == 300 and sorted(new) != sorted(old_keys)


def test_a_store_object_of_a_needed_name_that_no_manifest_names_is_refused(s3_bucket, tmp_path):
    out = f"s3://{s3_bucket}/p"
    storage.write_bytes(b"somebody else's", storage.join(out, "mnist-train-000002.tar"))
    p = make_shards_in_process([*BUILD, "--out", out])
    assert p.returncode == 2 and "refusing to overwrite" in p.stderr and len(p.stderr.splitlines()) == 1
    assert storage.keys(out) == ["mnist-train-000002.tar"]  # nothing else written, the marker gone
    p = make_shards_in_process([*BUILD, "--part", "0/2", "--out", out])
    assert p.returncode == 2 and "--part and --merge need a local --out" in p.stderr


@pytest.fixture
def foreign_in_s3(s3_bucket, tmp_path):
    folder = tmp_path / "wds"
    write_shardwriter(folder, 60, per_shard=20)
    for name in sorted(os.listdir(folder)):
        storage.put(str(folder / name), f"s3://{s3_bucket}/p/{name}")
    return folder, f"s3://{s3_bucket}/p"


def test_indexing_a_prefix_into_the_store_names_the_shards_beside_the_manifest(foreign_in_s3):
    folder, out = foreign_in_s3
    make_shards("--index", f"pets:train={out}/", "--out", out, "--workers", "1", "--quiet")
    m = read_json(f"{out}/pets-train.json")
    assert [s["name"] for s in m["shards"]] == ["wds-000000.tar", "wds-000001.tar", "wds-000002.tar"]
    src = resolve("pets", out + "/", "train")
    assert src.urls == [f"{out}/wds-00000{i}.tar" for i in range(3)]
    assert sorted(keys(src, "pets")) == sorted(f"train/c{i % 4}/{i:06d}" for i in range(60))


def test_indexing_a_prefix_into_a_local_folder_names_the_shards_by_url(foreign_in_s3, tmp_path):
    _, prefix = foreign_in_s3
    make_shards("--index", f"pets:train={prefix}/", "--out", tmp_path / "local", "--workers", "1", "--quiet")
    m = json.loads((tmp_path / "local/pets-train.json").read_text())
    assert [s["name"] for s in m["shards"]] == [f"{prefix}/wds-00000{i}.tar" for i in range(3)]
    src = resolve("pets", str(tmp_path / "local"), "train")
    assert sorted(keys(src, "pets")) == sorted(f"train/c{i % 4}/{i:06d}" for i in range(60))
