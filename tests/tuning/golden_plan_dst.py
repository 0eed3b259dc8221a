"""Seeded planning + DST cases whose decisions are pinned in ``golden_plan_dst.json``: the plans
(rank -> micro-batch -> item), DST's budgets per rank and per micro-batch, and the predicted
times, recorded from the code before issue 54's planning speed-ups. Speed-ups must not change
one of them (``test_plan_dst_golden.py``).

    .venv/bin/python -m tests.tuning.golden_plan_dst     # re-record (only for a wanted change)

The paper's setting (Qwen2.5-3B shapes, analytic H200, block 256, top-k 8,192 tokens, table1's
mixes), at DP 2 and 8, PP 1, 4 and 8, M = 4 and 8, plus a gamma case priced without a coverage
model (the trainer's step level).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np

from sparsebalance.batching import PlanConfig
from sparsebalance.batching.planner import assign_batch
from sparsebalance.batching.schedule import balanced_layers, head_layers
from sparsebalance.latency import LatencyModel, analytic_profile
from sparsebalance.models import load_shapes
from sparsebalance.simulate.engine import _workload
from sparsebalance.simulate.sparsity import CoverageModel, SparsityModel
from sparsebalance.tuning import DSTConfig, DSTTuner, PipelineWorkload

GOLDEN = Path(__file__).with_name("golden_plan_dst.json")
MIXES = {  # benchmarks/configs/table1.toml's simulated mixes
    "chatqa2": {"short": (1024, 4096), "long": (16384, 65536), "long_share": 0.15},
    "longalign": {"short": (8192, 73728), "long": (8192, 73728), "long_share": 0.0},
}
# (mix, DP, PP, M, documents per rank, strategy, seed)
SETTINGS = [
    ("chatqa2", 2, 4, 4, 8, "sab", 0),
    ("chatqa2", 2, 4, 4, 8, "sab", 1),
    ("longalign", 2, 4, 4, 8, "sab", 0),
    ("chatqa2", 8, 4, 4, 8, "sab", 2),
    ("longalign", 8, 4, 4, 8, "sequential", 3),
    ("chatqa2", 4, 8, 8, 16, "sab", 4),
    ("chatqa2", 8, 4, 4, 8, "lbb", 5),
    ("chatqa2", 4, 1, 4, 8, "sab", 6),
]


def model() -> LatencyModel:
    shapes = load_shapes("qwen2.5-3b")
    grid = replace(shapes, max_context=max(shapes.max_context, 73728 * 8 // 2 + 1))
    return LatencyModel(analytic_profile(grid, "h200", block_size=256))


def draw(mix: dict, n: int, rng: np.random.Generator) -> np.ndarray:
    def logu(lo_hi, size):
        return np.exp(rng.uniform(np.log(lo_hi[0]), np.log(lo_hi[1]), size)).astype(np.int64)

    is_long = rng.random(n) < mix["long_share"]
    return np.where(is_long, logu(mix["long"], n), logu(mix["short"], n))


def _arrays(dec) -> dict:
    out = {
        "budgets": dec.budgets.tolist(),
        "times_after": dec.times_after.tolist(),
        "density_after": dec.density_after.tolist(),
        "attention_after": dec.attention_after.tolist(),
        "times_before": list(dec.targets.times_before),
        "roles": list(dec.targets.roles),
    }
    if dec.microbatch_budgets is not None:
        out["microbatch_budgets"] = [m.tolist() for m in dec.microbatch_budgets]
    return out


def cases() -> dict:
    """Every setting's plan and DST decisions, JSON-ready (floats exact)."""
    cost = model()
    shapes = load_shapes("qwen2.5-3b")
    dst = DSTConfig(anchor="mean", p=0.1, budget_tokens=8192)
    knob = dst.knob(256, None)
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for mix, dp, pp, m, per_rank, strategy, seed in SETTINGS:
            rng = np.random.default_rng([54, seed])
            lengths = draw(MIXES[mix], dp * per_rank, rng)
            content = SparsityModel().sample(rng, lengths, 256)
            dens = knob.density(lengths, content, float(knob.base))
            cfg = PlanConfig(dp, m, strategy=strategy)
            if pp > 1:
                split = tuple(int(x) for x in balanced_layers(shapes.num_layers, pp, head_layers(shapes)))
                cfg = replace(cfg, pipeline_stages=pp, stage_layers=split)
            a = assign_batch(lengths, dens, cost, cfg)
            case = {"packs": a.packs, "times": [a.times[0].tolist(), a.times[1].tolist()]}
            for cover in (True, False):
                work = _workload(a, cost, knob, content, CoverageModel(knob.density, dst.gamma0) if cover else None)
                if pp > 1:
                    work = PipelineWorkload(work, cfg.pipeline(cost.num_layers))
                for mode in ("bidirectional", "down"):
                    dec = DSTTuner(replace(dst, mode=mode), knob=knob).decide_arrays(work)
                    case[f"{mode}/{'coverage' if cover else 'none'}"] = _arrays(dec)
            out[f"{mix}/DP{dp}/PP{pp}/M{m}/{strategy}/seed{seed}"] = case
        # gamma budgets, the trainer's step level (no coverage model): one PP4 case
        g = DSTConfig(budget="gamma", anchor="mean", p=0.1)
        gknob = g.knob(256, None)
        rng = np.random.default_rng([54, 99])
        lengths = draw(MIXES["chatqa2"], 16, rng)
        content = SparsityModel().sample(rng, lengths, 256)
        split = tuple(int(x) for x in balanced_layers(shapes.num_layers, 4, head_layers(shapes)))
        cfg = PlanConfig(2, 4, pipeline_stages=4, stage_layers=split)
        a = assign_batch(lengths, content, cost, cfg)
        work = PipelineWorkload(_workload(a, cost, gknob, content, None), cfg.pipeline(cost.num_layers))
        out["gamma/chatqa2/DP2/PP4"] = {
            "packs": a.packs,
            "bidirectional/none": _arrays(DSTTuner(g, knob=gknob).decide_arrays(work)),
        }
    return out


if __name__ == "__main__":
    GOLDEN.write_text(json.dumps(cases(), indent=None, separators=(",", ":")) + "\n")
    print(f"wrote {GOLDEN}")
