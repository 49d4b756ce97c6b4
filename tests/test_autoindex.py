"""A set opened by its URL with no manifest: indexed on first use, fields inferred from its members
(pipeline.writers.autoindex, pipeline.writers.infer), read through the DataLoader face
(pipeline.data.handover.dataloader)."""
import functools
import http.server
import json
import os
import subprocess
import sys

import pytest

from helpers import HANG, Quiet, completed, encode_pil, foreign_image, launch_train, serving, write_captioned
from pipeline.writers import autoindex, infer
from pipeline.errors import ShardError
from pipeline.stream import MixedStream, resolve

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def kinds(source):
    return {c.name: (c.kind, c.member) for c in source.schema.columns}


def test_an_img2dataset_set_infers_image_caption_class_and_the_json_numbers(tmp_path, capsys):
    write_captioned(tmp_path / "set", 40)
    src = resolve("web", str(tmp_path / "set"), "train")
    assert kinds(src) == {"image": ("image", "jpg"), "caption": ("text", "txt"), "label": ("class", "cls"),
                          "json_key": ("text", "json:key"), "width": ("int", "json:width"),
                          "height": ("int", "json:height"), "similarity": ("float", "json:similarity")}
    assert src.classes == ["0", "1", "2", "3"] and src.total == 40 and src.target.label == "cls"
    assert autoindex.trainable(src).schema is None  # the trainer reads it as image and class
    err = capsys.readouterr().err
    assert "web-train: indexed on first use: 2 shards, 40 samples in " in err
    assert "web-train: fields: image (image .jpg 3x16x16), caption (text .txt), label (class .cls), " in err
    m = json.loads(open(src.manifest).read())
    assert m["fields"][0]["name"] == "image" and m["origin"]["inferred"] is True  # the schema is in the index
    assert os.path.dirname(os.path.dirname(src.manifest)) == str(tmp_path / "set" / autoindex.INDEX_FOLDER)


def test_the_helpers_img2dataset_set_takes_its_class_from_the_json(tmp_path):
    """tests/helpers.py's img2dataset layout (gzip, no .cls): the class is the .json's "label"."""
    from helpers import write_img2dataset

    write_img2dataset(tmp_path / "i2d", 40, gz=True)
    src = resolve("i2d", str(tmp_path / "i2d"), "train")
    assert kinds(src) == {"image": ("image", "jpg"), "caption": ("text", "txt"), "label": ("class", "json:label"),
                          "json_key": ("text", "json:key"), "width": ("int", "json:width")}
    assert src.target.label == "json:label" and src.classes == ["0", "1", "2", "3"]


def test_a_class_in_the_json_under_another_key_is_the_label_field(tmp_path):
    """{"class": c} in the .json and no .cls (as the new user's img2dataset-style set had it): the
    batch field is `label`, as in every other batch, not `class`."""
    import json

    import webdataset as wds

    os.makedirs(tmp_path / "set")
    with wds.ShardWriter(str(tmp_path / "set" / "s-%06d.tar"), maxcount=20, verbose=0) as sink:
        for i in range(40):
            sink.write({"__key__": f"{i:06d}", "jpg": encode_pil(foreign_image(i % 4, (16, 16), i), "JPEG"),
                        "txt": f"photo {i}".encode(), "json": json.dumps({"class": i % 4, "w": 16}).encode()})
    src = resolve("web", str(tmp_path / "set"), "train")
    assert kinds(src)["label"] == ("class", "json:class") and "class" not in kinds(src)
    assert src.target.label == "json:class" and src.classes == ["0", "1", "2", "3"]


def test_a_thousand_way_free_text_member_is_text_not_a_class(tmp_path):
    """The same set with a free-text .cls (each value its own, 1,000 of them): text, and the set
    has no class (webdataset would have made a 1,000-way head of it)."""
    write_captioned(tmp_path / "set", 1000, per_shard=250, side=8, cls=lambda i: f"item {i} of the shop")
    src = resolve("web", f"{tmp_path}/set/*.tar", "train")
    assert kinds(src)["cls"] == ("text", "cls") and "label" not in kinds(src)
    assert src.classes == [] and src.total == 1000
    assert autoindex.trainable(src).schema is not None  # no class: the trainer refuses it in one line


