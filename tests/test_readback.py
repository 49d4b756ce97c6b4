"""What the job reads back: checkpoints, metrics.jsonl, the data behind a source's name, and
the loss itself, checked before they steer training.

A checkpoint is written by this trainer but may be damaged or edited by anyone: every
number in it is range-checked against the run (one line naming the field, exit code 2),
resuming onto other shards behind the same name is refused unless `--change-data`, and a
loss that is not finite stops the run (exit code 3) on every rank at the same step.
"""
import copy
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import HANG, build_shards, finish, free_port, run_capture
from pipeline.train import checkpoint, options, loop as train
from pipeline.train.run import Run
from pipeline.data.manifests import manifest
from pipeline.data.manifests import locations
from pipeline.data.store import remote
from pipeline.errors import InputError, ShardError
from pipeline.train.metrics import Metrics
from pipeline.data.streams.stream import resolve
from pipeline.data.handover.loader import make_loader
from pipeline.ordering.topology import Topology

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def data(mixed_shards):
    return mixed_shards  # built once per test run (conftest.py); read only here


def small(data, out, *extra):
    return ["--train", f"mnist={data}/", "--train", f"cifar10={data}/", "--eval", f"mnist={data}/", "--epochs", "2",
            "--epoch-samples", "160", "--batch-size", "16", "--workers", "0", "--width", "4", "--log-every", "2",
            "--out", str(out), *extra]


def run_main(argv, capsys):
    """pipeline.train.main in this process: (exit code, its error lines, all of stderr)."""
    try:
        code = train.main([str(a) for a in argv])
    except SystemExit as e:  # the command line's own checks exit from argparse
        code = e.code
    err = capsys.readouterr().err
    return code, [ln for ln in err.splitlines() if "error:" in ln], err


def one_line(argv, capsys, *needles, code=2):
    got, errors, err = run_main(argv, capsys)
    assert got == code and len(errors) == 1 and "Traceback" not in err, err[-2000:]
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory):
    """Two real checkpoints: one inside epoch 1 (step 5), one at the end of epoch 1."""
    base = tmp_path_factory.mktemp("runs")
    out = {}
    for name, extra in (("mid", ["--stop-after-steps", "5"]), ("end", ["--stop-after", "1"])):
        assert train.main(small(data, base / name, *extra)) == 0
        out[name] = base / name
    return out


def copy_run(src, dst, change=None):
    """A copy of a run folder, its checkpoint edited by `change(state)`."""
    shutil.copytree(src, dst)
    if change:
        path = dst / "checkpoint.pt"
        state = torch.load(path, weights_only=True)
        change(state)
        torch.save(state, path)
    return dst


def edit_json(key, fn):
    def change(state):
        value = json.loads(state[key])
        value = fn(value)
        state[key] = json.dumps(value)
    return change


def setitem(path, value):
    """Set value at a path of keys/indices into a JSON document (returns the document)."""
    def fn(doc):
        node = doc
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value
        return doc
    return fn


# ---------------------------------------------------------------- 1. every trainer number, checked

def limits_for(state):
    return checkpoint.Limits(epochs=2, epoch_samples=160, batch_size=16, sources=2)


