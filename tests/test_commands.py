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
