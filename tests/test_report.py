"""tools/report.py on hand-written run folders: the picture, the per-epoch table, the
origin of every source in the figure's text, and one-line answers to bad input.

The folders are written here line by line in the formats pipeline.train writes, so a
change to those formats that the report does not follow shows up as a failure here.
"""
import json
import os
import sys
from pathlib import Path

import pytest

from helpers import HANG, figure_texts, main_in_process, run_capture, tool_module
from pipeline.train import picture, report

TOOL = Path(__file__).resolve().parents[1] / "tools" / "report.py"
ORIGINS = {"mnist": "real data, torchvision files", "cifar10": "synthetic look-alike data"}
ACCURACY = {1: {"mnist": 0.8125, "cifar10": 0.4375}, 2: {"mnist": 0.9375, "cifar10": 0.5625}}


def train_line(epoch, step, loss, share, speed, weights=None):
    return {"kind": "train", "epoch": epoch, "step": step, "lr": 0.01,
            "weights": weights or {"mnist": 0.5, "cifar10": 0.5}, "loss": loss,
            "samples_per_s": speed, "share": share, "skipped": 0}


def eval_line(epoch, step):
    return {"kind": "eval", "epoch": epoch, "step": step, "eval": {
        name: {"count": 16, "correct": int(acc * 16), "accuracy": acc, "loss": 1.0, "skipped": 0,
               "data": ORIGINS[name]} for name, acc in ACCURACY[epoch].items()}}


def metrics_lines():
    half = {"mnist": 0.5, "cifar10": 0.5}
    return [
        train_line(1, 5, {"mnist": 2.0, "cifar10": 2.2}, half, 100.0),
        train_line(1, 10, {"mnist": 1.5, "cifar10": 1.9}, half, 300.0),
        train_line(1, 12, {"mnist": 1.25, "cifar10": 1.75}, half, 200.0),
        eval_line(1, 12),
        {"kind": "weights_changed", "epoch": 2, "step": 12, "weights": {"mnist": 0.9, "cifar10": 0.1}},
        train_line(2, 17, {"mnist": 1.0, "cifar10": 1.5}, {"mnist": 0.9, "cifar10": 0.1}, 400.0,
                   {"mnist": 0.9, "cifar10": 0.1}),
        train_line(2, 24, {"mnist": 0.75, "cifar10": 1.25}, {"mnist": 0.875, "cifar10": 0.125}, 500.0,
                   {"mnist": 0.9, "cifar10": 0.1}),
        eval_line(2, 24),
    ]


def summary():
    return {"data": {name: {"origin": origin, "synthetic": "synthetic" in origin, "manifest": f"/x/{name}-train.json",
                            "train_samples": 100} for name, origin in ORIGINS.items()},
            "accuracy": ACCURACY[2], "epochs": [{"epoch": 1, "batches": {"rank0": 12}, "samples": {}, "skipped": 0},
                                               {"epoch": 2, "batches": {"rank0": 12}, "samples": {}, "skipped": 0}],
            "data_wait_share": 0.125, "wall_time_s": 3.5, "world_size": 2, "finished": True}


def write_run(folder, lines, summary_json=None, torn=True):
    folder.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in lines)
    if torn:  # a crash mid-write: the last line stops half way
        text += json.dumps(train_line(3, 30, {"mnist": 0.5, "cifar10": 1.0}, {"mnist": 0.5, "cifar10": 0.5}, 9.0))[:40]
    (folder / "metrics.jsonl").write_text(text)
    if summary_json is not None:
        (folder / "summary.json").write_text(json.dumps(summary_json))
    return folder


@pytest.fixture
def run_dir(tmp_path):
    return write_run(tmp_path / "run", metrics_lines(), summary())


def cli_subprocess(*args):
    return run_capture([sys.executable, str(TOOL), *map(str, args)], capture_output=True, text=True, timeout=HANG)


def cli(*args):
    """tools/report.py's main() in process (no interpreter to start and matplotlib to import
    each time); test_cli_writes_a_png_and_a_table_per_epoch runs the real script."""
    return main_in_process(tool_module("report").main, "report.py", args)


