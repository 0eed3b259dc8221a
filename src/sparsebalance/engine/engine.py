"""``StepEngine``: what every front end plans, tunes and learns with, the same on every rank.

It holds the latency model, the density estimator, DST's tuner and (for context-parallel plans)
the cost model that prices split documents, and runs the step's stages on them:

    samples --plan--> StepPlan --tune--> TunedStep --(the front end executes)--> RankRecords
      --records / feedback--> recalibrated latency model and estimator

``sparsebalance train``'s :class:`~.step.StepRunner` executes a tuned step with its own executor
and optimizer; the integrations hand this rank's micro-batches to another trainer's loop and
report their times back through :meth:`StepEngine.records` and :meth:`StepEngine.feedback`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..batching import DensityEstimator, PlanConfig
from ..latency import LatencyModel
from ..tuning import DSTTuner, LayerController
from ..workload import CostModel, Sample
from .feedback import apply_feedback
from .records import MicroBatchResult, RankRecord, StepFeedback, StepPlan, TunedStep
from .stages import plan_step, rank_controller, tune_step
from .summary import derive_bubbles


@dataclass(frozen=True)
class PlanningConfig:
    """How a step is planned (the same on every rank)."""

    num_ranks: int
    """Data-parallel ranks the plan is for (real or emulated)."""
    micro_batches: int | None
    """Micro-batches per rank (None with a ``capacity``: as many as the capacity needs)."""
    capacity: int | None
    """Tokens per micro-batch, the memory bound (None: no bound)."""
    strategy: str = "sab"
    overlong: str = "split"
    cp_degree: int | None = None
    """A fixed context-parallel degree for ``sab-cp`` (None: chosen per document)."""
    ranks_per_node: int | None = None
    """The topology CP units are placed in (None: the cost model's links decide)."""
    per_doc_weighting: bool = False
    """Every document's tokens share one total loss weight (LongAlign)."""
    deterministic: bool = False
    """No measured time enters any decision."""

    def plan_config(self) -> PlanConfig:
        return PlanConfig(
            self.num_ranks,
            self.micro_batches,
            self.capacity,
            self.strategy,
            self.overlong,
            cp_degree=self.cp_degree,
            ranks_per_node=self.ranks_per_node,
        )


class StepEngine:
    """The step's stages over the run's models (see the module docstring).

    Args:
        config: the :class:`PlanningConfig`.
        latency: the latency model (the same on every rank; :func:`~.startup.load_latency_model`).
        tuner: DST's step-level tuner (its knob turns budget values into budgets).
        estimator: the density estimator SAB plans with.
        sample: sample id -> :class:`Sample` (length and source, for the estimator's feedback).
        all_gather: ``obj -> [obj of every rank]`` (one rank: ``[obj]``).
        cost: what plans and DST price with, when not ``latency`` itself (``sab-cp``'s
            ``ContextCost``, which prices documents split over several ranks).
        device: where the micro-batches train: off the CPU nothing inside a step may wait for
            it (DST's layer controllers decide on it, :class:`~sparsebalance.tuning.
            LayerController`).
    """

    def __init__(
        self,
        config: PlanningConfig,
        latency: LatencyModel,
        tuner: DSTTuner,
        estimator: DensityEstimator,
        sample: Callable[[int], Sample],
        all_gather: Callable[[object], list] | None = None,
        cost: CostModel | None = None,
        *,
        device: torch.device,
    ) -> None:
        self.config = config
        self.device = torch.device(device)
        self.latency = latency
        self.tuner = tuner
        self.estimator = estimator
        self.sample = sample
        self.all_gather = all_gather or (lambda obj: [obj])
        self.cost = cost

    @property
    def knob(self):
        return self.tuner.knob

    @property
    def dense_from(self) -> float | None:
        """The latency profile's crossover density (documents from it run on the dense kernel);
        None where the profile has none (CPU, analytic, gamma budgets)."""
        return self.latency.profile.dense_from

    def plan(self, samples: list[Sample]) -> StepPlan:
        """SAB: samples -> ranks -> micro-batches; every rank derived the same (checked)."""
        cfg = self.config
        return plan_step(
            samples,
            self.cost or self.latency,
            cfg.plan_config(),
            self.estimator,
            self.all_gather,
            cfg.per_doc_weighting,
        )

    def tune(self, planned: StepPlan, world_size: int) -> TunedStep:
        """DST: a budget per rank, and the loss scale ``world_size / global weight`` (the
        processes' gradient sync averages over ``world_size``)."""
        return tune_step(planned, self.tuner, self.latency, self.cost, world_size)

    def controller(self, tuned: TunedStep, rank: int) -> LayerController | None:
        """DST's layer controller for ``rank``'s one-rank micro-batches (None: budgets fixed)."""
        return rank_controller(tuned, rank, self.latency, self.tuner.config, self.tuner.knob, self.device)

    def records(
        self, tuned: TunedStep, rank: int, results: Sequence[MicroBatchResult], gather: bool = True
    ) -> list[RankRecord]:
        """Every rank's :class:`RankRecord` from this rank's micro-batch ``results`` (one
        all-gather when ``gather``), each with its derived bubble."""
        mine = RankRecord.from_results(tuned.decision.ranks[rank], list(results))
        records = self.all_gather(mine) if gather else [mine]
        derive_bubbles(records)
        return records

    def feedback(self, records: list[RankRecord], measured: bool = True) -> StepFeedback:
        """Fold the step's micro-batches (every rank's, rank order) into the latency model and
        the density estimator; their times only when ``measured`` and not deterministic."""
        feedback = StepFeedback.from_records(records)
        apply_feedback(
            feedback,
            self.latency,
            self.estimator,
            self.tuner.knob,
            self.sample,
            use_timings=measured and not self.config.deterministic,
            context=self.cost,
        )
        return feedback

    def state_dict(self) -> dict:
        """JSON-ready: the latency model's calibration, the estimator's state and the ring
        terms of ``sab-cp``'s cost model (None without one)."""
        return {
            "latency": self.latency.state_dict(),
            "estimator": self.estimator.state_dict(),
            "context": None if self.cost is None else self.cost.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.latency.load_state_dict(state["latency"])
        self.estimator.load_state_dict(state["estimator"])
        if self.cost is not None and state.get("context") is not None:
            self.cost.load_state_dict(state["context"])
