"""pipeline.manifest: resolving a command line's SPEC into a Source, checking manifests, and
the rule for where a listed shard may be (hostile names: tests/test_security.py)."""
import os
import re

import pytest

from helpers import HANG, build_shards, run_capture, shard_keys
from pipeline.data.manifests import manifest
from pipeline.data.manifests import locations
from pipeline.data.manifests import patterns
from pipeline.errors import ShardError
from pipeline.data.streams.stream import MixedStream, resolve


def test_resolve_manifest_folder_and_pattern(data):
    m = data.manifests["mnist", "train"]
    names = [s["name"] for s in m["shards"]]
    by_manifest = resolve("mnist", os.path.join(data.dir, "mnist-train.json"), "train")
    by_folder = resolve("mnist", data.dir, "train")
    by_slash = resolve("mnist", data.dir + "/", "train")
    for s in (by_manifest, by_folder, by_slash):
        assert [os.path.basename(u) for u in s.urls] == names
        assert s.total == 230 == m["total"]
        assert s.shape == (1, 28, 28) and s.target.image_exts == ("raw",) and len(s.classes) == 10
    sub = resolve("mnist", os.path.join(data.dir, "mnist-train-{000002..000004}.tar"), "train")
    assert [os.path.basename(u) for u in sub.urls] == names[2:5]
    assert sub.counts == [20, 20, 20]
    expected = [k for u in sub.urls for k in shard_keys(u)]
    layout_stream = MixedStream([sub], {"mnist": 1}, 7)
    got = [k for b in layout_stream.eval_stream(sub) for k in b["key"]]
    assert sorted(got) == sorted(expected) and len(got) == 60


def test_resolve_errors(data, tmp_path):
    with pytest.raises(ShardError, match="no manifest"):
        resolve("mnist", str(tmp_path), "train")
    with pytest.raises(ShardError, match="index them in place with: make-shards --index"):
        resolve("mnist", str(tmp_path / "whatever.tar"), "train")
    with pytest.raises(ShardError) as e:  # a pattern's hint writes the manifest where resolve looks for it
        resolve("mnist", str(tmp_path / "x-{0..3}.tar"), "train")
    assert str(e.value).endswith(f"--index 'mnist:train={tmp_path}/x-{{0..3}}.tar' --out {tmp_path}")
    with pytest.raises(ShardError, match="not in"):
        resolve("mnist", os.path.join(data.dir, "mnist-train-{000011..000012}.tar"), "train")
    # a manifest whose shard is gone
    build_shards(tmp_path, "mnist", "train", 30, maxcount=10)
    os.remove(tmp_path / "mnist-train-000001.tar")
    with pytest.raises(ShardError, match="missing"):
        resolve("mnist", str(tmp_path), "train")




def test_locate_plain_names_next_to_the_manifest_wherever_it_is(tmp_path):
    local = str(tmp_path / "m.json")
    assert manifest.locate(local, "a-000001.tar") == str(tmp_path / "a-000001.tar")
    assert manifest.locate(local, "sub/a.tar") == str(tmp_path / "sub" / "a.tar")
    assert manifest.locate("http://h:8/p/m.json", "a b.tar".replace(" ", "_")) == "http://h:8/p/a_b.tar"
    assert manifest.locate("http://h/p/m.json?sig=1", "x.tar") == "http://h/p/x.tar?sig=1"
    assert manifest.locate("pipe:curl -s http://h/p/m.json", "x.tar") == "pipe:curl -s http://h/p/x.tar"
    assert manifest.locate(local, "https://other/x.tar") == "https://other/x.tar"
    assert manifest.locate(local, "/data/x.tar") == "/data/x.tar"


def test_check_accepts_what_make_shards_writes_and_version_1(tmp_path):
    m, _ = build_shards(tmp_path, "toy", "train", 10, maxcount=5)
    assert manifest.check(dict(m), "x")["format"] == manifest.FORMAT
    old = {k: v for k, v in m.items() if k not in ("image_exts", "label", "origin")}
    old["format"] = "pipeline-shards/1"
    target = manifest.target_of(manifest.check(old, "x"))
    assert target.image_exts == ("raw",) and target.label == "cls"


