"""scripts/newcomer.sh runs a fresh clone through exactly the README's quick-start commands. The
default tier checks which commands it would run (``--dry-run``); `-m newcomer` runs them all
(the demo and the whole default test tier on a fresh virtual environment and an empty cache:
~20 minutes alone on 2 cores, more on a loaded machine)."""

from __future__ import annotations

import subprocess

import pytest

from tests.docs.pages import ROOT, blocks

SCRIPT = ROOT / "scripts" / "newcomer.sh"


def readme_quick_start() -> list[str]:
    text = (ROOT / "README.md").read_text()
    marker = text.index("<!-- newcomer.sh runs the next block -->")
    block = next(b for b in blocks(ROOT / "README.md") if text.count("\n", 0, marker) < b.line)
    return [line.split("  #")[0].strip() for line in block.code.split("\n") if line.strip()]


def test_newcomer_runs_exactly_the_readme_commands():
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.split("\n")
    commands = [x.removeprefix("would run: ") for x in lines if x.startswith("would run: ")]
    assert commands == readme_quick_start() == ["bash scripts/demo.sh", "bash scripts/test.sh"]


def test_newcomer_refuses_unknown_arguments():
    proc = subprocess.run(["bash", str(SCRIPT), "--bogus"], capture_output=True, text=True)
    assert proc.returncode == 2 and "--bogus" in proc.stderr


@pytest.mark.slow
@pytest.mark.newcomer
def test_a_fresh_clone_runs_the_readme_commands(tmp_path):
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--workdir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=3 * 3600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    clone = tmp_path / "sparsebalance"
    assert (clone / "runs" / "demo" / "report.md").is_file(), out[-6000:]
    assert "[newcomer] bash scripts/demo.sh: exit 0" in out
    assert "[newcomer] bash scripts/test.sh: exit 0" in out
    assert " passed" in out
