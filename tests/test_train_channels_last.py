"""The trainer's --channels-last: the training and evaluation batches reach the model with
torch.channels_last strides (make_loader's memory_format), the model's weights are in that
layout too (before DDP wraps it), whatever the --model kind; the run trains to the same weights
as without the flag (to a float tolerance: convolutions in NHWC may round otherwise), a resume
may add or drop the flag, and a model that `.view()`s its input is refused in one line."""
import json
import os
import sys
import textwrap

import pytest
import torch

from helpers import _launch_env, build_shards, finish, free_port, launchers, tool_module, train_in_process
from pipeline.errors import InputError
from pipeline.train import options
from pipeline.train.model import build_model

BATCH = 8

# the user's file of the tests: a small CNN that writes, for each batch it is given, whether the
# batch and its convolution's weight are channels-last (a file per rank: under torchrun too)
USER = textwrap.dedent("""
    import json
    import os

    import torch
    from torch import nn

    class Probe(nn.Module):
        def __init__(self, c, n):
            super().__init__()
            self.conv, self.bn, self.fc = nn.Conv2d(c, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Linear(4, n)

        def forward(self, x):
            if len(x) == 8:  # the batches, not the blank pair the trainer checks the model on
                last = torch.channels_last
                seen = {"training": self.training, "contiguous": x.is_contiguous(),
                        "last": x.is_contiguous(memory_format=last),
                        "weight_last": self.conv.weight.is_contiguous(memory_format=last)
                        and not self.conv.weight.is_contiguous()}
                with open(f"layouts-rank{os.environ.get('RANK', '0')}.jsonl", "a") as f:
                    f.write(json.dumps(seen) + "\\n")
            return self.fc(self.bn(self.conv(x)).relu().amax((2, 3)))

    def probe(num_classes, shape):
        return Probe(shape[0], num_classes)

    class Viewer(nn.Module):
        def __init__(self, size, n):
            super().__init__()
            self.fc = nn.Linear(size, n)

        def forward(self, x):
            return self.fc(x.view(len(x), -1))

    def viewer(num_classes, shape):
        return Viewer(shape[0] * shape[1] * shape[2], num_classes)

    class ConvThenView(nn.Module):
        def __init__(self, c, h, w, n):
            super().__init__()
            self.conv, self.fc = nn.Conv2d(c, 2, 3, padding=1), nn.Linear(2 * h * w, n)

        def forward(self, x):
            return self.fc(self.conv(x).view(len(x), -1))

    def conv_then_view(num_classes, shape):
        return ConvThenView(*shape, num_classes)

    class WithConv3d(nn.Module):
        def __init__(self, c, n):
            super().__init__()
            self.conv, self.video, self.fc = nn.Conv2d(c, 4, 3, padding=1), nn.Conv3d(1, 1, 1), nn.Linear(4, n)

        def forward(self, x):
            return self.fc(self.conv(x).amax((2, 3)))

    def with_conv3d(num_classes, shape):
        return WithConv3d(shape[0], num_classes)

    class Locked(ConvThenView):
        def __init__(self, *a):
            import threading
            super().__init__(*a)
            self.lock = threading.Lock()  # copy.deepcopy refuses it

    def locked(num_classes, shape):
        return Locked(*shape, num_classes)

    def lazy(num_classes, shape):
        return nn.Sequential(nn.LazyConv2d(4, 3, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                             nn.LazyLinear(num_classes))
""")


@pytest.fixture(scope="module")
def colour(tmp_path_factory):
    """cifar10 3x16x16 raw: 96 training samples in shards of 24, 32 test samples."""
    folder = tmp_path_factory.mktemp("colour")
    build_shards(folder, "cifar10", "train", 96, shape=(3, 16, 16), maxcount=24)
    build_shards(folder, "cifar10", "test", 32, shape=(3, 16, 16), maxcount=16)
    return folder


@pytest.fixture
def user_file(tmp_path, monkeypatch):
    """mymodule.py in a folder of its own, made the current folder (as test_models' user_file)."""
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "mymodule.py").write_text(USER)
    monkeypatch.chdir(folder)
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.delitem(sys.modules, "mymodule", raising=False)
    return folder


def common(colour, out, model="mymodule:probe"):
    return ["--train", f"cifar10={colour}/", "--eval", f"cifar10={colour}/", "--model", model, "--width", "4",
            "--epochs", "1", "--epoch-samples", "48", "--batch-size", str(BATCH), "--workers", "0",
            "--seed", "3", "--out", str(out)]


def layouts(folder, rank=0):
    with open(folder / f"layouts-rank{rank}.jsonl") as f:
        return [json.loads(ln) for ln in f]


def weights(out):
    return torch.load(out / "checkpoint.pt", weights_only=True)["model"]


