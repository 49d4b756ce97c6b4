"""The README's streaming-API example and examples/ run as written: the README block is taken
from README.md itself, so the two cannot drift apart unnoticed."""
import re
import sys
from pathlib import Path

import pytest

from helpers import HANG, build_shards, run_capture

ROOT = Path(__file__).resolve().parents[1]


def shards(tmp_path):
    """tmp_path/shards, the folder the README's example reads (relative to where it runs)."""
    out = tmp_path / "shards"
    out.mkdir()
    build_shards(out, "mnist", "train", 200, shape=(1, 28, 28), maxcount=50)
    build_shards(out, "cifar10", "train", 200, shape=(3, 32, 32), maxcount=50)
    return out


@pytest.mark.slow
def test_the_readme_api_example_runs_on_shards(tmp_path):
    block = re.search(r"## The streaming API in your own loop\n\n```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert block, "README.md has no streaming-API example"
    code = block.group(1) + "\nassert x.shape == (64, 3, 32, 32) and y.shape == (64,) and sorted(state)\nprint('ok')\n"
    r = run_capture([sys.executable, "-c", code], cwd=shards(tmp_path).parent, capture_output=True, text=True, timeout=HANG,
                    env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]


@pytest.mark.slow
def test_examples_stream_api_prints_shapes_and_state(tmp_path):
    r = run_capture([sys.executable, str(ROOT / "examples" / "stream_api.py"), str(shards(tmp_path))],
                    capture_output=True, text=True, timeout=HANG, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "epoch 0:" in r.stdout and "image (64, 3, 32, 32) torch.float32" in r.stdout and "state keys:" in r.stdout


@pytest.mark.slow
def test_examples_stream_api_takes_each_data_set_from_its_own_place(tmp_path):
    """It assumed both data sets in one folder: NAME=SPEC pairs, as the trainer's --train takes them."""
    for name, shape in (("mnist", (1, 28, 28)), ("cifar10", (3, 32, 32))):
        (tmp_path / name).mkdir()
        build_shards(tmp_path / name, name, "train", 200, shape=shape, maxcount=50)
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    r = run_capture([sys.executable, str(ROOT / "examples" / "stream_api.py"), f"mnist={tmp_path}/mnist/",
                     f"cifar10={tmp_path}/cifar10/cifar10-train.json"], capture_output=True, text=True,
                    timeout=HANG, env=env)
    assert r.returncode == 0 and "epoch 1:" in r.stdout and "image (64, 3, 32, 32)" in r.stdout, r.stderr[-2000:]
    r = run_capture([sys.executable, str(ROOT / "examples" / "stream_api.py"), f"mnist={tmp_path}/mnist/",
                     "mnist=x"], capture_output=True, text=True, timeout=HANG, env=env)
    assert r.returncode == 1 and r.stderr == ("stream_api: error: 'mnist=x': expected NAME=SPEC, once per name "
                                              "(mnist=shards/), or a folder\n")


def test_examples_my_stages_keep_shape_and_dtype_and_flip_by_seed():
    import importlib.util

    import numpy as np

    spec = importlib.util.spec_from_file_location("my_stages", ROOT / "examples" / "my_stages.py")
    stages = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stages)
    image = np.arange(3 * 4 * 5, dtype=np.uint8).reshape(3, 4, 5)
    out = [stages.flip({"__source__": "cifar10", "image": image.copy(), "__seed__": s})["image"] for s in range(40)]
    assert all(o.shape == image.shape and o.dtype == np.uint8 for o in out)
    mirrored = [bool((o == image[:, :, ::-1]).all()) for o in out]
    assert 5 < sum(mirrored) < 35  # about half, chosen by the seed
    assert mirrored == [bool((stages.flip({"image": image.copy(), "__seed__": s})["image"] == image[:, :, ::-1]).all())
                        for s in range(40)]  # the same seed, the same choice
    inv = stages.invert({"__source__": "cifar10", "image": image.copy()})["image"]
    assert (inv == 255 - image).all()


SCRIPTS = sorted(str(p.relative_to(ROOT)) for d in ("tools", "examples") for p in (ROOT / d).glob("*.py"))


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_answers_help(script, tmp_path):
    """`--help` of every tool and example exits 0 with a usage line and a description, run from
    elsewhere (so no default folder of the repo is read), and writes nothing."""
    r = run_capture([sys.executable, str(ROOT / script), "--help"], cwd=tmp_path, capture_output=True, text=True,
                    timeout=HANG, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stdout.startswith("usage: ") and len(r.stdout.splitlines()) > 2, r.stdout
    assert list(tmp_path.iterdir()) == []
