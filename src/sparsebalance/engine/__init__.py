"""The step engine: one implementation of every stage of a training step, below every front end
(``sparsebalance train``'s :class:`~sparsebalance.train.Trainer`, the plain-loop API and the
sampler of :mod:`sparsebalance.integrations`, the HF Trainer callback of :mod:`sparsebalance.hf`).

    list[Sample] --plan--> StepPlan --tune--> TunedStep --execute--> LocalWork
      --synchronize--> list[RankRecord] --update--> StepReport + StepFeedback --feedback-->
      latency model, density estimator

- :class:`StepEngine` (:mod:`.planning`): plan (SAB), tune (DST), the layer controllers, the
  records of a rank's micro-batches, feedback and the learned state; what every front end uses;
- :func:`microbatch_attention` (:mod:`.stages`): the attention context of one packed
  micro-batch (budget, DST's per-layer choices, the closed loop's layer timer);
- :class:`StepRunner`, :class:`RankExecutor`, :class:`Updater` (:mod:`.step`, :mod:`.execute`):
  the own loop's execution, gradient sync and optimizer update;
- :func:`load_latency_model` (:mod:`.startup`), :func:`resolve_kernel` (:mod:`.defaults`):
  latency start-up and per-device defaults, once for every front end;
- :class:`StepReport`, :class:`Balance` (:mod:`.summary`): what a step's records say, for every
  front end (``StepReport.to_log()``: metrics.jsonl, log_history, TensorBoard, report).

The stage types are in :mod:`.records`; ``docs/engine.md`` draws the data flow.
"""

from .defaults import Kernel, resolve_kernel
from .execute import ExecutionConfig, RankExecutor
from .planning import PlanningConfig, StepEngine
from .records import (
    LocalWork,
    MicroBatchResult,
    RankRecord,
    StepFeedback,
    StepPlan,
    StepResult,
    TunedStep,
)
from .runtime import Runtime
from .stages import LayerTimer, microbatch_attention
from .startup import load_latency_model
from .step import NonFiniteLoss, StepRunner, UpdateConfig, Updater
from .summary import Balance, StepReport, log_values

__all__ = [
    "Balance",
    "ExecutionConfig",
    "Kernel",
    "LayerTimer",
    "LocalWork",
    "MicroBatchResult",
    "NonFiniteLoss",
    "PlanningConfig",
    "RankExecutor",
    "RankRecord",
    "Runtime",
    "StepEngine",
    "StepFeedback",
    "StepPlan",
    "StepReport",
    "StepResult",
    "StepRunner",
    "TunedStep",
    "UpdateConfig",
    "Updater",
    "load_latency_model",
    "log_values",
    "microbatch_attention",
    "resolve_kernel",
]
