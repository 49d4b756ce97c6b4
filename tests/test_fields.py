"""Samples of any fields (pipeline.data.fields.schema): every field type, decoded, staged and batched
with the right types and shapes at 0 and 2 workers; an img2dataset-shaped set written by
wds.ShardWriter; stages that repeat on resume; the schema from --fields, the manifest and
the API; the default image-and-label layout untouched."""
import dataclasses
import io
import json
import os
import sys

import numpy as np
import pytest
from PIL import Image

from helpers import encode_pil, make_shards_in_process, write_foreign
from pipeline.data.fields import augment
from pipeline.data.handover import budget
from pipeline.data.shards import read
from pipeline.data.manifests.manifest import resolve
from pipeline.data.fields.schema import Column, Schema, parse_fields
from pipeline.data.streams.stream import MixedStream
from pipeline.data.handover.loader import make_loader
from pipeline.ordering.topology import Topology
from pipeline.errors import InputError
from pipeline.writers import index

SIZES = [(40, 60), (64, 64), (30, 50)]  # (h, w) of sample i's image: i % 3
N = 24


def tokens(text):
    """A tokeniser of the user's: a number per character."""
    return [ord(c) % 1000 for c in text]


def npy(a):
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def image_of(i):
    h, w = SIZES[i % 3]
    rng = np.random.default_rng(i)
    return rng.integers(0, 256, (h, w, 3), dtype=np.uint8)


def caption_of(i):
    return f"caption {i} " + "é" * (i % 3)


def every_member(i):
    key = f"s{i:04d}"
    fmt = "PNG" if i % 2 else "JPEG"
    members = [(f"{key}.{fmt.lower().replace('jpeg', 'jpg')}", encode_pil(Image.fromarray(image_of(i)), fmt)),
               (key + ".txt", caption_of(i).encode()),
               (key + ".cls", str(i % 4).encode()),
               (key + ".json", json.dumps({"caption": caption_of(i), "score": i / 10, "tags": [i, i + 1, i + 2]}).encode()),
               (key + ".npy", npy(np.full((i % 3 + 1, 2), i, np.float64)))]
    if i % 5:
        members.append((key + ".bin", bytes([i]) * i))
    return key, members


EVERY = Schema([
    Column("image", "image", "jpg;png", fit="center-crop", size=(16, 16)),
    Column("padded", "image", "jpg;png", fit="pad", size=(32, 32)),
    Column("native", "image", "jpg;png", fit="native", size=(48, 48)),
    Column("grey", "image", "jpg;png", fit="resize", size=(8, 12), channels=1),
    Column("caption", "text", "txt"),
    Column("ids", "text", "json:caption"),
    Column("label", "int", "cls"),
    Column("tags", "int", "json:tags", length=3),
    Column("score", "float", "json:score"),
    Column("emb", "array", "npy", shape=(4, 2)),
    Column("blob", "bytes", "bin", optional=True),
], stages=[augment.Tokenize("ids", tokens, 12)])


@pytest.fixture(scope="module")
def every(tmp_path_factory):
    out = tmp_path_factory.mktemp("every")
    write_foreign(out, N, 8, "every-{:04d}.tar", every_member)
    index.index("every", "train", str(out), str(out), fields=Schema(EVERY.columns), progress=False)
    return dataclasses.replace(resolve("every", str(out), "train"), schema=EVERY)


def fitted(h, w, H, W, grow=True):
    scale = min(H / h, W / w, *(() if grow else (1.0,)))
    return max(1, min(H, round(h * scale))), max(1, min(W, round(w * scale)))


