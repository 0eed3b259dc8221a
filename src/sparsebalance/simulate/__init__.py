"""Cluster simulator: replay many steps over R virtual ranks with the trainer's own planner (SAB),
tuner (DST) and latency model, and compare the ablations.

```python
from sparsebalance.simulate import SimConfig, run_simulation, simulate_steps

summary = run_simulation(SimConfig(world_sizes=(8, 64), micro_batches=4, steps=20))
table = simulate_steps([(lengths, densities)], 8, cost_model, micro_batches=4, block_size=128)  # explicit
table["strategies"]["sab+dst"]["speedup"]
```

Modules: ``distributions`` (document lengths), ``sparsity`` (densities at gamma0), ``engine``
(the step replay, :func:`simulate_steps`), ``pipeline`` (1F1B, interleaved and ZB-H1 makespans, ``--pp``),
``scenario`` (config, batches, cost model, all-reduce),
``plots`` (PNG).
"""

from .distributions import BUILTIN, LengthDistribution
from .engine import (
    ABLATIONS,
    DEFAULT_STRATEGIES,
    StepBatch,
    Strategy,
    resolve_strategies,
    simulate_steps,
)
from .scenario import SimConfig, build_cost_model, draw_batches, run_simulation, step_overhead
from .sparsity import SparsityModel

__all__ = [
    "ABLATIONS",
    "BUILTIN",
    "DEFAULT_STRATEGIES",
    "LengthDistribution",
    "SimConfig",
    "SparsityModel",
    "StepBatch",
    "Strategy",
    "build_cost_model",
    "draw_batches",
    "resolve_strategies",
    "run_simulation",
    "simulate_steps",
    "step_overhead",
]