def table_rows(stdout):
    """{column: [cells]} of the printed table, read by its header row."""
    lines = [ln.split() for ln in stdout.splitlines() if ln.strip()]
    start = next(i for i, cells in enumerate(lines) if cells[0] == "epoch")
    singles = [c for c in lines[start][1:] if c in ("samples/s", "skipped")]  # one-word columns, last
    pairs = lines[start][1:len(lines[start]) - len(singles)]
    head = ["epoch"] + [" ".join(pairs[i:i + 2]) for i in range(0, len(pairs), 2)] + singles
    rows = [cells for cells in lines[start + 1:] if cells[0].isdigit()]
    return [dict(zip(head, cells)) for cells in rows]


@pytest.mark.slow
def test_cli_writes_a_png_and_a_table_per_epoch(run_dir):
    r = cli_subprocess(run_dir)
    assert r.returncode == 0, r.stderr
    png = run_dir / "report.png"
    assert png.read_bytes()[:4] == b"\x89PNG"
    rows = table_rows(r.stdout)
    assert [row["epoch"] for row in rows] == ["1", "2"]  # the torn epoch-3 line is skipped
    for row in rows:
        for name, acc in ACCURACY[int(row["epoch"])].items():
            assert float(row[f"acc {name}"]) == pytest.approx(acc, abs=1e-4)
    # the mean over the epoch's samples: (2.0 x 5 steps + 1.5 x 5 + 1.25 x 2) / 12, and cifar10's shares 0.1 and 0.125
    assert rows[0]["loss mnist"] == "1.6667" and rows[1]["loss cifar10"] == f"{(1.5 * .5 + 1.25 * .875) / 1.375:.4f}"
    assert float(rows[0]["samples/s"]) == 200.0 and float(rows[1]["samples/s"]) == 450.0  # medians
    assert str(png) in r.stdout


def test_the_table_says_each_epochs_skipped_samples(tmp_path):
    """pipeline-report printed loss and samples/s but no `skipped`: a run with a quarter of its samples
    damaged looked clean (hostileH). Each epoch's count is the sum of its lines'; a hostile count
    is no count; a run written before the count has no column."""
    lines = metrics_lines()
    for r, k in zip([r for r in lines if r["kind"] == "train"], (1, 3, "x", 0, 7)):
        r["skipped"] = k
    huge = dict(lines[-2], skipped=10 ** 400)  # a 401-digit count: math.isfinite overflowed (hostileI)
    rows = table_rows(cli(write_run(tmp_path / "r", lines + [huge, dict(huge, epoch=10 ** 400)])).stdout)
    assert [row["skipped"] for row in rows] == ["4", "7"], rows
    for r in lines:
        r.pop("skipped", None)
    r = cli(write_run(tmp_path / "old", lines))
    assert r.returncode == 0 and "skipped" not in r.stdout and [row["epoch"] for row in table_rows(r.stdout)] == ["1", "2"]


def test_out_puts_the_picture_elsewhere(run_dir, tmp_path):
    out = tmp_path / "elsewhere.png"
    r = cli(run_dir, "--out", out)
    assert r.returncode == 0, r.stderr
    assert out.read_bytes()[:4] == b"\x89PNG"
    assert not (run_dir / "report.png").exists()


def test_figure_says_which_data_each_source_is(run_dir):
    texts = figure_texts(report.build_figure(report.load_run(str(run_dir))))
    joined = "\n".join(texts)
    for name, origin in ORIGINS.items():
        assert f"{name} ({origin})" in joined
    assert "origin unknown" not in joined
    assert "12.5%" in joined  # the data-wait share from summary.json
    for title in ("training loss", "test accuracy", "share", "throughput"):
        assert any(title in t for t in texts), title


def test_summary_alone_says_which_data_each_source_is(tmp_path):
    """Before any eval line (or with no --eval sources) only summary.json knows the origins."""
    folder = write_run(tmp_path / "r", metrics_lines()[:3], summary())
    joined = "\n".join(figure_texts(report.build_figure(report.load_run(str(folder)))))
    for name, origin in ORIGINS.items():
        assert f"{name} ({origin})" in joined


