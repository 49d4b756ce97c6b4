"""--model: a torchvision classification model by name or MODULE:FUNCTION of the user's own,
built for the manifests' classes and image shape, checked on a blank batch before the run,
part of the run's fingerprint; and the trainer's guarantees with such a model (2 ranks under
torchrun, resumed on another world size with no sample read twice)."""
import json
import os
import sys
import textwrap

import pytest
import torch

from helpers import _launch_env, finish, free_port, launchers, run_capture
from pipeline.errors import InputError
from pipeline.train import checkpoint, options
from pipeline.train.model import build_model, check_name
from pipeline.train.metrics import read_keys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the user's file of the tests: a model without BatchNorm (no buffers at all), one with
# BatchNorm and dropout, one fixed to 64x64 inputs, one that returns two outputs, one no model
USER = textwrap.dedent("""
    import torch
    from torch import nn

    def make_model(num_classes, shape):
        c, h, w = shape
        return nn.Sequential(nn.Flatten(), nn.Linear(c * h * w, 32), nn.ReLU(), nn.Linear(32, num_classes))

    def with_bn(num_classes, shape):
        return nn.Sequential(nn.Conv2d(shape[0], 4, 3), nn.BatchNorm2d(4), nn.Dropout(0.5), nn.AdaptiveAvgPool2d(1),
                             nn.Flatten(), nn.Linear(4, num_classes))

    def fixed_size(num_classes, shape):
        return nn.Sequential(nn.Flatten(), nn.Linear(shape[0] * 64 * 64, num_classes))

    class Two(nn.Module):
        def __init__(self, n):
            super().__init__()
            self.fc = nn.Linear(1, n)

        def forward(self, x):
            out = self.fc(x.mean((1, 2, 3))[:, None])
            return out, out

    def two_outputs(num_classes, shape):
        return Two(num_classes)

    def not_a_model(num_classes, shape):
        return "resnet18"

    def one_argument(num_classes):
        return nn.Linear(1, num_classes)

    class Unused(nn.Module):
        def __init__(self, shape, n):
            super().__init__()
            self.fc, self.spare = nn.Linear(shape[0] * shape[1] * shape[2], n), nn.Linear(3, 3)

        def forward(self, x):
            return self.fc(x.flatten(1))

    def unused(num_classes, shape):
        return Unused(shape, num_classes)

    def no_params(num_classes, shape):
        return nn.Sequential(nn.Flatten(), nn.AdaptiveAvgPool1d(num_classes))

    class Note:
        pass

    class Noted(nn.Sequential):
        def get_extra_state(self):
            return Note()

        def set_extra_state(self, state):
            pass

    def noted(num_classes, shape):
        return Noted(nn.Flatten(), nn.Linear(shape[0] * shape[1] * shape[2], num_classes))
""")


@pytest.fixture
def user_file(tmp_path, monkeypatch):
    """mymodule.py in a folder of its own, made the current folder, with neither it nor '' on
    sys.path: the trainer must find it there as `python -m` would."""
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "mymodule.py").write_text(USER)
    monkeypatch.chdir(folder)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(folder))])
    monkeypatch.delitem(sys.modules, "mymodule", raising=False)
    return folder


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v3_small"])
@pytest.mark.parametrize("shape", [(3, 28, 28), (3, 32, 32)])
def test_torchvision_models_take_the_small_images_of_the_manifests(name, shape):
    model = build_model(name, 20, shape, 64)
    assert model(torch.zeros(2, *shape)).shape == (2, 20)


def test_the_default_is_the_small_cnn_at_its_width():
    from pipeline.train.model import Net

    model = build_model(options.DEFAULT_MODEL, 7, (3, 8, 8), 4)
    assert isinstance(model, Net) and model.head.out_features == 7 and model.head.in_features == 16


def test_a_misspelt_name_is_one_line_naming_valid_ones():
    with pytest.raises(InputError) as e:
        check_name("resnet17")
    assert "--model resnet17" in str(e.value) and "resnet18" in str(e.value) and "\n" not in str(e.value)
    check_name("mobilenet_v3_small")
    check_name("anything:at_all")  # the user's: imported when the model is built


def test_the_names_read_from_torchvisions_files_are_those_it_registers():
    """Every name torchvision builds is taken (modelnames reads them from its files, unrun)."""
    import torchvision

    from pipeline.train import modelnames

    assert modelnames.torchvision_names() == torchvision.models.list_models(module=torchvision.models)


def test_a_name_the_files_reading_misses_is_asked_of_torchvision_not_refused(monkeypatch):
    """A later torchvision could register a model in a way the files' reading does not see: a name
    missing from that reading but written in the files is checked by torchvision itself."""
    from pipeline.train import modelnames

    monkeypatch.setattr(modelnames, "torchvision_names", lambda: ["alexnet", "resnet50"])  # resnet18 unseen
    modelnames.check_name("resnet18")  # torchvision builds it: taken
    with pytest.raises(InputError, match="resnet19: not a torchvision classification model"):
        modelnames.check_name("resnet19")  # in no file: refused from the reading alone