TAMPERED = {  # name: (which checkpoint, change to its state, the field the line must name)
    "epoch negative": ("mid", edit_json("position", setitem(["epoch"], -1)), "position.epoch"),
    "epoch huge": ("end", edit_json("position", setitem(["epoch"], 10 ** 9)), "position.epoch"),
    "epoch as text": ("mid", edit_json("position", setitem(["epoch"], "0")), "position.epoch"),
    "epoch as float": ("end", edit_json("position", setitem(["epoch"], 1.0)), "position.epoch"),
    "mid as text": ("mid", edit_json("position", setitem(["mid"], "yes")), "position.mid"),
    "step negative": ("mid", edit_json("position", setitem(["step"], -1)), "position.step"),
    "step past the samples seen": ("mid", edit_json("position", setitem(["step"], 10 ** 6)), "position.step"),
    "seen negative": ("mid", edit_json("position", setitem(["seen"], -16)), "position.seen"),
    "seen past the epochs": ("end", edit_json("position", setitem(["seen"], 10 ** 15)), "position.seen"),
    "seen not whole batches": ("mid", edit_json("position", setitem(["seen"], 79)), "position.seen"),
    "seen NaN": ("mid", edit_json("position", setitem(["seen"], float("nan"))), "position.seen"),
    "position missing a field": ("mid", edit_json("position", lambda p: {"epoch": 0}), "position.mid"),
    "position not an object": ("mid", edit_json("position", lambda p: [0, True, 5, 80]), "position"),
    "position not JSON": ("mid", lambda s: s.update(position="{epoch"), "position"),
    "position missing": ("mid", lambda s: s.pop("position"), "position"),
    "world zero": ("mid", lambda s: s.update(world=0), "world"),
    "world huge": ("mid", lambda s: s.update(world=10 ** 9), "world"),
    "world as text": ("end", lambda s: s.update(world="1"), "world"),
    "key count negative": ("end", edit_json("key_counts", lambda k: [-1]), "key_counts[0]"),
    "key count huge": ("end", edit_json("key_counts", lambda k: [10 ** 12]), "key_counts[0]"),
    "key counts for two ranks": ("end", edit_json("key_counts", lambda k: [0, 0]), "key_counts[1]"),
    # within the samples consumed, yet not the lines the run logged: it silently cut keys-rank0.txt
    "key count edited at an epoch's end": ("end", edit_json("key_counts", lambda k: [k[0] + 7]), "key_counts[0]"),
    "key count edited inside an epoch": ("mid", edit_json("key_counts", lambda k: [k[0] + 7]), "key_counts[0]"),
    "history key lines past the samples": ("end", edit_json("history", setitem(["epochs", 0, "keys", "rank0"], 10 ** 9)),
                                           "history.epochs[0].keys.rank0"),
    "tally key lines past its samples": ("mid", edit_json("facts", setitem([0, "keys"], 10 ** 6)), "facts[0].keys"),
    "history epochs not a list": ("end", edit_json("history", setitem(["epochs"], "x")), "history.epochs"),
    "history skipped negative": ("end", edit_json("history", setitem(["epochs", 0, "skipped"], -5)),
                                 "history.epochs[0].skipped"),
    "history skipped as text": ("end", edit_json("history", setitem(["epochs", 0, "skipped"], "5")),
                                "history.epochs[0].skipped"),
    "history batches huge": ("end", edit_json("history", setitem(["epochs", 0, "batches", "rank0"], 10 ** 9)),
                             "history.epochs[0].batches.rank0"),
    "history wait NaN": ("end", edit_json("history", setitem(["wait"], float("inf"))), "history.wait"),
    "history one epoch short": ("end", edit_json("history", setitem(["epochs"], [])), "position.epoch"),
    "stream ranks for two ranks in a one-rank checkpoint": (
        "mid", edit_json("stream", lambda s: dict(s, ranks=s["ranks"] * 2)), "stream.ranks"),
    "stream ranks empty": ("mid", edit_json("stream", setitem(["ranks"], [])), "stream.ranks"),
    "stream ranks not a list": ("mid", edit_json("stream", lambda s: dict(s, ranks=s["ranks"][0])), "stream.ranks"),
    "stream ranks missing": ("mid", edit_json("stream", lambda s: {k: v for k, v in s.items() if k != "ranks"}),
                             "stream.ranks"),
    "stream not an object": ("mid", edit_json("stream", lambda s: [5]), "stream"),
    "stream a list of per-rank states": ("mid", edit_json("stream", lambda s: [s]), "stream"),
    "stream not JSON": ("mid", lambda s: s.update(stream="{ranks"), "stream"),
    "stream of another epoch": ("mid", edit_json("stream", setitem(["epoch"], 1)), "stream.epoch"),
    "stream epoch as text": ("mid", edit_json("stream", setitem(["epoch"], "0")), "stream.epoch"),
    "stream epoch missing": ("mid", edit_json("stream", lambda s: {k: v for k, v in s.items() if k != "epoch"}),
                             "stream.epoch"),
    "facts batches negative": ("mid", edit_json("facts", setitem([0, "batches"], -1)), "facts[0].batches"),
    "facts batches past the epoch": ("mid", edit_json("facts", setitem([0, "batches"], 11)), "facts[0].batches"),
    "facts samples for 3 sources": ("mid", edit_json("facts", setitem([0, "samples"], [1, 2, 3])),
                                    "facts[0].samples"),
    "facts more samples than batches hold": ("mid", edit_json("facts", setitem([0, "samples"], [80, 80])),
                                             "facts[0].samples"),
    "facts wait NaN": ("mid", edit_json("facts", setitem([0, "wait"], float("nan"))), "facts[0].wait"),
    "facts missing skipped": ("mid", edit_json("facts", lambda f: [{k: v for k, v in f[0].items() if k != "skipped"}]),
                              "facts[0].skipped"),
    "carried not facts": ("mid", edit_json("carried", lambda c: {"before_resume_rank0": 5}),
                          "carried.before_resume_rank0"),
    "log sums short": ("mid", edit_json("log_sums", lambda s: s[:2]), "log_sums"),
    "log sums negative count": ("mid", edit_json("log_sums", setitem([2], -3.0)), "log_sums[2]"),
    "log sums fractional count": ("mid", edit_json("log_sums", setitem([2], 1.5)), "log_sums[2]"),
    "log sums NaN loss": ("mid", edit_json("log_sums", setitem([0], float("nan"))), "log_sums[0]"),
    "log sums loss without samples": ("mid", edit_json("log_sums", lambda s: [5.0, 0.0, 0.0, 0.0, 0.0]),
                                      "log_sums[0]"),
    "log sums count past the samples seen": ("mid", edit_json("log_sums", setitem([2], 1e9)), "log_sums[2]"),
    "history nested 200,000 deep": ("end", lambda s: s.update(history="[" * 200_000), "history"),
    "seen of 5,000 digits": ("mid", lambda s: s.update(position='{"epoch": 0, "mid": true, "step": 5, "seen": '
                                                                 + "9" * 5000 + "}"), "position"),
    "seen true": ("mid", edit_json("position", setitem(["seen"], True)), "position.seen"),
    "position a tensor": ("mid", lambda s: s.update(position=torch.zeros(3)), "position"),
    "nonfinite count true": ("mid", lambda s: s.update(nonfinite="true"), "nonfinite"),
    "nonfinite count negative": ("mid", lambda s: s.update(nonfinite="-1"), "nonfinite"),
    "nonfinite count past the steps": ("mid", lambda s: s.update(nonfinite="6"), "nonfinite"),
}


@pytest.mark.parametrize("case", sorted(TAMPERED))
def test_every_trainer_number_in_a_checkpoint_is_range_checked(runs, case):
    which, change, field = TAMPERED[case]
    state = torch.load(runs[which] / "checkpoint.pt", weights_only=True)
    change(state)
    with pytest.raises(ValueError) as e:
        checkpoint.trainer_state(state, "ckpt.pt", limits_for(state))
    assert f"checkpoint field {field}:" in str(e.value) and "ckpt.pt" in str(e.value)
    assert "\n" not in str(e.value)


def test_the_untampered_checkpoints_pass(runs):
    for which, mid in (("mid", True), ("end", False)):
        state = torch.load(runs[which] / "checkpoint.pt", weights_only=True)
        got = checkpoint.trainer_state(state, "ckpt.pt", limits_for(state))
        assert got["mid"] is mid and got["step"] == (5 if mid else 10) and got["seen"] == got["step"] * 16


def test_a_checkpoint_whose_tallies_did_not_count_key_lines_is_checked_as_before(runs):
    """Tallies written before they counted key lines can't fix key_counts: at most the samples."""
    for which in ("mid", "end"):
        state = torch.load(runs[which] / "checkpoint.pt", weights_only=True)
        history = json.loads(state["history"])
        for e in history["epochs"]:
            del e["keys"]
        state["history"] = json.dumps(history)
        if which == "mid":
            state["facts"] = json.dumps([{k: v for k, v in f.items() if k != "keys"} for f in json.loads(state["facts"])])
        state["key_counts"] = json.dumps([3])
        assert checkpoint.trainer_state(state, "ckpt.pt", limits_for(state))["key_counts"] == [3]


def net_and_opt(width=4):
    from pipeline.train.model import Net

    model = Net(20, width)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)
    return model, opt


def _nan_weight(s):
    s["model"]["head.weight"][0, 0] = float("nan")


