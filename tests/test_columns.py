"""One batch model (pipeline.data.fields.batch.Layout) for every schema: pipeline/ defines one layout
class; a two-source mix gives the same keys, labels (the second source's classes offset) and
images through the default schema (image and class) and an explicit --fields one, at 0 and 2
workers and on 2 ranks; an img2dataset-shaped set (jpg, txt caption, json class) trains with
the trainer on 2 ranks and resumes exactly, its captions riding along in the API; free-text
labels indexed as classes are named, with --fields."""
import ast
import json
import os
import sys

import numpy as np
import pytest
from PIL import Image

from helpers import (HANG, build_shards, encode_pil, finish, free_port, launch_train, make_shards_in_process,
                     run_capture, train_sources, write_foreign)
from pipeline.data.manifests.manifest import resolve
from pipeline.data.streams.stream import MixedStream
from pipeline.data.handover.loader import make_loader
from pipeline.errors import InputError
from pipeline.train.metrics import read_keys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = {"mnist": (1, 12, 12), "cifar10": (3, 16, 16)}
COUNTS = {"mnist": 40, "cifar10": 30}
HALF = {"mnist": 0.5, "cifar10": 0.5}


def test_pipeline_defines_one_layout_class():
    """No second batch model beside batch.Layout: a class named *Layout, or one with a collate
    method, anywhere in pipeline/."""
    found = []
    for top, _, files in os.walk(os.path.join(ROOT, "pipeline")):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(top, f)
                for node in ast.walk(ast.parse(open(path).read())):
                    if isinstance(node, ast.ClassDef) and (node.name.endswith("Layout") or any(
                            isinstance(d, ast.FunctionDef) and d.name == "collate" for d in node.body)):
                        found.append((os.path.relpath(path, ROOT), node.name))
    assert found == [(os.path.join("pipeline", "data", "fields", "batch.py"), "Layout")]


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """(folder of image-and-label manifests, folder of --fields manifests of the same shards,
    {name: the synthetic source}): MNIST-like grey 12x12 and CIFAR10-like RGB 16x16 PNGs."""
    top = tmp_path_factory.mktemp("two")
    plain, fields = top / "plain", top / "fields"
    truth = {}
    for name, shape in SHAPES.items():
        truth[name] = build_shards(plain, name, "train", COUNTS[name], shape=shape, encoding="png", maxcount=10)[1]
        c, h, w = shape
        done = make_shards_in_process([
            "--index", f"{name}:train={plain}/{name}-train-*.tar", "--out", str(fields), "--quiet",
            "--fields", f"image:image=png,fit=resize,size={h}x{w},channels={c} label:class=cls"])
        assert done.returncode == 0, done.stderr
    return str(plain), str(fields), truth


def batches(folder, workers, normalize=False):
    stream = MixedStream(train_sources(folder), HALF, 8, seed=5, normalize=normalize)
    return [{k: (v.numpy() if hasattr(v, "numpy") else v) for k, v in b.items() if k != "state"}
            for b in make_loader(stream, workers)]


@pytest.mark.parametrize("workers", [0, 2])
def test_the_default_schema_and_an_explicit_one_give_the_same_batches(two, workers):
    plain, fields, truth = two
    assert [len(s.classes) for s in train_sources(fields)] == [10, 10]  # the class field's classes, from the index
    a, b = batches(plain, workers), batches(fields, workers)
    assert len(a) == len(b) == 70 // 8
    seen = 0
    for x, y in zip(a, b):
        assert sorted(x) == sorted(y) == ["image", "key", "label", "skipped", "source"]
        assert x["key"] == y["key"] and np.array_equal(x["source"], y["source"])
        assert np.array_equal(x["label"], y["label"]) and np.array_equal(x["image"], y["image"])
        assert x["image"].shape == (8, 3, 16, 16) and x["image"].dtype == np.uint8
        for r, key in enumerate(x["key"]):
            name = ["mnist", "cifar10"][x["source"][r]]
            i = int(key.rsplit("-", 1)[1])
            assert x["label"][r] == truth[name].label(i) + (10 if name == "cifar10" else 0)  # 10-19 after 0-9
            if name == "mnist":  # grey, repeated to 3 channels, centred on the 16x16 canvas
                assert np.array_equal(x["image"][r, :, 2:14, 2:14], np.repeat(truth[name].image(i), 3, 0))
                seen += 1
    assert seen > 0


