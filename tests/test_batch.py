"""pipeline.data.fields.batch: collate and normalize give exactly what the straightforward formulas
they replaced give (a windowed, channel-broadcast assignment per source; uint8 * scale - shift)."""
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pipeline.data.decoding import rgbx
from pipeline.data.fields import batch as batch_module
from pipeline.data.fields.batch import Layout


def sources():
    """A grey 28x28 source, an RGB 32x32 one and an RGB 30x30 one: padding, channel repeat, neither."""
    return [SimpleNamespace(name="grey", classes=range(10), shape=(1, 28, 28), mean=(0.13,), std=(0.31,)),
            SimpleNamespace(name="rgb", classes=range(10), shape=(3, 32, 32), mean=(0.49, 0.48, 0.45),
                            std=(0.25, 0.24, 0.26)),
            SimpleNamespace(name="small", classes=range(3), shape=(3, 30, 30), mean=(0.5, 0.4, 0.3),
                            std=(0.2, 0.3, 0.1))]


def parts_for(choice, layout, rng):
    parts = []
    for s, src in enumerate(layout.sources):
        n = int((choice == s).sum())
        parts.append(([f"{src.name}-{i}" for i in range(n)], rng.integers(0, 256, (n, *src.shape), dtype=np.uint8),
                      rng.integers(0, len(src.classes), n)))
    return parts


def old_collate(layout, choice, parts):
    """The collate this module had before: one windowed assignment per source."""
    b, (h, w) = len(choice), layout.hw
    u8, keys, label = np.zeros((b, 3, h, w), np.uint8), np.empty(b, object), np.empty(b, np.int64)
    for s, (k, pixels, labels) in enumerate(parts):
        if not len(k):
            continue
        idx = np.flatnonzero(choice == s)
        sh, sw = pixels.shape[2:]
        top, left = (h - sh) // 2, (w - sw) // 2
        u8[idx, :, top:top + sh, left:left + sw] = pixels
        keys[idx] = k
        label[idx] = labels + layout.offsets[s]
    return u8, keys.tolist(), label


@pytest.mark.parametrize("canvas", [False, True])
@pytest.mark.parametrize("weights", [(1, 1, 1), (1, 0, 0), (0, 1, 0), (0, 0, 1)])
def test_collate_places_every_source_as_the_windowed_assignment_did(canvas, weights):
    layout, rng = Layout(sources()), np.random.default_rng(1)
    p = np.array(weights, float) / sum(weights)
    choice = rng.choice(3, size=37, p=p)
    parts = parts_for(choice, layout, rng)
    given = np.full(layout.batch_shape(37), 77, np.uint8) if canvas else None  # a reused buffer: last batch's bytes
    batch = layout.collate(choice, parts, skipped=2, out=None if given is None else {"image": given})
    image, keys, label = old_collate(layout, choice, parts)
    assert batch["image"].dtype == np.uint8 and np.array_equal(batch["image"], image)
    assert batch["key"] == keys and all(isinstance(k, str) for k in keys)
    assert np.array_equal(batch["label"], label) and batch["label"].dtype == np.int64
    assert np.array_equal(batch["source"], choice) and batch["skipped"] == 2
    if canvas:
        assert batch["image"] is given
    grey = np.flatnonzero(choice == 0)
    if len(grey):  # the grey image in all 3 channels, zeros around it
        assert (batch["image"][grey, 1] == batch["image"][grey, 0]).all()
        assert not batch["image"][grey][:, :, :2].any() and not batch["image"][grey][:, :, :, 30:].any()


def hwc_view(p):
    return np.ascontiguousarray(p.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)


def rgbx_view(p):
    """p as decode_batch's view="rgbx" hands it on (rgbx.joined), its fourth bytes not zero."""
    n, c, h, w = p.shape
    if c != 3:
        return hwc_view(p)
    four = np.full((n, h, w, 4), 201, np.uint8)
    four[..., :3] = p.transpose(0, 2, 3, 1)
    return rgbx.joined(list(four), n, h, w)