@pytest.mark.parametrize("workers", [0, 2])
def test_every_field_type_batches_with_its_type_and_shape(every, workers):
    stream = MixedStream([every], {"every": 1}, 8, seed=3, normalize=False)
    seen = set()
    for b in make_loader(stream, workers):
        n = len(b["key"])
        assert b["image"].shape == (n, 3, 16, 16) and b["image"].dtype.is_floating_point is False
        assert b["padded"].shape == (n, 3, 32, 32) and b["padded_size"].shape == (n, 2)
        assert b["native"].shape == (n, 3, 48, 48) and b["grey"].shape == (n, 1, 8, 12)
        assert b["ids"].shape == (n, 12) and str(b["ids"].dtype) == "torch.int64" and b["ids_len"].shape == (n,)
        assert b["tags"].shape == (n, 3) and str(b["label"].dtype) == "torch.int64"
        assert str(b["score"].dtype) == "torch.float32" and b["score"].shape == (n,)
        assert b["emb"].shape == (n, 4, 2) and str(b["emb"].dtype) == "torch.float32" and b["emb_shape"].shape == (n, 2)
        assert b["blob_mask"].dtype.is_floating_point is False and len(b["blob"]) == len(b["caption"]) == n
        for r, key in enumerate(b["key"]):
            i = int(key[1:])
            seen.add(i)
            h, w = SIZES[i % 3]
            assert b["caption"][r] == caption_of(i)
            text = caption_of(i)
            assert b["ids_len"][r] == min(len(text), 12)
            assert b["ids"][r, :len(text)].tolist() == tokens(text)[:12] and not b["ids"][r, len(text):].any()
            assert b["label"][r] == i % 4 and b["tags"][r].tolist() == [i, i + 1, i + 2]
            assert b["score"][r] == np.float32(i / 10)
            assert b["emb_shape"][r].tolist() == [i % 3 + 1, 2]
            assert (b["emb"][r, :i % 3 + 1] == i).all() and not b["emb"][r, i % 3 + 1:].any()
            assert b["blob"][r] == (bytes([i]) * i if i % 5 else None) and bool(b["blob_mask"][r]) == bool(i % 5)
            ph, pw = fitted(h, w, 32, 32)
            assert b["padded_size"][r].tolist() == [ph, pw] and not b["padded"][r, :, ph:].any()
            assert not b["padded"][r, :, :, pw:].any()
            nh, nw = fitted(h, w, 48, 48, grow=False)
            assert b["native_size"][r].tolist() == [nh, nw]
            if i % 2:  # a PNG: lossless, so the native image at its own size is the image itself
                if (nh, nw) == (h, w):
                    assert (b["native"][r, :, :h, :w].numpy() == image_of(i).transpose(2, 0, 1)).all()
    assert seen == set(range(N))


def test_random_fields_are_the_same_whatever_the_workers_and_repeat_after_a_resume(every):
    """Crops and flips drawn from the sample's seed: the same sample gets the same crop at 0 and 2
    workers, and a stream stopped and resumed repeats the uninterrupted one's batches bit for bit."""
    schema = Schema(EVERY.columns[:1] + (Column("native", "image", "jpg;png", fit="native", size=(48, 48)),
                                         Column("caption", "text", "txt")),
                    stages=[augment.RandomResizedCrop("native", (12, 10)), augment.Flip("native"),
                            augment.ColorJitter("native")])
    src = dataclasses.replace(every, schema=schema)

    def run(workers, stop=None, state=None):
        stream = MixedStream([src], {"every": 1}, 4, seed=5)
        if state is not None:
            stream.load_state_dict(state)
        got = []
        for b in make_loader(stream, workers):
            got.append((list(b["key"]), b["native"].numpy().copy(), list(b["caption"])))
            if stop is not None and len(got) == stop:
                return got, stream.state_dict()
        return got, None

    whole, _ = run(0)
    assert all(native.shape[1:] == (3, 12, 10) for _, native, _ in whole)
    by_key = {k: native[r] for keys, native, _ in whole for r, k in enumerate(keys)}
    two, _ = run(2)
    assert sorted(k for keys, _, _ in two for k in keys) == sorted(by_key)
    assert all((native[r] == by_key[k]).all() for keys, native, _ in two for r, k in enumerate(keys))
    first, state = run(0, stop=3)
    rest, _ = run(0, state=json.loads(json.dumps(state)))
    assert [k for k, _, _ in first + rest] == [k for k, _, _ in whole]
    assert all((a[1] == b[1]).all() for a, b in zip(first + rest, whole))
    assert len(by_key) == N and len({a.tobytes() for a in by_key.values()}) == N


