"""Sparsity-aware batching (SAB): estimate each sample's attention density before the step, predict
its latency with a cost model, and pack the global batch into ranks x micro-batches so that
predicted rank times are even.

```python
from sparsebalance.batching import HistoryEstimator, PlanConfig, plan_batch

est = HistoryEstimator()  # a prior until the trainer reports densities
plan = plan_batch(samples, cost_model, PlanConfig(world_size=8, capacity=32768), estimator=est)
plan.ranks[rank]          # this rank's micro-batches (MicroBatch: sample_ids, lengths, densities)
plan.metrics.efficiency   # mean / max predicted rank time
plan.hash()               # compare across ranks
est.observe(samples, realized_densities)  # after the step
```
"""

from .budget_ema import ESTIMATORS, BudgetEMAEstimator, make_estimator
from .estimate import (
    DensityEstimator,
    HistoryEstimator,
    ProbeEstimator,
    ProbeModel,
    estimator_report,
    mape,
)
from .plan import Plan, PlanMetrics
from .planner import DEFAULT_CAPACITY, OVERLONG, STRATEGIES, PlanConfig, plan_batch
from .units import Unit, check_units

__all__ = [
    "DEFAULT_CAPACITY",
    "ESTIMATORS",
    "OVERLONG",
    "STRATEGIES",
    "BudgetEMAEstimator",
    "DensityEstimator",
    "HistoryEstimator",
    "Plan",
    "PlanConfig",
    "PlanMetrics",
    "ProbeEstimator",
    "ProbeModel",
    "Unit",
    "check_units",
    "estimator_report",
    "make_estimator",
    "mape",
    "plan_batch",
]
