"""SparseBalance's telemetry reaches the HF Trainer's ``log_history`` and every logging callback
(issue 38, item 7), whether the callback was added before ``sparsebalance.hf.enable`` (as the
``report_to`` integrations and ``Trainer(callbacks=...)`` are) or after it. One process on CPU,
the tiny model, 2 steps, an analytic profile (nothing measured, nothing downloaded). With
TensorBoard importable, also the event files ``report_to=["tensorboard"]`` writes."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

NAMES = ("efficiency", "bubble_fraction", "budget_mean", "budget_min", "budget_max", "mean_density")
KEYS = tuple(f"sparsebalance/{name}" for name in NAMES)
STEPS = 2
pytestmark = pytest.mark.filterwarnings("ignore::sparsebalance.latency.ProfileMismatchWarning")


def _recorder():
    from transformers import TrainerCallback

    class Recorder(TrainerCallback):
        def __init__(self) -> None:
            self.logs: list[dict] = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append(dict(logs))

    return Recorder()


def _train(tmp_path, report_to: list[str], callbacks: list, log="compact") -> tuple:
    from transformers import Trainer, TrainingArguments

    import sparsebalance.hf
    from sparsebalance.latency import analytic_profile
    from sparsebalance.models import load_shapes
    from sparsebalance.models.hf import build_model
    from sparsebalance.tuning import DSTConfig

    profile = tmp_path / "profile.json"
    analytic_profile(load_shapes("tiny"), "h100", block_size=32).save(profile)
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        report_to=report_to,
        max_steps=STEPS,
        logging_steps=1,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        learning_rate=1e-3,
    )
    data = [{"input_ids": list(range(3, 3 + n))} for n in (40, 200, 90, 300, 60, 150, 70, 250)]
    before, after = _recorder(), _recorder()
    trainer = Trainer(model=build_model("tiny"), args=args, train_dataset=data, callbacks=[before, *callbacks])
    sparsebalance.hf.enable(
        trainer,
        capacity=512,
        profile=profile,
        block_size=32,
        deterministic=True,
        dst=DSTConfig(mode="bidirectional", budget="gamma", gamma0=0.9, gamma_min=0.5, gamma_max=0.99),
        log=log,
    )
    trainer.add_callback(after)
    trainer.train()
    return trainer, before, after


def _check(entry: dict) -> None:
    assert set(KEYS) <= set(entry), sorted(entry)
    assert 0 < entry["sparsebalance/efficiency"] <= 1
    assert entry["sparsebalance/bubble_fraction"] == pytest.approx(1 - entry["sparsebalance/efficiency"])
    assert 0 < entry["sparsebalance/mean_density"] <= 1
    assert 0.5 <= entry["sparsebalance/budget_min"] <= entry["sparsebalance/budget_max"] <= 0.99


def test_telemetry_reaches_log_history_and_callbacks_in_any_order(tmp_path):
    from sparsebalance.hf.callback import COMPACT

    trainer, before, after = _train(tmp_path, [], [])
    history = [e for e in trainer.state.log_history if "loss" in e]
    assert [e["step"] for e in history] == list(range(1, STEPS + 1))
    for entry in history:
        _check(entry)
        # issue 55: the compact set by default (it was every number of the step, 27 keys)
        assert {k for k in entry if k.startswith("sparsebalance/")} == {f"sparsebalance/{k}" for k in COMPACT}
    for recorder in (before, after):  # added before enable (report_to's place) and after it
        logs = [e for e in recorder.logs if "loss" in e]
        assert len(logs) == STEPS
        for entry in logs:
            _check(entry)
    # eval / end-of-train summaries carry no telemetry (nothing is counted twice)
    assert all(not set(KEYS) & set(e) for e in trainer.state.log_history if "loss" not in e)


def test_telemetry_reaches_tensorboard_event_files(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))  # transformers >= 5
    _train(tmp_path, ["tensorboard"], [])
    events = sorted((tmp_path / "tb").rglob("events.out.tfevents.*"))
    assert events, "report_to=['tensorboard'] wrote no event file"
    tags: dict[str, list] = {}
    for path in events:
        acc = EventAccumulator(str(path))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            tags.setdefault(tag, []).extend(acc.Scalars(tag))
    for key in KEYS:  # the TensorBoard callback prefixes training scalars with "train/"
        steps = sorted(e.step for e in tags.get(f"train/{key}", []))
        assert steps == list(range(1, STEPS + 1)), (key, sorted(tags))


# What only one front end knows: the own loop's loss, step time, throughput, optimizer time,
# learning rate, emulation, data mixture and skipped-step flag; the integrations' target tokens.
OWN_LOOP_ONLY = {
    "loss",
    "step_seconds",
    "tokens_per_s",
    "optimizer_s",
    "lr",
    "emulated",
    "data_documents",
    "skipped_nonfinite",
    "planned_ahead",
}
INTEGRATIONS_ONLY = {"target_tokens"}


def test_one_step_report_feeds_metrics_jsonl_and_log_history(tmp_path):
    """``sparsebalance train``'s ``"rank": "all"`` line and the HF callback's step log are the same
    ``StepReport.to_log()``: the same keys but for the ones a front end alone has, listed above;
    every number of it reaches ``log_history`` under ``sparsebalance/``."""
    import json

    import torch

    from sparsebalance.engine import Runtime, StepReport
    from sparsebalance.engine.summary import OWN_LOOP_ONLY as DECLARED
    from sparsebalance.hf.callback import SparseBalanceCallback
    from sparsebalance.train import Trainer
    from tests.train.harness import base_config

    assert set(DECLARED) == OWN_LOOP_ONLY
    (tmp_path / "own").mkdir()
    Trainer(base_config(tmp_path / "own", steps=1), Runtime(0, 1, torch.device("cpu"))).run()
    lines = [json.loads(x) for x in (tmp_path / "own" / "run" / "metrics.jsonl").read_text().splitlines()]
    (own,) = [x for x in lines if x["rank"] == "all"]
    own_keys = set(own) - {"rank"}

    trainer, _, _ = _train(tmp_path, [], [], log="all")
    (callback,) = [c for c in trainer.callback_handler.callbacks if isinstance(c, SparseBalanceCallback)]
    step = callback.planner.history[-1]
    assert own_keys - OWN_LOOP_ONLY == set(step) - INTEGRATIONS_ONLY
    assert set(StepReport.__dataclass_fields__) == own_keys | INTEGRATIONS_ONLY
    numbers = {k for k, v in step.items() if k != "step" and isinstance(v, int | float) and not isinstance(v, bool)}
    logged = [e for e in trainer.state.log_history if "loss" in e][-1]
    assert {k for k in logged if k.startswith("sparsebalance/")} == {f"sparsebalance/{k}" for k in numbers}


def test_a_log_gets_the_numbers_asked_for():
    """Issue 55: each log line printed 27 ``sparsebalance/*`` keys (~1,300 characters); by default
    it gets the compact set (checked on a real run above), ``log="all"`` every number, or the
    names asked for; a name that is no step number is refused in one line."""
    from types import SimpleNamespace

    from sparsebalance.hf import _log_keys
    from sparsebalance.hf.callback import COMPACT, SparseBalanceCallback

    step = {"step": 1, "efficiency": 0.9, "dst_budget_cut": 0.1, "plan_hash": "ab", "lr": 1e-3}
    history = SimpleNamespace(history=[step])
    for log, want in (("compact", {"efficiency"}), ("all", {"efficiency", "dst_budget_cut", "lr"})):
        got = SparseBalanceCallback(history, keys=_log_keys(log)).log_values()
        assert set(got) == {f"sparsebalance/{k}" for k in want}
    two = SparseBalanceCallback(history, keys=_log_keys(["efficiency", "dst_budget_cut"])).log_values()
    assert two == {"sparsebalance/efficiency": 0.9, "sparsebalance/dst_budget_cut": 0.1}
    assert "efficiency" in COMPACT and len(COMPACT) <= 8
    with pytest.raises(ValueError, match=r"log must be 'compact', 'all' or step numbers' names .*\['efficency'\]"):
        _log_keys(["efficency"])