def test_without_summary_origins_are_unknown_until_evaluated(tmp_path):
    lines = metrics_lines()
    folder = write_run(tmp_path / "early", lines[:3])  # stopped in epoch 1: train lines only
    r = cli(folder)
    assert r.returncode == 0, r.stderr
    assert (folder / "report.png").read_bytes()[:4] == b"\x89PNG"
    joined = "\n".join(figure_texts(report.build_figure(report.load_run(str(folder)))))
    assert "mnist (origin unknown)" in joined and "cifar10 (origin unknown)" in joined
    assert "no summary.json" in joined
    assert [row["epoch"] for row in table_rows(r.stdout)] == ["1"]

    folder = write_run(tmp_path / "evaluated", lines[:4])  # an eval line says what data it tested on
    joined = "\n".join(figure_texts(report.build_figure(report.load_run(str(folder)))))
    assert f"mnist ({ORIGINS['mnist']})" in joined and "origin unknown" not in joined


def test_a_source_without_samples_has_no_loss_rather_than_zero(tmp_path):
    """The trainer writes loss 0.0 for a source that got no samples in a line (weight 0)."""
    lines = metrics_lines()[:3] + [train_line(1, 14, {"mnist": 1.0, "cifar10": 0.0}, {"mnist": 1.0, "cifar10": 0.0},
                                              200.0, {"mnist": 1.0, "cifar10": 0.0})]
    run = report.load_run(str(write_run(tmp_path / "r", lines)))
    row = report.epoch_rows(run)[0]
    assert row["loss"] == {"mnist": 1.5, "cifar10": 2.0}  # cifar10's 0.0 would have made it (5.5 + 4.75 + 1.75) / 8


def test_text_from_the_run_is_drawn_literally(tmp_path):
    """A `$` in an origin would otherwise be read as matplotlib math, and a broken one fails the drawing."""
    s = summary()
    s["data"]["mnist"]["origin"] = r"files from $\frac{1$ somewhere"
    folder = write_run(tmp_path / "r", metrics_lines(), s)
    r = cli(folder)
    assert r.returncode == 0, r.stderr
    assert (folder / "report.png").read_bytes()[:4] == b"\x89PNG"


def test_control_characters_from_the_run_are_printed_as_escapes(tmp_path):
    s = summary()
    s["data"]["mnist"]["origin"] = "files\x1b[2J\rfrom here"
    folder = write_run(tmp_path / "r", metrics_lines(), s)
    text = report.table(report.load_run(str(folder)))
    assert "\x1b" not in text and "\r" not in text and "files\\x1b[2J\\rfrom here" in text, text


def test_importing_the_report_does_not_import_matplotlib():
    code = "import sys, pipeline.train.report; sys.exit('matplotlib' in sys.modules)"
    r = run_capture([sys.executable, "-c", code], cwd=TOOL.parents[1], capture_output=True, text=True, timeout=HANG)
    assert r.returncode == 0, r.stderr


def _bad_folders(tmp_path):
    empty = tmp_path / "empty"
    write_run(empty, [], torn=False)
    torn_only = tmp_path / "torn_only"
    write_run(torn_only, [eval_line(1, 12)], summary())  # an eval line and a torn one, no train line
    bare = tmp_path / "bare"
    bare.mkdir()
    return {"missing": tmp_path / "nowhere", "empty": empty, "no train lines": torn_only, "no metrics": bare}


@pytest.mark.parametrize("case", ["missing", "empty", "no train lines", "no metrics"])
def test_bad_run_folders_fail_in_one_line(tmp_path, case):
    r = cli(_bad_folders(tmp_path)[case])
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert r.stderr.startswith("pipeline-report: error: ") and r.stderr.count("\n") == 1, r.stderr
    assert r.stdout == ""


@pytest.mark.parametrize("args", [[], ["--out"], ["--bogus"]])
def test_bad_command_lines_fail_in_one_line(run_dir, args):
    r = cli(*([run_dir] if args else []), *args)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and r.stderr.startswith("pipeline-report: error: ")


