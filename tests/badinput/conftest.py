"""The bad-input suite (issue 39): every bad input is refused in one line (exit 2 on the command
line, ``ValueError`` / ``TypeError`` from the Python API) that names the culprit, before the
expensive stage, with nothing in ``--out`` lost or half-written.

"Before the expensive stage" is asserted, not timed: :func:`tripwires` replaces every stage that
costs seconds to minutes (launching ranks, measuring a latency profile, a training step, an
evaluation, planning, simulating) with one that raises :class:`ExpensiveStageReached`, a
``BaseException`` that no ``except Exception`` can swallow. A case whose refusal came after such
a stage fails with the stage's name.
"""

from __future__ import annotations

import hashlib
import importlib
import json
from pathlib import Path

import pytest

from sparsebalance.cli import main

EXPENSIVE = {
    "sparsebalance.train.launch.supervise": "training was launched",
    "sparsebalance.latency.measure.measure_profile": "a latency profile was measured",
    "sparsebalance.commands.profile.measure_profile": "a latency profile was measured",
    "sparsebalance.commands.profile.validate_profile": "a profile was validated (timed)",
    "sparsebalance.engine.step.StepRunner.run": "a training step ran",
    "sparsebalance.evaluation.evaluate_task": "the evaluation ran",
    "sparsebalance.evaluation.perplexity": "the evaluation ran",
    "sparsebalance.commands.plan.plan_batch": "the batch was planned",
    "sparsebalance.commands.simulate.run_simulation": "the simulation ran",
    "sparsebalance.commands.ring_balance.analyse": "the layouts were built",
}


class ExpensiveStageReached(BaseException):
    """Raised by a tripwire: the bad input was not refused before this stage."""


def _import_targets() -> None:
    """Import every module a tripwire patches before patching any: a module first imported while
    another's function is patched would bind the tripwire under its own name for good (its
    ``from ... import`` runs once), and monkeypatch would restore the tripwire there."""
    for target in EXPENSIVE:
        parts = target.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            try:
                importlib.import_module(".".join(parts[:cut]))
                break
            except ImportError:
                continue


@pytest.fixture(autouse=True)
def tripwires(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # default outputs (runs/train, profile.json) land in the test's
    _import_targets()
    for target, what in EXPENSIVE.items():

        def trip(*args, _what=what, **kwargs):
            raise ExpensiveStageReached(f"{_what} before the bad input was refused")

        monkeypatch.setattr(target, trip)


@pytest.fixture
def small_machine(monkeypatch):
    """A machine with 8 GiB available, whatever this one has: the refusals do not depend on it."""
    monkeypatch.setattr("sparsebalance.sizes.available_memory", lambda: 8 * 2**30)


def cli(capsys, *argv: str) -> tuple[int, str]:
    """``sparsebalance ARGV`` in this process: (exit code, stderr)."""
    code = main([str(a) for a in argv])
    return code, capsys.readouterr().err


def assert_refused(code: int, err: str, command: str, *culprits: str) -> None:
    """Exit 2 and exactly one line on stderr, the command's error line, naming every culprit."""
    lines = err.strip().splitlines()
    assert code == 2, (code, err)
    assert len(lines) == 1, err
    assert lines[0].startswith(f"sparsebalance {command}: error: "), err
    for culprit in culprits:
        assert culprit in lines[0], (culprit, err)


def assert_one_line(err: BaseException | str, *culprits: str) -> None:
    """A Python API refusal: one line naming every culprit."""
    text = str(err)
    assert "\n" not in text.strip(), text
    for culprit in culprits:
        assert culprit in text, (culprit, text)


def snapshot(path: Path) -> dict[str, str] | None:
    """Every file under ``path`` (or ``path`` itself) with its content hash; None if absent."""
    path = Path(path)
    if not path.exists():
        return None
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(p.relative_to(path.parent)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def write_json(path: Path, data) -> Path:
    path.write_text(json.dumps(data))
    return path


def sliding_window_model(tmp: Path) -> Path:
    """A model folder (config only: random weights) whose attention slides: Qwen2 with
    ``use_sliding_window`` on every layer."""
    from sparsebalance.models.shapes import CONFIG_DIR

    tiny = json.loads((CONFIG_DIR / "tiny.json").read_text())
    cfg = {k: v for k, v in tiny.items() if not k.startswith("_")}
    cfg.update(use_sliding_window=True, sliding_window=256, max_window_layers=0)
    folder = tmp / "windowed"
    folder.mkdir()
    write_json(folder / "config.json", cfg)
    return folder


def gpt2_model(tmp: Path) -> Path:
    """A model folder (config only) of a type SparseBalance does not run: GPT-2, whose config
    has ``n_head`` / ``n_layer`` instead of the keys a Qwen2 / Llama config has."""
    folder = tmp / "gpt2"
    folder.mkdir()
    config = {"model_type": "gpt2", "n_embd": 64, "n_head": 2, "n_layer": 2, "vocab_size": 4096}
    write_json(folder / "config.json", config)
    return folder


def write_profile(tmp: Path, name: str = "profile.json", model: str = "tiny", block_size: int = 32, edit=None) -> Path:
    """An analytic profile of ``model`` at ``block_size``; ``edit(data)`` damages its JSON."""
    from sparsebalance.latency import analytic_profile
    from sparsebalance.models import load_shapes

    path = tmp / name
    analytic_profile(load_shapes(model), "h100", block_size=block_size).save(path)
    if edit is not None:
        data = json.loads(path.read_text())
        edit(data)
        path.write_text(json.dumps(data))
    return path
