"""The project's markdown as the docs tests read it: fenced code blocks (with the marker that
exempts one), inline code, links and the anchors GitHub gives headings.

A block is exempted from running or parsing by an HTML comment on the line right before its
opening fence, with the reason in brackets::

    <!-- docs-test: skip (needs CUDA) -->

and a page's quick start (shell commands on built-in data, run as written by the slow tier,
``tests/docs/test_quick_starts.py``) is marked the same way::

    <!-- docs-test: quick-start -->
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"<!--\s*docs-test:(?P<body>.*?)-->")
SKIP = re.compile(r"^\s*skip\s*\((?P<reason>[^()]*\S[^()]*)\)\s*$")
QUICK_START = re.compile(r"^\s*quick-start\s*$")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>```+|~~~+)\s*(?P<lang>[\w+-]*)")
TODO = "TODO(coordinator)"


def doc_files() -> list[Path]:
    """README.md and every page under docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


@dataclass(frozen=True)
class Block:
    """One fenced code block."""

    path: Path
    line: int
    """1-based line of the opening fence."""
    lang: str
    code: str
    """The block's lines, dedented by the fence's indentation (blocks inside list items)."""
    skip: str | None
    """The reason of the ``docs-test: skip`` marker right before the block, if any."""
    quick_start: bool = False
    """Marked ``docs-test: quick-start``: the page's quick start, run as written (slow tier)."""

    @property
    def where(self) -> str:
        return f"{rel(self.path)}:{self.line}"


def blocks(path: Path, text: str | None = None) -> list[Block]:
    """Every fenced block of a page, in order."""
    lines = (path.read_text() if text is None else text).split("\n")
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence = len(m["indent"]), m["fence"]
        before = next((x for x in reversed(lines[:i]) if x.strip()), "")
        body_of = MARKER.search(before)["body"] if MARKER.search(before) else ""
        marker = SKIP.match(body_of)
        body, j = [], i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            line = lines[j]
            body.append(line[indent:] if not line[:indent].strip() else line.lstrip())
            j += 1
        code = "\n".join(body) + "\n"
        quick = bool(QUICK_START.match(body_of))
        out.append(Block(path, i + 1, m["lang"], code, marker["reason"] if marker else None, quick))
        i = j + 1
    return out


def bad_markers(path: Path, text: str | None = None) -> list[str]:
    """``docs-test`` comments that exempt nothing: not of the form ``skip (reason)``, or not
    right before a fenced block."""
    text = path.read_text() if text is None else text
    lines = text.split("\n")
    bad = []
    for n, line in enumerate(lines):
        m = MARKER.search(line)
        if not m:
            continue
        following = next((x for x in lines[n + 1 :] if x.strip()), "")
        if not (SKIP.match(m["body"]) or QUICK_START.match(m["body"])):
            bad.append(
                f"{rel(path)}:{n + 1}: write <!-- docs-test: skip (reason) --> or <!-- docs-test: quick-start -->"
            )
        elif not FENCE.match(following):
            bad.append(f"{rel(path)}:{n + 1}: a docs-test marker must come right before a ``` block")
    return bad


def prose(text: str) -> str:
    """The page without its fenced blocks and HTML comments (their lines kept blank, so line
    numbers stay)."""
    lines = text.split("\n")
    out, fence = [], None
    for line in lines:
        m = FENCE.match(line)
        if fence is None and m:
            fence = m["fence"]
            out.append("")
        elif fence is not None:
            if line.strip().startswith(fence):
                fence = None
            out.append("")
        else:
            out.append(line)
    joined = "\n".join(out)
    return re.sub(r"<!--.*?-->", lambda m: "\n" * m[0].count("\n"), joined, flags=re.S)


_INLINE = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)


def inline_code(text: str) -> list[tuple[int, str]]:
    """``(line, code)`` of every inline code span outside fenced blocks."""
    body = prose(text)
    return [(body.count("\n", 0, m.start()) + 1, " ".join(m[2].split())) for m in _INLINE.finditer(body)]


_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?(?P<target>[^)\s>]+)>?(?:\s+\"[^\"]*\")?\)")
_REF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(?P<target>\S+?)>?(?:\s|$)", re.M)
_IMG = re.compile(r"<img\s[^>]*src=\"(?P<target>[^\"]+)\"")


def links(text: str) -> list[tuple[int, str]]:
    """``(line, target)`` of every link and image (inline, reference-style, ``<img src>``)
    outside code."""
    body = _INLINE.sub(lambda m: re.sub(r"[^\n]", " ", m[0]), prose(text))
    found = [m for pattern in (_LINK, _REF, _IMG) for m in pattern.finditer(body)]
    return sorted((body.count("\n", 0, m.start()) + 1, m["target"]) for m in found)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: markup removed, lower case, punctuation other than
    ``-`` and ``_`` dropped, spaces as ``-``."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # [text](target) -> text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "")
    text = re.sub(r"(\*\*|__|\*|_)(\S.*?\S|\S)\1", r"\2", text)
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors a page offers: its headings' (GitHub numbers repeats ``-1``, ``-2``) and
    explicit ``<a id=...>`` / ``<a name=...>``."""
    seen: dict[str, int] = {}
    out = set()
    for line in prose(text).split("\n"):
        m = re.match(r"^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m[1])
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    out.update(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", text))
    return out