def test_unwritable_picture_fails_in_one_line(run_dir, tmp_path):
    for out in (tmp_path / "no" / "such" / "dir" / "r.png", tmp_path / "r.xyz"):
        r = cli(run_dir, "--out", out)
        assert r.returncode == 2, out
        assert "Traceback" not in r.stderr and r.stderr.startswith("pipeline-report: error: ")
        assert not os.path.exists(out)


@pytest.mark.slow
def test_hostile_metrics_lines_cost_neither_a_traceback_nor_minutes(tmp_path):
    """Infinity and NaN epochs, a line nested 100,000 deep, 20,000 epochs each resumed on another
    world: one picture (a scan per epoch, or per resume, took minutes: the test's timeout)."""
    run = tmp_path / "run"
    run.mkdir()
    with open(run / "metrics.jsonl", "w") as f:
        for e in range(20000):
            f.write(json.dumps({"kind": "train", "epoch": e + 1, "step": e + 1, "lr": 0.1, "weights": {"a": 1},
                                "loss": {"a": 1.0}, "samples_per_s": 10, "share": {"a": 1.0}, "skipped": 0}) + "\n")
            f.write(json.dumps({"kind": "resumed", "epoch": e + 2, "step": e + 1, "world": e % 3 + 1}) + "\n")
        f.write('{"kind": "train", "epoch": Infinity, "step": 1, "loss": {}}\n')
        f.write('{"kind": "eval", "epoch": NaN, "step": 1, "eval": {}}\n')
        f.write("[" * 100000 + "]" * 100000 + "\n")
    p = run_capture([sys.executable, str(TOOL), str(run)], capture_output=True, text=True, timeout=HANG)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert (run / "report.png").exists() and "20000" in p.stdout


@pytest.mark.slow
def test_confusion_matrices_are_drawn_with_class_names(tmp_path):
    """An eval line with per-class accuracy and a confusion matrix (as pipeline.train writes it
    for sources of up to 20 classes) adds a panel per source, its axes the class names."""
    lines = metrics_lines()
    lines[-1]["eval"]["cifar10"].update(per_class={"airplane": 0.5, "257.clutter": 1.0},
                                        confusion=[[4, 3, 1], [0, 8, 0]])
    lines[-1]["eval"]["mnist"].update(per_class={"0": 1.0}, confusion=[[1, 2, 3]])  # malformed: rows of 2 expected
    folder = write_run(tmp_path / "r", lines, summary())
    fig = report.build_figure(report.load_run(str(folder)))
    texts = figure_texts(fig)
    assert any("cifar10: confusion, accuracy 0.750" in t for t in texts)
    assert not any("mnist: confusion" in t for t in texts)
    labels = {t.get_text() for ax in fig.axes for t in ax.get_xticklabels() + ax.get_yticklabels()}
    assert {"airplane", "257.clutter", "other"} <= labels
    assert cli(folder).returncode == 0


def test_the_table_names_each_sources_origin_and_manifests(tmp_path):
    lines = metrics_lines()
    for r in lines:
        for name, v in r.get("eval", {}).items():
            v["manifest"] = f"/x/{name}-test.json"
    r = cli(write_run(tmp_path / "run", lines, summary()))
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    at = out.index("data:")
    assert out[at - 1].startswith("loss NAME: the mean training loss over the epoch's samples of NAME; acc NAME: "
                                  "the test accuracy after the epoch; samples/s: training samples a second")
    assert out[at + 1:at + 3] == [
        "  mnist: real data, torchvision files; train /x/mnist-train.json; test /x/mnist-test.json",
        "  cifar10: synthetic look-alike data; train /x/cifar10-train.json; test /x/cifar10-test.json"]
    assert [row["epoch"] for row in table_rows(r.stdout)] == ["1", "2"]  # the table itself as it was
    early = report.table(report.load_run(str(write_run(tmp_path / "early", metrics_lines()[:3]))))
    assert early.splitlines()[-2:] == ["  mnist: origin unknown; manifests not recorded",
                                       "  cifar10: origin unknown; manifests not recorded"]


