"""Issue 55: every docs page's commands run as written, on the built-in data or the sample the
repository ships (``examples/data/sample.jsonl``). Each page below has one quick-start block
(``<!-- docs-test: quick-start -->``); the slow tier runs it with ``bash -e`` in a fresh folder
holding the repository's ``examples``, this environment's ``sparsebalance`` first on ``PATH``.
The README's quick start (the demo and the whole test suite) is ``scripts/newcomer.sh``'s
(``tests/docs/test_newcomer.py``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs.pages import ROOT, blocks, doc_files, links, rel

PAGES = (
    "docs/getting-started.md",
    "docs/training.md",
    "docs/data.md",
    "docs/pipeline.md",
    "docs/long-documents.md",
    "docs/simulator.md",
    "docs/latency.md",
    "docs/memory.md",
)
QUICK = {rel(p): [b for b in blocks(p) if b.quick_start] for p in doc_files()}


def test_each_page_has_one_quick_start_of_sparsebalance_commands():
    assert {page for page, found in QUICK.items() if found} == set(PAGES)
    for page in PAGES:
        (block,) = QUICK[page]
        assert block.lang == "bash", page
        commands = [line for line in block.code.splitlines() if line.strip()]
        assert commands and all(c.startswith("sparsebalance ") for c in commands), (page, commands)


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("page", PAGES)
def test_a_quick_start_runs_as_written(page, tmp_path):
    (block,) = QUICK[page]
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(
        ["bash", "-e", "-c", block.code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1100
    )
    assert proc.returncode == 0, f"{block.where}:\n{block.code}\n{proc.stderr[-4000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]


DEMO_FIGURE = re.compile(r"\*\*(\d\.\d\d(?:-\d\.\d\d)?)x\*\*")


def test_the_readme_and_getting_started_quote_one_demo_figure_from_one_file():
    """One set of current demo numbers: the README's and getting-started's speed-up is the same,
    from the same results file, which says it."""
    quoted = {}
    for page in ("README.md", "docs/getting-started.md"):
        path = ROOT / page
        text = path.read_text()
        (figure,) = set(DEMO_FIGURE.findall(text))
        files = {t for _, t in links(text) if t.endswith("train-demo-interleaved-cpu.md")}
        (target,) = files
        quoted[page] = (figure, (path.parent / target).resolve())
    ((figure, results),) = set(quoted.values())  # one figure, one file, on both pages
    assert f"{figure}x" in results.read_text()