def test_what_looks_like_a_class():
    assert infer.looks_like_class([str(i % 1000) for i in range(256)])  # integers: ids, whatever their count
    assert infer.looks_like_class(["cat", "dog", "ship"] * 10)
    assert not infer.looks_like_class([f"a photo of a {w} on a sunny afternoon" for w in ("cat", "dog")] * 10)  # long
    assert not infer.looks_like_class([f"item {i}" for i in range(40)])  # mostly distinct


def test_json_keys_are_named_apart_from_reserved_and_added_batch_fields():
    samples = [{"__key__": f"{i:03d}", "jpg": encode_pil(foreign_image(0, (8, 8), i), "JPEG"),
                "json": json.dumps({"image_size": 3, "key": "k", "score": 0.5, "tags": ["a"]}).encode()}
               for i in range(3)]
    schema, label = infer.infer(samples)
    assert [(c.name, c.member) for c in schema.columns] == [
        ("image", "jpg"), ("json_image_size", "json:image_size"), ("json_key", "json:key"), ("score", "json:score")]
    assert label is None  # lists are left to --fields


def test_a_test_split_short_of_a_class_takes_the_training_split_s_classes(tmp_path):
    """As the trainer resolves --eval NAME=SPEC: classes_from its training source."""
    write_captioned(tmp_path / "train", 40)
    write_captioned(tmp_path / "test", 12, cls=lambda i: str(i % 3))  # no sample of class 3
    train = resolve("web", str(tmp_path / "train"), "train")
    test = resolve("web", str(tmp_path / "test"), "test", classes_from=train)
    assert test.classes == train.classes == ["0", "1", "2", "3"] and test.total == 12


def test_fields_override_the_inferred_ones_of_the_same_name(tmp_path):
    write_captioned(tmp_path / "set", 20)
    src = resolve("web", str(tmp_path / "set"), "train", fields="caption:text=txt,max=100 score:float=json:similarity")
    by_name = {c.name: c for c in src.schema.columns}
    assert by_name["caption"].max_bytes == 100 and by_name["score"].kind == "float" and "width" in by_name


def _scalar_npy(x, dtype="float32"):
    import io

    import numpy as np

    buf = io.BytesIO()
    np.save(buf, np.array(x, dtype))
    return buf.getvalue()


def test_scalar_npy_members_open_by_url_and_a_shape_asked_for_is_the_one_a_refusal_names(tmp_path):
    """Each sample's .npy a 0-d array: inferred as an array of shape (1,), which reads them (it
    refused its own inference before); a --fields array of 2x2 over them is refused naming that
    field and its shape, not the inferred field's (1,)."""
    from helpers import write_tar

    os.makedirs(tmp_path / "set")
    write_tar(tmp_path / "set" / "s-000.tar", [(f"{i:03d}.{ext}", data) for i in range(8)
                                               for ext, data in (("npy", _scalar_npy(i)), ("cls", b"%d" % (i % 2)))])
    src = resolve("web", str(tmp_path / "set"), "train")
    assert kinds(src)["npy"] == ("array", "npy")
    stream = MixedStream([src], {"web": 1}, 4, seed=0, normalize=False)
    got = sorted(float(v) for b in stream for v in b["npy"][:, 0])
    assert got == list(range(8))
    with pytest.raises(ShardError, match=r"field emb: \.npy of shape \(\) \(a scalar\), the field takes at most "
                                         r"\(2, 2\)"):
        resolve("web", str(tmp_path / "set"), "train", fields="emb:array=npy,shape=2x2")


def test_an_empty_folder_still_says_no_manifest(tmp_path):
    with pytest.raises(ShardError, match="no manifest"):
        resolve("web", str(tmp_path), "train")


class Logged(Quiet, http.server.SimpleHTTPRequestHandler):
    """Serves a folder and logs each request's method and path on the server."""

    def do_GET(self):
        self.server.log.append(("GET", self.path))
        super().do_GET()

    def do_HEAD(self):
        self.server.log.append(("HEAD", self.path))
        super().do_HEAD()