def test_equal_weights_stay_visible_and_the_share_axis_is_the_whole_0_to_1(tmp_path):
    """Equal weights drew one dashed line over the other; a 0.48-0.52 axis made noise look large."""
    lines = metrics_lines()[:3]  # 0.5 and 0.5 throughout
    lines[1]["share"] = {"mnist": 0.52, "cifar10": 0.48}
    fig = report.build_figure(report.load_run(str(write_run(tmp_path / "run", lines, summary()))))
    ax = next(a for a in fig.axes if "mixture share" in a.get_title())
    assert ax.get_ylim() == (0, 1)
    dashed = {ln.get_label(): ln for ln in ax.get_lines() if "weight (equal" in ln.get_label()}
    assert set(dashed) == {"mnist weight (equal to cifar10)", "cifar10 weight (equal to mnist)"}
    a, b = dashed.values()
    assert list(a.get_ydata()) == list(b.get_ydata())  # the same values, drawn truthfully
    assert a._dash_pattern != b._dash_pattern  # but dashes that interleave: both colours show
    assert any("equal to" in t for t in figure_texts(fig))  # in the legend
    unequal = report.build_figure(report.load_run(str(write_run(tmp_path / "r2", metrics_lines(), summary()))))
    ax = next(a for a in unequal.axes if "mixture share" in a.get_title())
    assert {ln.get_label() for ln in ax.get_lines() if "weight" in ln.get_label()} == {"mnist weight", "cifar10 weight"}


def test_an_infinite_or_nan_loss_is_left_out_and_said(tmp_path):
    """A run that diverged logs Infinity and NaN losses: the picture draws the finite points and
    says what it left out, under the picture and under the table; no traceback."""
    lines = metrics_lines()
    lines[1]["loss"] = {"mnist": float("inf"), "cifar10": float("nan")}
    lines[5]["samples_per_s"] = float("inf")
    folder = write_run(tmp_path / "r", lines, summary())
    r = cli(folder)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    said = ("left out of the picture: 2 loss, 1 samples/s value(s) that no axis holds (Infinity, NaN, below 0, "
            "past 1e300; an accuracy or share past 1)")
    assert said in r.stdout.splitlines()
    assert said in figure_texts(report.build_figure(report.load_run(str(folder))))


def test_stops_and_resumes_are_marked(tmp_path):
    """A 'stopped' line (with its signal), a resume that changed the weights (weights_changed)
    and summary.json's resumed_from each give a dotted line with a label, and a table line."""
    lines = metrics_lines()
    lines.insert(4, {"kind": "stopped", "epoch": 1, "step": 12, "signal": "SIGTERM"})
    s = dict(summary(), resumed_from={"epoch": 2, "step": 17})
    folder = write_run(tmp_path / "r", lines, s)
    fig = report.build_figure(report.load_run(str(folder)))
    texts = figure_texts(fig)
    assert "stopped (SIGTERM) and resumed at step 12" in texts and "resumed at step 17" in texts
    dotted = [ln for ax in fig.axes for ln in ax.get_lines() if ln.get_linestyle() == ":"]
    assert sorted({ln.get_xdata()[0] for ln in dotted}) == [12, 17] and len(dotted) == 6  # on 3 step panels
    out = cli(folder).stdout.splitlines()
    assert "run stopped (SIGTERM) and resumed at step 12" in out and "run resumed at step 17" in out


@pytest.mark.parametrize("name", ["summary.json", "metrics.jsonl"])
def test_a_fifo_in_the_run_folder_is_not_waited_on(run_dir, name):
    """A FIFO named summary.json is left out (the report stands on metrics.jsonl); one named
    metrics.jsonl is one error line. Neither blocks."""
    os.remove(run_dir / name)
    os.mkfifo(run_dir / name)
    p = run_capture([sys.executable, str(TOOL), str(run_dir)], capture_output=True, text=True, timeout=HANG)
    assert "Traceback" not in p.stderr
    if name == "summary.json":
        assert p.returncode == 0 and "picture:" in p.stdout
    else:
        assert p.returncode == 2 and p.stderr.splitlines() == [
            f"pipeline-report: error: {run_dir}/metrics.jsonl: {run_dir}/metrics.jsonl is a FIFO, not a regular file: refused"]


def test_help_says_what_the_picture_holds():
    r = cli("--help")
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    assert "confusion matrix per source evaluated per class" in text and "six panels in all" in text
    assert "stopped and resumed" in text and "Infinity or NaN" in text


