"""Workload-aware dynamic sparsity tuning (DST): attention budgets per rank, micro-batch and layer.

```python
tuner = DSTTuner(DSTConfig(mode="bidirectional", anchor="mean", p=0.1))
decision = tuner.decide(plan, cost_model)        # plan: rank -> micro-batches; StepDecision
ctl = LayerController.from_decision(decision.ranks[rank], plan[rank], cost_model, tuner.config)
budget = ctl.choose(mb, layer, estimate_block_mass(q, k, cu, block_size))   # in the forward
ctl.observe(mb, layer, seconds)                  # closed loop
```

Modules: ``curve`` (density vs gamma), ``dst`` (config, step level), ``layer`` (closed-loop
controller), ``records`` (what was decided and measured).
"""

from .curve import DensityCurve
from .dst import ANCHORS, MODES, DSTConfig, DSTTuner, RankWorkload, add_dst_arguments
from .layer import LayerController
from .plan_workload import PlanWorkload
from .records import (
    LayerRecord,
    RankDecision,
    RankRunSummary,
    StepDecision,
    StepTargets,
    bubbles,
)
from .unit_workload import UnitWorkload, decide_units

__all__ = [
    "ANCHORS",
    "MODES",
    "DSTConfig",
    "DSTTuner",
    "DensityCurve",
    "LayerController",
    "LayerRecord",
    "PlanWorkload",
    "RankDecision",
    "RankRunSummary",
    "RankWorkload",
    "StepDecision",
    "StepTargets",
    "UnitWorkload",
    "add_dst_arguments",
    "bubbles",
    "decide_units",
]
