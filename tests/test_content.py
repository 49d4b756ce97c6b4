"""One sample never ends a run: whatever a label or image member holds, parsing it gives a
ValueError (a skipped, counted sample; one line under --strict and in --index), and a
sample without a label is named with what it holds and the --label-key that would read it."""
import collections
import json
import struct

import pytest

from helpers import encode_pil, foreign_image, make_shards_in_process, read_pass, write_tar
from pipeline.data.decoding import decode
from pipeline.data.decoding import labelling
from pipeline.data.decoding.decode import Target
from pipeline.data.decoding.labelling import Unlabelled
from pipeline.data.streams.stream import MixedStream, resolve
from pipeline.errors import ShardError
from pipeline.ordering.topology import Topology, Worker

DEEP = b"[" * 100_000 + b"]" * 100_000
NAMES = ("cat", "dog")


def index(*args):
    return make_shards_in_process(["--quiet", *args])


def one_line(p, *needles):
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr[-3000:]
    errors = [ln for ln in p.stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1 and len(errors[0]) < 1000, p.stderr[-3000:]
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


def json_tar(path, labels):
    """Samples s0, s1, ... of a 16x16 PNG and a .json member each: `labels` gives each .json's bytes."""
    members = []
    for i, body in enumerate(labels):
        members += [(f"s{i}.png", encode_pil(foreign_image(i % 2, (16, 16), seed=i), "PNG")), (f"s{i}.json", body)]
    write_tar(path, members)


def nested(i):
    return json.dumps({"annotation": {"category": NAMES[i % 2], "id": i}, "caption": "a picture"}).encode()


@pytest.mark.parametrize("body, needle", [
    (DEEP, "nested too deeply"),
    (b'{"label": ' + DEEP + b"}", "nested too deeply"),
    (b" " * (labelling.MAX_LABEL_JSON + 1), "more than the"),
    (b"\xff\xfe\xfd", "not valid JSON"),
    (b'{"label": ' + b"9" * 5000 + b"}", "not valid JSON"),
    (b'{"label": 1e999}', "not an integer"),
    (b'{"label": {"a": 1}}', "not an integer"),
], ids=["deep", "deep field", "huge", "not utf-8", "5000 digits", "inf", "object"])
def test_any_json_label_is_a_value_error_of_one_short_line(body, needle):
    with pytest.raises(ValueError, match=needle) as e:
        labelling.label_of({"__key__": "k", "json": body}, Target((1, 4, 4), label="json:label"))
    assert len(str(e.value)) < 300 and "\n" not in str(e.value)


def test_other_label_and_image_content_is_a_value_error(monkeypatch):
    cls = Target((1, 4, 4))
    for body in (b"\xff\xfe", b"1" * 10_000, b"", b"  "):
        with pytest.raises(ValueError):
            labelling.label_of({"__key__": "k", "cls": body}, cls)
    names = Target((1, 4, 4), label="txt", classes=2, names=NAMES)
    with pytest.raises(ValueError, match=r"more characters\) \.\.\..* is not one of") as e:
        labelling.label_of({"__key__": "k", "txt": b"x" * 100_000}, names, names.lookup())
    assert len(str(e.value)) < 300

    def broken(*args, **kwargs):  # a decoder failing in a way of its own
        raise struct.error("unpack requires a buffer of 4 bytes")
    monkeypatch.setattr(decode, "_pil", broken)
    with pytest.raises(ValueError, match=r"undecodable .bmp image \(error: unpack requires"):
        decode.decode_image(b"BM", "bmp", (1, 4, 4))
    pixels, kept, errors = decode.decode_batch([b"BM", b"BM"], ["bmp", "bmp"], Target((1, 4, 4), ("bmp",)))
    assert kept == [] and [i for i, _ in errors] == [0, 1]


def test_a_deeply_nested_json_label_is_skipped_and_counted_and_one_line_in_index(tmp_path):
    """The trial's case: a .json nested 100,000 deep ended the trainer and --index with a
    RecursionError traceback."""
    good = [json.dumps({"label": NAMES[i % 2]}).encode() for i in range(6)]
    json_tar(tmp_path / "web-000000.tar", good)
    p = index("--index", f"web:train={tmp_path}/web-000000.tar", "--label-key", "json:label", "--out", tmp_path)
    assert p.returncode == 0, p.stderr
    json_tar(tmp_path / "web-000000.tar", good[:2] + [b'{"label": ' + DEEP + b"}"] + good[3:])
    src = resolve("web", str(tmp_path / "web-train.json"), "train")
    with pytest.warns(UserWarning, match="s2: .json nested too deeply"):
        batches = list(MixedStream([src], {"web": 1}, 3, epoch_samples=6).eval_stream(src))
    assert sum(b["skipped"] for b in batches) == 1 and sum(len(b["key"]) for b in batches) == 5
    for label in (["--label-key", "json:label"], []):  # the default label reads the .json too
        p = index("--index", f"web:test={tmp_path}/web-000000.tar", *label, "--out", tmp_path / "again")
        one_line(p, "nested too deeply")
    json_tar(tmp_path / "first.tar", [DEEP] + good[1:])
    one_line(index("--index", f"web:test={tmp_path}/first.tar", "--out", tmp_path / "again"), "s0")


def test_a_label_nested_in_json_is_named_with_the_fields_and_a_key_that_works(tmp_path):
    """The new user's afternoon: the default label error said the sample had no .json and
    suggested json:label; --label-key json:label said there was no label field and no more."""
    json_tar(tmp_path / "web-000000.tar", [nested(i) for i in range(6)])
    spec = f"web:train={tmp_path}/web-000000.tar"
    for label in ([], ["--label-key", "json:label"]):
        line = one_line(index("--index", spec, *label, "--out", tmp_path),
                        "annotation.category, annotation.id, caption", "--label-key json:annotation.category")
        assert "no .json" not in line and "e.g. --label-key json:label" not in line
    assert "sample s0 has members .json, .png; its .json: it has" in one_line(index("--index", spec, "--out", tmp_path))
    p = index("--index", spec, "--label-key", "json:annotation.category", "--out", tmp_path)
    assert p.returncode == 0, p.stderr
    assert json.loads((tmp_path / "web-train.json").read_text())["classes"] == list(NAMES)


def test_json_hints_are_cut_to_a_line_and_suggest_only_keys_the_rule_can_read():
    some, many = ({f"field{i}": {"deeper": i} for i in range(n)} for n in (50, 5000))
    assert "and 38 more; e.g. --label-key json:field0.deeper" in labelling.json_hint(some)
    assert len(labelling.json_hint(many)) < 600 and "more" in labelling.json_hint(many)
    odd = {"a.b": 1, "": 2, "flag": True, "class_name": "cat", "x": None}
    assert labelling.json_hint(odd).endswith("--label-key json:class_name")
    assert "--label-key" not in labelling.json_hint({"a.b": 1, "x": [1, 2]})
    with pytest.raises(Unlabelled, match="it holds a JSON list"):
        labelling.raw_label({"__key__": "k", "json": b"[1]"}, "json:label")
    long_key = {"__key__": "k" * 10_000, "json": json.dumps(many).encode()}
    for text in (labelling.json_hint(many), labelling.label_hint(long_key)):
        assert len(text) < 800, len(text)


def png_tar(path, n, without=(), junk=(), first=0):
    """Samples s{first}..s{first+n-1}, a 16x16 PNG and a .cls each; those in `without` (numbered from
    first) lack their .png, those in `junk` have a .png that does not decode (refused when decoded,
    not when read)."""
    members = []
    for i in range(first, first + n):
        if i not in without:
            png = encode_pil(foreign_image(i % 2, (16, 16), seed=i), "PNG")
            members.append((f"s{i}.png", png[:20] + bytes(40) if i in junk else png))
        members.append((f"s{i}.cls", str(i % 2).encode()))
    write_tar(path, members)


@pytest.mark.slow  # starts loader workers
def test_a_sample_refused_while_read_is_counted_once_whatever_the_workers(tmp_path):
    """Two samples without their .png were counted 2 times at 0 workers and 3 times at 2 in
    `skipped` (and the trainer's skipped_samples, their sum): every (rank, worker) whose share
    lies in a window read it whole and counted its refusals, and so did a chain reading a
    window again for the samples it still owed."""
    import warnings

    from pipeline.data.handover.loader import make_loader

    png_tar(tmp_path / "web-000000.tar", 20)
    p = index("--index", f"web:train={tmp_path}/web-000000.tar", "--out", tmp_path)
    assert p.returncode == 0, p.stderr
    png_tar(tmp_path / "web-000000.tar", 20, without=(3, 11))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        src = resolve("web", str(tmp_path / "web-train.json"), "train")
        got = {}
        for workers in (0, 2):
            batches = list(make_loader(MixedStream([src], {"web": 1}, 4, epoch_samples=20), num_workers=workers))
            got[workers] = (sum(b["skipped"] for b in batches), sum(len(b["key"]) for b in batches))
    assert got == {0: (2, 20), 2: (2, 20)}, got
    named = [str(w.message) for w in said if "skipped sample" in str(w.message)]
    assert len(named) == 2, named  # at 0 workers (a worker's warnings stay in its process)


@pytest.mark.slow  # starts loader workers
@pytest.mark.parametrize("damage", ["without", "junk"])
def test_skipped_counts_the_damaged_samples_of_the_epoch_once_whatever_the_workers(tmp_path, damage):
    """10 of 40 samples damaged (no .png: refused when read; junk .png: refused when decoded):
    `skipped` is the epoch's positions that held one, each once, named once, at 0 and 2 workers.
    Before, it counted every refused read: a pair that passed over damage reads replacements
    (its reserve, the next pass), damaged ones among them counted again: 13-15 at 40, and the
    samples refused when read 10 or 20 at 80 depending on the workers."""
    import warnings

    from pipeline.data.handover.loader import make_loader

    bad = set(range(0, 40, 4))
    png_tar(tmp_path / "web-000000.tar", 40)
    p = index("--index", f"web:train={tmp_path}/web-000000.tar", "--out", tmp_path)
    assert p.returncode == 0, p.stderr
    png_tar(tmp_path / "web-000000.tar", 40, **{damage: bad})
    src = resolve("web", str(tmp_path / "web-train.json"), "train")
    got = {}
    for samples in (40, 80):  # the pass once; twice, each damaged sample at two positions
        for workers in (0, 2):
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                stream = MixedStream([src], {"web": 1}, 4, epoch_samples=samples, shuffle_buffer=20)
                batches = list(make_loader(stream, num_workers=workers))
            keys = [k for b in batches for k in b["key"]]
            assert len(keys) == samples and not {f"s{i}" for i in bad} & set(keys)
            got[samples, workers] = sum(b["skipped"] for b in batches)
            if not workers:  # (a worker's warnings stay in its process)
                assert len([w for w in said if "skipped sample" in str(w.message)]) == got[samples, workers]
    assert got == {(40, 0): 10, (40, 2): 10, (80, 0): 20, (80, 2): 20}, got


@pytest.mark.parametrize("damage", ["garbage_header", "cut_in_data", "cut_in_label"])
def test_the_whole_sample_before_damage_is_read_and_skipped_is_the_damaged_positions(tmp_path, damage):
    """6 samples, damage at s3.png (a garbage header, a cut inside its data) or inside s2.cls: s0-s2
    are read and 3 skipped, as webdataset's warn_and_continue reads them (s2, whole, was lost and
    counted: 4); s2 cut inside its label is refused and counted (4). The index of the shard cut
    inside s2.cls names the damage, not s2's missing label."""
    import tarfile

    png_tar(tmp_path / "web-000000.tar", 6)
    assert index("--index", f"web:train={tmp_path}", "--out", tmp_path).returncode == 0
    raw = (tmp_path / "web-000000.tar").read_bytes()
    with tarfile.open(tmp_path / "web-000000.tar") as tar:
        at = {m.name: m for m in tar.getmembers()}
    o = at["s3.png"].offset
    damaged = {"garbage_header": raw[:o] + bytes([7]) * 512 + raw[o + 512:],
               "cut_in_data": raw[:at["s3.png"].offset_data + 10], "cut_in_label": raw[:at["s2.cls"].offset_data]}
    (tmp_path / "web-000000.tar").write_bytes(damaged[damage])
    stream = MixedStream([resolve("web", str(tmp_path / "web-train.json"), "train")], {"web": 1}, 1, seed=1,
                         epoch_samples=6, shuffle_buffer=1, on_error="skip")
    keys, skipped = damaged_epoch_of(stream)
    read = 2 if damage == "cut_in_label" else 3
    assert sorted(set(keys)) == [f"s{i}" for i in range(read)] and skipped == 6 - read, (keys, skipped)
    if damage == "cut_in_label":
        (tmp_path / "again").mkdir()
        (tmp_path / "again" / "web-000000.tar").write_bytes(damaged[damage])
        one_line(index("--index", f"web:train={tmp_path / 'again'}", "--out", tmp_path / "again"),
                 "web-000000.tar: truncated tar member")


def damaged_epoch_of(stream):
    stream.set_workers(1)
    keys, skipped = [], 0
    for batch in stream.batches(Worker(0, 1)):
        keys += batch["key"]
        skipped += batch["skipped"]
    return keys, skipped


def damaged_epoch(folder, world, workers, batch_size, samples):
    """Every (rank, worker)'s batches of one epoch, read in this process: (keys, skipped)."""
    src = resolve("web", str(folder / "web-train.json"), "train")
    keys, skipped = [], 0
    for rank in range(world):
        stream = MixedStream([src], {"web": 1}, batch_size, Topology(rank, world), seed=5, epoch_samples=samples,
                             shuffle_buffer=8, on_error="skip")
        stream.set_workers(max(workers, 1))
        for w in range(max(workers, 1)):
            for batch in stream.batches(Worker(w, max(workers, 1))):
                assert len(batch["key"]) == batch_size
                keys += batch["key"]
                skipped += batch["skipped"]
    return keys, skipped


def test_an_epoch_completes_while_any_sample_is_readable_whatever_the_ranks_and_workers(tmp_path):
    """Random small sets (1-3 shards, 2-6 global batches a pass), some samples without their
    image (refused while read) or with a junk one (refused when decoded), read by 1-2 ranks x
    0-3 workers for one or two passes: every rank makes its batches, no damaged sample is
    read, every good one is read at least once a pass, and `skipped` is the damaged samples
    once a pass; a set with none readable is one line. Before, 2 ranks x 3 workers over 40 samples,
    10 without an image, raised "no readable samples" (those sat at their window's end, where one
    pair's run and its reserve lay), and so did any pair whose run and reserve held only damaged
    samples (it read them again and again), though the set had good ones."""
    import random
    import warnings

    warnings.simplefilter("ignore")  # a damaged set's warnings: counted in `skipped`, checked here
    rng = random.Random(6)
    for case in range(16):
        world, workers, batch_size = rng.choice((1, 2)), rng.randrange(4), rng.choice((2, 4))
        n = world * batch_size * rng.randrange(2, 7)
        cuts = sorted(rng.sample(range(1, n), rng.randrange(3)))
        folder = tmp_path / f"c{case}"
        folder.mkdir()
        sizes = [b - a for a, b in zip([0, *cuts], [*cuts, n])]
        starts = [0, *cuts]
        for k, size in enumerate(sizes):
            png_tar(folder / f"web-{k:06d}.tar", size, first=starts[k])
        assert index("--index", f"web:train={folder}", "--out", folder).returncode == 0
        bad = set(rng.sample(range(n), rng.choice((rng.randrange(1, n), n - 1, n))))
        how = rng.choice(("without", "junk"))
        for k, size in enumerate(sizes):
            png_tar(folder / f"web-{k:06d}.tar", size, first=starts[k], **{how: bad})
        names = [f"s{i}" for i in range(n)]
        passes = rng.choice((1, 2))
        if len(bad) == n:
            with pytest.raises(ShardError, match="no readable samples in this worker's shards .* every sample in "
                                                 "them refused or damaged; the first refused: sample s[0-9]+: "
                                                 + ("no .png member" if how == "without" else "undecodable")):
                damaged_epoch(folder, world, workers, batch_size, n * passes)
            continue
        keys, skipped = damaged_epoch(folder, world, workers, batch_size, n * passes)
        said = (case, world, workers, batch_size, sizes, sorted(bad), how, passes)
        read = collections.Counter(keys)
        assert len(keys) == n * passes, said
        assert not {names[i] for i in bad} & set(read), said
        assert all(read[names[i]] >= passes for i in range(n) if i not in bad), said
        assert skipped == len(bad) * passes, (skipped, said)


@pytest.mark.parametrize("how", ["without", "junk"])
def test_2_ranks_x_3_workers_complete_an_epoch_of_40_with_10_damaged(tmp_path, how):
    """The case that raised "no readable samples in this worker's shards": one pair's run of 4
    places, and its reserve in the next pass, lay at the window's end, where every sample
    refused while read sat."""
    import warnings

    warnings.simplefilter("ignore")
    bad = set(range(0, 40, 4))
    png_tar(tmp_path / "web-000000.tar", 40)
    assert index("--index", f"web:train={tmp_path}/web-000000.tar", "--out", tmp_path).returncode == 0
    png_tar(tmp_path / "web-000000.tar", 40, **{how: bad})
    keys, skipped = damaged_epoch(tmp_path, 2, 3, 4, 40)
    assert len(keys) == 40 and not {f"s{i}" for i in bad} & set(keys) and len(set(keys)) == 30
    assert skipped == 10


def read_some(stream, most=None):
    """A rank's batches, its workers in turn as a loader takes them, each recorded: (keys, skipped)."""
    keys, _, skipped = read_pass(stream, most)
    return keys, skipped


def test_skipped_across_a_resume_on_another_world_counts_each_damaged_position_once(tmp_path):
    """Random small sets with damaged samples, an epoch of one or two passes stopped after some
    batches on 1 or 2 ranks x 1-3 workers and resumed on the other world: the samples delivered
    are the epoch's, none damaged, and `skipped` over both worlds is the damaged samples once a
    pass."""
    import random
    import warnings

    warnings.simplefilter("ignore")
    rng = random.Random(7)
    for case in range(8):
        before, after = rng.choice(((1, 2), (2, 1)))
        batch_size = rng.choice((2, 4))
        n = 2 * batch_size * rng.randrange(2, 5)
        folder = tmp_path / f"c{case}"
        folder.mkdir()
        png_tar(folder / "web-000000.tar", n)
        assert index("--index", f"web:train={folder}", "--out", folder).returncode == 0
        bad = set(rng.sample(range(n), rng.randrange(1, n // 2)))
        how = rng.choice(("without", "junk"))
        png_tar(folder / "web-000000.tar", n, **{how: bad})
        src = resolve("web", str(folder / "web-train.json"), "train")
        passes = rng.choice((1, 2))

        def streams(world, workers):
            out = []
            for rank in range(world):
                s = MixedStream([src], {"web": 1}, batch_size, Topology(rank, world), seed=5,
                                epoch_samples=n * passes, shuffle_buffer=8, on_error="skip")
                s.set_workers(workers)
                out.append(s)
            return out

        # stopped where what is left fills whole global batches of the new world (a segment leaves
        # less than one unread, and whether damage lay there is no matter here)
        stop = rng.randrange(1, n * passes // (before * batch_size) // after) * after
        first = streams(before, rng.randrange(1, 4))
        head = [read_some(s, stop) for s in first]
        states = json.loads(json.dumps([s.state_dict() for s in first]))
        second = streams(after, rng.randrange(1, 4))
        for s in second:
            s.load_state_dict(states)
        tail = [read_some(s) for s in second]
        keys = [k for part, _ in head + tail for k in part]
        skipped = sum(n for _, n in head + tail)
        said = (case, before, after, batch_size, n, sorted(bad), how, passes, stop)
        assert len(keys) == n * passes and not {f"s{i}" for i in bad} & set(keys), said
        assert skipped == len(bad) * passes, (skipped, said)


def test_a_resume_on_the_same_world_past_the_reserve_reads_what_the_uninterrupted_run_reads(tmp_path):
    """Most samples damaged, so pairs read past their reserves into later passes: stopped after
    some batches and resumed on the same world, each rank's keys and `skipped` are those of the
    run that was not stopped."""
    import random
    import warnings

    warnings.simplefilter("ignore")
    rng = random.Random(8)
    for case in range(6):
        world, workers, batch_size = rng.choice((1, 2)), rng.randrange(1, 4), 2
        n = world * batch_size * rng.randrange(3, 6)
        folder = tmp_path / f"c{case}"
        folder.mkdir()
        png_tar(folder / "web-000000.tar", n)
        assert index("--index", f"web:train={folder}", "--out", folder).returncode == 0
        png_tar(folder / "web-000000.tar", n, **{rng.choice(("without", "junk")): set(rng.sample(range(n), n - 2))})
        src = resolve("web", str(folder / "web-train.json"), "train")

        def streams():
            out = []
            for rank in range(world):
                s = MixedStream([src], {"web": 1}, batch_size, Topology(rank, world), seed=5, epoch_samples=n,
                                shuffle_buffer=8, on_error="skip")
                s.set_workers(workers)
                out.append(s)
            return out

        whole = [read_some(s) for s in streams()]
        stop = rng.randrange(1, n // (world * batch_size))
        first = streams()
        head = [read_some(s, stop) for s in first]
        states = json.loads(json.dumps([s.state_dict() for s in first]))
        second = streams()
        for s, state in zip(second, states):
            s.load_state_dict(state)
        tail = [read_some(s) for s in second]
        got = [(sorted(h + t), a + b) for (h, a), (t, b) in zip(head, tail)]
        assert got == [(sorted(k), m) for k, m in whole], (case, world, workers, n, stop)


def test_extra_reads_of_a_damaged_set_spread_over_its_readable_samples(tmp_path):
    """Random small sets, a fifth to two thirds of the samples without their image, read by 1-3
    ranks x 0-3 workers for epochs that are neither a whole pass nor a multiple of the global
    batch: no good sample is read more than ceil(epoch / good) + 2 times (docs/faults.md: a
    position is read by two pairs at most). Before, every pair that passed over most of its run
    went on into the same ends of the other pairs' reserves (the positions after the epoch's
    target), so a few good samples there were read by every pair: ceil + 8 here, and 400 samples,
    120 damaged, 3 ranks x 4 x 3 workers, an epoch of 384 read 7 of them 9 times."""
    import math
    import random
    import warnings

    warnings.simplefilter("ignore")
    rng = random.Random(7)
    worst = []
    for case in range(24):
        world, workers, batch_size = rng.randrange(1, 4), rng.randrange(4), rng.choice((2, 3, 4))
        n = rng.randrange(24, 61)
        cuts = sorted(rng.sample(range(1, n), rng.randrange(3)))
        folder = tmp_path / f"c{case}"
        folder.mkdir()
        sizes, starts = [b - a for a, b in zip([0, *cuts], [*cuts, n])], [0, *cuts]
        for k, size in enumerate(sizes):
            png_tar(folder / f"web-{k:06d}.tar", size, first=starts[k])
        assert index("--index", f"web:train={folder}", "--out", folder).returncode == 0
        bad = set(rng.sample(range(n), rng.randrange(n // 5, 2 * n // 3)))
        for k, size in enumerate(sizes):
            png_tar(folder / f"web-{k:06d}.tar", size, first=starts[k], without=bad)
        samples = rng.randrange(n // 2, 2 * n)
        while samples % n == 0 or samples % (world * batch_size) == 0:
            samples += 1
        keys, _ = damaged_epoch(folder, world, workers, batch_size, samples)
        read = collections.Counter(keys)
        said = (case, world, workers, batch_size, sizes, len(bad), samples, read.most_common(3))
        assert not {f"s{i}" for i in bad} & set(read), said
        assert max(read.values()) <= math.ceil(samples / (n - len(bad))) + 2, said
        worst.append(max(read.values()) - math.ceil(samples / (n - len(bad))))
    assert max(worst) >= 1  # some case came near the bound: the sets are damaged enough to test it