def test_values_no_axis_can_hold_are_left_out_and_said(tmp_path):
    """An accuracy of 1e308 beside one of -1e308 ended in `ValueError: arange: cannot compute
    length`, a loss of -1e308 or a speed of 1.7e308 in a singular matrix, an eval epoch of 1e300
    in a TypeError: each is left out and said, and the rest is drawn."""
    lines = metrics_lines()
    lines[1]["loss"]["mnist"], lines[2]["samples_per_s"] = -1e308, 1.7e308
    lines[3]["eval"]["cifar10"]["accuracy"], lines[-1]["eval"]["cifar10"]["accuracy"] = -1e308, 1e308
    lines.append(dict(eval_line(2, 24), epoch=1e300))
    lines.append(dict(train_line(2, 25, {"mnist": float("inf")}, {"mnist": 1.0}, 1.0), step=float("inf")))
    folder = write_run(tmp_path / "r", lines, summary())
    r = cli(folder)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    said = ("left out of the picture: 1 loss, 1 samples/s, 2 accuracy value(s) that no axis holds (Infinity, NaN, "
            "below 0, past 1e300; an accuracy or share past 1); 2 train or eval line(s) without a whole epoch and step")
    assert said in r.stdout.splitlines() and said in figure_texts(report.build_figure(report.load_run(str(folder))))
    rows = table_rows(r.stdout)
    assert [row["epoch"] for row in rows] == ["1", "2"] and rows[0]["acc cifar10"] == "-"
    assert rows[0]["loss mnist"] == f"{(2.0 * 5 + 1.25 * 2) / 7:.4f}"  # the epoch's other lines


def loss_lines():
    """Epoch 1: steps 4, 12 and 16, mnist's share 0.25 then 0.75 then 0.5; epoch 2 from step 16."""
    return [train_line(1, 4, {"mnist": 4.0, "cifar10": 2.0}, {"mnist": 0.25, "cifar10": 0.75}, 10.0),
            train_line(1, 12, {"mnist": 2.0, "cifar10": 1.0}, {"mnist": 0.75, "cifar10": 0.25}, 10.0),
            train_line(1, 16, {"mnist": 1.0, "cifar10": 3.0}, {"mnist": 0.5, "cifar10": 0.5}, 10.0),
            train_line(2, 20, {"mnist": 0.5, "cifar10": 0.5}, {"mnist": 0.5, "cifar10": 0.5}, 10.0)]


def test_an_epoch_s_loss_is_the_mean_over_its_samples(tmp_path):
    """The table's loss was the epoch's last line's (here 1.0 and 3.0, from 4 of its 16 steps):
    it is each line's mean weighted by the samples of the source it covers."""
    rows = report.epoch_rows(report.load_run(str(write_run(tmp_path / "r", loss_lines(), summary(), torn=False))))
    mnist = (4.0 * 4 * .25 + 2.0 * 8 * .75 + 1.0 * 4 * .5) / (4 * .25 + 8 * .75 + 4 * .5)
    cifar10 = (2.0 * 4 * .75 + 1.0 * 8 * .25 + 3.0 * 4 * .5) / (4 * .75 + 8 * .25 + 4 * .5)
    assert rows[0]["loss"] == pytest.approx({"mnist": mnist, "cifar10": cifar10})
    assert rows[1]["loss"] == {"mnist": 0.5, "cifar10": 0.5}