def test_normalised_batches_differ_only_by_each_manifests_statistics(two):
    """normalize=True normalises `image` whatever the schema; the other fields stay as they are."""
    plain, fields, _ = two
    for folder in (plain, fields):
        floats, u8 = batches(folder, 0, normalize=True), batches(folder, 0)
        stream = MixedStream(train_sources(folder), HALF, 8, seed=5)
        for f, u in zip(floats, u8):
            assert f["image"].dtype == np.float32 and np.array_equal(f["label"], u["label"])
            assert np.array_equal(f["image"], stream.layout.normalize(u["image"], u["source"]).numpy())


RANKS = r'''
import json, os, sys
import torch.distributed as dist
from pipeline.data.streams.stream import MixedStream, resolve
from pipeline.data.handover.loader import make_loader
from pipeline.ordering.topology import Topology

dist.init_process_group("gloo")
topo = Topology.from_env()
out = {}
for folder in sys.argv[1:3]:
    stream = MixedStream([resolve(n, folder, "train") for n in ("mnist", "cifar10")], {"mnist": 1, "cifar10": 1}, 5,
                         topo, seed=2, normalize=False)
    got = out.setdefault(folder, {"keys": [], "labels": [], "images": []})
    for b in make_loader(stream, num_workers=2):
        got["keys"] += b["key"]
        got["labels"] += b["label"].tolist()
        got["images"] += b["image"].sum(dim=(1, 2, 3)).tolist()
with open(os.path.join(sys.argv[3], f"rank{topo.rank}.json"), "w") as f:
    json.dump(out, f)
dist.destroy_process_group()
'''


