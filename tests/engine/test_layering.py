"""The front ends touch the step through the engine only (issue 43, item 1): no module under
``sparsebalance/integrations`` or ``sparsebalance/hf`` imports from ``sparsebalance.tuning``,
``sparsebalance.batching`` or ``sparsebalance.latency`` (the stages below the engine); what a
front end needs of them (its settings' types: ``DSTConfig``, ``PlanConfig``, ``LatencyModel``)
it takes from ``sparsebalance.engine``'s public names. Found with ``ast``: relative and absolute
imports, at module level or inside a function."""

from __future__ import annotations

import ast
from pathlib import Path

import sparsebalance
import sparsebalance.engine

ROOT = Path(sparsebalance.__file__).parent
FRONT_ENDS = ("integrations", "hf")
BELOW = ("tuning", "batching", "latency")

# (file under sparsebalance/, imported module) -> why it is still imported directly. Empty: none.
ALLOWED: dict[tuple[str, str], str] = {}


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """``(absolute module, names)`` of every import in ``path`` (relative ones resolved)."""
    package = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[: len(base) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            found.append((module, [a.name for a in node.names]))
    return found


def _below(module: str, names: list[str]) -> list[str]:
    """The stages below the engine that an import reaches (``from sparsebalance import latency``
    included)."""
    parts = module.split(".")
    if parts[0] != "sparsebalance":
        return []
    if len(parts) > 1:
        return [".".join(parts[:2])] if parts[1] in BELOW else []
    return [f"sparsebalance.{n}" for n in names if n in BELOW]


def test_front_ends_import_nothing_below_the_engine():
    found = []
    for package in FRONT_ENDS:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for module, names in _imports(path):
                for stage in _below(module, names):
                    if (rel, stage) not in ALLOWED:
                        found.append(f"{rel}: {module}")
    assert not found, "front ends importing stages below the engine:\n" + "\n".join(found)


def test_front_ends_use_the_engines_public_names_only():
    """What a front end takes from ``sparsebalance.engine`` itself is in its ``__all__``."""
    public = set(sparsebalance.engine.__all__)
    found = []
    for package in FRONT_ENDS:
        for path in sorted((ROOT / package).rglob("*.py")):
            for module, names in _imports(path):
                if module == "sparsebalance.engine":
                    found += [f"{path.name}: {n}" for n in names if n not in public]
    assert not found, found


def test_the_check_sees_a_relative_import_below_the_engine(tmp_path):
    """The finder resolves ``from ..tuning import X`` in a front end (else the test passes
    vacuously)."""
    imports = _imports(ROOT / "integrations" / "planner.py")
    assert any(m == "sparsebalance.engine" for m, _ in imports)
    assert _below("sparsebalance.tuning", ["DSTConfig"]) == ["sparsebalance.tuning"]
    assert _below("sparsebalance", ["latency"]) == ["sparsebalance.latency"]