def resumed_run(tmp_path, at=10, world=3, history=True, summary_json=True):
    """loss_lines() run on 2 ranks, resumed on `world` after step `at` (its 'resumed' line
    written where the trainer writes it, a later line covering the steps on both worlds);
    summary.json's epochs as the trainer writes them (the epoch of the resume carries the old
    ranks' part in before_resume when the world changed)."""
    lines = loss_lines()
    lines.insert(next(i for i, r in enumerate(lines) if r["step"] > at),
                 {"kind": "resumed", "epoch": 1 if at < 16 else 2, "step": at, "world": world, "workers": 1})
    s = summary()
    old, new = {f"rank{r}": 8 for r in range(2)}, {f"rank{r}": 8 for r in range(world)}
    s.update(world_size=world, resumed_from={"epoch": 1, "step": at})
    s["epochs"] = [{"epoch": 1, "batches": new if at < 16 else old, "samples": {}, "skipped": 0},
                   {"epoch": 2, "batches": new, "samples": {}, "skipped": 0}]
    if at < 16 and world != 2:
        s["epochs"][0]["before_resume"] = {f"before_resume_rank{r}": {"batches": at} for r in range(2)}
    if not history:
        del s["epochs"]
    return write_run(tmp_path / f"r{at}-{world}-{history}-{summary_json}", lines, s if summary_json else None,
                     torn=False)


def test_the_title_names_each_world_the_run_ran_on(tmp_path):
    """Steps 1-10 on 2 ranks, then 3: the title said "3 rank(s)" (summary.json's last world)."""
    def title(folder):
        return picture.figure_title(report.load_run(str(folder))).splitlines()[0]

    assert title(resumed_run(tmp_path)).endswith(", 2 then 3 ranks")  # inside epoch 1: from before_resume
    assert title(resumed_run(tmp_path, at=16)).endswith(", 2 then 3 ranks")  # at its end: from its batches
    assert title(resumed_run(tmp_path, world=2)).endswith(", 2 ranks")  # the same world again
    assert title(resumed_run(tmp_path, history=False)).endswith(", 3 ranks from step 10")  # the first not known
    assert ", 3 ranks from step 10, no summary.json" in title(resumed_run(tmp_path, summary_json=False))
    assert title(write_run(tmp_path / "plain", loss_lines(), summary())).endswith(", 2 ranks")
    assert title(write_run(tmp_path / "one", loss_lines(), dict(summary(), world_size=1))).endswith(", 1 rank")
    retried = resumed_run(tmp_path / "retried")  # a resume on 4 that failed before its first line, then one on 3
    lines = (retried / "metrics.jsonl").read_text().splitlines(keepends=True)
    lines.insert(1, lines[1].replace('"world": 3', '"world": 4'))
    (retried / "metrics.jsonl").write_text("".join(lines))
    assert title(retried).endswith(", 2 then 3 ranks")
    for epochs in (5, [{"epoch": [1]}, {"epoch": 1, "batches": "x"}, 7]):  # a hostile summary: no first world
        folder = resumed_run(tmp_path / str(epochs)[:4])
        s = json.loads((folder / "summary.json").read_text())
        (folder / "summary.json").write_text(json.dumps(dict(s, epochs=epochs)))
        assert title(folder).endswith(", 3 ranks from step 10")


def test_an_epoch_s_loss_counts_each_step_with_the_world_it_ran_on(tmp_path):
    """Resumed on 3 ranks after step 10: the line at step 12 covers steps 5-10 on 2 ranks and
    11-12 on 3, the one at 16 four steps on 3: a step on 3 ranks takes 1.5 times the samples."""
    rows = report.epoch_rows(report.load_run(str(resumed_run(tmp_path))))
    n = [4 * 2, 6 * 2 + 2 * 3, 4 * 3]  # samples in units of the batch size
    share = [.25, .75, .5]
    loss = [4.0, 2.0, 1.0]
    expected = sum(x * k * s for x, k, s in zip(loss, n, share)) / sum(k * s for k, s in zip(n, share))
    assert rows[0]["loss"]["mnist"] == pytest.approx(expected)


def test_the_confusion_matrix_says_what_other_is(tmp_path):
    """Its last column, 'other', was explained nowhere: under the panel and in docs/training.md."""
    lines = metrics_lines()
    lines[-1]["eval"]["cifar10"].update(per_class={"airplane": 0.5, "bird": 1.0}, confusion=[[4, 3, 1], [0, 8, 0]])
    texts = figure_texts(report.build_figure(report.load_run(str(write_run(tmp_path / "r", lines, summary())))))
    assert "predicted (other: a class of another source)" in texts
    docs = " ".join((Path(__file__).resolve().parents[1] / "docs" / "training.md").read_text().split())
    assert "`other`, counts test samples predicted as a class of another source" in docs