def test_over_http_the_second_use_reads_no_shard_and_a_changed_shard_is_indexed_again(tmp_path, capsys):
    shards = write_captioned(tmp_path / "set", 60)
    with serving(functools.partial(Logged, directory=str(tmp_path / "set")), log=[]) as server:
        spec = f"{server.url}wds-{{000000..000002}}.tar"
        src = resolve("web", spec, "train", cache_dir=str(tmp_path / "cache"))
        assert src.total == 60 and src.classes == ["0", "1", "2", "3"]
        assert src.manifest.startswith(str(tmp_path / "cache" / "index"))  # not beside http shards
        assert any(m == "GET" and p.endswith(".tar") for m, p in server.log)
        assert "indexed on first use: 3 shards, 60 samples" in capsys.readouterr().err
        server.log.clear()
        again = resolve("web", spec, "train", cache_dir=str(tmp_path / "cache"))
        assert again.manifest == src.manifest and again.total == 60
        assert [p for m, p in server.log if m == "GET"] == ["/web-train.json"]  # the manifest looked for; no shard
        assert "indexed" not in capsys.readouterr().err
        write_captioned(tmp_path / "set", 7, start=1)  # shard 1 rewritten, 7 samples now
        os.utime(shards[1], (1, 1))
        server.log.clear()
        changed = resolve("web", spec, "train", cache_dir=str(tmp_path / "cache"))
        assert changed.total == 47 and changed.manifest != src.manifest
        assert any(m == "GET" and p.endswith(".tar") for m, p in server.log)


def test_a_cache_folder_that_cannot_be_written_is_one_line(tmp_path):
    write_captioned(tmp_path / "set", 20)
    (tmp_path / "file").write_text("not a folder")
    with serving(functools.partial(Logged, directory=str(tmp_path / "set")), log=[]) as server:
        with pytest.raises(ShardError, match=r"web=.*: cannot keep its index in .*/file/index .*--cache-dir"):
            resolve("web", f"{server.url}wds-000000.tar", "train", cache_dir=str(tmp_path / "file"))


def test_an_http_folder_with_no_manifest_asks_for_a_brace_pattern(tmp_path):
    write_captioned(tmp_path / "set", 20)
    with serving(functools.partial(Logged, directory=str(tmp_path)), log=[]) as server:
        with pytest.raises(ShardError, match=r"cannot read manifest .*404.*cannot be listed.*brace pattern"):
            resolve("web", f"{server.url}set/", "train")


def test_a_brace_pattern_naming_a_missing_http_shard_says_missing_404_in_one_line(tmp_path):
    """It said "cannot stamp it for the index (HTTP Error 404: File not found)": "stamp" is this
    code's word, not the user's (newuser3); the manifest's head check says "missing (HTTP 404)"."""
    write_captioned(tmp_path / "set", 20)
    with serving(functools.partial(Logged, directory=str(tmp_path / "set")), log=[]) as server:
        with pytest.raises(ShardError) as e:
            resolve("web", f"{server.url}wds-{{000000..000001}}.tar", "train", cache_dir=str(tmp_path / "cache"))
    said = str(e.value)
    assert "\n" not in said and "wds-000001.tar: missing (HTTP 404)" in said and "stamp" not in said, said


SCRIPT = """
import sys, time
from pipeline.writers import autoindex
from pipeline.stream import resolve
build = autoindex.build
autoindex.build = lambda *a, **kw: time.sleep(4) or build(*a, **kw)  # an index that takes a while
print(resolve("web", sys.argv[1], "train", cache_dir=sys.argv[2]).total)
"""


def test_a_changed_local_shard_is_indexed_again(tmp_path, capsys):
    write_captioned(tmp_path / "set", 40)
    first = resolve("web", str(tmp_path / "set"), "train")
    assert resolve("web", str(tmp_path / "set"), "train").manifest == first.manifest
    assert capsys.readouterr().err.count("indexed on first use") == 1
    write_captioned(tmp_path / "set", 5, start=1)  # shard 1 rewritten, 5 samples now
    changed = resolve("web", str(tmp_path / "set"), "train")
    assert changed.total == 25 and changed.manifest != first.manifest
    assert "indexed on first use: 2 shards, 25 samples" in capsys.readouterr().err