def assert_close_weights(a, b):
    assert a.keys() == b.keys()
    for k in a:  # NHWC convolutions may add in another order: a float tolerance, not bits
        assert torch.allclose(a[k].float(), b[k].float(), rtol=1e-3, atol=1e-5), k


def test_the_flag_is_off_by_default_and_recorded():
    assert options.parse(["--train", "a=x/"]).channels_last is False
    assert options.parse(["--train", "a=x/", "--channels-last"]).channels_last is True
    both = options.parse(["--train", "a=x/", "--channels-last", "--decode-on", "device"])  # the loader keeps the
    assert both.channels_last and both.decode_on == "device"  # layout through the decode (test_channels_last.py)


def test_a_users_model_gets_channels_last_batches_with_the_flag_and_the_same_weights(colour, user_file):
    """One process: with the flag every training and evaluation batch, and the convolution's
    weight, is channels-last (three channels: not also contiguous); without it none is; both
    runs end with the same weights to a float tolerance."""
    runs = {}
    for flag in (False, True):
        out = user_file / f"run-{flag}"
        p = train_in_process([*common(colour, out), *["--channels-last"] * flag])
        assert p.returncode == 0, p.stderr[-2000:]
        seen = layouts(user_file)
        os.remove(user_file / "layouts-rank0.jsonl")
        assert sum(s["training"] for s in seen) == 6 and sum(not s["training"] for s in seen) == 4  # 48 / 8, 32 / 8
        for s in seen:
            assert s == {"training": s["training"], "contiguous": not flag, "last": flag, "weight_last": flag}, s
        summary = json.loads((out / "summary.json").read_text())
        assert summary["config"]["channels_last"] is flag
        runs[flag] = weights(out)
    assert_close_weights(runs[False], runs[True])


@pytest.mark.parametrize("model, steps", [("cnn", 6), ("resnet18", 1)])
def test_every_model_kind_trains_channels_last_to_the_same_weights(colour, user_file, monkeypatch, model, steps):
    """The default CNN and a torchvision model (BatchNorm, strided convolutions): the model's
    input and its convolutions' weights channels-last with the flag (seen by a hook on the model
    the trainer builds), the weights after `steps` as without the flag. resnet18 for one step only: on 16x16 images its
    last stages are 1x1, where BatchNorm normalises 8 values a channel, and there a change of
    1e-6 in the weights (without the flag) moves the next step's gradients by 10% or more: the
    two layouts' rounding grows alike, and only the first step compares to a tolerance."""
    from pipeline.train import run as run_module

    seen, real = [], run_module.build_model

    def record(module, args):
        if len(args[0]) == BATCH:  # the batches, not the blank pair the trainer checks the model on
            kernels = [p for p in module.parameters() if p.dim() == 4]  # 1x1 ones have both layouts' strides
            seen.append((args[0].is_contiguous(), args[0].is_contiguous(memory_format=torch.channels_last),
                         all(p.is_contiguous(memory_format=torch.channels_last) for p in kernels)
                         and not all(p.is_contiguous() for p in kernels)))

    def built(*a, **kw):
        model = real(*a, **kw)
        model.register_forward_pre_hook(record)
        return model

    monkeypatch.setattr(run_module, "build_model", built)
    runs = {}
    for flag in (False, True):
        out = user_file / f"run-{flag}"
        p = train_in_process([*common(colour, out, model), *["--channels-last"] * flag, "--stop-after-steps", steps])
        assert p.returncode == 0, p.stderr[-2000:]
        evals = 4 if steps == 6 else 0  # 32 test samples / 8, after the epoch's 48 / 8 steps
        assert len(seen) == steps + evals and set(seen) == {(not flag, flag, flag)}, seen
        seen.clear()
        runs[flag] = weights(out)
    assert_close_weights(runs[False], runs[True])


def test_a_resume_may_add_or_drop_the_flag(colour, user_file):
    """Stopped after 3 steps with the flag and resumed without it (and the other way round): the
    run ends with the uninterrupted run's weights (to a float tolerance), and metrics.jsonl's
    resumed line says which layout the resume took."""
    whole = user_file / "whole"
    p = train_in_process(common(colour, whole, "cnn"))
    assert p.returncode == 0, p.stderr[-2000:]
    for first, then in ((["--channels-last"], []), ([], ["--channels-last"])):
        out = user_file / f"resumed-{bool(first)}"
        p = train_in_process([*common(colour, out, "cnn"), *first, "--stop-after-steps", "3"])
        assert p.returncode == 0, p.stderr[-2000:]
        saved = torch.load(out / "checkpoint.pt", weights_only=True)
        assert json.loads(saved["config"])["channels_last"] is bool(first)
        assert json.loads(saved["position"])["step"] == 3
        p = train_in_process([*common(colour, out, "cnn"), *then, "--resume"])
        assert p.returncode == 0, p.stderr[-2000:]
        resumed = [json.loads(ln) for ln in open(out / "metrics.jsonl") if '"resumed"' in ln]
        assert [(r["step"], r["channels_last"]) for r in resumed] == [(3, bool(then))]
        assert json.loads((out / "summary.json").read_text())["config"]["channels_last"] is bool(then)
        assert_close_weights(weights(whole), weights(out))