@pytest.mark.parametrize("weights", [(1, 1, 1), (0, 1, 0)])
@pytest.mark.parametrize("view", [hwc_view, rgbx_view])
@pytest.mark.parametrize("memory_format", ["contiguous", "channels_last"])
def test_collate_places_chw_views_of_decoded_images_as_their_copies(weights, view, memory_format):
    """The stream's decoded JPEGs come as CHW views of an HWC or RGBX buffer (decode_batch view=):
    collate's copy into the batch, a slice for one source's run of rows, a gather else,
    gives exactly what contiguous images give, in a batch of its memory format."""
    layout, rng = Layout(sources()).laid_out(memory_format), np.random.default_rng(4)
    choice = rng.choice(3, size=29, p=np.array(weights, float) / sum(weights))
    parts = parts_for(choice, layout, rng)
    views = [(k, view(p), labels) for k, p, labels in parts]
    assert all(v.shape == p.shape and (not len(v) or not v.flags.c_contiguous) for (_, v, _), (_, p, _)
               in zip(views, parts) if v.shape[1] > 1)
    if view is rgbx_view:  # else the plane-by-plane copy was not taken
        assert any(len(v) and rgbx.planes(v) is not None for _, v, _ in views)
    made = layout.collate(choice, parts)["image"]
    given = np.full_like(made, 77)  # in made's memory format
    batch = layout.collate(choice, views, out={"image": given})
    assert batch["image"] is given and given.strides == made.strides
    assert given.flags.c_contiguous == (memory_format == "contiguous")
    assert np.array_equal(given, made)
    assert np.array_equal(given, old_collate(layout, choice, parts)[0])


def test_collate_zeroes_the_places_of_a_source_that_gave_nothing():
    layout, rng = Layout(sources()), np.random.default_rng(3)
    choice = np.array([0, 1, 1, 2, 0])
    parts = parts_for(choice, layout, rng)
    parts[1] = ([], np.zeros((0, 3, 32, 32), np.uint8), np.zeros(0, np.int64))
    batch = layout.collate(choice, parts, out={"image": np.full(layout.batch_shape(5), 9, np.uint8)})
    assert not batch["image"][1:3].any()
    assert np.array_equal(batch["image"][[0, 3, 4]], old_collate(layout, choice, parts)[0][[0, 3, 4]])


def test_collate_into_a_slot_writes_every_field_and_normalises_float32_images():
    """A reused slot holds the last batch's bytes: every field is written over, and a float32
    image field gets Layout.normalize of the uint8 batch, bit for bit."""
    layout, rng = Layout(sources()), np.random.default_rng(5)
    choice = rng.choice(3, size=23)
    parts = parts_for(choice, layout, rng)
    plain = layout.collate(choice, parts)
    out = {"image": np.full(layout.batch_shape(23), np.nan, np.float32), "label": np.full(23, -7, np.int64),
           "source": np.full(23, 9, np.int64)}
    batch = layout.collate(choice, parts, out=out)
    assert all(batch[k] is out[k] for k in out)
    assert np.array_equal(batch["label"], plain["label"]) and np.array_equal(batch["source"], choice)
    assert torch.equal(torch.from_numpy(batch["image"]), layout.normalize(plain["image"], plain["source"]))


def old_normalize(layout, image, source):
    o = np.empty(image.shape, np.float32)
    np.multiply(image, layout.scale.numpy()[source], out=o)
    o -= layout.shift.numpy()[source]
    return o


