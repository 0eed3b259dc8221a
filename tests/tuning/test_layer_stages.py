"""Issue 54, item 4: DST's layer controller in a pipeline. Each stage decides only its own layers;
with :meth:`LayerController.share_by_stage` it allots each unit what one process deciding every
layer allots it (PP1 and PP2 choose the same per-layer budgets for the same step decision), and a
stage's overspend (a coverage bound's raise) is taken back from that stage's later units."""

import numpy as np
import pytest
import torch

from sparsebalance.batching.schedule import schedule_order
from sparsebalance.models.attention import PackedAttention
from sparsebalance.ops import Budget
from sparsebalance.tuning import DSTConfig, LayerController
from sparsebalance.tuning.layer_ledger import asked_microbatches
from sparsebalance.workload import MicroBatch
from tests.conftest import cu_from_lengths

from .oracle import Oracle

L = 8
ORACLE = Oracle(num_layers=L, a=1e-7, b=2e-9, c=2e-7, overhead=1e-3)


class CurveGate:
    """A top-k layer gate whose coverage is ``1 - exp(-k / tau)`` (anchors ignored): ``tau``
    large, the coverage bound stops a cut early."""

    def __init__(self, tau: float):
        self.tau = tau

    def _c(self, ks) -> np.ndarray:
        return 1.0 - np.exp(-np.asarray(ks, dtype=np.float64) / self.tau)

    def coverage(self, budget: Budget) -> float:
        return float(self._c(budget.top_k))

    def coverage_curve(self, budget: Budget, ks) -> np.ndarray:
        return self._c(ks)

    def coverage_floor(self, budget: Budget, ks, p: float) -> torch.Tensor:
        within = np.flatnonzero(self._c(budget.top_k) - self._c(ks) <= p)
        return torch.tensor([int(within[0]) if within.size else len(ks)])

    def keeps_whole(self, budget: Budget) -> bool:
        return False

    def document_density(self, budget: Budget) -> torch.Tensor:
        raise AssertionError("top-k prices a layer from the plan")


MBS = [
    MicroBatch((0, 1), (6000, 3000), (0.5, 0.5)),
    MicroBatch((2,), (9000,), (0.5,)),
    MicroBatch((3, 4, 5), (2000, 2500, 4000), (0.5, 0.5, 0.5)),
    MicroBatch((6,), (7000,), (0.5,)),
]
VALUES = (9.3, 6.4, 10.7, 12.2)  # DST's budgets per micro-batch (fractional: the layers run 9s and 10s)


def controller(p: float, stage_of=None) -> LayerController:
    cfg = DSTConfig(budget_tokens=640, p=p)  # k = 10 blocks of 64
    ctl = LayerController(MBS, ORACLE, cfg, 0.0, knob=cfg.knob(64), device="cpu", values=VALUES)
    ctl.target_seconds = float(ctl.planned.sum())  # the engine's, for a pipeline
    if stage_of is not None:
        ctl.share_by_stage(stage_of, 64, None)
    return ctl


def gates(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(2.0, 12.0, size=(len(MBS), L))


def one_process(p: float, tau: np.ndarray) -> np.ndarray:
    """Every layer decided by one controller, micro-batch by micro-batch (PP1)."""
    ctl = controller(p)
    return np.array([[ctl.choose(m, layer, CurveGate(tau[m, layer])).top_k for layer in range(L)] for m in range(4)])


def stages(p: float, tau: np.ndarray, split: tuple[int, ...], shared: bool = True) -> np.ndarray:
    """Each stage's controller decides its own layers in its 1F1B order (a stage per process)."""
    stage_of = np.repeat(np.arange(len(split)), split)
    out = np.zeros((4, L), dtype=np.int64)
    for s in range(len(split)):
        ctl = controller(p, stage_of if shared else None)
        for kind, m in schedule_order(len(split), 4, s):
            if kind == "F":
                for layer in np.flatnonzero(stage_of == s).tolist():
                    out[m, layer] = ctl.choose(m, layer, CurveGate(tau[m, layer])).top_k
    return out


@pytest.mark.parametrize("split", [(4, 4), (3, 5), (2, 2, 2, 2)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_stages_choose_what_one_process_chooses(split, seed):
    """No coverage event (p = 1): the same whole k per (micro-batch, layer) on any split."""
    tau = gates(seed)
    want = one_process(1.0, tau)
    assert np.unique(want).size > len(VALUES)  # fractional budgets: whole k above and below, a carry
    np.testing.assert_array_equal(stages(1.0, tau, split), want)


def test_stages_that_budget_alone_choose_otherwise():
    """What the stages did before: their own running sums, the other stages' layers counted as
    never spent; the budgets differ from one process's."""
    tau = gates(0)
    assert not np.array_equal(stages(1.0, tau, (4, 4), shared=False), one_process(1.0, tau))


def test_a_stage_takes_back_its_overspend_and_the_difference_is_bounded():
    """The coverage bound raises cut layers (p = 0.02 on steep gates): one process takes each
    raise back from every later layer, a stage from its own later layers. Measured on 3 seeds x
    3 splits: per-layer budgets within 3 blocks of one process's (base 10), each stage's predicted
    attention seconds within 5.1 % of one process's (docs/pipeline.md states this bound)."""
    worst_k, worst_s = 0, 0.0
    for seed in range(3):
        tau = gates(seed) * 4.0  # steep: the bound stops the cuts
        want = one_process(0.02, tau)
        for split in [(4, 4), (3, 5), (2, 2, 2, 2)]:
            got = stages(0.02, tau, split)
            worst_k = max(worst_k, int(np.abs(got - want).max()))
            stage_of = np.repeat(np.arange(len(split)), split)
            for s in range(len(split)):
                cols = stage_of == s
                a, b = _seconds(got[:, cols], cols), _seconds(want[:, cols], cols)
                worst_s = max(worst_s, abs(a / b - 1.0))
    assert worst_k <= 3 and worst_s <= 0.051, (worst_k, worst_s)


def _seconds(ks: np.ndarray, cols: np.ndarray) -> float:
    knob = DSTConfig(budget_tokens=640).knob(64)
    total = 0.0
    for m, mb in enumerate(MBS):
        for k in ks[m].tolist():
            total += float(
                ORACLE.layer_attention_seconds(mb.lengths, knob.density(np.asarray(mb.lengths), 0.5, k)).sum()
            )
    return total


@pytest.mark.parametrize("dense_from", [None, 0.6])
@pytest.mark.parametrize("lengths", [(64,), (100, 30), (200, 200), (64, 64, 64), (1000,), (300, 20, 500)])
def test_the_micro_batches_no_layer_asks_are_the_attention_contexts(lengths, dense_from):
    """The replay skips the micro-batches whose every document the lowest budget keeps whole:
    the same ones :class:`PackedAttention` never asks."""
    low = Budget(top_k=1)
    ctx = PackedAttention(
        cu_from_lengths(lengths),
        low,
        64,
        "torch",
        choose_budget=lambda *a: low,
        lengths=lengths,
        min_budget=low,
        dense_from=dense_from,
    )
    asked = asked_microbatches(low, [np.asarray(lengths)], 64, dense_from)
    assert bool(asked[0]) == (not ctx._all_covered)
