"""Workload-aware dynamic sparsity tuning (DST): attention budgets per rank, micro-batch and layer.

```python
tuner = DSTTuner(DSTConfig(budget="top-k", budget_tokens=512, anchor="mean", p=0.1),
                 block_size=kernel.block_size)   # the resolved kernel's (engine.resolve_kernel)
decision = tuner.decide(plan, cost_model)        # plan: rank -> micro-batches; StepDecision
ctl = LayerController.from_decision(decision.ranks[rank], plan[rank], cost_model, tuner.config,
                                    knob=tuner.knob, device=device)
budget = ctl.choose(mb, layer, estimate_block_mass(q, k, cu, block_size))   # in the forward
ctl.observe(mb, layer, seconds)                  # closed loop
```

Modules: ``knob`` (top-k or gamma behind one interface), ``curve`` (density vs gamma), ``config``
(DSTConfig), ``dst`` (step level), ``layer`` (closed-loop controller), ``records`` (what was
decided and measured).
"""

from .config import ANCHORS, BUDGETS, MODES, RAISE_TO, DSTConfig, add_dst_arguments
from .curve import DensityCurve
from .dst import DSTTuner, RankWorkload
from .knob import GammaKnob, Knob, TopKKnob, knob_from_tokens
from .layer import LayerController
from .pipeline_workload import PipelineWorkload
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
    "BUDGETS",
    "MODES",
    "RAISE_TO",
    "DSTConfig",
    "DSTTuner",
    "DensityCurve",
    "GammaKnob",
    "Knob",
    "LayerController",
    "LayerRecord",
    "PipelineWorkload",
    "PlanWorkload",
    "RankDecision",
    "RankRunSummary",
    "RankWorkload",
    "StepDecision",
    "StepTargets",
    "TopKKnob",
    "UnitWorkload",
    "add_dst_arguments",
    "bubbles",
    "decide_units",
    "knob_from_tokens",
]