def test_a_reused_index_says_where_it_is_and_how_to_index_again(tmp_path, capsys):
    """A second use read no shard and said nothing: a new user wondered whether their new files were read."""
    write_captioned(tmp_path / "set", 40)
    first = resolve("web", str(tmp_path / "set"), "train")
    assert "indexed on first use" in capsys.readouterr().err
    assert resolve("web", str(tmp_path / "set"), "train").manifest == first.manifest
    assert capsys.readouterr().err == (f"web-train: reused the index made on first use, {first.manifest}: the same 2 "
                                       f"shard files, of the same sizes and times as when it was made; delete that "
                                       f"file to index them again\n")
    resolve("web", str(tmp_path / "set"), "train", progress=False)  # the other ranks of a job
    assert capsys.readouterr().err == ""
    os.remove(first.manifest)  # as the line says
    assert resolve("web", str(tmp_path / "set"), "train").total == 40
    assert "indexed on first use: 2 shards, 40 samples" in capsys.readouterr().err


def test_a_set_indexed_again_leaves_one_index_and_another_set_of_the_same_name_keeps_its_own(tmp_path):
    """A changed set's old index is stale for good: it goes when the new one is made (a new
    user's cache grew a folder a change, F11 of the hostile pass); another set under the same
    name in the same cache folder is not touched."""
    cache = str(tmp_path / "cache")
    write_captioned(tmp_path / "set", 20)
    write_captioned(tmp_path / "other", 10)
    other = resolve("web", str(tmp_path / "other"), "train", cache_dir=cache)
    first = resolve("web", str(tmp_path / "set"), "train", cache_dir=cache)
    for n in (5, 7):  # shard 1 rewritten twice
        write_captioned(tmp_path / "set", n, start=1)
        now = resolve("web", str(tmp_path / "set"), "train", cache_dir=cache)
    index = os.path.join(cache, "index")
    assert sorted(x for x in os.listdir(index) if not x.endswith(".lock")) == sorted(
        os.path.basename(os.path.dirname(f)) for f in (other.manifest, now.manifest))
    assert not os.path.exists(first.manifest) and os.path.exists(other.manifest) and now.total == 27


def test_an_index_of_a_listing_that_changed_while_it_was_made_removes_no_other(tmp_path, monkeypatch):
    """P indexes the set, the shards change while it works, Q indexes the new listing and
    returns; P's index is the stale one, so P must not remove Q's (the re-attack: it did)."""
    write_captioned(tmp_path / "set", 20)
    built, made = autoindex.build, {}

    def slow_p(*args, **kwargs):
        got = built(*args, **kwargs)
        if not made:  # P's index is made: now the set changes and Q indexes it
            made["q"] = True
            write_captioned(tmp_path / "set", 5, start=1)
            made["q"] = resolve("web", str(tmp_path / "set"), "train")
        return got

    monkeypatch.setattr(autoindex, "build", slow_p)
    resolve("web", str(tmp_path / "set"), "train")
    assert os.path.exists(made["q"].manifest) and made["q"].total == 25


def test_processes_started_together_index_once(tmp_path):
    """Ranks of one job open the set at the same moment: the first to take the lock indexes,
    the others wait and read its index."""
    write_captioned(tmp_path / "set", 200, per_shard=25)
    env = dict(os.environ, PYTHONPATH=ROOT)
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT, f"{tmp_path}/set/", str(tmp_path / "cache")], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=HANG) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    assert [o.strip() for o, _ in outs] == ["200"] * 3
    assert sum(e.count("indexed on first use") for _, e in outs) == 1, [e[-500:] for _, e in outs]


def test_a_mid_epoch_state_through_the_dataloader_face_reads_every_sample_once(tmp_path):
    from pipeline.data.handover.dataloader import StatefulLoader
    from pipeline.topology import Topology

    write_captioned(tmp_path / "set", 96, per_shard=12)
    src = autoindex.trainable(resolve("web", str(tmp_path / "set"), "train"))

    def face():
        stream = MixedStream([src], {"web": 1}, batch_size=8, topo=Topology(0, 1), seed=3)
        return StatefulLoader(stream, num_workers=2)

    whole = face()
    everything = [k for b in whole for k in b["key"]]
    whole.close()
    first = face()
    it = iter(first)
    head = [k for _ in range(5) for k in next(it)["key"]]
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint keeps it
    first.close()
    second = face()
    second.load_state_dict(state)
    tail = [k for b in second for k in b["key"]]
    assert len(head) == 40 and sorted(head + tail) == sorted(everything) and len(set(everything)) == len(everything)
    assert second.next_epoch == 1
    nxt = [k for b in second for k in b["key"]]  # the next pass is epoch 1: every sample again, another order
    second.close()
    assert sorted(nxt) == sorted(everything) and nxt != everything


