"""make_loader(..., decode="device") (issue 55 item 3): a MixedStream's exact-size JPEGs cross the
hand-over as bytes and are decoded after it, on the loader's device. device="cpu" runs the same
path through torchvision's CPU decoder, so its batches must be the host path's byte for byte;
the CUDA case (nvJPEG) runs where a GPU is (here and in tools/gpucheck)."""
import numpy as np
import pytest
import torch

from helpers import jpegs_beside_mnist, make_shards_in_process
from pipeline.data.decoding import gpujpeg
from pipeline.data.handover.loader import make_loader
from pipeline.data.streams.stream import MixedStream, resolve

BATCH, BATCHES = 8, 6


@pytest.fixture(scope="module")
def web(tmp_path_factory):
    """A wds.ShardWriter set of JPEGs of three sizes (one of them the index's 40x56), some grey, and
    its manifest; beside it the raw MNIST-shaped source of helpers.build_shards."""
    return jpegs_beside_mnist(tmp_path_factory.mktemp("web"))


def _stream(sources, normalize, **kw):
    return MixedStream(sources, {s.name: 1 for s in sources}, BATCH, epoch_samples=BATCH * BATCHES,
                       normalize=normalize, **kw)


def _batches(sources, workers, decode, normalize):
    loader = make_loader(_stream(sources, normalize), workers, device="cpu", decode=decode)
    try:
        return [dict(b) for b in loader]
    finally:
        loader.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_batches_decoded_after_the_hand_over_are_the_host_paths_byte_for_byte(web, workers, monkeypatch):
    """uint8 and normalised, one source and a mix with a raw grey one (its images on the host,
    padded and repeated): the same keys, labels, sources and image bytes, and JPEGs did cross
    the hand-over encoded (counted where they are decoded, in this process)."""
    crossed = []
    unpack = gpujpeg.unpack

    def counted(image, sizes, device, move):
        crossed.append(int((sizes > 0).sum()))
        return unpack(image, sizes, device, move)

    monkeypatch.setattr(gpujpeg, "unpack", counted)
    for sources in (web[:1], web):
        for normalize in (False, True):
            host = _batches(sources, workers, "host", normalize)
            assert not crossed
            device = _batches(sources, workers, "device", normalize)
            assert len(host) == len(device) == BATCHES and sum(crossed) > 0
            crossed.clear()
            for a, b in zip(host, device):
                assert sorted(a) == sorted(b) and a["key"] == b["key"] and a["skipped"] == b["skipped"]
                for name in ("image", "label", "source"):
                    assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


def test_only_the_canvas_sized_default_schema_sources_leave_their_jpegs_encoded(web):
    """The slot gains one int32 a sample; the grey 28x28 source (padded, repeated on a 40x56
    canvas) is decoded on the host; a normalising stream's slot holds uint8, normalised after."""
    stream = _stream(web, normalize=True)
    spec = stream.batch_spec()
    loader = make_loader(stream, 0, device="cpu", decode="device")
    assert stream.layout.encoded == [True, False]
    got = {f.name: (f.dtype, f.shape) for f in loader.ring.spec.fields}
    assert got[gpujpeg.SIZES] == (np.dtype(np.int32), ()) and got["image"][0] == np.uint8
    assert loader.ring.spec.slot_bytes <= spec.slot_bytes  # float32 images gone, 4 bytes a sample come
    assert {f.name for f in spec.fields} == set(got) - {gpujpeg.SIZES}
    loader.close()


def test_a_stream_sharing_the_layout_keeps_decoding_on_the_host(web):
    """The decode is the loader's: an evaluation stream made from the same layout, and a later
    loader over the same stream without decode=, get the host's layout back."""
    stream = _stream(web, normalize=True)
    evaluation = stream.eval_stream(web[0])
    make_loader(stream, 0, device="cpu", decode="device").close()
    assert gpujpeg.SIZES not in evaluation.batch_spec().names
    assert {f.name: f.dtype for f in evaluation.batch_spec().fields}["image"] == np.float32
    loader = make_loader(stream, 0, device="cpu")
    assert gpujpeg.SIZES not in loader.ring.spec.names and not any(stream.layout.encoded)
    loader.close()


