"""Preemption: a stop signal finishes the step on every rank, writes one checkpoint, prints
one line with the command that resumes, and the resumed run equals an uninterrupted one.
Also: --help and option errors before torch, and which errors keep their traceback."""
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest

from helpers import HANG, completed, free_port, mid_epoch_args, put_back, run_capture, steps_logged, train_in_process
from pipeline.train.metrics import read_keys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def python(code, *args, timeout=HANG):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return run_capture([sys.executable, "-c", code, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=timeout)


def trainer(*args, timeout=HANG):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    return run_capture([sys.executable, "-m", "pipeline.train", *map(str, args)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=timeout)


# ---------------------------------------------------------------- without torch


def test_the_option_parser_does_not_import_torch():
    p = python("import sys; from pipeline.train import options, stop\n"
               "options.parse(['--train', 'a=x/', '--weights', 'a=1', '--stop-signals', 'TERM,usr1'])\n"
               "heavy = sorted(m for m in ('torch', 'webdataset', 'numpy') if m in sys.modules)\n"
               "print(heavy)")
    assert p.returncode == 0 and p.stdout.strip() == "[]", p.stdout + p.stderr


TOOLS_RUN = ("import runpy, sys\n"
             "sys.argv = sys.argv[1:]\n"
             "try:\n"
             "    runpy.run_path(sys.argv[0], run_name='__main__')\n"
             "except SystemExit as e:\n"
             "    print('exit', e.code, sorted(m for m in ('torch', 'webdataset') if m in sys.modules))\n")


@pytest.mark.parametrize("tool", ["make_shards", "bench_loader", "gpu_check", "scale_sim", "write_wds", "rehearsal",
                                  "report"])
def test_every_tools_help_and_bad_flag_answer_before_torch_loads(tool):
    """A bad flag of each tool (and its --help) is answered before torch or webdataset is
    imported: under 0.25 s rather than about 2 s (docs/benchmarks.md, start-up)."""
    path = os.path.join(ROOT, "tools", f"{tool}.py")
    for flag, code in (("--help", 0), ("--no-such-flag", 2)):
        p = python(TOOLS_RUN, path, flag)
        assert p.stdout.strip().splitlines()[-1] == f"exit {code} []", (flag, p.stdout[-500:], p.stderr[-2000:])


def test_resume_without_a_checkpoint_is_one_line_and_needs_no_torch(tmp_path):
    p = trainer("--train", "a=x/", "--out", tmp_path / "run", "--resume")
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert "no checkpoint" in p.stderr and "--resume-or-start" in p.stderr and len(p.stderr.splitlines()) == 1


def test_a_local_folder_that_is_not_there_is_one_line_and_needs_no_torch(tmp_path):
    spec = f"mnist={tmp_path}/shards/"
    p = trainer("--train", spec, "--eval", spec, "--out", tmp_path / "run")
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert f"mnist={tmp_path}/shards/: no such folder" in p.stderr
    p = python("import sys; from pipeline.train import options\n"
               "options.check_out(options.parse(sys.argv[1:]))", "--train", f"a={tmp_path}/nowhere")
    assert p.returncode == 2 and "no such folder" in p.stderr  # from check_out, which runs before torch
    (tmp_path / "mine-train.json").write_text("{}")  # newuser5 5: a mistyped manifest name gets the manifest line
    p = trainer("--train", f"mine={tmp_path}/mine-train.jsn", "--out", tmp_path / "run")
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert f"no manifest at {tmp_path}/mine-train.jsn (build one with make-shards" in p.stderr
    assert f"did you mean {tmp_path}/mine-train.json?" in p.stderr and "no such folder" not in p.stderr


def test_a_mistyped_manifest_gets_the_json_it_is_a_typo_of_and_no_other(tmp_path):
    """hostileN 5: any .json was offered (package.json for a mistyped folder, the test split's
    manifest for the train one's), and a typo ending in .json (manifest.load's line) got none."""
    from pipeline.data.manifests import manifest
    from pipeline.files import missing_line

    data = tmp_path / "d"
    data.mkdir()
    (tmp_path / "package.json").write_text("{}")
    (data / "mine-test.json").write_text("{}")
    assert "did you mean" not in missing_line("mine", f"{tmp_path}/shards.new")
    assert "did you mean" not in missing_line("mine", f"{data}/mine-train.jsn")  # another split is no typo
    (data / "mine-train.json").write_text("{}")
    assert missing_line("mine", f"{data}/mine-train.jsn").endswith(f"; did you mean {data}/mine-train.json?")
    with pytest.raises(manifest.NoManifest) as e:
        manifest.load(f"{data}/mine-trian.json")
    assert str(e.value).startswith(f"no manifest at {data}/mine-trian.json (build one")
    assert str(e.value).endswith(f"; did you mean {data}/mine-train.json?")


@pytest.mark.parametrize("bad, needle", [("KILL", "'KILL'"), ("TERM,NOPE", "'NOPE'"), ("9", "'9'"),
                                         ("CHLD", "'CHLD'"), ("WINCH", "'WINCH'"), ("SEGV", "'SEGV'")])
def test_bad_stop_signals_are_one_line(bad, needle, capsys):
    from pipeline.train import options

    with pytest.raises(SystemExit) as e:
        options.parse(["--train", "a=x/", "--stop-signals", bad])
    err = capsys.readouterr().err
    assert e.value.code == 2 and needle in err and "--stop-signals" in err


def test_parse_signals():
    from pipeline.train import stop

    assert stop.parse_signals("TERM,sigint, USR1,TERM") == [signal.SIGTERM, signal.SIGINT, signal.SIGUSR1]
    assert stop.parse_signals("") == []


def test_resume_command_adds_resume_and_drops_overwrite(monkeypatch):
    from pipeline.train import stop

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    cmd = shlex.split(stop.resume_command(["--train", "a=x y/", "--overwrite", "--out", "o"]))
    assert cmd[1:] == ["-m", "pipeline.train", "--train", "a=x y/", "--out", "o", "--resume"]
    assert shlex.split(stop.resume_command(["--resume-or-start"]))[-1] == "--resume-or-start"


SECOND = r"""
import os, signal, sys, time
from pipeline.train import stop
with stop.StopRequest(stop.parse_signals("USR1,TERM"), []) as s:
    os.kill(os.getpid(), signal.SIGUSR1)
    time.sleep(0.1)
    assert s.got == signal.SIGUSR1 and s.agreed([0.0, 0.0]) is None and s.agreed(s.vector()) == signal.SIGUSR1
    pid = os.fork()
    if pid == 0:  # a forked child (a DataLoader worker) leaves the stop signals to the trainer
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
        os._exit(0 if {signal.SIGUSR1, signal.SIGTERM} <= blocked else 1)
    assert os.waitpid(pid, 0)[1] == 0, "the child does not block the stop signals"
    print("first signal noted", flush=True)
    os.kill(os.getpid(), signal.SIGTERM)  # the second: the default action, at once
    time.sleep(5)
print("still running")
"""


def test_a_second_signal_stops_at_once():
    p = python(SECOND)
    assert p.stdout == "first signal noted\n" and p.returncode == -signal.SIGTERM, (p.returncode, p.stdout, p.stderr)


GROUP = r"""
import os, signal, sys, time
from pipeline.train import stop
stop.TWICE = 0.5
with stop.StopRequest(stop.parse_signals("TERM"), []) as s:
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)  # the group's copy (scancel: the rank itself, then torchrun's)
    time.sleep(0.1)
    print("one stop", s.got.name, flush=True)
    time.sleep(0.6)
    os.kill(os.getpid(), signal.SIGTERM)  # later: a second request, at once
    time.sleep(5)
print("still running")
"""


def test_the_same_signal_twice_at_once_is_one_stop_and_later_ends_the_process():
    """A group signal reaches a rank twice (itself, and torchrun's copy): ended by the copy, a
    rank left its peers with a traceback and the last epoch unsaved (the final hostile pass)."""
    p = python(GROUP)
    assert p.stdout == "one stop SIGTERM\n" and p.returncode == -signal.SIGTERM, (p.returncode, p.stdout, p.stderr)


def test_an_internal_bug_keeps_its_traceback(tmp_path, monkeypatch, capsys):
    """Expected errors are one line; a ValueError from a bug is not taken for one."""
    from pipeline.train import loop

    def bug(*a, **k):
        raise ValueError("a bug, not bad input")

    monkeypatch.setattr(loop, "train", bug)
    with pytest.raises(ValueError, match="a bug"):
        loop.main(["--train", "a=x/", "--out", str(tmp_path / "o")])
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL or callable(signal.getsignal(signal.SIGTERM))
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL, "the stop handlers outlived main()"


# ---------------------------------------------------------------- the trainer under torchrun


@pytest.fixture(scope="session")
def data(mid_epoch_shards):
    return mid_epoch_shards


def common(data, out):
    return mid_epoch_args(data, out)


def metrics(out):
    """The run's figures, without the line a resume adds to say where it began."""
    lines = [json.loads(ln) for ln in open(os.path.join(out, "metrics.jsonl"))]
    for ln in lines:
        ln.pop("samples_per_s", None)
    return [ln for ln in lines if ln["kind"] != "resumed"]


def key_log(out):
    return {r: read_keys(os.path.join(out, f"keys-rank{r}.txt")) for r in range(2)}


@pytest.mark.slow
@pytest.mark.xdist_group("mid-epoch-runs")  # shares the session's stopped and uninterrupted runs with test_resume
def test_sigterm_to_torchrun_stops_with_a_checkpoint_and_the_resume_matches(sigterm_stopped, uninterrupted_run):
    out, as_stopped, said = sigterm_stopped
    whole = uninterrupted_run
    put_back(out, as_stopped)
    stops = re.findall(r"stopped at epoch (\d+), step (\d+); checkpoint saved in (\S+); resume with: (.*)", said)
    assert len(stops) == 1, said[-3000:]
    epoch, step, where, command = stops[0]
    assert where == f"{out}/" and epoch == "1" and 4 <= int(step) < 40, stops
    assert "interrupted" not in said
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped_by"] == "SIGTERM" and not summary["finished"] and summary["steps_done"] == int(step)

    words = shlex.split(command)
    assert words[-1] == "--resume" and "pipeline.train" in words
    words = [f"--master_port={free_port()}" if w.startswith("--master_port=") else w for w in words]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    p = run_capture(words, cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG)
    assert p.returncode == 0, p.stderr[-3000:]
    resumed = re.findall(r"resumed from epoch (\d+), step (\d+) \(saved at [^)]+\)", p.stdout + p.stderr)
    assert resumed == [(epoch, step)], (p.stdout + p.stderr)[-3000:]
    assert metrics(out) == metrics(whole)
    assert key_log(out) == key_log(whole)
    s, w = (json.loads((d / "summary.json").read_text()) for d in (out, whole))
    assert s["eval"] == w["eval"] and s["stopped_by"] is None and s["finished"]


@pytest.mark.slow
def test_sigterm_to_one_process_exits_143_and_resume_or_start_starts_then_resumes(data, tmp_path):
    out = tmp_path / "run"
    args = [*common(data, out), "--workers", "1", "--resume-or-start"]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.train", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    t0 = time.time()
    while not steps_logged(out):
        if proc.poll() is not None or time.time() - t0 > HANG:  # a hang guard, not a speed test
            p = completed(proc, 1)  # a hang: the stacks and a failure; else what it said
            pytest.fail(f"no training step logged; it ended with {p.returncode}: {p.stderr[-3000:]}")
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    p = completed(proc)
    stdout, stderr = p.stdout, p.stderr
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert stdout.count("stopped at ") == 1 and "resume with: " in stdout and "resumed from" not in stdout
    assert stdout.strip().splitlines()[-1].endswith("--resume-or-start")  # the requeue command stays as it was
    p = train_in_process(args)  # the requeued run: main() here, as `python -m pipeline.train` runs it
    assert p.returncode == 0 and p.stdout.count("resumed from ") == 1, p.stderr[-3000:]
    assert json.loads((out / "summary.json").read_text())["epochs_done"] == 2


def test_signals_by_number_and_abbreviated_resume_flags():
    """A stop signal may be given by number; a --resume-or-start that argparse took abbreviated
    is not followed by a --resume the two would refuse together."""
    from pipeline.train import stop

    assert stop.parse_signals("15,usr2") == [signal.SIGTERM, signal.SIGUSR2]
    for given in ("--resume-or-s", "--resume-or", "--resu"):
        cmd = shlex.split(stop.resume_command(["--train", "a=b", given]))
        assert cmd[-1] == given and "--resume" not in cmd[:-1], cmd
