"""``--plan-ahead``: the next step is planned and tuned once this step's work is launched, before the
host waits for the device; a resume re-plans the step planned ahead from the state that planned
it, so it runs what the uninterrupted run ran (:mod:`sparsebalance.train.ahead`)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from sparsebalance.engine.runtime import Runtime
from sparsebalance.train import Trainer
from sparsebalance.train.ahead import resolve
from sparsebalance.train.config import TrainConfig
from tests.train.harness import base_config, rewind, run_trainers

CPU1 = Runtime(0, 1, torch.device("cpu"))
pytestmark = [
    pytest.mark.timeout(900),
    pytest.mark.filterwarnings("ignore::sparsebalance.latency.ProfileMismatchWarning"),
]


def test_auto_plans_ahead_on_cuda_only_and_a_bad_mode_is_one_line(tmp_path):
    assert resolve("auto", torch.device("cuda")) and not resolve("auto", torch.device("cpu"))
    assert resolve("on", torch.device("cpu")) and not resolve("off", torch.device("cuda"))
    assert TrainConfig.plan_ahead == "auto"
    with pytest.raises(ValueError, match="plan-ahead") as err:
        base_config(tmp_path, plan_ahead="early")
    assert "\n" not in str(err.value)


def _events(trainer: Trainer) -> list[str]:
    """Record when steps are planned (``begin``) and when the host waits for the device."""
    events: list[str] = []
    begin, clock = trainer.engine.begin, trainer.runner.executor.clock
    sync = clock.synchronize
    trainer.engine.begin = lambda samples, **kw: events.append("plan") or begin(samples, **kw)
    clock.synchronize = lambda: events.append("wait") or sync()
    return events


@pytest.mark.parametrize("mode", ["on", "off"])
def test_the_next_step_is_planned_before_this_step_waits_for_the_device(tmp_path, mode):
    trainer = Trainer(base_config(tmp_path, steps=3, emulate_ranks=2, plan_ahead=mode), CPU1)
    events = _events(trainer)
    result = trainer.run()
    if mode == "on":  # step n + 1 planned after step n's last rank is launched, before its wait
        # (the last step plans one more: its checkpoint extends a run exactly)
        assert events == ["plan", "wait", "plan", "wait", "wait", "plan", "wait", "wait", "plan", "wait"]
        assert [s["planned_ahead"] for s in result["summaries"]] == [False, True, True]
    else:
        assert events == ["plan", "wait", "wait", "plan", "wait", "wait", "plan", "wait", "wait"]
        assert not any(s["planned_ahead"] for s in result["summaries"])


def _drifting_feedback(trainer: Trainer) -> None:
    """Each step's feedback moves the latency level by 1.25x, as measured times would, but
    deterministically: a step planned one feedback earlier is priced visibly differently."""
    engine = trainer.engine
    feedback = engine.feedback

    def drift(records, measured=True):
        out = feedback(records, measured)
        state = engine.latency.state_dict()
        state["calibration"]["state"][0] += math.log(1.25)
        engine.latency.load_state_dict(state)
        return out

    engine.feedback = drift


def _summaries(run) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["rank"] == "all"]


PRICED = ("plan_hash", "predicted_max_before_s", "predicted_max_s", "dst_anchor_seconds", "budget_mean")


def test_a_resume_runs_the_step_the_saving_run_planned_ahead(tmp_path):
    """The checkpoint after step 2 holds the sampler's position before step 3's batch and the
    engine state that planned it; the resumed step 3 is priced as the uninterrupted one (and
    not as a plan from the state after step 2's feedback, which this resume with
    ``--plan-ahead off`` shows differs), and every loss matches."""
    (tmp_path / "a").mkdir()
    cfg = base_config(tmp_path / "a", steps=4, emulate_ranks=2, plan_ahead="on", checkpoint_every=2)
    whole = Trainer(cfg, CPU1)
    _drifting_feedback(whole)
    losses = whole.run()["losses"]
    state = torch.load(tmp_path / "a" / "run" / "checkpoints" / "step-000002" / "state.pt", weights_only=True)
    assert state["trainer"]["ahead"] is not None  # step 3 was planned ahead

    priced = {}
    for mode in ("on", "off"):
        run = rewind(tmp_path / "a" / "run", tmp_path / mode, step=2, drop=4)
        resumed = Trainer(replace(cfg, out=str(run), resume=True, plan_ahead=mode), CPU1)
        _drifting_feedback(resumed)
        tail = resumed.run()["losses"]
        if mode == "on":
            assert tail == losses[2:]
        priced[mode] = _summaries(run)
    step3 = {k: [s for s in _summaries(tmp_path / "a" / "run") if s["step"] == 3][0][k] for k in PRICED}
    on3, off3 = ({k: [s for s in priced[m] if s["step"] == 3][0][k] for k in PRICED} for m in ("on", "off"))
    assert on3 == step3
    assert off3["predicted_max_before_s"] != pytest.approx(step3["predicted_max_before_s"], rel=0.05)


def test_the_layer_controllers_rebase_a_target_priced_one_feedback_earlier(tmp_path):
    """A step planned ahead was priced by the model before the last feedback; its layer
    controllers, built during the step from the newer model, aim at the decision's time in that
    model (target / planned 1), not at the older model's seconds (a uniform cut of every rank
    by the feedback's change: 1 / 1.25 here)."""
    trainer = Trainer(base_config(tmp_path, steps=3, emulate_ranks=2, plan_ahead="on"), CPU1)
    _drifting_feedback(trainer)
    trainer.run()
    ran = trainer.engine._layers[0]  # step 3's (the one after it was planned, not run)
    controllers = [c for c in ran.solo.values() if c is not None]
    assert ran.tuned.ahead and len(controllers) == 2
    for c in controllers:
        assert c.target_seconds == pytest.approx(float(c.planned.sum()), rel=1e-9)


def test_a_finished_run_extends_exactly_and_a_resume_with_nothing_to_run_keeps_its_checkpoint(tmp_path):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    longer = Trainer(base_config(tmp_path / "a", steps=4, emulate_ranks=2, plan_ahead="on"), CPU1)
    _drifting_feedback(longer)
    longer.run()
    cfg = base_config(tmp_path / "b", steps=2, emulate_ranks=2, plan_ahead="on")
    short = Trainer(cfg, CPU1)
    _drifting_feedback(short)
    short.run()
    state = tmp_path / "b" / "run" / "checkpoints" / "step-000002" / "state.pt"
    before = state.read_bytes()
    Trainer(replace(cfg, resume=True), CPU1).run()  # --steps 2 again: nothing to run
    assert state.read_bytes() == before  # the saved plan ahead is kept
    extended = Trainer(replace(cfg, resume=True, steps=4), CPU1)
    _drifting_feedback(extended)
    extended.run()
    want = {s["step"]: [s[k] for k in PRICED] for s in _summaries(tmp_path / "a" / "run")}
    have = {s["step"]: [s[k] for k in PRICED] for s in _summaries(tmp_path / "b" / "run")}
    assert have == want


def _pipeline_events(trainer: Trainer, rank: int) -> dict:
    events = _events(trainer)
    trainer.run()
    return {"events": events}


@pytest.mark.distributed
def test_each_stage_plans_the_next_step_before_its_wait(tmp_path):
    cfg = base_config(tmp_path, steps=2, pp=2, strategy="sab", plan_ahead="on")
    for got in run_trainers(_pipeline_events, cfg, 2, tmp_path):
        assert got["events"] == ["plan", "plan", "wait", "plan", "wait"]