@pytest.mark.slow
@pytest.mark.parametrize("where", ["local", "http"])
def test_a_shardwriter_set_trains_under_torchrun_with_no_index_step_and_no_fields(tmp_path, where):
    """2 gloo ranks, --train and --eval of shards with no manifest (the test split a class short):
    the first run indexes each once, the second reads the indexes it left."""
    write_captioned(tmp_path / "set" / "train", 96, per_shard=12)
    write_captioned(tmp_path / "set" / "test", 12, cls=lambda i: str(i % 3))
    with serving(functools.partial(Logged, directory=str(tmp_path / "set")), log=[]) as server:
        base = f"{tmp_path}/set/" if where == "local" else server.url
        args = ["--train", f"web={base}train/wds-{{000000..000007}}.tar", "--eval", f"web={base}test/wds-000000.tar",
                "--epochs", "1", "--batch-size", "8", "--workers", "1", "--width", "4",
                "--cache-dir", tmp_path / "cache"]
        for run in ("one", "two"):
            p = completed(launch_train([*args, "--out", tmp_path / run]))
            assert p.returncode == 0, p.stderr[-3000:]
            summary = json.loads((tmp_path / run / "summary.json").read_text())
            assert summary["epochs"][0]["batches"] == {"rank0": 6, "rank1": 6}
            assert summary["eval"]["web"]["count"] == 12
            assert p.stderr.count("indexed on first use") == (2 if run == "one" else 0), p.stderr[-3000:]


def test_a_store_prefix_is_indexed_on_first_use_into_the_cache_folder(s3_server, tmp_path, capsys):
    import boto3

    from pipeline.data.store import writing

    shards = write_captioned(tmp_path / "set", 40)
    bucket = f"autoindex-{os.getpid()}"
    boto3.client("s3").create_bucket(Bucket=bucket)
    for path in shards:
        writing.put(path, f"s3://{bucket}/web/{os.path.basename(path)}")
    src = resolve("web", f"s3://{bucket}/web", "train", cache_dir=str(tmp_path / "cache"))
    assert src.total == 40 and src.classes == ["0", "1", "2", "3"] and src.urls[0].startswith(f"s3://{bucket}/web/")
    assert src.manifest.startswith(str(tmp_path / "cache" / "index"))
    assert "web-train: indexed on first use: 2 shards, 40 samples" in capsys.readouterr().err
    assert resolve("web", f"s3://{bucket}/web/", "train", cache_dir=str(tmp_path / "cache")).manifest == src.manifest
    err = capsys.readouterr().err  # (the folder's name holds "indexed": the test's)
    assert "indexed on first use" not in err and err.endswith(
        ": the same 2 shard names as when it was made (a shard rewritten under its name is not noticed); delete that "
        "file to index them again\n"), err


