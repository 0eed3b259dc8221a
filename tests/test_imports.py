"""The package's import structure: every module imports; no import cycle between modules or between
sub-packages; nothing imports upward (a stage never imports the trainer, a command or the CLI).

The graph is read from the source with ``ast`` (function-level imports included: a lazy import is
still a dependency), so the test sees what a reader sees, not only what one run happens to load.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
from collections import defaultdict
from pathlib import Path

import pytest

import sparsebalance

PACKAGE = "sparsebalance"
ROOT = Path(sparsebalance.__file__).parent

# Top-level parts of the package, lowest first. A module may import its own part and any part of
# a lower layer, never a higher one. Parts of one layer may import each other as long as the
# part-level graph stays acyclic (checked separately).
LAYERS: tuple[tuple[str, ...], ...] = (
    (
        "workload",
        "results",
        "timing",
        "clock",
        "precision",
        "sizes",
        "flags",
        "versions",
        "files",
        "launches",
        "transfer",
        "cli_spec",  # the command line's flags as data, read without importing a command
    ),
    ("ops",),  # the attention op
    ("models", "tasks", "data", "batching", "tuning", "latency", "parallel"),  # library stages
    ("evaluation", "simulate", "timeline", "report_pipeline", "report_dst", "verdict"),  # built from the stages
    ("engine",),  # the step engine below every front end
    ("report", "train"),  # the CLI trainer (own loop) and its reports
    ("integrations", "hf"),  # other trainers (HF Trainer, TRL, loops) over the engine
    ("commands",),  # one module per command: parse, call the library, print
    ("cli", "__main__", "cli_spec_write"),  # the entry point (and what writes its flags as data)
)
LAYER_OF = {part: i for i, parts in enumerate(LAYERS) for part in parts}
# Who may import ``commands`` and ``cli``: only the entry point (and commands themselves).
ENTRY_ONLY = {"commands": {"cli", "__main__", "commands"}, "cli": {"__main__", "cli_spec_write"}}
# The front ends drive the engine and import none of each other (issue 37): ``train`` is the CLI
# trainer only, ``integrations`` and ``hf`` reach the step's stages through ``engine``.
FRONT_ENDS = {"train": set(), "integrations": {"hf"}, "hf": set()}


def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package)."""
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = [PACKAGE, *path.relative_to(ROOT).with_suffix("").parts]
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


MODULES = _modules()


def _imports(name: str, path: Path, is_pkg: bool) -> set[str]:
    """The package modules that module ``name`` imports anywhere in its source."""
    here = name.split(".") if is_pkg else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:  # ``from pkg import module`` names the module itself
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in MODULES else target)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: _imports(name, *info) for name, info in MODULES.items()}


def _imported_names(name: str, path: Path, is_pkg: bool) -> set[tuple[str, str]]:
    """``(module, name)`` of every ``from module import name`` of a package module in ``name``."""
    here = name.split(".") if is_pkg else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            base = here[: len(here) - (node.level - 1)] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            if target in MODULES:
                found.update((target, alias.name) for alias in node.names)
    return found


NAMES = {name: _imported_names(name, *info) for name, info in MODULES.items()}


def _part(module: str) -> str:
    """``sparsebalance.engine.step`` -> ``train``; the root package -> ``""``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a node list (first node repeated at the end), or None."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_every_module_imports():
    names = [m.name for m in pkgutil.walk_packages(sparsebalance.__path__, f"{PACKAGE}.")]
    names = [n for n in names if not n.endswith("__main__")]  # running them is their import
    assert set(names) | {PACKAGE} >= set(MODULES) - {f"{PACKAGE}.__main__", f"{PACKAGE}.train.__main__"}
    for name in names:
        importlib.import_module(name)


def test_every_part_has_a_layer():
    parts = {_part(m) for m in MODULES} - {""}
    assert parts <= set(LAYER_OF), f"add {sorted(parts - set(LAYER_OF))} to LAYERS"


def test_no_module_import_cycle():
    assert _find_cycle(GRAPH) is None, " -> ".join(_find_cycle(GRAPH) or [])


def test_no_cycle_between_parts():
    parts: dict[str, set[str]] = defaultdict(set)
    for src, targets in GRAPH.items():
        parts[_part(src)].update(_part(t) for t in targets if _part(t) not in ("", _part(src)))
    cycle = _find_cycle(parts)
    assert cycle is None, "sub-package cycle: " + " -> ".join(cycle or [])


def test_no_upward_import():
    upward = [
        f"{src} imports {dst}"
        for src, targets in GRAPH.items()
        for dst in targets
        if _part(src) and _part(dst) and LAYER_OF[_part(dst)] > LAYER_OF[_part(src)]
    ]
    assert not upward, "\n".join(sorted(upward))


def test_commands_and_cli_only_imported_by_the_entry_point():
    wrong = [
        f"{src} imports {dst}"
        for src, targets in GRAPH.items()
        for dst in targets
        if _part(dst) in ENTRY_ONLY and _part(src) not in ENTRY_ONLY[_part(dst)]
    ]
    assert not wrong, "\n".join(sorted(wrong))


def test_front_ends_drive_the_engine_and_import_no_other_front_end():
    """``integrations`` and ``hf`` import nothing from ``train`` (``hf`` builds on
    ``integrations``); every front end imports the engine."""
    wrong = [
        f"{src} imports {dst}"
        for src, targets in GRAPH.items()
        for dst in targets
        if _part(dst) in FRONT_ENDS
        and _part(src) in FRONT_ENDS
        and _part(src) != _part(dst)
        and _part(src) not in FRONT_ENDS[_part(dst)]
    ]
    assert not wrong, "\n".join(sorted(wrong))
    for front in FRONT_ENDS:
        engine_users = {
            src for src, targets in GRAPH.items() if _part(src) == front and any(_part(t) == "engine" for t in targets)
        }
        assert engine_users, f"{front} does not use the engine"
    private = [
        f"{src} imports {name} from {dst}"
        for src, names in NAMES.items()
        for dst, name in names
        if _part(src) in FRONT_ENDS
        and _part(dst) != _part(src)
        and (name.startswith("_") or any(seg.startswith("_") and seg != "__init__" for seg in dst.split(".")))
    ]
    assert not private, "\n".join(sorted(private))


@pytest.mark.parametrize(
    ("graph", "has_cycle"),
    [({"a": {"b"}, "b": {"c"}, "c": set()}, False), ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, True)],
)
def test_cycle_finder(graph, has_cycle):
    assert (_find_cycle(graph) is not None) == has_cycle
