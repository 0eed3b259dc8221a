"""Every ```python block of the README and docs/ runs, at the small sizes the page shows: the
blocks of one page run in order in one namespace (a later block may use an earlier one's names),
in a scratch working directory. A block that needs a GPU, several processes or a trainer
framework's full setup carries ``<!-- docs-test: skip (reason) -->``; every such marker must be
well formed and name its reason, and they stay few."""

from __future__ import annotations

import os
import traceback

import pytest

from tests.docs.pages import bad_markers, blocks, doc_files, rel

PAGES = {rel(p): [b for b in blocks(p) if b.lang == "python"] for p in doc_files()}
MAX_SKIPPED = 8


RUNNABLE = sorted(p for p, bs in PAGES.items() if any(not b.skip for b in bs))


@pytest.mark.parametrize("page", RUNNABLE)
def test_python_blocks_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    namespace: dict = {"__name__": "__docs__"}
    for block in PAGES[page]:
        if block.skip:
            continue
        try:
            exec(compile(block.code, block.where, "exec"), namespace)
        except Exception:
            pytest.fail(f"{block.where} failed:\n{traceback.format_exc(limit=-3)}")
    assert os.getcwd() == str(tmp_path)


def test_python_blocks_exist_and_few_are_exempt():
    every = [b for bs in PAGES.values() for b in bs]
    skipped = [f"{b.where}: {b.skip}" for b in every if b.skip]
    assert len(every) - len(skipped) >= 8, "the docs should show runnable Python"
    assert len(skipped) <= MAX_SKIPPED, "too many exempt blocks:\n" + "\n".join(skipped)


def test_skip_markers_are_well_formed():
    bad = [m for p in doc_files() for m in bad_markers(p)]
    assert not bad, "\n".join(bad)


def test_a_skip_marker_needs_a_reason_and_a_block(tmp_path):
    page = tmp_path / "page.md"
    text = "<!-- docs-test: skip () -->\n```python\n1/0\n```\n<!-- docs-test: skip (x) -->\ntext\n"
    assert len(bad_markers(page, text)) == 2
    (block,) = blocks(page, "<!-- docs-test: skip (needs CUDA) -->\n\n```python\nx = 1\n```\n")
    assert block.skip == "needs CUDA" and block.code == "x = 1\n"
    (block,) = blocks(page, "- item:\n\n  ```python\n  if True:\n      x = 1\n  ```\n")
    assert block.skip is None and block.code == "if True:\n    x = 1\n"