def _reorder_params(s):
    s["optimizer"]["param_groups"][0]["params"][:2] = s["optimizer"]["param_groups"][0]["params"][1::-1]


TENSORS = {
    "a NaN weight": (_nan_weight, "load_model", "model.head.weight"),
    "a weight of another shape": (lambda s: s["model"].__setitem__("head.weight", torch.zeros(3, 3)), "load_model",
                                  "field model:"),
    "a weight missing": (lambda s: s["model"].pop("head.bias"), "load_model", "field model:"),
    "a weight that is not a tensor": (lambda s: s["model"].__setitem__("head.bias", [1.0]), "load_model",
                                      "model.head.bias"),
    "model not a dict": (lambda s: s.__setitem__("model", [1]), "load_model", "field model:"),
    "a momentum buffer of another shape": (
        lambda s: s["optimizer"]["state"][0].__setitem__("momentum_buffer", torch.zeros(2)), "load_optimizer",
        "optimizer.state.0.momentum_buffer"),
    "an infinite momentum buffer": (
        lambda s: s["optimizer"]["state"][0]["momentum_buffer"].fill_(float("inf")), "load_optimizer",
        "optimizer.state.0.momentum_buffer"),
    "a momentum buffer that is text": (
        lambda s: s["optimizer"]["state"][0].__setitem__("momentum_buffer", "x"), "load_optimizer",
        "optimizer.state.0.momentum_buffer"),
    "optimizer state for parameter 999": (lambda s: s["optimizer"]["state"].__setitem__(999, {}), "load_optimizer",
                                          "optimizer.state"),
    "optimizer state not an object": (lambda s: s["optimizer"]["state"].__setitem__(0, torch.zeros(2)),
                                      "load_optimizer", "optimizer.state.0"),
    "parameters out of order": (_reorder_params, "load_optimizer", "optimizer.param_groups"),
    "a parameter group too many": (
        lambda s: s["optimizer"]["param_groups"].append(dict(s["optimizer"]["param_groups"][0], params=[])),
        "load_optimizer", "optimizer"),
    "a complex weight": (lambda s: s["model"].__setitem__("head.bias", s["model"]["head.bias"].to(torch.complex64)),
                         "load_model", "model.head.bias"),
    "a negative running variance": (lambda s: s["model"]["features.0.1.running_var"].__setitem__(0, -1.0),
                                    "load_model", "model.features.0.1.running_var"),
    "an extra weight": (lambda s: s["model"].__setitem__("evil", torch.zeros(1)), "load_model", "field model:"),
    "rng of another size": (lambda s: s.__setitem__("rng", torch.zeros(3, dtype=torch.uint8)), "set_rng", "rng"),
    "rng of floats": (lambda s: s.__setitem__("rng", s["rng"].float()), "set_rng", "rng"),
}


@pytest.mark.parametrize("case", sorted(TENSORS))
def test_every_tensor_in_a_checkpoint_is_checked_before_use(runs, case):
    change, loader, field = TENSORS[case]
    state = torch.load(runs["mid"] / "checkpoint.pt", weights_only=True)
    change(state)
    model, opt = net_and_opt()
    rng = torch.get_rng_state()
    with pytest.raises(ValueError) as e:
        {"load_model": lambda: checkpoint.load_model(model, state, "ckpt.pt"),
         "load_optimizer": lambda: checkpoint.load_optimizer(opt, state, "ckpt.pt"),
         "set_rng": lambda: checkpoint.set_rng(state, "ckpt.pt")}[loader]()
    assert field in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert torch.equal(torch.get_rng_state(), rng)


def test_the_optimisers_settings_come_from_the_command_line_not_the_checkpoint(runs):
    state = torch.load(runs["mid"] / "checkpoint.pt", weights_only=True)
    state["optimizer"]["param_groups"][0].update(momentum=1e10, weight_decay=-3.0, nesterov=False)
    model, opt = net_and_opt()
    checkpoint.load_optimizer(opt, state, "ckpt.pt")
    group = opt.param_groups[0]
    assert (group["momentum"], group["weight_decay"], group["nesterov"]) == (0.9, 5e-4, True)
    saved = state["optimizer"]["state"][0]["momentum_buffer"]
    assert torch.equal(opt.state[group["params"][0]]["momentum_buffer"], saved)


@pytest.mark.parametrize("case", ["seen negative", "stream of another epoch",
                                  "stream ranks for two ranks in a one-rank checkpoint", "facts samples for 3 sources"])
def test_a_tampered_checkpoint_is_one_line_from_the_trainer(data, runs, tmp_path, capsys, case):
    which, change, field = TAMPERED[case]
    out = copy_run(runs[which], tmp_path / "run", change)
    before = (out / "metrics.jsonl").read_text()
    one_line(small(data, out, "--resume"), capsys, f"checkpoint field {field}")
    assert (out / "metrics.jsonl").read_text() == before


def test_a_nan_weight_in_the_checkpoint_is_one_line_from_the_trainer(data, runs, tmp_path, capsys):
    out = copy_run(runs["mid"], tmp_path / "run", _nan_weight)
    one_line(small(data, out, "--resume"), capsys, "model.head.weight", "not finite")


def test_a_checkpoint_stopped_inside_an_epoch_past_epochs_is_one_line(data, runs, tmp_path, capsys):
    out = copy_run(runs["end"], tmp_path / "run")
    out2 = copy_run(runs["mid"], tmp_path / "run2")
    assert train.main(small(data, out, "--resume", "--epochs", "1")) == 0  # finished: nothing to do, as before
    assert "nothing to do" in capsys.readouterr().out
    argv = small(data, out2, "--resume")
    argv[argv.index("--epochs") + 1] = "1"
    state = torch.load(out2 / "checkpoint.pt", weights_only=True)
    pos = json.loads(state["position"])
    pos.update(epoch=1, step=13, seen=13 * 16)
    state["position"] = json.dumps(pos)
    state["history"] = json.dumps({"epochs": [json.loads(torch.load(runs["end"] / "checkpoint.pt",
                                                                    weights_only=True)["history"])["epochs"][0]]})
    torch.save(state, out2 / "checkpoint.pt")
    one_line(argv, capsys, "inside epoch 2, past --epochs 1", "raise --epochs")


# ---------------------------------------------------------------- 2. --eval-only and other mismatches