def test_fields_from_the_command_line_and_the_manifest(every, tmp_path):
    schema = parse_fields("image:image=jpg;png,fit=pad,size=20x24 caption:text=txt,max=100 label:int=cls "
                          "tags:int=json:tags,length=3 emb:array=npy,shape=4x2,dtype=float64 blob:bytes=bin,optional")
    assert schema.columns[0].size == (20, 24) and schema.columns[1].max_bytes == 100
    assert Schema.from_json(json.loads(json.dumps(schema.to_json()))).to_json() == schema.to_json()
    src = resolve("every", os.path.dirname(every.urls[0]), "train")  # the manifest's fields
    assert [c.name for c in src.schema.columns] == [c.name for c in EVERY.columns]
    for bad, said in (("image:image=jpg", "needs its size"), ("x:vector=txt", "type 'vector'"),
                      ("caption=txt", "NAME:TYPE=MEMBER"), ("a:text=txt,max=lots", "option 'max=lots'"),
                      ("a:array=npy,shape=1048576x1048576", "at most"), ("source:int=cls", "none of source"),
                      ("a:text=txt a:int=cls", "named twice"), ("a:image=json:x,size=4", "image extensions")):
        with pytest.raises(ValueError, match=said):
            parse_fields(bad)


@pytest.mark.parametrize("n, members", [(5000, 1), (1, 30000)])
def test_the_index_line_of_many_fields_or_members_stays_a_line(tmp_path, n, members):
    """5,000 fields printed a summary line of 94,001 characters, 30,000 members one of 120,122."""
    from helpers import write_tar

    write_tar(tmp_path / "web-000000.tar", [(f"s{i}.t{j}", b"x") for i in range(2) for j in range(n)])
    spec = " ".join(f"f{j}:text=" + ";".join([f"t{j}"] * members) for j in range(n))
    p = make_shards_in_process(["--quiet", "--index", f"web:train={tmp_path}/web-000000.tar", "--fields", spec,
                                "--out", tmp_path / "out"])
    assert p.returncode == 0, p.stderr[-2000:]
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("indexed web-train"))
    assert len(line) < 1000, line[:2000]
    assert ("... and 4980 more field(s)" if n > 1 else "more characters") in line, line


def test_an_optional_field_no_sample_holds_is_warned_at_indexing(tmp_path):
    from helpers import write_tar

    write_tar(tmp_path / "web-000000.tar", [(f"s{i}.txt", b"x") for i in range(3)])
    with pytest.warns(UserWarning, match=r"web-train: no sample holds the optional field\(s\) extra \(\.nope\)"):
        p = make_shards_in_process(["--quiet", "--index", f"web:train={tmp_path}/web-000000.tar", "--fields",
                                    "caption:text=txt extra:text=nope,optional", "--out", tmp_path / "out"])
    assert p.returncode == 0, p.stderr


def test_a_schema_source_mixes_with_an_image_and_label_source_with_masks(every, tmp_path):
    from helpers import build_shards

    build_shards(tmp_path, "grey", "train", 30, shape=(3, 16, 16), maxcount=10)
    grey = resolve("grey", str(tmp_path), "train")
    schema = Schema([Column("image", "image", "jpg;png", size=(16, 16)), Column("caption", "text", "txt")])
    stream = MixedStream([grey, dataclasses.replace(every, schema=schema)], {"grey": 1, "every": 1}, 10, seed=1)
    assert stream.batch_spec().names == ["image", "label", "label_mask", "caption_mask", "source"]
    n = 0
    for b in make_loader(stream, 0):
        for r, key in enumerate(b["key"]):
            mine = int(b["source"][r]) == 1
            assert bool(b["caption_mask"][r]) == mine and bool(b["label_mask"][r]) != mine
            assert (b["caption"][r] == caption_of(int(key[1:]))) if mine else b["caption"][r] is None
            assert mine or b["label"][r] in range(10)
            n += mine
    assert n > 0
    with pytest.raises(InputError, match="the trainer takes an image and a class label.*`image` or `label` is missing"):
        stream.layout.num_classes
    plain = MixedStream([grey, every], {"grey": 1, "every": 1}, 10, schemas={"every": None})
    assert plain.batch_spec().names == ["image", "label", "source"]  # image and label, as always
    small = MixedStream([grey, every], {"grey": 1, "every": 1}, 10,  # a smaller image: on the canvas, centred
                        schemas={"every": Schema([Column("image", "image", "jpg", size=(8, 8))])})
    assert small.batch_spec().fields[0].shape == (3, 16, 16)
    with pytest.raises(ValueError, match="image .* in source grey and image .* in source every"):
        MixedStream([grey, every], {"grey": 1, "every": 1}, 10,
                    schemas={"every": Schema([Column("image", "image", "jpg", fit="pad", size=(8, 8))])})


