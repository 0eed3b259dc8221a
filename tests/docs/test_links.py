"""Links and images in the README and docs/ resolve (files, and headings for ``#anchor`` links
into markdown pages); every docs page can be reached from the README; the benchmarks page
indexes every results file; the README stays a page a newcomer reads in five minutes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.docs.pages import ROOT, anchors, doc_files, links, rel, slug

README_MAX_LINES = 220
RESULTS = ROOT / "benchmarks" / "results"


def broken_links(path: Path, text: str | None = None) -> list[str]:
    text = path.read_text() if text is None else text
    bad = []
    for line, target in links(text):
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve()
        if not file_part:
            if anchor not in anchors(text):
                bad.append(f"{rel(path)}:{line}: {target}: no heading with that anchor")
        elif not dest.exists():
            bad.append(f"{rel(path)}:{line}: {target}: no such file")
        elif ROOT not in dest.parents and dest != ROOT:
            bad.append(f"{rel(path)}:{line}: {target}: outside the repository")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            bad.append(f"{rel(path)}:{line}: {target}: no heading with that anchor")
    return bad


@pytest.mark.parametrize("path", doc_files(), ids=rel)
def test_links_and_images_resolve(path):
    bad = broken_links(path)
    assert not bad, "\n".join(bad)


def test_every_docs_page_is_reachable_from_the_readme():
    seen, todo = set(), [ROOT / "README.md"]
    while todo:
        page = todo.pop()
        if page in seen:
            continue
        seen.add(page)
        for _, target in links(page.read_text()):
            file_part = target.partition("#")[0]
            dest = (page.parent / file_part).resolve()
            if file_part.endswith(".md") and dest.is_file() and dest.parent.name == "docs":
                todo.append(dest)
    orphans = [rel(p) for p in doc_files() if p not in seen]
    assert not orphans, f"not linked from the README or a page it links: {orphans}"


def test_the_benchmarks_page_indexes_every_results_file():
    index = (ROOT / "docs" / "benchmarks.md").read_text()
    listed = {Path(target.partition("#")[0]).name for _, target in links(index)}
    files = [p.name for p in RESULTS.iterdir() if p.suffix in (".md", ".png")]
    missing = sorted(set(files) - listed)
    assert not missing, (
        "docs/benchmarks.md does not list these results files (add a row: date, command, "
        f"one-line conclusion): {missing}"
    )


def test_the_readme_is_short():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines: move detail to docs/"


def test_the_checker_finds_broken_links_and_anchors(tmp_path):
    page = ROOT / "docs" / "page.md"  # not written: only its folder matters
    text = (
        "[ok](../README.md) [gone](missing.md) ![img](../benchmarks/results/none.png)\n"
        "[anchor](#a-heading) [bad anchor](#nope) `[not a link](in-code.md)`\n"
        "```\n[in a block](block.md)\n```\n## A heading\n"
    )
    bad = broken_links(page, text)
    assert len(bad) == 3
    assert all(("missing.md" in b or "none.png" in b or "#nope" in b) for b in bad)


@pytest.mark.parametrize(
    "heading, anchor",
    [
        ("Training (`sparsebalance train`)", "training-sparsebalance-train"),
        ("`python -m sparsebalance.train.convert`", "python--m-sparsebalancetrainconvert"),
        ("SAB and DST: **the paper's rule**", "sab-and-dst-the-papers-rule"),
        ("On a GPU (`scripts/gpu_check.sh`)", "on-a-gpu-scriptsgpu_checksh"),
    ],
)
def test_anchors_follow_github(heading, anchor):
    assert slug(heading) == anchor
    assert anchor in anchors(f"# Title\n\n## {heading}\n")