def test_a_stream_state_the_stream_refuses_is_one_line_from_the_trainer(data, runs, tmp_path, capsys):
    """MixedStream checks the rest of the stream's state; what it refuses (a field
    missing: a KeyError before) comes out of the trainer as one line."""
    out = copy_run(runs["mid"], tmp_path / "run", edit_json("stream", lambda s: [s.pop("sources"), s][1]))
    one_line(small(data, out, "--resume"), capsys, "stream state: field sources missing")


def signed(state, entries):
    """Rank entries as state_dict writes them over `state`'s root: each with its check."""
    from pipeline.ordering import state_format

    return [dict(e, check=state_format.check_of(state, e)) for e in entries]


def resigned(change):
    """An edit of the stream state made consistent: every rank entry's check recomputed, so
    only the checks of what the numbers say can refuse it."""
    def edit(s):
        s = change(s)
        s["ranks"] = signed(s, [{k: v for k, v in e.items() if k != "check"} for e in s["ranks"]])
        return s
    return edit


def taken_by(segment, pair, done):
    """Positions of each source `pair` of a checkpoint's segment took when each rank made
    `done` batches (seed 0; a pass of either source is its 200 samples)."""
    from pipeline.ordering import deal

    seg = deal.replay(0, [80, 80], (), world=segment["world"], workers=segment["workers"],
                      batch_size=segment["batch_size"], seed=0, passes=(200, 200))
    return [int(n) for n in seg.taken(pair, done)]