def test_a_users_stage_sees_and_returns_the_fields_and_is_checked(every):
    def shout(sample):
        assert isinstance(sample["__seed__"], int) and sample["__source__"] == "every"
        return None if sample["label"] == 3 else dict(sample, caption=sample["caption"].upper())

    schema = Schema([Column("caption", "text", "txt"), Column("label", "int", "cls")], stages=[shout])
    stream = MixedStream([dataclasses.replace(every, schema=schema)], {"every": 1}, 4, epoch_samples=16)
    batches = list(make_loader(stream, 0))
    assert all(c == c.upper() for b in batches for c in b["caption"])
    assert all(int(x) != 3 for b in batches for x in b["label"])

    def wrong(sample):
        return dict(sample, label="three")

    stream = MixedStream([dataclasses.replace(every, schema=Schema(schema.columns, [wrong]))], {"every": 1}, 4)
    with pytest.raises(InputError, match=r"returned field label: int of shape \(\) expected, got str"):
        next(iter(make_loader(stream, 0)))


def test_the_memory_estimate_counts_every_field(every):
    stream = MixedStream([every], {"every": 1}, 8)
    batch, image = stream.layout.memory(8)
    assert batch >= stream.batch_spec().slot_bytes + 8 * (2 * 64 << 10)  # two text fields at their caps
    assert image == 3 * 48 * 48
    parts = budget.needed(8, [every.shape], 2, fields=(batch, image))
    assert parts["ring"] == 2 * (budget.PREFETCH + 2) * batch
    with pytest.raises(ValueError, match="every field at its cap"):
        budget.check_budget(8, {"every": every.shape}, 2, parts["total"] - 1, fields=(batch, image))


