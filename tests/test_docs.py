"""The README and docs/ keep their promises to a reader: every relative link reaches a file and,
with an #anchor, one of its headings; the README names the test command CI runs; and every flag
a documented trainer or make_shards command line uses is one that command takes."""
import re
import sys
from pathlib import Path

import pytest

from helpers import HANG, run_capture

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def slugs(text):
    """GitHub's anchors of a Markdown file's headings: lower case, punctuation dropped, spaces to
    dashes, a repeated heading numbered -1, -2, ..."""
    out, seen = set(), {}
    for title in re.findall(r"(?m)^#{1,6} (.*)$", re.sub(r"(?s)```.*?```", "", text)):
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(path):
    """The relative links of one Markdown file that reach no file, or no heading of it."""
    text = re.sub(r"(?s)```.*?```", "", path.read_text())
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"\w+:", target):  # http(s)://, mailto:
            continue
        name, _, anchor = target.partition("#")
        dest = (path.parent / name).resolve() if name else path
        if not dest.exists():
            bad.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in slugs(dest.read_text()):
            bad.append(f"{target} (no such heading)")
    return bad


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_relative_link_reaches_its_file_and_heading(path):
    assert broken_links(path) == []


def test_the_link_check_sees_a_missing_heading_and_a_missing_file(tmp_path):
    (tmp_path / "a.md").write_text("# A title, with: punctuation\n\n## Twice\n\n## Twice\n")
    page = tmp_path / "b.md"
    page.write_text("[ok](a.md#a-title-with-punctuation) [ok](a.md#twice-1) [no](a.md#nowhere) [no](c.md)\n"
                    "```\n[in a code block](x.md)\n```\n")
    assert broken_links(page) == ["a.md#nowhere (no such heading)", "c.md (no such file)"]


def test_the_readme_names_the_test_command_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text()
    command = re.findall(r"(?m)^(make \S+)\s*$", ci)
    assert command == ["make test"], command
    assert re.search(r"(?m)^make test\b", (ROOT / "README.md").read_text())


def documented_flags(pattern):
    """{flag: a line using it} for every --flag after a command matching pattern in README and docs/."""
    flags = {}
    for path in DOCS:
        for line in path.read_text().replace("\\\n", " ").splitlines():
            m = re.search(pattern, line)
            if m:
                for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", m.group(1)):
                    flags.setdefault(flag, f"{path.name}: {line.strip()[:100]}")
    return flags


@pytest.mark.slow  # two Pythons for --help
@pytest.mark.parametrize("command, pattern", [
    (["-m", "pipeline.train"], r"(?:pipeline\.train|pipeline-train)\b(.*)"),
    (["tools/make_shards.py"], r"(?:make_shards\.py|make-shards)\b(.*?)(?:`|$)"),
])
def test_the_documented_flags_are_the_commands_own(command, pattern):
    p = run_capture([sys.executable, *command, "--help"], cwd=ROOT, timeout=HANG)  # a hang guard only
    assert p.returncode == 0, p.stderr[-2000:]
    known = set(re.findall(r"--[a-z][a-z0-9-]*", p.stdout)) | {"--slots"}  # --slots: hidden, ignored with a line
    unknown = {flag: line for flag, line in documented_flags(pattern).items() if flag not in known}
    assert unknown == {}
