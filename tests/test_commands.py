"""The commands `pip install` puts on the PATH ([project.scripts] in pyproject.toml): each
one's function exists and answers --help exactly as the command it stands for does
(tools/make_shards.py, python -m pipeline.train, tools/report.py), without importing torch
where that command does not."""
import re
import sys
from pathlib import Path

import pytest

from helpers import HANG, run_capture

ROOT = Path(__file__).resolve().parents[1]
SAME_AS = {"make-shards": ["tools/make_shards.py"], "pipeline-train": ["-m", "pipeline.train"],
           "pipeline-report": ["tools/report.py"]}
CALL = """import sys
sys.argv = [{name!r}, "--help"]
from {module} import {function}
try:
    sys.exit({function}())  # as the wrapper pip writes calls it
except SystemExit as e:
    print("exit", e.code, "torch" in sys.modules, file=sys.stderr)
"""


def scripts():
    """{name: "module:function"} of pyproject.toml's [project.scripts] (read as text: tomllib is 3.11+)."""
    text = (ROOT / "pyproject.toml").read_text()
    section = re.search(r"^\[project\.scripts\]\n(.*?)(?=^\[)", text, re.M | re.S)
    assert section, "pyproject.toml has no [project.scripts]"
    return dict(re.findall(r'^([\w-]+)\s*=\s*"([\w.]+:\w+)"', section.group(1), re.M))


def test_the_three_commands_are_declared():
    assert set(scripts()) == set(SAME_AS)


@pytest.mark.slow  # three Pythons each way
@pytest.mark.parametrize("name", sorted(SAME_AS))
def test_each_command_answers_help_as_the_tool_it_stands_for(name):
    module, function = scripts()[name].split(":")
    p = run_capture([sys.executable, "-c", CALL.format(name=name, module=module, function=function)],
                    cwd=ROOT, capture_output=True, text=True, timeout=HANG)  # a hang guard only
    assert p.stderr.splitlines()[-1] == "exit 0 False", p.stderr[-2000:]  # no torch imported for --help
    tool = run_capture([sys.executable, *SAME_AS[name], "--help"], cwd=ROOT, capture_output=True, text=True,
                       timeout=HANG)
    assert tool.returncode == 0 and "usage:" in tool.stdout
    usage, rest = p.stdout.split("\n\n", 1)
    tool_usage, tool_rest = tool.stdout.split("\n\n", 1)
    assert rest == tool_rest  # the same help; the usage names the command typed (argparse wraps it to its length)
    assert usage.startswith(f"usage: {name} ")
    assert usage.replace(f"usage: {name} ", "").split() == tool_usage.split(None, 2)[2].split()


@pytest.mark.slow  # two Pythons
def test_the_trainer_names_a_report_command_that_exists_where_it_was_installed(tmp_path):
    """Its last line said `python tools/report.py RUN` where pip installed the package: no tools/ there."""
    from pipeline.train.summary import report_command

    python = sys.executable
    assert report_command("runs/x", clone=str(ROOT), installed=False) == f"{python} tools/report.py runs/x"
    assert report_command("runs/x", clone=str(tmp_path), installed=False) == f"{python} -m pipeline.train.report runs/x"
    assert report_command("runs/x", installed=True) == "pipeline-report runs/x"  # the installed command, if there
    p = run_capture([python, "-m", "pipeline.train.report", "--help"], cwd=tmp_path, capture_output=True,
                    text=True, timeout=HANG)  # a hang guard only
    tool = run_capture([python, "tools/report.py", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=HANG)
    assert p.returncode == 0 and p.stdout == tool.stdout


@pytest.mark.slow  # a 2-rank torchrun job
def test_torchrun_runs_the_installed_trainer_with_no_python(tmp_path):
    """`torchrun ... pipeline-train` failed ("can't open file .../pipeline-train": torchrun runs a
    Python script); `torchrun --no-python pipeline-train ...`, as the docs show, runs the command."""
    import json
    import os

    from helpers import build_shards, free_port

    command = os.path.join(os.path.dirname(sys.executable), "pipeline-train")
    if not os.path.exists(command):
        pytest.skip("the package is not installed in this Python's environment (make setup installs it)")
    build_shards(tmp_path, "mnist", "train", 64, maxcount=16)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1",
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    p = run_capture([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
                     "--no-python", "pipeline-train", "--train", f"mnist={tmp_path}/", "--epochs", "1",
                     "--batch-size", "8", "--workers", "0", "--width", "4", "--out", str(tmp_path / "run")],
                    cwd=tmp_path, env=env, capture_output=True, text=True, timeout=HANG)
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["world_size"] == 2