def test_a_model_that_views_its_input_is_refused_in_one_line_with_the_flag(user_file):
    build_model("mymodule:viewer", 10, (3, 8, 8), 64)  # contiguous batches: .view works
    with pytest.raises(InputError) as e:
        build_model("mymodule:viewer", 10, (3, 8, 8), 64, channels_last=True)
    message = str(e.value)
    assert "\n" not in message and "--channels-last" in message and ".reshape its input rather than .view" in message
    assert "resize the data" not in message  # the layout, not the size


def test_a_view_after_a_convolution_is_named_as_the_layout_not_the_size(user_file):
    """A model that .view()s a convolution's output trains without the flag; with it, the retry on
    contiguous images kept the channels-last weights, so the conv's output was channels-last again
    and the refusal blamed the image size (hostileI)."""
    build_model("mymodule:conv_then_view", 10, (3, 8, 8), 64)
    with pytest.raises(InputError) as e:
        build_model("mymodule:conv_then_view", 10, (3, 8, 8), 64, channels_last=True)
    message = str(e.value)
    assert ".reshape its input rather than .view" in message and "resize the data" not in message, message


def test_weights_of_other_than_4_dimensions_stay_as_they_are(user_file):
    """Module.to(memory_format=channels_last) raised on a Conv3d's 5-d weight, a traceback (hostileI):
    the 4-d weights go channels-last, the others stay."""
    made = build_model("mymodule:with_conv3d", 10, (3, 8, 8), 64, channels_last=True)
    assert made.conv.weight.is_contiguous(memory_format=torch.channels_last) and not made.conv.weight.is_contiguous()
    assert made.video.weight.dim() == 5 and made.video.weight.is_contiguous()


def test_a_model_no_copy_can_be_made_of_is_refused_in_one_line_and_a_lazy_one_is_laid_out(user_file):
    """The layout check copied the model: one holding a lock raised "cannot pickle" as a traceback;
    a lazy module's parameters had no dims to ask before their first forward (hostileJ)."""
    with pytest.raises(InputError, match=r"\.reshape its input rather than \.view"):
        build_model("mymodule:locked", 10, (3, 8, 8), 64, channels_last=True)
    made = build_model("mymodule:lazy", 10, (3, 8, 8), 64, channels_last=True)
    assert made[0].weight.is_contiguous(memory_format=torch.channels_last) and not made[0].weight.is_contiguous()


def launch_in(folder, args, nproc):
    """torchrun -m pipeline.train ARGS with `folder` as the current folder (as test_models')."""
    root, env = _launch_env(())
    entry = ["--run-path", "--start-method=fork", os.path.join(root, "tests", "forked_rank.py")]
    return launchers().start([f"--nproc_per_node={nproc}", f"--master_port={free_port()}", *entry, *map(str, args)],
                             env, folder)


def test_two_ranks_train_and_evaluate_on_channels_last_batches(colour, user_file):
    """torchrun, 2 ranks on gloo, a loader worker each: every batch each rank's model (in DDP,
    its weight channels-last) is given, training and evaluation, is channels-last."""
    out = user_file / "run"
    args = [*common(colour, out), "--workers", "1", "--channels-last"]
    code, err = finish(launch_in(user_file, args, 2))
    assert code == 0, err[-3000:]
    for rank in (0, 1):
        seen = layouts(user_file, rank)
        assert sum(s["training"] for s in seen) == 3 and sum(not s["training"] for s in seen) == 2  # 48 / 2 / 8
        assert all(s["last"] and not s["contiguous"] and s["weight_last"] for s in seen), seen


def test_the_step_benchmark_prints_both_layouts_medians(capsys):
    """tools/bench_channels_last.py (the figures of docs/training.md's --channels-last), tiny."""
    assert tool_module("bench_channels_last").main(["--width", "2", "--batch-size", "4", "--side", "8",
                                                    "--rounds", "3"]) == 0
    line = json.loads(capsys.readouterr().out)
    assert line["steps"] == 1 and line["contiguous_s"] > 0 and line["channels_last_s"] > 0
    ratio = line["channels_last_s"] / line["contiguous_s"]  # of the medians as rounded
    assert line["ratio"] == pytest.approx(ratio, rel=0.05)