def two_ranks(entries=None):
    """The mid checkpoint as two ranks of one worker would have written it after their
    second step (a metrics line just written), its stream's ranks `entries(state)` if given."""
    def change(state):
        stream = json.loads(state["stream"])
        stream["segment"].update(world=2, batches=stream["segment"]["batches"] // 2)
        stream["done"] = 2
        fresh = [{"rank": r, "passed": []} for r in range(2)]
        stream["ranks"] = signed(stream, entries(stream) if entries else fresh)
        facts = json.loads(state["facts"])[0]
        state.update(world=2, stream=json.dumps(stream), key_counts=json.dumps([0, 0]), nonfinite=json.dumps(0),
                     position=json.dumps({"epoch": 0, "mid": True, "step": 2, "seen": 2 * 2 * 16}),
                     facts=json.dumps([dict(facts, batches=2, samples=taken_by(stream["segment"], r, 2))
                                       for r in range(2)]),
                     log_sums=json.dumps([0.0] * 5))
    return change


def _rank(change):
    return edit_json("stream", lambda s: [change(s["ranks"][0]), s][1])


STREAM = {  # name: (change to the mid checkpoint's state, what its one line must say)
    "segment generation negative": (edit_json("stream", setitem(["segment", "generation"], -1)),
                                    "stream state segment generation: -1"),
    "segment generation as text": (edit_json("stream", setitem(["segment", "generation"], "0")),
                                   "stream state segment generation"),
    "segment workers zero": (edit_json("stream", setitem(["segment", "workers"], 0)), "segment workers: 0"),
    "segment batch size huge": (edit_json("stream", setitem(["segment", "batch_size"], 10 ** 30)),
                                "segment batch_size"),
    "segment not an object": (edit_json("stream", setitem(["segment"], [1, 16])), "segment: a mapping expected"),
    "segment of more batches than its targets make": (edit_json("stream", setitem(["segment", "batches"], 11)),
                                                      "segment batches: 11, where its worlds and what they consumed "
                                                      "make 10"),
    "segment of fewer batches than its epoch": (edit_json("stream", setitem(["segment", "batches"], 8)),
                                                "segment batches: 8, where"),
    "segment of another world": (edit_json("stream", setitem(["segment", "world"], 2)),
                                 "segment batches: 10, where its worlds and what they consumed make 5"),
    "segment of two ranks in a one-rank checkpoint": (
        edit_json("stream", resigned(lambda s: [s["segment"].update(world=2, batches=5), s.update(done=0), s][2])),
        "needs every rank's stream state; have ranks [0]"),
    "segment before not a list": (edit_json("stream", setitem(["segment", "before"], {"world": 2})),
                                  "segment before: a list"),
    "segment before of a world zero": (
        edit_json("stream", setitem(["segment", "before"], [{"world": 0, "workers": 1, "batch_size": 16, "done": 0,
                                                              "passed": []}])), r"segment before[0] world: 0"),
    "segment before done past its segment": (
        edit_json("stream", setitem(["segment", "before"], [{"world": 1, "workers": 1, "batch_size": 16, "done": 11,
                                                              "passed": []}])), r"segment before[0] done: 11"),
    # consistent in itself, but a world before this one that the run never ran: 32 samples it did not read
    "segment re-dealt from a world before it": (
        edit_json("stream", resigned(lambda s: [s["segment"].update(
            generation=1, batches=8, before=[{"world": 1, "workers": 1, "batch_size": 16, "done": 2, "passed": []}]),
            s][1])), "earlier worlds read 32 samples of this epoch, the run carried tallies of 0"),
    "targets of another mixture": (edit_json("stream", setitem(["targets"], [100, 60])), "does not match its numbers"),
    "listings of other shards": (edit_json("stream", setitem(["listings"], ["0" * 64, "1" * 64])),
                                 "other shards of source mnist"),
    "sources of another run": (edit_json("stream", setitem(["sources"], ["cifar10", "mnist"])), "for sources"),
    "seed of another run": (edit_json("stream", setitem(["seed"], 1)), "with seed 1"),
    "version 3": (edit_json("stream", setitem(["version"], 3)), "stream state version 3, expected 4"),
    "order settings of another run": (edit_json("stream", setitem(["order", "window_samples"], 7)),
                                      "which sample each position holds would change"),
    # passed over inside the run, consistent, but where the run counted none skipped
    "positions passed over where nothing was skipped": (
        edit_json("stream", resigned(lambda s: [s["ranks"][0].update(passed=[[0, [20, 0]]]), s][1])),
        "passed over 20 positions without a sample, the run counted 0 skipped"),
    "positions passed over, the check not recomputed": (_rank(lambda r: r.update(passed=[[0, [20, 0]]])),
                                                        "does not match its numbers"),
    "check missing": (_rank(lambda r: r.pop("check")), "does not match its numbers"),
    "stream of another rank": (_rank(lambda r: r.update(rank=1)), "stream state rank: 1"),
    "rank as text": (_rank(lambda r: r.update(rank="0")), "stream state rank: '0'"),
    "done beyond the segment": (edit_json("stream", setitem(["done"], 11)), "stream state done: 11"),
    "done negative": (edit_json("stream", setitem(["done"], -1)), "stream state done: -1"),
    "passed of another worker": (_rank(lambda r: r.update(passed=[[1, [1, 0]]])), "rank 0 passed: 1"),
    "passed beyond a worker's run": (_rank(lambda r: r.update(passed=[[0, [0, 10 ** 6]]])),
                                     "does not match its numbers"),
    "passed for three sources": (_rank(lambda r: r.update(passed=[[0, [0, 0, 1]]])), "rank 0 passed of 0"),
    "passed missing": (_rank(lambda r: r.pop("passed")), "rank 0 passed: a list"),
    # consistent in itself, but 3 batches where the run counted 5: an epoch of 12 would follow (192 of 160 samples)
    "done of fewer batches than the run made": (
        edit_json("stream", resigned(lambda s: [s.update(done=3), s][1])),
        "the stream state says the ranks made {0: 3} batches of this epoch, the run counted {0: 5}"),
    "a rank twice": (two_ranks(lambda s: [{"rank": 0, "passed": []}, {"rank": 0, "passed": []}]),
                     "rank 0 appears twice"),
    # within the samples seen (64), but past what rank 0 consumed (32): its key log would keep lines read after
    "key count past what its rank consumed": (
        lambda state: [two_ranks()(state), state.update(key_counts=json.dumps([64, 0]))],
        "key_counts[0]: 64 key lines, but the run's counts say rank 0 consumed 32 samples"),
    "a rank's entry from another state": (
        lambda state: [two_ranks()(state), edit_json("stream", lambda s: [s["ranks"][1].update(check="0" * 16), s][1])(
            state)], "rank 1: its check"),
}


@pytest.mark.parametrize("case", sorted(STREAM))
def test_every_number_of_a_stream_state_is_one_line_from_the_trainer(data, runs, tmp_path, capsys, case):
    """The stream's state in a checkpoint stopped inside an epoch: what trainer_state leaves
    to MixedStream.load_state_dict is refused there, one line and exit code 2, no traceback,
    nothing written."""
    change, needle = STREAM[case]
    out = copy_run(runs["mid"], tmp_path / "run", change)
    before = (out / "metrics.jsonl").read_text()
    one_line(small(data, out, "--resume"), capsys, needle)
    assert (out / "metrics.jsonl").read_text() == before


def test_a_two_rank_stream_state_of_the_same_checkpoint_resumes_on_one_rank(data, runs, tmp_path, capsys):
    """The control of the two-rank cases above: untampered, it resumes on one rank (a
    re-deal of what the two left) and its epoch ends where the checkpoint's epoch would."""
    out = copy_run(runs["mid"], tmp_path / "run", two_ranks())
    checkpoint.trainer_state(torch.load(out / "checkpoint.pt", weights_only=True), "ckpt.pt", limits_for(None))
    code, errors, err = run_main(small(data, out, "--resume", "--stop-after", "1"), capsys)
    assert code == 0 and not errors and "Traceback" not in err, err[-2000:]
    position = json.loads(torch.load(out / "checkpoint.pt", weights_only=True)["position"])
    assert position == {"epoch": 1, "mid": False, "step": 2 + (160 - 64) // 16, "seen": 160}, position


def test_slots_on_resume_is_ignored_with_one_line_and_the_run_resumes(data, runs, tmp_path, capsys):
    """--slots went with the canonical slots: given on resume, inside an epoch or at its end,
    it is said to be ignored in one line and the run goes on from the checkpoint."""
    for which, step in (("mid", 5), ("end", 10)):
        out = copy_run(runs[which], tmp_path / which)
        code, errors, err = run_main(small(data, out, "--resume", "--slots", "7", "--stop-after-steps", "1"), capsys)
        assert code == 0 and not errors and "Traceback" not in err, err[-2000:]
        said = [ln for ln in err.splitlines() if "--slots" in ln]
        assert len(said) == 1 and "no longer used" in said[0] and said[0].endswith("ignored"), said
        state = torch.load(out / "checkpoint.pt", weights_only=True)
        assert json.loads(state["position"])["step"] == step + 1 and "slots" not in state


def test_eval_only_with_another_width_is_one_line(data, runs, tmp_path, capsys):
    out = copy_run(runs["end"], tmp_path / "run")
    argv = small(data, out, "--eval-only")
    argv[argv.index("--width") + 1] = "8"
    one_line(argv, capsys, "--eval-only with other settings", "--width: checkpoint 4, now 8")
    argv = small(data, out, "--eval-only")
    argv[argv.index(f"cifar10={data}/") - 1:argv.index(f"cifar10={data}/") + 1] = []
    one_line(argv, capsys, "--eval-only with other settings", "sources")
    assert not (out / "eval.json").exists()
    code, errors, err = run_main(small(data, out, "--eval-only"), capsys)  # the matching command still works
    assert code == 0 and not errors and json.loads((out / "eval.json").read_text())["eval"]["mnist"]["count"] == 40


def test_eval_only_with_a_model_that_does_not_fit_its_fingerprint_is_one_line(data, runs, tmp_path, capsys):
    out = copy_run(runs["end"], tmp_path / "run",
                   lambda s: s["model"].__setitem__("head.weight", torch.zeros(20, 32)))
    one_line(small(data, out, "--eval-only"), capsys, "checkpoint field model:", "does not fit", "--width")


@pytest.mark.parametrize("change, field", [
    (lambda s: s.update(fingerprint="[1, 2"), "fingerprint"),
    (lambda s: s.update(fingerprint="[1, 2]"), "fingerprint"),
    (lambda s: s.update(fingerprint=json.dumps({"sources": [{"name": 5}], "width": 4})), "sources"),
])
def test_a_tampered_fingerprint_is_one_line(data, runs, tmp_path, capsys, change, field):
    for flag in ("--resume", "--eval-only"):
        out = copy_run(runs["end"], tmp_path / flag, change)
        one_line(small(data, out, flag), capsys, field)


# ---------------------------------------------------------------- 3. other data behind the same name


def rebuilt(data, dst, seed=7):
    """The same source names and layout as `data`, with mnist's training shards rebuilt
    (other pixels: other sha256, same names, sizes and counts)."""
    dst.mkdir()
    for f in os.listdir(data):
        if not f.startswith("mnist-train"):
            os.link(data / f, dst / f)
    build_shards(dst, "mnist", "train", 200, shape=(1, 28, 28), encoding="raw", maxcount=20, seed=seed)
    old, new = (json.loads((d / "mnist-train.json").read_text()) for d in (data, dst))
    assert [s["name"] for s in old["shards"]] == [s["name"] for s in new["shards"]]
    assert old["shards"][0]["sha256"] != new["shards"][0]["sha256"]
    return dst


@pytest.mark.slow
def test_resuming_onto_other_data_behind_the_same_name_is_refused_then_recorded(data, runs, tmp_path, capsys):
    other = rebuilt(data, tmp_path / "other")
    out = copy_run(runs["end"], tmp_path / "run")
    before = (out / "metrics.jsonl").read_text()
    line = one_line(small(other, out, "--resume"), capsys, "data of mnist", "--change-data")
    assert "data of cifar10" not in line
    assert (out / "metrics.jsonl").read_text() == before
    code, errors, err = run_main(small(other, out, "--resume", "--change-data"), capsys)
    assert code == 0 and not errors, err[-2000:]
    lines = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    changed = [ln for ln in lines if ln["kind"] == "data_changed"]
    assert len(changed) == 1 and list(changed[0]["sources"]) == ["mnist"] and changed[0]["epoch"] == 2
    was, now = changed[0]["sources"]["mnist"]["from"], changed[0]["sources"]["mnist"]["to"]
    assert was["listing"] != now["listing"] and now["listing"] == resolve("mnist", str(other), "train").listing


@pytest.mark.slow
def test_the_same_data_in_another_folder_is_the_same_data(data, runs, tmp_path, capsys):
    moved = tmp_path / "moved"
    shutil.copytree(data, moved)
    out = copy_run(runs["end"], tmp_path / "run")
    code, errors, err = run_main(small(moved, out, "--resume"), capsys)
    assert code == 0 and not errors, err[-2000:]


def test_other_data_inside_an_epoch_is_refused_even_with_change_data(data, runs, tmp_path, capsys):
    other = rebuilt(data, tmp_path / "other")
    out = copy_run(runs["mid"], tmp_path / "run")
    one_line(small(other, out, "--resume", "--change-data"), capsys, "--change-data", "inside epoch 1",
             "epoch boundary")


def test_change_data_needs_resume(data, tmp_path, capsys):
    one_line(small(data, tmp_path / "run", "--change-data"), capsys, "--change-data only applies with --resume")


# ---------------------------------------------------------------- 4. a loss that is not finite


def test_a_huge_learning_rate_stops_the_run_naming_the_step_and_the_sources(data, tmp_path, capsys):
    out = tmp_path / "run"
    line = one_line(small(data, out, "--lr", "1e30"), capsys, "the loss is not finite", "step ", "mnist",
                    "--max-nonfinite", code=3)
    lines = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    bad = [ln for ln in lines if ln["kind"] == "nonfinite"]
    assert len(bad) == 1 and f"step {bad[0]['step']} " in line
    assert all(math.isfinite(v) for ln in lines if ln["kind"] == "train" for v in ln["loss"].values())


class NanAt:
    """F.cross_entropy, but NaN for every sample at the given steps (counted in calls)."""

    def __init__(self, steps):
        self.steps, self.calls, self.real = set(steps), 0, torch.nn.functional.cross_entropy

    def __call__(self, logits, y, **kw):
        self.calls += 1
        out = self.real(logits, y, **kw)
        return out * float("nan") if self.calls in self.steps else out


def test_skipped_steps_leave_the_weights_and_running_stats_alone(data, tmp_path, monkeypatch):
    args = options.parse(small(data, tmp_path / "run"))
    srcs = [resolve(n, spec, "train") for n, spec in args.train.items()]
    run = Run(args, Topology(), torch.device("cpu"), srcs, [], policy=remote.Policy(), started=0.0, startup={})
    batch = next(iter(make_loader(run.stream, 0)))
    gen = torch.Generator().manual_seed(0)
    run.step_once(batch, gen)  # momentum buffers exist from here on
    before = copy.deepcopy(run.model.state_dict())
    monkeypatch.setattr(torch.nn.functional, "cross_entropy", NanAt([1]))
    losses, source, found = run.step_once(batch, gen)
    assert found.item() == 1 and not torch.isfinite(losses).any()
    after = run.model.state_dict()
    assert [k for k in before if not torch.equal(before[k], after[k])] == []
    assert run.step == 2
    run.step_once(batch, gen)  # the next finite step trains again
    assert not torch.equal(before["head.weight"], run.model.state_dict()["head.weight"])


@pytest.mark.slow
def test_max_nonfinite_allows_that_many_skipped_steps_then_stops(data, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.nn.functional, "cross_entropy", NanAt([3, 7]))
    out = tmp_path / "run"
    assert train.main(small(data, out, "--epochs", "1", "--max-nonfinite", "2")) == 0
    s = json.loads((out / "summary.json").read_text())
    lines = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert s["nonfinite_steps"] == 2 and [ln["step"] for ln in lines if ln["kind"] == "nonfinite"] == [3, 7]
    assert all(math.isfinite(v) for ln in lines if ln["kind"] == "train" for v in ln["loss"].values())
    capsys.readouterr()
    monkeypatch.setattr(torch.nn.functional, "cross_entropy", NanAt([3, 7]))
    one_line(small(data, tmp_path / "run2", "--epochs", "1", "--max-nonfinite", "1"), capsys, "step 7 ",
             "2 such step(s), --max-nonfinite 1", code=3)


@pytest.mark.slow  # trains twice
def test_the_count_of_skipped_steps_carries_across_a_resume(data, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    monkeypatch.setattr(torch.nn.functional, "cross_entropy", NanAt([2]))
    assert train.main(small(data, out, "--max-nonfinite", "1", "--stop-after-steps", "4")) == 0
    monkeypatch.setattr(torch.nn.functional, "cross_entropy", NanAt([3]))  # step 7 of the run
    capsys.readouterr()
    one_line(small(data, out, "--max-nonfinite", "1", "--resume"), capsys, "step 7 ", "2 such step(s)", code=3)


NAN_ON_RANK1 = r"""
import sys, torch, pipeline.train.loop as t
real = torch.nn.functional.cross_entropy
calls = [0]
def ce(logits, y, **kw):
    calls[0] += 1
    out = real(logits, y, **kw)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return out * float("nan") if rank == 1 and calls[0] == 4 else out
torch.nn.functional.cross_entropy = ce
sys.exit(t.main())
"""


@pytest.mark.slow
def test_a_nan_on_one_rank_stops_every_rank_at_the_same_step(data, tmp_path):
    """Only rank 1 sees the NaN; both must skip the same step and stop, not hang in an all-reduce."""
    script = tmp_path / "nan_on_rank1.py"
    script.write_text(NAN_ON_RANK1)
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    out = tmp_path / "run"
    # a rank left in the all-reduce would wait out --timeout: longer than the hang guard, so a hang
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                             f"--master_port={free_port()}", str(script), *small(data, out, "--timeout", str(2 * HANG))],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    code, err = finish(proc, timeout=HANG)
    assert code != 0
    errors = [part.splitlines()[0] for part in err.split("pipeline-train: error:")[1:]]  # ranks share stderr
    assert errors and len(set(errors)) == 1, err[-3000:]  # every rank that said it said the same step
    assert "step 4 " in errors[0] and ("mnist" in errors[0] or "cifar10" in errors[0]), errors[0]
    lines = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [ln["step"] for ln in lines if ln["kind"] == "nonfinite"] == [4]


# ---------------------------------------------------------------- 5. metrics.jsonl on resume


@pytest.mark.parametrize("bad, problem", [
    ('[1, 2, 3]', "not a JSON object"),
    ('"just text"', "not a JSON object"),
    ('{"kind": "train", "step": "12"}', 'step "12"'),
    ('{"kind": "train", "step": null}', "step null"),
    ('{"kind": "train", "step": 1.5}', "step 1.5"),
    ('{"kind": "train", "step": true}', "step true"),
    ('{"kind": "train", "step": [3]}', "step [3]"),
    ('{"kind": "train", "st', "not valid JSON"),
    ('{"a": ' * 100000, "not valid JSON"),
])
def test_a_mistyped_metrics_line_is_dropped_with_a_warning(tmp_path, bad, problem):
    path = tmp_path / "metrics.jsonl"
    good = ['{"kind": "train", "step": 2}', '{"kind": "eval", "step": 4}']
    path.write_text("\n".join([*good, bad, '{"kind": "train", "step": 5}']) + "\n")
    with pytest.warns(UserWarning, match=f"line 3 .*{re.escape(problem)}"):
        Metrics(str(path), True, resume_step=10)
    assert path.read_text().splitlines() == good


@pytest.mark.slow
def test_a_mistyped_metrics_line_is_one_warning_on_resume(data, runs, tmp_path, capsys):
    out = copy_run(runs["end"], tmp_path / "run")
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "step": "12"}\n[1]\n')
    with pytest.warns(UserWarning, match="line .* has step"):
        code, errors, err = run_main(small(data, out, "--resume"), capsys)
    assert code == 0 and not errors and "Traceback" not in err, err[-2000:]


# ---------------------------------------------------------------- 6. manifests: one spelling per shard, sane statistics


def write_manifest(folder, change, split="train"):
    """A changed copy of mnist-SPLIT.json beside the shards (their names are relative to it),
    under a name of its own: the folder is shared by both test processes (conftest.mixed_shards)."""
    import tempfile

    m = json.loads((folder / f"mnist-{split}.json").read_text())
    change(m)
    m["total"] = sum(s["samples"] for s in m["shards"])
    fd, path = tempfile.mkstemp(prefix="mnist-x-", suffix=".json", dir=folder)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(m))
    return Path(path)


