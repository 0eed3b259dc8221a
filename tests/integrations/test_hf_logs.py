"""SparseBalance's telemetry reaches the HF Trainer's ``log_history`` and every logging callback
(issue 38, item 7), whether the callback was added before ``sparsebalance.hf.enable`` (as the
``report_to`` integrations and ``Trainer(callbacks=...)`` are) or after it. One process on CPU,
the tiny model, 2 steps, an analytic profile (nothing measured, nothing downloaded). With
TensorBoard importable, also the event files ``report_to=["tensorboard"]`` writes."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

NAMES = ("balance", "bubble_fraction", "budget_mean", "budget_min", "budget_max", "density")
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


def _train(tmp_path, report_to: list[str], callbacks: list) -> tuple:
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
    )
    trainer.add_callback(after)
    trainer.train()
    return trainer, before, after


def _check(entry: dict) -> None:
    assert set(KEYS) <= set(entry), sorted(entry)
    assert 0 < entry["sparsebalance/balance"] <= 1
    assert entry["sparsebalance/bubble_fraction"] == pytest.approx(1 - entry["sparsebalance/balance"])
    assert 0 < entry["sparsebalance/density"] <= 1
    assert 0.5 <= entry["sparsebalance/budget_min"] <= entry["sparsebalance/budget_max"] <= 0.99


def test_telemetry_reaches_log_history_and_callbacks_in_any_order(tmp_path):
    trainer, before, after = _train(tmp_path, [], [])
    history = [e for e in trainer.state.log_history if "loss" in e]
    assert [e["step"] for e in history] == list(range(1, STEPS + 1))
    for entry in history:
        _check(entry)
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