def test_a_pipe_manifest_of_tar_gz_shards_resolves(tmp_path):
    """One rule for a shard's name inside a pipe: command: the indexer names "00000.tar.gz"
    and the reader looks for the manifest beside it (not at "web-train.json.gz")."""
    from helpers import write_img2dataset
    from pipeline.writers.index import index

    folder = tmp_path / "web"
    write_img2dataset(folder, 30, per_shard=15, gz=True)
    index("web", "train", f"pipe:cat {folder}/{{00000..00001}}.tar.gz", str(folder), label="json:label",
          progress=False)
    assert locations.pipe_shard_name(f"pipe:cat {folder}/00000.tar.gz") == "00000.tar.gz"
    src = resolve("web", f"pipe:cat {folder}/00000.tar.gz", "train")
    assert src.manifest == f"pipe:cat {folder}/web-train.json"
    assert src.urls == [f"pipe:cat {folder}/00000.tar.gz"] and src.counts == [15]
    got = [k for b in MixedStream([src], {"web": 1}, 5).eval_stream(src) for k in b["key"]]
    assert len(got) == 15


def test_test_classes_that_differ_from_training_point_at_classes_from(tmp_path):
    import json

    build_shards(tmp_path, "toy", "train", 10, maxcount=5)
    m, _ = build_shards(tmp_path, "toy", "test", 10, maxcount=5)
    m["classes"] = [f"c{i}" for i in range(len(m["classes"]))]
    (tmp_path / "toy-test.json").write_text(json.dumps(m))
    train, test = resolve("toy", str(tmp_path), "train"), resolve("toy", str(tmp_path), "test")
    with pytest.raises(ShardError, match=r"would not match the model's head: index the test shards with the training "
                                         r"split's classes \(make-shards --index toy:test=SHARDS "
                                         rf"--classes-from {tmp_path}/toy-train.json --out DIR\)"):
        MixedStream([train], {"toy": 1}, 5).eval_stream(test)


def test_a_folder_of_tars_without_a_manifest_gets_the_index_command(tmp_path):
    import shlex
    import sys

    from helpers import write_img2dataset

    folder = tmp_path / "my web"
    write_img2dataset(folder, 10, per_shard=5)
    with pytest.raises(ShardError) as e:  # the strict resolver's word (the stream's indexes them on first use)
        manifest.resolve("web", str(folder) + "/", "train")
    said = str(e.value)
    assert "no manifest" in said and "2 shard(s) (00000.tar, ...)" in said
    command = said.split("index them in place with: ")[1]
    assert command == f"make-shards --index 'web:train={folder}' --out '{folder}'"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the clone: tests/ is in its root
    argv = shlex.split(command)
    p = run_capture([sys.executable, "tools/make_shards.py", *argv[1:], "--label-key", "json:label"],
                    cwd=root, capture_output=True, text=True, timeout=HANG)
    assert p.returncode == 0, p.stderr
    assert resolve("web", str(folder), "train").total == 10  # the command did what it said
    with pytest.raises(ShardError, match=r"no manifest .+/web-test.json; the folder holds 1 other\(s\): "
                                         r"web-train.json\Z"):  # indexed already: not the index command again
        resolve("web", str(folder), "test")
    with pytest.raises(ShardError, match=r"web=\S+/gone: no such folder\Z"):
        resolve("web", str(tmp_path / "gone"), "train")
    with pytest.raises(ShardError, match="no such folder"):
        resolve("web", str(tmp_path / "gone") + "/", "train")
    # newuser5 5: a mistyped manifest file name in a folder that is there is a missing manifest, not a folder
    with pytest.raises(ShardError, match=r"no manifest at .+/web-train\.jsn \(build one with make-shards.*; did you "
                                         r"mean .+/web-train\.json\?\Z"):
        resolve("web", str(folder / "web-train.jsn"), "train")
    with pytest.raises(ShardError, match=r"web=\S+/gone/web-train\.jsn: no such folder\Z"):
        resolve("web", str(tmp_path / "gone" / "web-train.jsn"), "train")


@pytest.mark.parametrize("command, name", [("pipe:cat /d/x.tar.gz", "x.tar.gz"), ('pipe:cat "/d/x.tar"', "x.tar"),
                                           ("pipe:aws s3 cp s3://b/s/x-000.tar -", "x-000.tar"),
                                           ("pipe:cat /d/x.tar|gunzip", "x.tar")])
def test_the_shard_name_in_a_pipe_command_ends_where_the_shell_word_ends(command, name):
    from pipeline.data.manifests.locations import pipe_shard_name
    assert pipe_shard_name(command) == name


@pytest.mark.parametrize("command, needle", [("pipe:cat /d/x.tar.gzip", "no shard file name"),
                                             ("pipe:cat /d/x.tar.bak", "no shard file name"),
                                             ("pipe:cat /d/$(echo x).tar", "no shard file name"),
                                             ("pipe:cat /d/x.tar > /tmp/copy.tar", "more than one shard file name")])
