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