def test_a_misspelt_name_is_refused_by_the_option_parser_before_torch_loads():
    """--model resnet19 took about 4.5 s to be refused: the check imported torchvision (and torch)."""
    code = ("import sys\nfrom pipeline.train import options\ntry:\n"
            "    options.parse(['--train', 'a=x/', '--model', 'resnet19'])\nexcept SystemExit as e:\n"
            "    print(e.code, sorted(m for m in ('torch', 'torchvision') if m in sys.modules))\n")
    p = run_capture([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT),
                    capture_output=True, text=True)
    assert p.stdout.strip() == "2 []", p.stdout + p.stderr
    assert p.stderr.startswith("pipeline-train: error: --model resnet19: not a torchvision classification model; "
                               "e.g. resnet18, "), p.stderr
    assert p.stderr.endswith("; did you mean resnet18? (see --help)\n") and p.stderr.count("\n") == 1, p.stderr


def test_a_users_function_is_called_with_classes_and_shape_from_the_current_folder(user_file):
    model = build_model("mymodule:make_model", 12, (3, 6, 5), 64)
    assert model[1].in_features == 3 * 6 * 5 and model[-1].out_features == 12


@pytest.mark.parametrize("spec, needle", [
    ("mymodule:fixed_size", "--model mymodule:fixed_size cannot take 3x28x28 images"),
    ("mymodule:two_outputs", "gave tuple, not a (2, 10) tensor of class scores"),
    ("mymodule:not_a_model", "returned str, not a torch.nn.Module"),
    ("mymodule:missing", "--model mymodule:missing: AttributeError"),
    ("mymodule:one_argument", "--model mymodule:one_argument: raised TypeError"),
    ("no_such_module_h2:make", "--model no_such_module_h2:make: ModuleNotFoundError: No module named "
                               "'no_such_module_h2'; MODULE is a file of yours, no_such_module_h2.py in the current "
                               "folder"),
    ("mymodule:noted", "--model mymodule:noted: its state_dict's _extra_state is an object that torch.load(..., "
                       "weights_only=True) refuses, so no checkpoint could hold it"),  # said before, not at a save
])
def test_a_model_that_cannot_train_on_the_data_is_refused_in_one_line(user_file, spec, needle):
    with pytest.raises(InputError) as e:
        build_model(spec, 10, (3, 28, 28), 64)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_the_blank_batch_check_leaves_no_trace(user_file):
    """The check runs the model in training mode: it must not move BatchNorm's statistics nor
    draw from the global generator (dropout), which every rank and a resume rely on."""
    torch.manual_seed(3)
    model = build_model("mymodule:with_bn", 10, (3, 8, 8), 64)
    assert bool((model[1].running_var == 1).all()) and int(model[1].num_batches_tracked) == 0
    after = torch.rand(4)
    torch.manual_seed(3)
    with_bn = sys.modules["mymodule"].with_bn(10, (3, 8, 8))
    assert torch.equal(torch.rand(4), after)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), with_bn.state_dict().values()))


def test_the_model_is_in_the_fingerprint_and_another_is_refused_on_resume():
    def fp(model, width=64):
        args = options.parse(["--train", "mnist=x/", "--model", model, "--width", str(width)])
        return checkpoint.fingerprint(args, [])
    with pytest.raises(ValueError) as e:
        checkpoint.check_resume(fp("resnet18"), fp("cnn"))
    assert str(e.value) == ('--resume with other settings than the checkpoint\'s: --model: checkpoint "resnet18", '
                            'now "cnn"')
    checkpoint.check_resume(fp("resnet18", 8), fp("resnet18", 16))  # --width is the default model's only
    with pytest.raises(ValueError, match="--width: checkpoint 8, now 16"):
        checkpoint.check_resume(fp("cnn", 8), fp("cnn", 16))
    old = {k: v for k, v in fp("cnn").items() if k != "model"}  # written before --model: the cnn
    state = {"fingerprint": json.dumps(old)}
    checkpoint.check_resume(checkpoint.fingerprint_of(state, "c.pt"), fp("cnn"))


@pytest.mark.parametrize("bad", ["a:", ":f", "", "res net"])
def test_a_malformed_model_flag_is_one_line(bad, capsys):
    with pytest.raises(SystemExit) as e:
        options.parse(["--train", "mnist=x/", "--model", bad])
    assert e.value.code == 2 and "--model" in capsys.readouterr().err


class NanAt:
    """F.cross_entropy, but NaN for every sample at the given call."""

    def __init__(self, call):
        self.call, self.calls, self.real = call, 0, torch.nn.functional.cross_entropy

    def __call__(self, logits, y, **kw):
        self.calls += 1
        out = self.real(logits, y, **kw)
        return out * float("nan") if self.calls == self.call else out