def test_a_pipe_command_without_one_plain_shard_name_is_refused(command, needle):
    from pipeline.data.manifests.locations import pipe_shard_name
    with pytest.raises(ShardError, match=needle):
        pipe_shard_name(command)


# ---------------------------------------------------------------- a manifest one folder up, and globs


@pytest.fixture()
def wds(tmp_path):
    """The new user's layout: shards in WDS/train/, indexed with `--index cifar10:train=WDS/train/ --out WDS`,
    so that WDS/cifar10-train.json names train/*.tar."""
    from pipeline.writers.index import index

    build_shards(tmp_path / "WDS" / "train", "mnist", "train", 40, maxcount=10, encoding="png")
    os.remove(tmp_path / "WDS" / "train" / "mnist-train.json")  # somebody else's shards: no manifest of ours
    index("cifar10", "train", str(tmp_path / "WDS" / "train"), str(tmp_path / "WDS"), progress=False)
    return tmp_path / "WDS"


@pytest.mark.parametrize("spec", ["train/", "train", "train/mnist-train-{000000..000003}.tar", "train/*.tar",
                                  "train/mnist-train-00000?.tar"])
def test_shards_find_the_manifest_one_folder_up_that_lists_them(wds, spec):
    """Before: an --index command to run again, though WDS/cifar10-train.json lists exactly these shards."""
    src = resolve("cifar10", f"{wds}/{spec}", "train")
    assert src.manifest == f"{wds}/cifar10-train.json"
    assert [os.path.basename(u) for u in src.urls] == [f"mnist-train-{i:06d}.tar" for i in range(4)]
    assert src.total == 40 and src.split == "train"
    assert src.listing == resolve("cifar10", f"{wds}/", "train").listing  # the same data: a resume accepts it


def test_a_pattern_of_some_shards_takes_those_from_the_manifest_above(wds):
    src = resolve("cifar10", f"{wds}/train/mnist-train-00000[12].tar", "train")
    assert [os.path.basename(u) for u in src.urls] == ["mnist-train-000001.tar", "mnist-train-000002.tar"]


def test_a_manifest_above_that_does_not_list_every_shard_is_not_taken(wds):
    """A shard added after indexing: the manifest is stale, and the index command is the answer."""
    import shutil

    shutil.copy(wds / "train" / "mnist-train-000000.tar", wds / "train" / "extra.tar")
    with pytest.raises(ShardError, match=r"no manifest \S+/train/cifar10-train.json, but 5 shard\(s\).*--index"):
        manifest.resolve("cifar10", f"{wds}/train/", "train")  # the stream's resolve indexes them on first use
    src = resolve("cifar10", f"{wds}/train/mnist-*.tar", "train")  # these four it lists
    assert src.manifest == f"{wds}/cifar10-train.json" and len(src.urls) == 4
    with pytest.raises(ShardError, match="no manifest"):  # another split's manifest is never taken
        manifest.resolve("cifar10", f"{wds}/train/mnist-*.tar", "test")


def test_globs_expand_in_name_order_and_say_what_is_wrong(tmp_path):
    from pipeline.data.store import find_manifest

    for name in ("b-1.tar", "a-2.tar.gz", "a-1.tar", ".hidden.tar", "a-3.json", "c.tgz"):
        (tmp_path / name).write_bytes(b"x")
    assert patterns.expand_shards(f"{tmp_path}/*") == [f"{tmp_path}/{n}" for n in ("a-1.tar", "a-2.tar.gz", "b-1.tar",
                                                                                      "c.tgz")]
    assert patterns.expand_shards(f"{tmp_path}/{{b,a}}-?.tar") == [f"{tmp_path}/b-1.tar", f"{tmp_path}/a-1.tar"]
    assert find_manifest.globbed(f"{tmp_path}/.h*") == [f"{tmp_path}/.hidden.tar"]
    for spec, said in ((f"{tmp_path}/*.zip", "no shards (*.tar, *.tar.gz, *.tgz) match"),
                       (f"{tmp_path}/*/x.tar", "a wildcard in a folder's name"),
                       (f"{tmp_path}/gone/*.tar", "cannot list")):
        with pytest.raises(ShardError, match=re.escape(said)):
            patterns.expand_shards(spec)
    assert patterns.expand_shards("http://h/x.tar?sig=1") == ["http://h/x.tar?sig=1"]  # a query, not a glob