def test_an_oversized_member_is_passed_over_unread_when_asked():
    buf = io.BytesIO()
    import tarfile

    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in (("a.txt", b"x" * 5000), ("a.cls", b"1"), ("b.txt", b"ok"), ("b.cls", b"2")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with pytest.raises(Exception, match="claims 5000 bytes"):
        list(read.iter_samples(io.BytesIO(buf.getvalue()), {"txt", "cls"}, max_member=4096))
    got = list(read.iter_samples(io.BytesIO(buf.getvalue()), {"txt", "cls"}, max_member=4096, oversized=lambda n: n))
    assert [(s["__key__"], s["txt"], s["cls"]) for s in got] == [("a", 5000, b"1"), ("b", b"ok", b"2")]


# ---------------------------------------------------------------- an img2dataset-shaped set


def write_img2dataset(folder, n, per_shard=10):
    """What img2dataset writes, through wds.ShardWriter: jpg + txt + json per sample."""
    import webdataset as wds

    os.makedirs(folder, exist_ok=True)
    with wds.ShardWriter(os.path.join(str(folder), "%05d.tar"), maxcount=per_shard, verbose=0) as sink:
        for i in range(n):
            h, w = SIZES[i % 3]
            sink.write({"__key__": f"{i:09d}", "jpg": encode_pil(Image.fromarray(image_of(i)), "JPEG"),
                        "txt": caption_of(i).encode(),
                        "json": json.dumps({"caption": caption_of(i), "url": f"http://x/{i}.jpg", "key": f"{i:09d}",
                                            "status": "success", "width": w, "height": h,
                                            "original_width": 2 * w, "original_height": 2 * h}).encode()})


I2D_FIELDS = "image:image=jpg;png;webp,fit=center-crop,size=24x24 caption:text=txt width:int=json:width"


@pytest.fixture(scope="module")
def img2dataset(tmp_path_factory):
    out = tmp_path_factory.mktemp("i2d")
    write_img2dataset(out / "shards", 60)
    done = make_shards_in_process(["--index", f"laion:train={out / 'shards'}", "--fields", I2D_FIELDS, "--out",
                                   str(out / "shards"), "--quiet"])
    assert done.returncode == 0, done.stderr
    assert "fields image (jpg;png;webp, center-crop 24x24), caption (text .txt), width (int json:width)" in done.stdout
    return str(out / "shards")


@pytest.mark.parametrize("workers", [0, 2])
def test_an_img2dataset_set_streams_image_caption_and_json(img2dataset, workers):
    src = resolve("laion", img2dataset, "train")
    stream = MixedStream([src], {"laion": 1}, 16, seed=0, normalize=False)
    keys = []
    for b in make_loader(stream, workers):
        assert b["image"].shape == (16, 3, 24, 24) and str(b["image"].dtype) == "torch.uint8"
        for r, key in enumerate(b["key"]):
            i = int(key)
            assert b["caption"][r] == caption_of(i) and b["width"][r] == SIZES[i % 3][1]
        keys += b["key"]
    assert len(keys) == len(set(keys)) == 48


RANKS = r'''
import json, os, sys
import torch
import torch.distributed as dist
from pipeline.data.manifests.manifest import resolve
from pipeline.data.streams.stream import MixedStream
from pipeline.data.handover.loader import make_loader
from pipeline.ordering.topology import Topology

def main(data, out):
    dist.init_process_group("gloo")
    topo = Topology.from_env()
    stream = MixedStream([resolve("laion", data, "train")], {"laion": 1}, 6, topo, seed=2)
    keys, right, batches = [], 0, 0
    for b in make_loader(stream, num_workers=2):
        t = torch.ones(1)
        dist.all_reduce(t)
        batches += 1
        keys += b["key"]
        right += sum(c.startswith(f"caption {int(k)} ") for k, c in zip(b["key"], b["caption"]))
        assert b["image"].shape == (6, 3, 24, 24)
    with open(os.path.join(out, f"rank{topo.rank}.json"), "w") as f:
        json.dump({"batches": batches, "expected": len(stream), "keys": keys, "right": right}, f)
    dist.destroy_process_group()

if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
'''


@pytest.mark.slow
def test_two_ranks_stream_the_fields_disjointly(img2dataset, tmp_path):
    import subprocess

    from helpers import free_port

    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(script), img2dataset, str(tmp_path)]
    proc = subprocess.run(cmd, env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["batches"] == ranks[1]["batches"] == ranks[0]["expected"] == 60 // 12
    assert not set(ranks[0]["keys"]) & set(ranks[1]["keys"])
    assert all(r["right"] == len(r["keys"]) == 30 for r in ranks)


def test_the_index_refuses_a_sample_that_does_not_fit_in_one_line(img2dataset, tmp_path):
    done = make_shards_in_process(["--index", f"laion:train={img2dataset}", "--fields", "caption:text=txt,max=10",
                                   "--out", str(tmp_path), "--quiet", "--workers", "1"])
    assert done.returncode == 2
    assert done.stderr.splitlines() == [f"make-shards: error: {img2dataset}/00000.tar: sample 000000001: field caption: "
                                        f".txt of 12 bytes, more than its cap of 10 (raise the field's max_bytes)"]
    for args, said in ((["--fields", "caption:txt"], "NAME:TYPE=MEMBER"),
                       (["--fields", "caption:text=txt", "--label-key", "cls"], "give the label as a field"),
                       (["--fields", "x:text=txt", "--imagefolder", "a:train=" + str(tmp_path)], "--index only")):
        done = make_shards_in_process(["--index", f"laion:train={img2dataset}", *args, "--out", str(tmp_path)]
                                      if "--imagefolder" not in args else [*args, "--out", str(tmp_path)])
        assert done.returncode == 2 and said in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_an_imagefolder_or_a_folder_of_pairs_is_written_with_its_captions(tmp_path):
    for i in range(6):
        folder = tmp_path / "tree" / f"c{i % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image_of(1)[:8, :8]).save(folder / f"im{i}.png")
        (folder / f"im{i}.txt").write_text(caption_of(i))
    done = make_shards_in_process(["--imagefolder", f"pics:train={tmp_path / 'tree'}", "--captions", "--out",
                                   str(tmp_path / "out"), "--quiet", "--workers", "1"])
    assert done.returncode == 0, done.stderr
    src = resolve("pics", str(tmp_path / "out"), "train")
    assert [c.name for c in src.schema.columns] == ["image", "label", "caption"]
    batches = list(make_loader(MixedStream([src], {"pics": 1}, 3), 0))
    got = {c for b in batches for c in b["caption"]}
    assert got == {caption_of(i) for i in range(6)} and all(b["image"].shape == (3, 3, 8, 8) for b in batches)
    plain = list(make_loader(MixedStream([src], {"pics": 1}, 3, schemas={"pics": None}), 0))
    assert all("caption" not in b and b["image"].shape == (3, 3, 8, 8) for b in plain)  # image and label as ever
    pairs = tmp_path / "pairs"
    pairs.mkdir()
    for i in range(4):
        Image.fromarray(image_of(2)[:6, :10]).save(pairs / f"p{i}.jpg")
        (pairs / f"p{i}.txt").write_text(caption_of(i))
    done = make_shards_in_process(["--imagefolder", f"flat:train={pairs}", "--out", str(tmp_path / "out"), "--quiet"])
    assert done.returncode == 2 and "holds no images in ImageFolder layout" in done.stderr  # as before, without captions
    done = make_shards_in_process(["--imagefolder", f"flat:train={pairs}", "--captions", "--out",
                                   str(tmp_path / "out"), "--quiet", "--workers", "1"])
    assert done.returncode == 0, done.stderr
    batches = list(make_loader(MixedStream([resolve("flat", str(tmp_path / "out"), "train")], {"flat": 1}, 2), 0))
    assert sorted(c for b in batches for c in b["caption"]) == sorted(caption_of(i) for i in range(4))
    assert all(b["image"].shape == (2, 3, 6, 10) and not b["label"].any() for b in batches)
    os.remove(tmp_path / "tree" / "c1" / "im3.txt")
    done = make_shards_in_process(["--imagefolder", f"pics:train={tmp_path / 'tree'}", "--captions", "--out",
                                   str(tmp_path / "out2"), "--quiet", "--workers", "1"])
    assert done.returncode == 2 and "im3.txt: no caption for" in done.stderr


def test_a_stream_on_ranks_reads_each_sample_once(img2dataset):
    src = resolve("laion", img2dataset, "train")
    keys = []
    for rank in range(2):
        stream = MixedStream([src], {"laion": 1}, 5, Topology(rank, 2), seed=4)
        for b in make_loader(stream, 0):
            keys += b["key"]
    assert len(keys) == len(set(keys)) == 60


@pytest.mark.slow
def test_the_examples_stream_fields_into_their_models(img2dataset, every, tmp_path):
    import subprocess

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {"PYTHONPATH": repo, "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, os.path.join(repo, "examples", "image_text.py"), img2dataset, "--steps", "4"],
                       capture_output=True, text=True, timeout=180, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "image (16, 3, 24, 24) torch.uint8, caption ids (16, 32), lengths" in r.stdout and "4 steps" in r.stdout
    index.index("pets", "train", os.path.dirname(every.urls[0]), str(tmp_path), progress=False,
                fields=parse_fields("image:image=jpg;png,fit=native,size=512x512 label:int=cls"))
    r = subprocess.run([sys.executable, os.path.join(repo, "examples", "classify_native.py"), str(tmp_path),
                        "--steps", "3"], capture_output=True, text=True, timeout=180, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "image (16, 3, 64, 64), 3 steps" in r.stdout
    r = subprocess.run([sys.executable, os.path.join(repo, "examples", "image_text.py"), str(tmp_path), "--name",
                        "pets"], capture_output=True, text=True, timeout=180, env=env)
    assert r.returncode != 0 and r.stderr.strip().endswith("has no image and caption fields; index it with --fields "
                                                           "(see --help)")


def test_an_evaluation_stream_reads_its_own_fields_once(img2dataset, tmp_path):
    index.index("laion", "test", img2dataset, str(tmp_path), progress=False,
                fields=parse_fields("image:image=jpg,fit=pad,size=20x20 caption:text=txt"))
    train = resolve("laion", img2dataset, "train")
    stream = MixedStream([train], {"laion": 1}, 8, schemas={"laion": Schema(train.schema.columns,
                                                                              [augment.Flip("image")])})
    for workers in (0, 2):
        keys = []
        for b in make_loader(stream.eval_stream(resolve("laion", str(tmp_path), "test")), workers):
            assert b["image"].shape[1:] == (3, 20, 20) and b["image_size"].shape == (len(b["key"]), 2)
            assert [int(c.split()[1]) for c in b["caption"]] == [int(k) for k in b["key"]]
            keys += b["key"]
        assert sorted(keys) == [f"{i:09d}" for i in range(60)]