@pytest.mark.slow
def test_bench_index_prints_its_three_runs_and_the_ratio(tmp_path):
    from helpers import run_capture

    r = run_capture([sys.executable, os.path.join(ROOT, "tools", "bench_index.py"), "--shards", "3", "--per-shard",
                     "4", "--workers", "1", "--work-dir", str(tmp_path / "bench")], capture_output=True, text=True,
                    timeout=HANG, env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [json.loads(ln) for ln in r.stdout.splitlines()]
    assert [ln.get("run") for ln in lines[:3]] == ["make_shards_index", "first_use", "cached"]
    assert all(ln["samples"] == 12 and ln["seconds"] >= 0 for ln in lines[:3])
    assert "first_use_over_make_shards" in lines[3]


def test_a_folder_with_neither_shards_nor_a_manifest_says_so(tmp_path):
    """Not 'no manifest ... index existing shards with make-shards --index' (the new user's folder
    held no .tar at all, and the README says no index step is needed)."""
    (tmp_path / "empty").mkdir()
    with pytest.raises(ShardError, match=r"no shards \(\*\.tar, \*\.tar\.gz\) and no manifest \(web-train\.json\)"):
        resolve("web", str(tmp_path / "empty") + "/", "train")
    with pytest.raises(ShardError, match="no such folder"):
        resolve("web", str(tmp_path / "missing") + "/", "train")


def test_free_text_after_the_first_samples_is_text_not_three_hundred_classes(tmp_path, capsys):
    """.cls is 0/1/2 in the first 300 samples (all the inference reads) and 300 distinct texts after:
    the whole index shows free text, so the member is text and the set has no class (it was a
    303-class head, silently)."""
    write_captioned(tmp_path / "set", 600, per_shard=300, side=8,
                    cls=lambda i: str(i % 3) if i < 300 else f"item {i} of the shop")
    src = resolve("web", str(tmp_path / "set"), "train")
    assert kinds(src)["cls"] == ("text", "cls") and "label" not in kinds(src)
    assert src.classes == [] and src.total == 600
    err = capsys.readouterr().err
    assert "web-train: cls looked like a class in the first 256 samples but holds 303 distinct values in 600: " \
           "free text, indexed as text (no class)" in err
    assert "web-train: fields: image (image .jpg 3x8x8), caption (text .txt), cls (text .cls)" in err


def test_a_json_nested_past_the_stack_is_not_a_dict_of_fields():
    deep = ('{"a":' * 100_000 + "1" + "}" * 100_000).encode()
    samples = [{"__key__": f"{i:03d}", "jpg": encode_pil(foreign_image(0, (8, 8), i), "JPEG"),
                "json": deep if i == 1 else json.dumps({"score": 0.5}).encode()} for i in range(3)]
    schema, _ = infer.infer(samples)
    assert [(c.name, c.member, c.optional) for c in schema.columns] == [
        ("image", "jpg", False), ("score", "json:score", True)]


def test_a_set_indexed_on_first_use_mixes_with_our_own_shards_and_another_such_set(tmp_path):
    """The class of an inferred set is a `class` field, as our shards' label is: one head, the
    inferred set's classes offset past mnist's (it was "field 'label' is class ... and int ...")."""
    from helpers import build_shards
    from pipeline.topology import Topology

    build_shards(tmp_path / "shards", "mnist", "train", 20)
    write_captioned(tmp_path / "web", 20)
    write_captioned(tmp_path / "web2", 20)
    sources = [resolve("mnist", str(tmp_path / "shards"), "train"), resolve("web", str(tmp_path / "web"), "train"),
               resolve("web2", str(tmp_path / "web2"), "train")]
    assert kinds(sources[1])["label"] == ("class", "cls")
    stream = MixedStream(sources, {"mnist": 1, "web": 1, "web2": 1}, batch_size=12, topo=Topology(0, 1), seed=0)
    batch = next(iter(stream))
    names = ["mnist", "web", "web2"]
    offsets = {"mnist": 0, "web": 10, "web2": 14}
    for s, label in zip(batch["source"].tolist(), batch["label"].tolist()):
        assert offsets[names[s]] <= label < offsets[names[s]] + len(sources[s].classes)
    assert {names[s] for s in batch["source"].tolist()} == set(names)


def test_a_truncated_cached_index_is_made_again_with_one_line(tmp_path, capsys):
    write_captioned(tmp_path / "set", 20)
    first = resolve("web", str(tmp_path / "set"), "train")
    text = open(first.manifest).read()
    with open(first.manifest, "w") as f:
        f.write(text[: len(text) // 2])  # a write cut short
    capsys.readouterr()
    again = resolve("web", str(tmp_path / "set"), "train")
    assert again.manifest == first.manifest and again.total == 20
    err = capsys.readouterr().err
    assert f"web-train: the cached index {first.manifest} was unreadable; indexing again" in err
    assert "indexed on first use" in err


def test_a_cache_folder_given_wins_over_the_shards_folder(tmp_path, monkeypatch):
    """The user named where indexes go (a shared or read-only folder can pass os.access): there,
    by --cache-dir or $PIPELINE_CACHE, never beside the shards."""
    write_captioned(tmp_path / "set", 20)
    src = resolve("web", str(tmp_path / "set"), "train", cache_dir=str(tmp_path / "cache"))
    assert src.manifest.startswith(str(tmp_path / "cache" / "index"))
    monkeypatch.setenv("PIPELINE_CACHE", str(tmp_path / "env"))
    src = resolve("web", str(tmp_path / "set"), "train")
    assert src.manifest.startswith(str(tmp_path / "env" / "index"))
    assert not (tmp_path / "set" / autoindex.INDEX_FOLDER).exists()


def test_the_fields_line_of_a_five_thousand_key_json_names_twenty(tmp_path):
    doc = json.dumps({f"k{i:04d}": i for i in range(5000)}).encode()
    samples = [{"__key__": f"{i:03d}", "json": doc} for i in range(3)]
    schema, label = infer.infer(samples)
    line = infer.describe(schema, label)
    assert len(schema.columns) == 5000 and line.count("(int json:") == 20
    assert line.endswith(", k0019 (int json:k0019), ... and 4980 more field(s)") and len(line) < 1000


def test_class_ids_that_are_not_the_indices_stay_int(tmp_path):
    """.cls ids 5 and 7: the index's classes are ["5", "7"] (indices 0 and 1), so a class field
    reading 5 would point past its 2 classes: the field stays int (mixing it is refused loudly)."""
    write_captioned(tmp_path / "set", 20, cls=lambda i: str(5 + 2 * (i % 2)))
    src = resolve("web", str(tmp_path / "set"), "train")
    assert src.classes == ["5", "7"] and kinds(src)["label"] == ("int", "cls")


def test_class_names_indexed_on_first_use_are_a_class_field_that_trains(tmp_path, capsys):
    """.cls of three short names: a `class` field (not text), the names sorted as the classes; the
    stream over the inferred schema labels each sample by its name's index, as image and label do."""
    from pipeline.data.handover.loader import make_loader

    names = ["dog", "cat", "emu"]
    write_captioned(tmp_path / "set", 30, per_shard=10, side=8, cls=lambda i: names[i % 3])
    src = resolve("web", str(tmp_path / "set"), "train")
    assert kinds(src)["label"] == ("class", "cls") and src.classes == ["cat", "dog", "emu"]
    assert "label (class .cls)" in capsys.readouterr().err
    for source in (src, autoindex.trainable(src)):
        stream = MixedStream([source], {"web": 1}, 5, seed=0)
        got = {k: y for b in make_loader(stream, 0) for k, y in zip(b["key"], b["label"].tolist())}
        assert got == {f"{i:06d}": sorted(names).index(names[i % 3]) for i in range(30)}


def test_integer_npy_members_infer_an_int64_field_and_other_than_numbers_are_refused_when_indexed(tmp_path):
    """0-d int64 .npy members past 2**24 read exactly (the inferred field was float32: 2**53+1 read
    as 2**53); complex ones are refused when indexed in one line naming the sample (the inferred
    field refused every sample, and the line said to run --verify, which checks sizes only)."""
    from helpers import write_tar

    for name, dtype in (("int", "int64"), ("complex", "complex64")):
        os.makedirs(tmp_path / name)
        write_tar(tmp_path / name / "s-000.tar", [(f"{i:03d}.{ext}", data) for i in range(8) for ext, data in
                                                  (("npy", _scalar_npy(2 ** 53 + i, dtype)), ("cls", b"%d" % (i % 2)))])
    src = resolve("web", str(tmp_path / "int"), "train")
    assert {c.name: c.dtype for c in src.schema.columns}["npy"] == "int64"
    got = sorted(int(v) for b in MixedStream([src], {"web": 1}, 4, seed=0, normalize=False) for v in b["npy"][:, 0])
    assert got == [2 ** 53 + i for i in range(8)]
    with pytest.raises(ShardError, match=r"sample 000: \.npy holds complex64, not numbers, which no field reads"):
        resolve("web", str(tmp_path / "complex"), "train")


def test_an_index_cached_by_older_rules_is_made_again_and_reads_integer_npy_exactly(tmp_path, capsys):
    """A first-use index cached before the int64 rule (its .npy field float32, no `inference` in its
    origin) refused the values past 2**24 until the user deleted it; now it is made again on use."""
    from helpers import write_tar

    os.makedirs(tmp_path / "int")
    write_tar(tmp_path / "int" / "s-000.tar", [(f"{i:03d}.{ext}", data) for i in range(8) for ext, data in
                                               (("npy", _scalar_npy(2 ** 53 + i, "int64")), ("cls", b"%d" % (i % 2)))])
    path = resolve("web", str(tmp_path / "int"), "train").manifest
    old = json.load(open(path))  # as the last stop's code wrote it
    del old["origin"]["inference"]
    old["fields"] = [dict(f, dtype="float32") if f["name"] == "npy" else f for f in old["fields"]]
    with open(path, "w") as f:
        json.dump(old, f)
    capsys.readouterr()
    src = resolve("web", str(tmp_path / "int"), "train")
    said = capsys.readouterr().err
    got = sorted(int(v) for b in MixedStream([src], {"web": 1}, 4, seed=0, normalize=False) for v in b["npy"][:, 0])
    assert got == [2 ** 53 + i for i in range(8)] and {c.name: c.dtype for c in src.schema.columns}["npy"] == "int64"
    assert src.manifest == path and "was made by older rules; indexing again" in said, said


def test_make_shards_index_and_indexing_on_first_use_take_the_same_json_class_over_the_caption(tmp_path):
    """.jpg + .txt caption + .json {"class": ...}: both doors take json:class as the label (one
    rule, pipeline.data.decoding.labelling.default_label), not the captions as classes."""
    import webdataset as wds

    from helpers import make_shards_in_process

    folder = tmp_path / "set"
    folder.mkdir()
    with wds.ShardWriter(str(folder / "wds-%06d.tar"), maxcount=20, verbose=0) as sink:
        for i in range(40):
            sink.write({"__key__": f"{i:06d}", "jpg": encode_pil(foreign_image(i % 4, (16, 16), i), "JPEG"),
                        "txt": f"a small photo of thing number {i % 4}".encode(),
                        "json": json.dumps({"class": i % 4, "width": 16}).encode()})
    first = resolve("web", str(folder), "train")
    done = make_shards_in_process(["--index", f"web:train={folder}", "--out", str(tmp_path / "out"), "--quiet"])
    assert done.returncode == 0, done.stderr
    assert "free text" not in done.stdout + done.stderr
    m = json.loads((tmp_path / "out" / "web-train.json").read_text())
    assert first.target.label == m["label"] == "json:class"
    assert first.classes == m["classes"] == ["0", "1", "2", "3"]
    assert autoindex.trainable(first).schema is None and "fields" not in m  # both read as image and label


def test_a_json_with_label_and_class_keys_gives_its_label_key_in_both_rules():
    """CLASS_KEYS' order (label, class, cls), not the keys' alphabetical order, in infer and default_label."""
    from pipeline.data.decoding.labelling import default_label

    samples = [{"__key__": f"{i:03d}", "json": json.dumps({"class": i % 3, "label": i % 2}).encode()}
               for i in range(20)]
    assert infer.infer(samples)[1] == default_label(samples[0]) == "json:label"


@pytest.mark.parametrize("sizes", [20, 1])
def test_images_of_many_sizes_indexed_on_first_use_are_warned_as_make_shards_warns(tmp_path, capsys, sizes):
    """The first use resized 20 sizes to the most common one without a word, where make-shards --index
    warns (newuser4): the same warning, naming how to choose the size; one size says nothing."""
    from helpers import write_many_sizes

    write_many_sizes(tmp_path / "w", sizes)
    resolve("w", str(tmp_path / "w"), "train")
    said = [ln for ln in capsys.readouterr().err.splitlines() if "warning: images of" in ln]
    assert said == (["w-train: warning: images of 20 sizes, and the most common (3x8x9) only 2 of 40: every image is "
                     "resized to it; index them ahead with make-shards --index ... --shape C,H,W to choose it, or read "
                     "the images at their own sizes with --fields (docs/data.md, Fields)"] if sizes == 20 else [])
    resolve("w", str(tmp_path / "w"), "train")  # the index reused: its images are resized all the same
    err = capsys.readouterr().err
    assert "reused the index made on first use" in err
    assert [ln for ln in err.splitlines() if "warning: images of" in ln] == said