@pytest.mark.parametrize("model", ["resnet18", "mymodule:make_model"])
def test_a_skipped_step_leaves_any_models_weights_and_buffers_alone(mixed_shards, user_file, tmp_path, monkeypatch,
                                                                     model):
    """The trainer's step decided on the device, with a torchvision model's BatchNorm buffers
    and with a model that has no buffer at all."""
    import copy

    from pipeline.data.store import remote
    from pipeline.data.streams.stream import resolve
    from pipeline.data.handover.loader import make_loader
    from pipeline.ordering.topology import Topology
    from pipeline.train.run import Run

    args = options.parse(["--train", f"mnist={mixed_shards}/", "--train", f"cifar10={mixed_shards}/", "--model", model,
                          "--batch-size", "4", "--workers", "0", "--out", str(tmp_path / "run")])
    srcs = [resolve(n, spec, "train") for n, spec in args.train.items()]
    run = Run(args, Topology(), torch.device("cpu"), srcs, [], policy=remote.Policy(), started=0.0, startup={})
    assert bool(run.buffers) == (model == "resnet18")
    batch = next(iter(make_loader(run.stream, 0)))
    gen = torch.Generator().manual_seed(0)
    run.step_once(batch, gen)
    before = copy.deepcopy(run.model.state_dict())
    monkeypatch.setattr(torch.nn.functional, "cross_entropy", NanAt(1))
    losses, _, found = run.step_once(batch, gen)
    assert found.item() == 1 and not torch.isfinite(losses).any()
    assert [k for k, v in run.model.state_dict().items() if not torch.equal(before[k], v)] == []
    run.step_once(batch, gen)  # the next finite step trains again
    assert any(not torch.equal(before[k], v) for k, v in run.model.state_dict().items())


# ---------------------------------------------------------------- the trainer with another model


def launch_in(folder, args, nproc):
    """torchrun -m pipeline.train ARGS with `folder` as the current folder (helpers.launch_train
    runs in the repository's)."""
    root, env = _launch_env(())
    entry = ["--run-path", "--start-method=fork", os.path.join(root, "tests", "forked_rank.py")]
    return launchers().start([f"--nproc_per_node={nproc}", f"--master_port={free_port()}", *entry, *map(str, args)],
                             env, folder)


def keys_by_epoch(out, ranks):
    lines = [ln for r in range(ranks) if os.path.exists(out / f"keys-rank{r}.txt")
             for ln in read_keys(out / f"keys-rank{r}.txt")]
    return {e: [k for ep, k in lines if ep == e] for e in sorted({ep for ep, _ in lines})}


@pytest.mark.slow
def test_parameters_without_a_gradient_are_found_and_a_model_with_none_is_refused(user_file):
    """DDP on 2 ranks failed in the first step on a model with a parameter its forward never uses
    (a traceback from every rank); a model with nothing to train failed in the optimiser."""
    from pipeline.train.model import unused_parameters

    assert unused_parameters(build_model("mymodule:unused", 10, (1, 8, 8), 64), (1, 8, 8)) == ["spare.weight",
                                                                                               "spare.bias"]
    assert unused_parameters(build_model("mymodule:make_model", 10, (1, 8, 8), 64), (1, 8, 8)) == []
    with pytest.raises(InputError, match="the model has no parameters to train"):
        unused_parameters(build_model("mymodule:no_params", 10, (1, 8, 8), 64), (1, 8, 8))


@pytest.mark.parametrize("model", ["resnet18", "mymodule:make_model", "mymodule:unused"])
def test_another_model_trains_on_2_ranks_and_resumes_on_1_with_no_sample_twice(one_source, user_file, tmp_path,
                                                                                model):
    """resnet18 (BatchNorm) and the user's model without any buffer: an epoch and 3 steps of the
    next on 2 ranks, the rest on 1; every epoch's keys once each, fewer left unread than a batch."""
    out = tmp_path / "run"
    args = ["--train", f"mnist={one_source}/", "--model", model, "--epochs", "2", "--epoch-samples", "160",
            "--batch-size", "8", "--workers", "1", "--record-keys", "--log-every", "5", "--out", out]
    code, err = finish(launch_in(user_file, [*args, "--stop-after-steps", "13"], 2))
    assert code == 0, err[-3000:]
    assert json.loads(torch.load(out / "checkpoint.pt", weights_only=True)["position"])["step"] == 13
    code, err = finish(launch_in(user_file, [*args, "--resume"], 1))
    assert code == 0, err[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 1 and summary["epochs_done"] == 2
    epochs = keys_by_epoch(out, 2)
    assert list(epochs) == [1, 2]
    for keys in epochs.values():
        assert len(keys) == len(set(keys)), "a sample read twice in an epoch"
        assert 0 <= 160 - len(keys) < 8
    metrics = [json.loads(ln) for ln in open(out / "metrics.jsonl")]
    assert all(torch.isfinite(torch.tensor(list(m["loss"].values()))).all() for m in metrics if m["kind"] == "train")
    code, err = finish(launch_in(user_file, [*args, "--epochs", "3", "--resume", "--model", "cnn"], 1))
    assert code != 0 and f'--model: checkpoint "{model}", now "cnn"' in err, err[-3000:]  # (torchrun's code: 1)