@pytest.mark.slow
def test_on_two_ranks_the_default_and_explicit_schemas_give_the_same_batches(two, tmp_path):
    plain, fields, _ = two
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    proc = run_capture([sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
                        "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(script), plain, fields,
                        str(tmp_path)], env=env, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in ranks:
        assert r[plain] == r[fields] and len(r[plain]["keys"]) == 70 // 10 * 5
        assert any(v >= 10 for v in r[plain]["labels"]) and any(v < 10 for v in r[plain]["labels"])
    assert ranks[0][plain]["keys"] != ranks[1][plain]["keys"]  # each rank its own share


def i2d_sample(i):
    """What img2dataset writes: an image, its caption and a json (here with a class)."""
    img = np.random.default_rng(i).integers(0, 256, (20 + i % 3 * 6, 28, 3), dtype=np.uint8)
    caption = f"a photo of thing {i}"
    return {"__key__": f"{i:09d}", "jpg": encode_pil(Image.fromarray(img), "JPEG"), "txt": caption.encode(),
            "json": json.dumps({"caption": caption, "class": i % 3, "status": "success", "width": 28}).encode()}


@pytest.fixture(scope="module")
def i2d(tmp_path_factory):
    import webdataset as wds

    out = tmp_path_factory.mktemp("i2d")
    with wds.ShardWriter(str(out / "%05d.tar"), maxcount=16, verbose=0) as sink:
        for i in range(96):
            sink.write(i2d_sample(i))
    done = make_shards_in_process(["--index", f"web:train={out}", "--out", str(out), "--quiet", "--fields",
                                   "image:image=jpg,size=16x16 caption:text=txt label:class=json:class"])
    assert done.returncode == 0, done.stderr
    return str(out)


def test_an_img2dataset_set_has_classes_and_its_captions_ride_along(i2d):
    stream = MixedStream([resolve("web", i2d, "train")], {"web": 1}, 8, seed=0, normalize=False)
    assert stream.layout.num_classes == 3 and stream.layout.hw == (16, 16)
    keys = []
    for b in make_loader(stream, 0):
        for r, key in enumerate(b["key"]):
            assert b["caption"][r] == f"a photo of thing {int(key)}" and b["label"][r] == int(key) % 3
        keys += b["key"]
    assert len(keys) == len(set(keys)) == 96


def test_the_trainer_names_what_a_schema_lacks(i2d):
    from pipeline.data.fields.schema import parse_fields

    src = resolve("web", i2d, "train")
    stream = MixedStream([src], {"web": 1}, 8, schemas=parse_fields("image:image=jpg,size=16x16 caption:text=txt"))
    with pytest.raises(InputError, match="no class field `label`"):
        stream.layout.num_classes
    schema = parse_fields("picture:image=jpg,size=8x8 label:class=json:class")
    stream = MixedStream([src], {"web": 1}, 8, schemas=schema)
    with pytest.raises(InputError, match="no image field `image`"):
        stream.layout.hw


def keys_and_losses(out):
    keys = {r: read_keys(os.path.join(out, f"keys-rank{r}.txt")) for r in range(2)}
    lines = [json.loads(ln) for ln in open(os.path.join(out, "metrics.jsonl"))]
    losses = [ln["loss"] for ln in lines if ln["kind"] == "train"]
    return keys, losses


@pytest.mark.slow
def test_an_img2dataset_set_trains_on_two_ranks_and_resumes_exactly(i2d, tmp_path):
    args = ["--train", f"web={i2d}/", "--epochs", "2", "--batch-size", "4", "--workers", "2", "--width", "4",
            "--log-every", "2", "--record-keys"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    code, err = finish(launch_train([*args, "--out", whole], 2), HANG)
    assert code == 0, err[-3000:]
    code, err = finish(launch_train([*args, "--out", cut, "--checkpoint-every", "5", "--stop-after-steps", "5"], 2),
                       HANG)
    assert code == 0, err[-3000:]
    code, err = finish(launch_train([*args, "--out", cut, "--resume"], 2), HANG)
    assert code == 0, err[-3000:]
    keys, losses = keys_and_losses(whole)
    assert keys_and_losses(cut) == (keys, losses) and len(losses) == 2 * 96 // 8 // 2
    assert all(len(k) == 2 * 96 // 2 for k in keys.values())


def captions_as_labels(tmp_path, n, caption):
    from helpers import write_foreign

    def sample(i):
        img = np.full((8, 8, 3), i % 250, np.uint8)
        return f"s{i:04d}", [(f"s{i:04d}.png", encode_pil(Image.fromarray(img), "PNG")),
                             (f"s{i:04d}.txt", caption(i).encode())]

    write_foreign(tmp_path / "shards", n, 20, "part-{:03d}.tar", sample)
    return make_shards_in_process(["--index", f"caps:train={tmp_path / 'shards'}", "--label-key", "txt", "--out",
                                   str(tmp_path / "out"), "--quiet"])


@pytest.mark.parametrize("n, caption, warned", [
    (60, lambda i: f"caption number {i} of a set", True),  # most labels distinct
    (60, lambda i: f"a photo of a small thing of kind {i % 10}", True),  # one caption a class: long
    (60, lambda i: ["cat", "dog", "golden_retriever"][i % 3], False),  # class names
])
def test_labels_that_look_like_free_text_are_named_with_fields(tmp_path, n, caption, warned):
    done = captions_as_labels(tmp_path, n, caption)
    assert done.returncode == 0, done.stderr
    said = "look like free text, not classes" in done.stdout and "--fields" in done.stdout
    assert said == warned, done.stdout


# ---------------------------------------------------------------- a class field's labels are the default schema's

def _labelled_set(folder, labels, extra=lambda i: {}):
    """A foreign set of 16x16 JPEGs, sample i labelled labels[i] in .cls, with .json extra(i)."""
    def sample(i):
        img = Image.fromarray(np.full((16, 16, 3), 9 * i % 256, np.uint8))
        members = [("jpg", encode_pil(img, "JPEG")), ("cls", str(labels[i]).encode()),
                   ("json", json.dumps(extra(i)).encode())]
        return f"{i:06d}", [(f"{i:06d}.{ext}", data) for ext, data in members]
    write_foreign(folder, len(labels), 6, "s-{:04d}.tar", sample)


def _labels(stream, workers):
    """{key: (source name, batch label)} of an epoch, and the samples the batches say were skipped."""
    out, skipped = {}, 0
    for b in make_loader(stream, workers):
        for key, label, src in zip(b["key"], b["label"].tolist(), b["source"].tolist()):
            out[key] = (stream.layout.names[src], label)
        skipped += int(b["skipped"])
    return out, skipped


@pytest.mark.parametrize("workers", [0, 2])
def test_a_class_field_maps_labels_as_the_default_schema_does(tmp_path, workers):
    """Labels 0, 5 and 1000000000 (the manifest's label_values) are classes 0, 1, 2 whether the
    default schema or `label:class=cls` reads them; the raw values never reach the batch."""
    from pipeline.data.fields.schema import parse_fields

    raw = [0, 5, 10**9] * 4
    _labelled_set(tmp_path / "big", raw)
    done = make_shards_in_process(["--index", f"big:train={tmp_path}/big/s-*.tar", "--out", str(tmp_path / "m"),
                                   "--quiet"])
    assert done.returncode == 0, done.stderr
    src = resolve("big", str(tmp_path / "m"), "train")
    field = parse_fields("image:image=jpg,size=16x16 label:class=cls")
    by_default, _ = _labels(MixedStream([src], {"big": 1}, 4, seed=0, schemas={"big": None}), workers)
    stream = MixedStream([src], {"big": 1}, 4, seed=0, schemas={"big": field})
    by_field, skipped = _labels(stream, workers)
    assert stream.layout.num_classes == 3 and skipped == 0
    assert by_field == by_default == {f"{i:06d}": ("big", [0, 5, 10**9].index(raw[i])) for i in range(12)}


NAMES = ["dog", "cat", "emu"]  # written in this order; the manifest sorts them: cat 0, dog 1, emu 2


@pytest.mark.parametrize("workers", [0, 2])
def test_class_names_in_a_class_field_map_through_the_manifests_classes(tmp_path, workers):
    """Names in .cls: `make-shards --index` lists them sorted, and `label:class=cls` (named in
    --fields, or not) gives each sample its name's index, as the default schema's label does."""
    from pipeline.data.fields.schema import parse_fields

    raw = [NAMES[i % 3] for i in range(12)]
    _labelled_set(tmp_path / "pets", raw)
    fields = "image:image=jpg,size=16x16 label:class=cls"
    for out, extra in ((tmp_path / "m", []), (tmp_path / "f", ["--fields", fields])):
        done = make_shards_in_process(["--index", f"pets:train={tmp_path}/pets/s-*.tar", "--out", str(out), "--quiet",
                                       *extra])
        assert done.returncode == 0, done.stderr
        m = json.loads((out / "pets-train.json").read_text())
        assert m["classes"] == ["cat", "dog", "emu"] and m["label_names"] is True
    want = {f"{i:06d}": ("pets", sorted(NAMES).index(raw[i])) for i in range(12)}
    by_default, _ = _labels(MixedStream([resolve("pets", str(tmp_path / "m"), "train")], {"pets": 1}, 4, seed=0,
                                        schemas={"pets": None}), workers)
    for src, schema in ((resolve("pets", str(tmp_path / "m"), "train"), parse_fields(fields)),
                        (resolve("pets", str(tmp_path / "f"), "train"), None)):
        stream = MixedStream([src], {"pets": 1}, 4, seed=0, schemas={"pets": schema} if schema else None)
        assert [c.kind for c in stream.layout.columns if c.name == "label"] == ["class"]
        by_field, skipped = _labels(stream, workers)
        assert stream.layout.num_classes == 3 and skipped == 0 and by_field == by_default == want


def test_an_unknown_class_name_is_refused_and_counted_like_an_id_past_the_classes(tmp_path):
    """A class field read from json:kind whose value is a name the manifest does not list (or an
    id where it lists names): each such sample skipped and counted, the rest labelled by name."""
    from pipeline.data.fields.schema import parse_fields

    raw = [NAMES[i % 3] for i in range(24)]
    kind = lambda i: "yak" if i % 5 == 0 else 7 if i % 7 == 0 else raw[i]  # noqa: E731
    _labelled_set(tmp_path / "web", raw, lambda i: {"kind": kind(i)})
    done = make_shards_in_process(["--index", f"web:train={tmp_path}/web/s-*.tar", "--out", str(tmp_path / "m"),
                                   "--quiet"])
    assert done.returncode == 0, done.stderr
    stream = MixedStream([resolve("web", str(tmp_path / "m"), "train")], {"web": 1}, 4, seed=0,
                         schemas={"web": parse_fields("image:image=jpg,size=16x16 label:class=json:kind")})
    with pytest.warns(UserWarning, match="skipped sample 000005: field label: class name 'yak' is not one of the "
                                         "source's 3 classes"):
        got, skipped = _labels(stream, 0)
    bad = [i for i in range(24) if i % 5 == 0 or i % 7 == 0]
    assert skipped >= len(bad) == 8  # an epoch of 24 from 16 good samples reads some bad ones twice
    assert got == {f"{i:06d}": ("web", sorted(NAMES).index(raw[i])) for i in range(24) if i not in bad}


def test_a_class_value_past_the_sources_classes_is_refused_not_read_as_the_next_sources(tmp_path):
    """A 4-class source whose class field reads 16 for some samples, mixed before a 10-class one:
    those samples are skipped and counted, never labelled as the next source's class 12."""
    from pipeline.data.fields.schema import parse_fields

    labels = [i % 4 for i in range(24)]
    height = lambda i: 16 if i % 5 == 0 else labels[i]  # noqa: E731
    _labelled_set(tmp_path / "web", labels, lambda i: {"height": height(i)})
    build_shards(tmp_path / "m", "mnist", "train", 20, shape=(1, 12, 12), encoding="png", maxcount=10)
    done = make_shards_in_process(["--index", f"web:train={tmp_path}/web/s-*.tar", "--out", str(tmp_path / "m"),
                                   "--quiet"])
    assert done.returncode == 0, done.stderr
    srcs = [resolve("web", str(tmp_path / "m"), "train"), resolve("mnist", str(tmp_path / "m"), "train")]
    schema = parse_fields("image:image=jpg,size=16x16 label:class=json:height")
    stream = MixedStream(srcs, {"web": .5, "mnist": .5}, 8, seed=0, schemas={"web": schema})
    with pytest.warns(UserWarning, match="skipped sample 000005: field label: label 16 outside 0..3"):
        got, skipped = _labels(stream, 0)
    web = {k: label for k, (name, label) in got.items() if name == "web"}
    assert stream.layout.num_classes == 14 and skipped == 5
    assert web == {f"{i:06d}": labels[i] for i in range(24) if i % 5}
    assert all(4 <= label < 14 for name, label in got.values() if name == "mnist")


# ---------------------------------------------------------------- one reading of a class value on every path

def _classes_everywhere(tmp_path, raw, name="x"):
    """The manifest classes and {key: class name} of a set labelled `raw`, indexed by
    `make-shards --index`, by `--index --fields` and on first use (the three paths)."""
    from pipeline.stream import resolve as first_use

    fields = "image:image=jpg,size=16x16 label:class=cls"
    _labelled_set(tmp_path / "set", raw)
    got = {}
    for way, extra in (("index", []), ("fields", ["--fields", fields])):
        done = make_shards_in_process(["--index", f"{name}:train={tmp_path}/set/s-*.tar", "--out",
                                       str(tmp_path / way), "--quiet", *extra])
        assert done.returncode == 0, done.stderr
        got[way] = resolve(name, str(tmp_path / way), "train")
    got["first use"] = first_use(name, str(tmp_path / "set"), "train", fields=fields, cache_dir=str(tmp_path / "c"))
    out = {}
    for way, src in got.items():
        labels, skipped = _labels(MixedStream([src], {name: 1}, 4, seed=0, epoch_samples=len(raw)), 0)
        assert skipped == 0, way
        out[way] = (src.classes, {k: src.classes[y] for k, (_, y) in labels.items()})
    return out


def test_numeric_looking_names_are_one_class_on_every_path(tmp_path):
    """'3', '03', '+3' are the class 3 and '\u0663' (Arabic-Indic 3) and '3.0' names of their own,
    whether indexed with --index, --index --fields or on first use: the same classes, the same
    label for each sample (once: [3, 03, +3, 3.0, cat] were 4 classes on one path, 2 on another)."""
    raw = ["3", "03", "+3", "cat", "\u0663", "3.0"] * 2
    want = ["3", "3.0", "cat", "\u0663"]
    with pytest.warns(UserWarning, match="the labels mix 1 integer"):  # 3 among names: said
        seen = _classes_everywhere(tmp_path, raw)
    for way, (classes, labels) in seen.items():
        assert classes == want, way
        assert labels == {f"{i:06d}": "3" if raw[i] in ("03", "+3") else raw[i] for i in range(len(raw))}, way


def test_one_command_gives_every_split_the_training_splits_classes_with_fields(tmp_path):
    """`--index x:train=... --index x:test=... --fields ...`: the test split short of a class takes
    the training split's classes (dog is 1 in both), as the same command without --fields does."""
    _labelled_set(tmp_path / "tr", ["cat", "dog", "emu"] * 4)
    _labelled_set(tmp_path / "te", ["dog", "emu"] * 4)
    for out, extra in (("m", []), ("f", ["--fields", "image:image=jpg,size=16x16 label:class=cls"])):
        done = make_shards_in_process(["--index", f"x:test={tmp_path}/te/s-*.tar", "--index",
                                       f"x:train={tmp_path}/tr/s-*.tar", "--out", str(tmp_path / out), "--quiet",
                                       *extra])
        assert done.returncode == 0, done.stderr
        test = resolve("x", str(tmp_path / out), "test")
        assert test.classes == ["cat", "dog", "emu"], out
        labels, skipped = _labels(MixedStream([test], {"x": 1}, 4, seed=0, epoch_samples=8), 0)
        assert skipped == 0 and sorted({y for _, y in labels.values()}) == [1, 2], out


def test_integer_labels_among_names_are_named_in_one_warning(tmp_path):
    """Ids 0..11 and one 'cat': every value becomes a name sorted as text ('10' before '2'): one
    warning line says so, with --index and with --fields."""
    _labelled_set(tmp_path / "set", [str(i) for i in range(12)] + ["cat"] * 6)
    for out, extra in (("m", []), ("f", ["--fields", "image:image=jpg,size=16x16 label:class=cls"])):
        with pytest.warns(UserWarning) as caught:
            done = make_shards_in_process(["--index", f"x:train={tmp_path}/set/s-*.tar", "--out",
                                           str(tmp_path / out), "--quiet", *extra])
        assert done.returncode == 0, done.stderr
        said = [str(w.message) for w in caught if "the labels mix" in str(w.message)]
        assert len(said) == 1 and "mix 12 integer(s) (e.g. 0) with 1 class name(s) (e.g. 'cat')" in said[0], said


@pytest.mark.parametrize("value", ["", "true"])
def test_a_label_that_is_neither_an_id_nor_a_name_ends_the_index_on_every_path(tmp_path, value):
    """An empty .cls (or a JSON true): the index ends with one line naming the sample and the value,
    with --index, --fields and on first use alike (docs/data.md: the documented rule)."""
    from pipeline.errors import ShardError
    from pipeline.stream import resolve as first_use

    label = "json:class" if value == "true" else "cls"
    raw = ["cat", "dog", value, "cat"] * 3
    _labelled_set(tmp_path / "set", raw, lambda i: {"class": True if raw[i] == "true" else raw[i]})
    fields = f"image:image=jpg,size=16x16 label:class={label}"
    for extra in (["--label-key", label], ["--fields", fields]):
        done = make_shards_in_process(["--index", f"x:train={tmp_path}/set/s-*.tar", "--out", str(tmp_path / "m"),
                                       "--quiet", *extra])
        assert done.returncode == 2 and "sample 000002" in done.stderr, done.stderr
        assert "not an integer or a class name" in done.stderr, done.stderr
    if label != "cls":
        return  # on first use the class is the .cls the set is indexed by (pipeline.writers.autoindex.build)
    with pytest.raises(ShardError, match="sample 000002: .* not an integer or a class name"):
        first_use("x", str(tmp_path / "set"), "train", fields=fields, cache_dir=str(tmp_path / "c"))
