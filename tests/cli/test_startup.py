"""``sparsebalance --help`` is fast because it imports no command: a command's module (and torch,
numpy, transformers with it) is imported only when that command runs or shows its help. Asserted
on the modules a fresh interpreter has loaded, not timed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "numpy", "matplotlib")


def loaded_after(argv: list[str]) -> set[str]:
    """The modules a fresh interpreter has loaded after ``sparsebalance ARGV`` (run in-process)."""
    code = (
        "import json, sys\n"
        "from sparsebalance.cli import main\n"
        "try:\n"
        f"    main({argv!r})\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(json.loads(done.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("argv", [[], ["--help"], ["--version"], ["trian"]], ids=str)
def test_the_top_level_imports_nothing_heavy(argv):
    loaded = loaded_after(argv)
    assert not {m for m in HEAVY if m in loaded}
    assert not any(m.startswith("sparsebalance.commands.") for m in loaded)


def test_importing_the_cli_imports_nothing_heavy():
    code = "import json, sys, sparsebalance.cli; print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = set(json.loads(done.stdout))
    assert not {m for m in HEAVY if m in loaded}


def test_a_commands_help_imports_no_command():
    """Issue 55: its flags are kept as data (``cli_spec.json``; ``tests/cli/test_fast_answers.py``)."""
    loaded = loaded_after(["ring-balance", "--help"])
    assert not {m for m in loaded if m.startswith("sparsebalance.commands.")}
    assert not {m for m in HEAVY if m in loaded}