@pytest.mark.parametrize("spell", [
    lambda d, n: f"{d}/{n}",  # a relative name and its absolute path
    lambda d, n: f"{d}//{n}",
    lambda d, n: f"{d}///{n}",
    lambda d, n: f"{os.path.dirname(d)}//{os.path.basename(d)}/{n}",
])
def test_a_shard_listed_in_two_spellings_is_refused(data, spell):
    first = json.loads((data / "mnist-train.json").read_text())["shards"][0]["name"]
    path = write_manifest(data, lambda m: m["shards"].append(dict(m["shards"][0], name=spell(str(data), first))))
    with pytest.raises(ShardError, match="are the same shard") as e:
        resolve("mnist", str(path), "train")
    assert first in str(e.value) and path.name in str(e.value)


def test_a_dot_slash_name_is_refused_before_it_could_be_read_twice(data):
    first = json.loads((data / "mnist-train.json").read_text())["shards"][0]["name"]
    path = write_manifest(data, lambda m: m["shards"].append(dict(m["shards"][0], name=f"./{first}")))
    with pytest.raises(ShardError, match="not a plain relative name"):
        resolve("mnist", str(path), "train")


def test_a_shard_reached_through_a_link_is_the_same_shard(data, tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    m = json.loads((data / "mnist-train.json").read_text())
    for s in m["shards"]:
        os.link(data / s["name"], folder / s["name"])
    os.symlink(folder / m["shards"][0]["name"], folder / "alias.tar")
    m["shards"].append(dict(m["shards"][0], name="alias.tar"))
    m["total"] += m["shards"][0]["samples"]
    (folder / "mnist-train.json").write_text(json.dumps(m))
    with pytest.raises(ShardError, match="are the same shard"):
        resolve("mnist", str(folder), "train")


def test_hard_links_under_other_names_are_other_shards(data, tmp_path):
    """tools/bench_loader.py's 10x corpus lists hard links to the same files under new names."""
    folder = tmp_path / "m"
    folder.mkdir()
    m = json.loads((data / "mnist-train.json").read_text())
    extra = []
    for s in m["shards"]:
        os.link(data / s["name"], folder / s["name"])
        os.link(data / s["name"], folder / ("copy-" + s["name"]))
        extra.append(dict(s, name="copy-" + s["name"]))
    m["shards"] += extra
    m["total"] *= 2
    (folder / "mnist-train.json").write_text(json.dumps(m))
    assert len(resolve("mnist", str(folder), "train").urls) == 2 * len(extra)


@pytest.mark.parametrize("a, b", [
    ("http://h.example/s/a.tar", "http://H.EXAMPLE/s/a.tar"),
    ("http://h.example/s/a.tar", "http://h.example:80/s/a.tar"),
    ("https://h.example/s/a.tar", "https://h.example:443/s//a.tar"),
    ("http://h.example/s/a.tar", "http://h.example/s/./a.tar"),
    ("http://h.example/s/a.tar", "http://h.example/s/x/../a.tar"),
    ("http://h.example/s/a.tar", "http://h.example/s/%61.tar"),
    ("http://h.example/s/a.tar", "http://h.example/s/a.tar#frag"),
    ("http://h.example/s/a.tar", "http://h.example./s/a.tar"),
    ("http://[::1]/s/a.tar", "http://[::1]:80/s/a.tar"),
])
def test_urls_are_compared_resolved(a, b):
    assert locations.canonical(a) == locations.canonical(b)
    with pytest.raises(ShardError, match="are the same shard"):
        locations._once([a, b], "m.json: field shards")


@pytest.mark.parametrize("a, b", [
    ("http://h.example/s/a.tar", "https://h.example/s/a.tar"),
    ("http://h.example/s/a.tar", "http://h.example:8080/s/a.tar"),
    ("http://h.example/s/a.tar", "http://h.example/s/a.tar?part=2"),
    ("http://h.example/s/a.tar", "http://h.example/S/a.tar"),
])
def test_other_urls_stay_other_shards(a, b):
    assert locations.canonical(a) != locations.canonical(b)


def test_a_url_with_a_bad_port_is_one_line():
    with pytest.raises(ShardError, match="not a valid URL"):
        locations.canonical("http://h.example:99999/a.tar")


def test_a_pattern_naming_a_shard_twice_is_refused(data):
    with pytest.raises(ShardError, match="the pattern.*are the same shard"):
        resolve("mnist", f"{data}/mnist-train-{{000000,000001,000000}}.tar", "train")


def test_a_shard_listed_twice_is_read_once_in_evaluation_or_refused(data):
    """The issue's case: `name` and `dir//name` in a test manifest."""
    def twice(m):
        m["shards"].append(dict(m["shards"][0], name=f"{data}//{m['shards'][0]['name']}"))
    path = write_manifest(data, twice, split="test")
    with pytest.raises(ShardError, match="are the same shard"):
        resolve("mnist", str(path), "test")


STATS = {
    "mean above 1": (lambda m: m.update(mean=[1.5]), "mean"),
    "mean negative": (lambda m: m.update(mean=[-0.1]), "mean"),
    "mean on the 0..255 scale": (lambda m: m.update(mean=[33.3]), "mean"),
    "std above 1": (lambda m: m.update(std=[1.01]), "std"),
    "std huge": (lambda m: m.update(std=[1e30]), "std"),
    "std as text": (lambda m: m.update(std=["0.3"]), "std"),
    "std true": (lambda m: m.update(std=[True]), "std"),
    "mean NaN": (lambda m: m.update(mean=[float("nan")]), "mean"),
}


@pytest.mark.parametrize("case", sorted(STATS))
def test_manifest_mean_and_std_are_range_checked(data, case):
    change, field = STATS[case]
    path = write_manifest(data, change)
    with pytest.raises(ShardError, match=f"field {field}"):
        resolve("mnist", str(path), "train")


def test_sane_statistics_pass(data):
    for mean, std in (([0.0], [1.0]), ([1.0], [0.5]), ([0.1307], [0.3081])):
        path = write_manifest(data, lambda m: m.update(mean=mean, std=std))
        assert resolve("mnist", str(path), "train").std == std


# ---------------------------------------------------------------- 7. found by attacking the change


def test_a_checkpoint_from_before_shard_digests_resumes_with_a_warning(data, runs, tmp_path, capsys):
    def legacy(state):
        fp = json.loads(state["fingerprint"])
        fp.pop("data")
        state["fingerprint"] = json.dumps(fp)
    out = copy_run(runs["mid"], tmp_path / "run", legacy)
    with pytest.warns(UserWarning, match="before checkpoints recorded their shard lists"):
        code, errors, err = run_main(small(data, out, "--resume", "--stop-after-steps", "1"), capsys)
    assert code == 0 and not errors, err[-2000:]


@pytest.mark.parametrize("name", ["checkpoint.pt", "metrics.jsonl", "keys-rank0.txt"])
def test_a_fifo_in_the_run_folder_is_one_line_not_a_hang(data, runs, tmp_path, capsys, name):
    out = copy_run(runs["end"], tmp_path / "run")
    if (out / name).exists():
        os.remove(out / name)
    os.mkfifo(out / name)
    one_line(small(data, out, "--resume", "--record-keys"), capsys, name, "not a regular file")


# ---------------------------------------------------------------- 8. loadable by anyone's torch.load


def test_the_trainers_checkpoints_load_with_plain_weights_only_in_a_fresh_process(runs):
    """torch.load(path, weights_only=True) in a new user's own Python, no allowlist of ours: every
    field is a tensor or a plain type, inside an epoch (the stream states) and at its end."""
    code = "import sys, torch\nfor p in sys.argv[1:]:\n    print(sorted(torch.load(p, weights_only=True)))\n"
    p = run_capture([sys.executable, "-c", code, *(str(runs[k] / "checkpoint.pt") for k in ("mid", "end"))],
                    capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout.count("'model', 'nonfinite', 'optimizer'") == 2, p.stdout + p.stderr


def test_a_state_weights_only_would_refuse_is_one_line_naming_its_field_and_leaves_no_file(tmp_path):
    """A batch's Keys pickles as builtins.list, a global weights_only refuses ('GLOBAL list'): the
    check in save() raised torch's UnpicklingError with a traceback and left checkpoint.pt.tmp."""
    from pipeline.data.fields.keys import Keys

    path = str(tmp_path / "checkpoint.pt")
    checkpoint.save(path, {"version": checkpoint.VERSION, "n": 1})
    with pytest.raises(InputError) as e:
        checkpoint.save(path, {"version": checkpoint.VERSION, "n": 2, "keys": Keys.of(["a-0"])})
    said = str(e.value)
    assert said.startswith(f"could not write the checkpoint {path}: keys holds an object that torch.load(..., "
                           f"weights_only=True) refuses (Unsupported global: GLOBAL list ") and "\n" not in said, said
    assert sorted(os.listdir(tmp_path)) == ["checkpoint.pt"] and checkpoint.load(path)["n"] == 1