@pytest.fixture
def torch_threads():
    """Sets torch's thread count for one test and puts the old one back."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])  # normalize runs in one thread and leaves the count as it was
def test_normalize_is_bit_identical_to_the_old_formula(torch_threads, threads):
    torch_threads(threads)
    layout, rng = Layout(sources()), np.random.default_rng(2)
    choice = rng.integers(0, 3, 64)
    batch = layout.collate(choice, parts_for(choice, layout, rng))
    batch["image"][:3] = 255  # the extremes
    batch["image"][3:6] = 0
    out = layout.normalize(batch["image"], batch["source"])
    assert out.dtype == torch.float32 and out.shape == batch["image"].shape
    assert np.array_equal(out.numpy(), old_normalize(layout, batch["image"], batch["source"]))
    stats = sources()
    std = np.array([s.std * (3 // len(s.std)) for s in stats])[batch["source"]][:, :, None, None]
    mean = np.array([s.mean * (3 // len(s.mean)) for s in stats])[batch["source"]][:, :, None, None]
    exact = (batch["image"] / 255.0 - mean) / std
    assert np.abs(out.numpy() - exact).max() < 1e-5  # the textbook formula, to float32 rounding
    same = layout.normalize(torch.from_numpy(batch["image"]), torch.from_numpy(batch["source"]))
    assert torch.equal(same, out)
    assert torch.get_num_threads() == threads


def test_normalize_gives_the_thread_count_back_when_it_fails(torch_threads):
    torch_threads(2)
    layout = Layout(sources())
    with pytest.raises(IndexError):
        layout.normalize(np.zeros((2, 3, 32, 32), np.uint8), np.array([0, 7]))  # no source 7
    assert torch.get_num_threads() == 2


def test_normalize_from_several_threads_keeps_each_threads_count_and_values(torch_threads):
    torch_threads(2)
    layout, rng = Layout(sources()), np.random.default_rng(3)
    choice = rng.integers(0, 3, 64)
    batch = layout.collate(choice, parts_for(choice, layout, rng))
    want = old_normalize(layout, batch["image"], batch["source"])
    ready, seen = threading.Barrier(3), []

    def work():
        before = torch.get_num_threads()  # a thread that has run torch already has its count
        ready.wait()
        same = all(np.array_equal(layout.normalize(batch["image"], batch["source"]).numpy(), want) for _ in range(50))
        seen.append((before, torch.get_num_threads(), same))

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    work()
    for t in threads:
        t.join()
    assert seen == [(2, 2, True)] * 3


def test_normalize_switches_threads_only_where_no_other_python_thread_runs(torch_threads, monkeypatch):
    """torch.set_num_threads also sets the count a thread takes at its first parallel op: a
    thread reaching that op inside the switch would keep one thread for good."""
    torch_threads(2)
    layout, rng = Layout(sources()), np.random.default_rng(4)
    choice = rng.integers(0, 3, 16)
    batch = layout.collate(choice, parts_for(choice, layout, rng))
    want = old_normalize(layout, batch["image"], batch["source"])
    switched, real = [], torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (switched.append(n), real(n)))
    for alone, switches in [(True, [1, 2]), (False, [])]:
        monkeypatch.setattr(batch_module, "_alone", lambda: alone)
        switched.clear()
        assert np.array_equal(layout.normalize(batch["image"], batch["source"]).numpy(), want)
        assert switched == switches


def test_alone_means_no_other_thread_but_a_dataloaders_queue_feeders(monkeypatch):
    me = threading.current_thread()

    class Named:
        def __init__(self, name):
            self.name = name

    for others, alone in [([], True), ([Named("QueueFeederThread")], True), ([Named("Thread-3 (serve)")], False)]:
        monkeypatch.setattr(threading, "enumerate", lambda: [me, *others])
        assert batch_module._alone() is alone


@pytest.mark.parametrize("dtype", [np.uint8, np.int16, np.int32])
def test_normalize_takes_source_indices_of_any_integer_type(dtype):
    layout, rng = Layout(sources()), np.random.default_rng(5)
    choice = rng.integers(0, 3, 16)
    batch = layout.collate(choice, parts_for(choice, layout, rng))
    want = layout.normalize(batch["image"], batch["source"])
    assert torch.equal(layout.normalize(batch["image"], batch["source"].astype(dtype)), want)


@pytest.mark.parametrize("source", [np.array([0.0, 1.0]), np.array([True, False]), torch.tensor([0.5, 1.0])])
def test_normalize_refuses_source_indices_that_are_not_integers(source):
    with pytest.raises(TypeError, match="integers"):
        Layout(sources()).normalize(np.zeros((2, 3, 32, 32), np.uint8), source)


def test_normalize_takes_a_list_of_source_indices():
    layout, image = Layout(sources()), np.full((2, 3, 32, 32), 255, np.uint8)
    assert torch.equal(layout.normalize(image, [0, 2]), layout.normalize(image, np.array([0, 2])))
