"""``StepEngine`` with pipelines: DST's budget per micro-batch reaches each micro-batch's
attention context and its layer controller (the critical micro-batch cut, the others raised)."""

import numpy as np
import pytest
import torch

from sparsebalance.batching import PlanConfig
from sparsebalance.engine import StepEngine, resolve_kernel
from sparsebalance.latency import LatencyModel, analytic_profile
from sparsebalance.models import load_shapes
from sparsebalance.ops import Budget
from sparsebalance.tuning import DSTConfig
from sparsebalance.workload import Sample

LENGTHS = (8000, 2000, 2000, 2000)  # one document per micro-batch: the first is the critical path

pytestmark = pytest.mark.filterwarnings("ignore::sparsebalance.latency.OutsideGridWarning")


def _engine(stages: int) -> StepEngine:
    kernel = resolve_kernel("cpu", 32, "torch")
    latency = LatencyModel(analytic_profile(load_shapes("tiny"), "h100", block_size=kernel.block_size))
    dst = DSTConfig(budget_tokens=128)  # k = 4 blocks of 32: every document is sparse at the base
    plan = PlanConfig(world_size=1, micro_batches=4, pipeline_stages=stages)
    sample = lambda i: Sample(i, LENGTHS[i], "")  # noqa: E731
    return StepEngine(plan, latency, dst, sample, kernel=kernel, world_size=1, deterministic=True)


def _contexts(engine: StepEngine):
    step = engine.begin([Sample(i, n, "") for i, n in enumerate(LENGTHS)])
    out = []
    for m, u in enumerate(step.planned.rank_units[0]):
        lengths = step.planned.units[u].lengths
        cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
        out.append((lengths, engine.attention(step, 0, m, cu, lengths)))
    return step, out


def test_each_microbatch_runs_its_own_budget():
    engine = _engine(4)
    step, contexts = _contexts(engine)
    decision = step.decision.ranks[0]
    budgets = decision.microbatch_budgets
    assert budgets is not None and len(budgets) == 4
    base = engine.knob.base
    for (lengths, ctx), v in zip(contexts, budgets, strict=True):
        assert ctx.budget == engine.knob.budget(Budget(top_k=0), v)
        assert (v < base) == (max(lengths) == 8000)  # the critical one cut, not the others
    controller = engine._controller(step, 0)
    assert controller.values.tolist() == list(budgets)
    assert controller.target_seconds == pytest.approx(float(controller.planned.sum()))


def test_one_stage_runs_one_budget_per_rank():
    engine = _engine(1)
    step, contexts = _contexts(engine)
    decision = step.decision.ranks[0]
    assert decision.microbatch_budgets is None
    for _, ctx in contexts:
        assert ctx.budget == engine.knob.budget(Budget(top_k=0), decision.budget)


def _stage_engine(lengths=(5000, 4000, 1200, 1100)) -> StepEngine:
    """A pipeline of 2 stages (layers 3 / 1) whose DST decision raises two micro-batches to
    fractional budgets (17.5 and 8.4: the layers run whole k above and below them)."""
    kernel = resolve_kernel("cpu", 32, "torch")
    latency = LatencyModel(analytic_profile(load_shapes("tiny"), "h100", block_size=kernel.block_size))
    plan = PlanConfig(world_size=1, micro_batches=4, pipeline_stages=2, stage_layers=(3, 1))
    sample = lambda i: Sample(i, lengths[i], "")  # noqa: E731
    return StepEngine(
        plan, latency, DSTConfig(budget_tokens=128), sample, kernel=kernel, world_size=1, deterministic=True
    )


def _stage_contexts(engine: StepEngine, lengths=(5000, 4000, 1200, 1100)):
    step = engine.begin([Sample(i, n, "") for i, n in enumerate(lengths)])
    out = []
    for m, u in enumerate(step.planned.rank_units[0]):
        n = step.planned.units[u].lengths
        cu = torch.tensor(np.concatenate([[0], np.cumsum(n)]), dtype=torch.int32)
        out.append(engine.attention(step, 0, m, cu, n))
    return step, out


def test_each_stage_chooses_the_layer_budgets_one_process_chooses():
    """Issue 54, item 4: a pipeline's stages, each deciding only its own layers (in its 1F1B
    order, from the same plan and step decision), choose the whole k per (micro-batch, layer)
    that one process deciding every layer chooses (gates whose coverage bound never binds)."""
    from sparsebalance.batching.schedule import schedule_order
    from sparsebalance.tuning import LayerController
    from tests.tuning.test_layer_stages import CurveGate

    one = _stage_engine()
    step, contexts = _stage_contexts(one)
    assert any(v != round(v) for v in step.decision.ranks[0].microbatch_budgets)
    num_layers = one.latency.num_layers
    tau = np.random.default_rng(0).uniform(0.05, 0.2, size=(len(contexts), num_layers))
    ctl = LayerController.from_decision(
        step.decision.ranks[0], step.planned.plan.ranks[0], one.latency, one.tuner.config, knob=one.knob, device="cpu"
    )
    ctl.target_seconds = float(ctl.planned.sum())
    asked = [not ctx._all_covered for ctx in contexts]
    want = np.zeros((len(contexts), num_layers), dtype=np.int64)
    for m in np.flatnonzero(asked).tolist():
        for layer in range(num_layers):
            want[m, layer] = ctl.choose(m, layer, CurveGate(tau[m, layer])).top_k
    stage_of = np.array([0, 0, 0, 1])
    got = np.zeros_like(want)
    for s in range(2):
        _, stage_contexts = _stage_contexts(_stage_engine())  # a stage's own process: the same plan
        for kind, m in schedule_order(2, len(contexts), s):
            if kind == "F" and asked[m]:
                for layer in np.flatnonzero(stage_of == s).tolist():
                    got[m, layer] = stage_contexts[m].choose_budget(layer, CurveGate(tau[m, layer])).top_k
    np.testing.assert_array_equal(got, want)