def test_decode_device_is_refused_in_one_line_where_it_cannot_work(web):
    """No device, sample stages (they see pixels), an evaluation stream, an unknown place."""
    with pytest.raises(ValueError, match="needs a device="):
        make_loader(_stream(web, False), 0, decode="device")
    with pytest.raises(ValueError, match="sample stages need their pixels"):
        make_loader(_stream(web, False, sample_stages=[lambda s: s]), 0, device="cpu", decode="device")
    with pytest.raises(ValueError, match="MixedStream"):
        make_loader(_stream(web, False).eval_stream(web[0]), 0, device="cpu", decode="device")
    with pytest.raises(ValueError, match="'host' or 'device', got 'gpu'"):
        make_loader(_stream(web, False), 0, device="cpu", decode="gpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("workers", [0, 2])
def test_on_cuda_the_batches_are_the_host_paths_within_the_decoders_rounding(web, workers):
    """nvJPEG (another IDCT): every image within a level or two of libjpeg-turbo's on average,
    the rest equal, the images on the GPU."""
    host = _batches(web, workers, "host", False)
    loader = make_loader(_stream(web, False), workers, device="cuda", decode="device")
    for a, b in zip(host, loader):
        assert b["image"].device.type == "cuda" and a["key"] == b["key"]
        assert torch.equal(a["label"], b["label"].cpu())
        assert (a["image"].int() - b["image"].cpu().int()).abs().float().mean() < 3
    loader.close()


def test_the_trainer_flag_takes_host_or_device_and_refuses_sample_stages(capsys):
    """--decode-on: host by default, device accepted, device beside --sample-stage one line, exit 2."""
    from pipeline.train import options

    assert options.parse(["--train", "a=x/"]).decode_on == "host"
    assert options.parse(["--train", "a=x/", "--decode-on", "device"]).decode_on == "device"
    with pytest.raises(SystemExit) as e:
        options.parse(["--train", "a=x/", "--decode-on", "device", "--sample-stage", "m:f"])
    assert e.value.code == 2 and "--sample-stage needs their pixels" in capsys.readouterr().err


def test_a_jpeg_neither_decoder_takes_after_the_hand_over_is_counted_in_skipped(tmp_path):
    """A JPEG whose header passes but whose scan holds a stray FF C8 marker: torchvision and the
    host decoder both refuse it after the hand-over, so its image is zeros (the batch has left its
    worker) and each such sample is counted in the batch's `skipped`, with a warning saying so."""
    from helpers import encoded, smooth, write_foreign

    good = [encoded(smooth(3, 32, 32, seed=i), "JPEG", quality=90) for i in range(16)]
    scan = good[5].index(b"\xff\xda")
    middle = (scan + len(good[5])) // 2
    bad = good[5][:middle] + b"\xff\xc8" + good[5][middle:]

    def write(broken):
        write_foreign(tmp_path / "set", 16, 8, "s-{:04d}.tar", lambda i: (f"{i:06d}", [
            (f"{i:06d}.jpg", bad if broken and i == 5 else good[i]), (f"{i:06d}.cls", str(i % 2).encode())]))

    write(False)  # indexed whole (the index would refuse the broken one), broken after
    p = make_shards_in_process(["--quiet", "--index", f"x:train={tmp_path}/set", "--out", str(tmp_path / "m")])
    assert p.returncode == 0, p.stderr
    write(True)
    stream = MixedStream([resolve("x", str(tmp_path / "m"), "train")], {"x": 1}, 8, epoch_samples=16, normalize=False)
    loader = make_loader(stream, 0, device="cpu", decode="device")
    keys, skipped = [], 0
    with pytest.warns(UserWarning, match="refused after the hand-over"):
        for b in loader:
            keys += b["key"]
            skipped += int(b["skipped"])
            for key, image in zip(b["key"], b["image"]):
                assert (key == "000005") == (not image.any()), key
    loader.close()
    assert keys.count("000005") >= 1 and skipped == keys.count("000005")


def test_a_stream_whose_jpegs_all_decode_on_the_host_says_so(web, tmp_path):
    """A --fields source (its own schema) or the raw MNIST one alone: decode="device" moves no
    JPEG to the device, and one warning says every image decodes on the host."""
    from pipeline.data.fields.schema import parse_fields

    fields = {"web": parse_fields("image:image=jpg,size=40x56 label:class=cls")}
    for sources, kw in ((web[:1], {"schemas": fields}), (web[1:], {})):
        with pytest.warns(UserWarning, match="decode='device': no source's JPEGs .* decoded on the host"):
            make_loader(_stream(sources, False, **kw), 0, device="cpu", decode="device").close()


def test_decode_on_device_in_a_cpu_run_says_it_decodes_on_the_host_and_records_it(tmp_path):
    """--decode-on device without a GPU: one line says the host decodes, and summary.json's
    config records decode_on "host", what ran."""
    import json

    from helpers import build_shards, train_in_process

    build_shards(tmp_path / "d", "mnist", "train", 40, maxcount=20)
    p = train_in_process(["--train", f"mnist={tmp_path}/d/", "--epochs", "1", "--batch-size", "8", "--workers",
                          "0", "--width", "4", "--decode-on", "device", "--out", str(tmp_path / "o")])
    assert p.returncode == 0, p.stderr
    assert "--decode-on device needs a GPU; this CPU run decodes on the host" in p.stderr
    assert json.loads((tmp_path / "o" / "summary.json").read_text())["config"]["decode_on"] == "host"
