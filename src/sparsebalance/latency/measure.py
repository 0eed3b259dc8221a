"""Measuring a profile (``sparsebalance profile``, and the trainer's first run) in <= ~1 minute.

1. A *pilot*: three small micro-batches timed once give a rough cost per attention pair, per
   token and per call, enough to price candidate micro-batches.
2. A *design* (:func:`.sweep.choose_design`): four corners of the feature space (the capacity at
   low density, a long dense document, a tiny micro-batch, many short documents), then the
   candidate that most lowers the relative prediction variance over run-like micro-batches per
   second it costs (I-optimal), one per octave of tokens first, as many as fit the time budget.
   The relative fit weighs every micro-batch the same, so cheap ones of the right mix carry as
   much information as expensive ones (at 1 CPU thread a fixed grid of points alone would
   overrun the budget).
3. Interleaved rounds (:func:`.sweep.time_interleaved`): the median over rounds per micro-batch,
   the spread across rounds is the timing noise. The design is sized for 3 rounds in half the
   budget; rounds go on (up to 8) while the budget lasts, so the median spans ~40 s of the
   machine's life, not one slow phase of it.
4. The physical form (:mod:`.form`) fitted by relative-error non-negative least squares on those
   whole-micro-batch times (what validation and training measure), with leave-one-out errors;
   a micro-batch whose residual is far beyond the noise (a burst of load that hit all its
   rounds) is dropped and counted (:func:`.form.fit_form_robust`).
5. *Refinement*: budget left over buys more micro-batches like the worst-predicted one, then
   a refit.

The optimizer step and (optionally) a gloo all-reduce are timed separately: once per step.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..models import ModelShapes
from ..ops import resolve_backend
from ..ops.flex_config import check_flex_block_size
from ..precision import DTYPES
from ..timing import median_time, torch_threads
from .crossover import measure_dense_crossover
from .form import FEATURES, attention_floor, features, fit_form_robust, form_tables, nnls
from .profile import AttentionTable, Profile, Table1D, fingerprint
from .proxy import ProxyModel
from .sweep import (
    Batch,
    Timings,
    choose_design,
    prepare_microbatch,
    time_interleaved,
    topk_batch,
)
from .wait import SecondsBar, expected_seconds

TARGET_MAPE = 0.10  # the accuracy a profile is meant to reach on held-out micro-batches


MAX_ROUNDS = 8
"""Most interleaved rounds of the design (more only while the budget lasts)."""
DESIGN_SHARE = 0.5
"""Share of the budget the design is sized for at the minimum rounds (+ warm-up), by the pilot's
rough cost; the rest buys further rounds, then refinement points."""
ROUNDS_SHARE = 0.85
"""Share of the budget after which no further round of the design starts."""


def measure_profile(
    shapes: ModelShapes,
    device: torch.device,
    dtype: str = "fp32",
    backend: str = "auto",
    *,
    block_size: int,
    max_len: int | None = None,
    budget_s: float = 50.0,
    rounds: int = 3,
    allreduce_world_size: int = 0,
    quiet: bool = False,
    seed: int = 7,
    threads: int | None = None,
    layout: str = "threshold",
    announce: Callable[[float], None] | None = None,
    progress: bool = False,
) -> Profile:
    """Measure a :class:`Profile` for micro-batches of up to ``max_len`` tokens (default: the
    model's context) spending about ``budget_s`` seconds timing micro-batches, with ``threads``
    CPU threads (default: this process's count; recorded in the fingerprint). The design is
    sized for ``rounds`` timings of every micro-batch in about half the budget; further rounds
    (up to :data:`MAX_ROUNDS`) follow while the budget lasts: a median over more rounds spread
    over a longer window is what keeps a slow phase of a shared machine out of the profile.
    ``layout``: the budget kind's layout shape, ``threshold`` (gamma) or ``top-k`` (every design
    micro-batch then has top-k layouts and its realized densities). ``announce`` is called with
    the seconds measuring will take in all (:func:`~.wait.expected_seconds`) once the design is
    chosen, a few seconds in; ``progress``: a bar of those seconds on a terminal."""
    if budget_s <= 0 or rounds < 2:
        raise ValueError(f"need budget_s > 0 and rounds >= 2, got {budget_s}, {rounds}")
    with torch_threads(threads if device.type == "cpu" else None):
        return _measure_profile(
            shapes,
            device,
            dtype,
            backend,
            block_size,
            max_len,
            budget_s,
            rounds,
            allreduce_world_size,
            quiet,
            seed,
            layout,
            announce,
            progress,
        )


@dataclass
class _Rig:
    """What every timed micro-batch of one profiling run shares: the proxy model on its device,
    the kernel (backend, block, layout, dense crossover) and the seed."""

    shapes: ModelShapes
    model: ProxyModel
    device: torch.device
    backend: str
    block_size: int
    layout: str
    crossover: float | None
    top: int
    seed: int

    def shaped(self, batch: Batch) -> Batch:
        return topk_batch(batch, self.block_size) if self.layout == "top-k" else batch

    def prep(self, batch: Batch, i: int):
        return prepare_microbatch(
            self.model,
            batch[0],
            batch[1],
            self.device,
            self.backend,
            self.block_size,
            self.seed + i,
            self.layout,
            self.crossover,
        )

    def featurize(self, batches) -> np.ndarray:
        return features(batches, self.shapes.num_layers, self.block_size, self.crossover)


def _measure_profile(
    shapes,
    device,
    dtype,
    backend,
    block_size,
    max_len,
    budget_s,
    rounds,
    allreduce_world_size,
    quiet,
    seed,
    layout,
    announce=None,
    progress=False,
) -> Profile:
    t_start = time.perf_counter()
    rig = _make_rig(shapes, device, dtype, backend, block_size, int(max_len or shapes.max_context), seed, layout)
    cost = _pilot_cost(rig)
    # rounds + 1: time_interleaved runs each micro-batch once untimed first (warm-up).
    design = choose_design(rig.top, block_size, cost, budget_s * DESIGN_SHARE, rounds + 1, rig.featurize, seed=seed)
    design = [rig.shaped(b) for b in design]
    t_pilot = time.perf_counter() - t_start
    expected = expected_seconds(t_pilot, sum(cost(b) for b in design), budget_s, rounds)
    if announce is not None:
        announce(expected)
    bar = SecondsBar(expected, t_start, enabled=progress)
    fns = [rig.prep(b, i) for i, b in enumerate(design)]
    warm = time.perf_counter()
    for fn in fns:  # once untimed (a first call allocates); its time estimates the rest again
        fn()
        bar.tick()
    warm = time.perf_counter() - warm
    bar.retotal(expected_seconds(time.perf_counter() - t_start, warm, budget_s, rounds))
    timings = time_interleaved(
        fns,
        device,
        max(MAX_ROUNDS, rounds),
        min_rounds=rounds,
        budget_s=budget_s * ROUNDS_SHARE,
        seed=seed,
        warmup=False,
        tick=bar.tick,
    )
    x, y = rig.featurize(design), timings.median
    fit, dropped = fit_form_robust(x, y, noise=float(np.median(timings.cv)))
    left = budget_s - (time.perf_counter() - t_start)
    x, y = _refine_design(rig, design, x, y, timings, fit, dropped, cost, left, bar.tick)
    fit, rejected = _fit_floored(rig, x, y, timings)
    t_design = time.perf_counter() - t_start - t_pilot
    opt_s, num_params = _optimizer_seconds(rig.model, device)
    bar.close()
    allreduce = measure_allreduce(num_params, allreduce_world_size) if allreduce_world_size > 1 else None
    meta = {
        "model": shapes.name,
        "source": "measured",
        "num_params": num_params,
        "allreduce_world_size": allreduce_world_size or None,
        "max_len": rig.top,
    }
    stages = {
        "pilot_seconds": t_pilot,
        "design_seconds": t_design,
        "rounds_seconds": timings.wall_seconds,
        "expected_seconds": expected,
    }
    profile = _assemble_profile(
        rig, dtype, design, y, timings, fit, rejected, opt_s, allreduce, (meta, t_start, stages)
    )
    if not quiet:
        print(noise_line(profile), file=sys.stderr)
    return profile


def _make_rig(shapes, device, dtype, backend, block_size, top, seed, layout) -> _Rig:
    """The proxy model (seeded) on ``device`` and, for CUDA's flex with top-k budgets, the dense
    kernel's crossover; a flex block the device cannot run is refused before anything compiles."""
    backend = resolve_backend(backend, device)
    torch.manual_seed(0)
    if backend == "flex":
        check_flex_block_size(block_size, device)  # one line, before rank 0 compiles anything
    model = ProxyModel(shapes, precision=dtype).to(device)
    crossover = None  # the dense kernel's crossover: CUDA's flex with top-k budgets only
    if device.type == "cuda" and backend == "flex" and layout == "top-k":
        crossover = measure_dense_crossover(
            shapes, device, DTYPES[dtype], block_size, top, lambda fn: median_time(fn, device, 2, 5)
        )
    return _Rig(shapes, model, device, backend, block_size, layout, crossover, top, seed)


def _pilot_cost(rig: _Rig):
    """Time three small micro-batches once; return the rough (per pair, per token, per call) cost
    in seconds of a micro-batch, which prices the design's candidates."""
    top, block_size = rig.top, rig.block_size
    pilot = [
        ([min(top, 8 * block_size + 5)], [1.0]),
        ([min(top, 4 * block_size + 3)], [0.1]),
        ([min(top, block_size + 9)], [0.5]),
    ]
    pilot = [rig.shaped(b) for b in pilot]
    pt = np.array([median_time(rig.prep(b, i), rig.device, 1, 1) for i, b in enumerate(pilot)])
    px = rig.featurize(pilot)[:, [0, 1, 4]]
    rough = np.maximum(nnls(px / pt[:, None], np.ones(len(pilot))), 1e-12)

    def cost(batch: Batch) -> float:
        return float(rig.featurize([batch])[0, [0, 1, 4]] @ rough)

    return cost


def _refine_design(rig: _Rig, design, x, y, timings: Timings, fit, dropped, cost, left: float, tick=None):
    """Refinement: ``left`` seconds of budget go to up to 4 micro-batches like the worst
    leave-one-out point, timed as many rounds as the design; ``design`` and ``timings`` are
    extended in place, the extended features and medians returned."""
    loo = np.zeros(len(design))
    if fit.loo_errors:
        loo[np.setdiff1d(np.arange(len(design)), dropped)] = fit.loo_errors
    extra = [rig.shaped(b) for b in _refine(design, loo.tolist(), rig.top, rig.block_size, rig.seed)]
    extra = [b for b in extra if (left := left - timings.seconds.shape[0] * cost(b)) > 0][:4]
    if extra:
        more = time_interleaved(
            [rig.prep(b, 100 + i) for i, b in enumerate(extra)],
            rig.device,
            timings.seconds.shape[0],
            seed=rig.seed + 1,
            tick=tick,
        )
        design += extra
        x = np.vstack([x, rig.featurize(extra)])
        y = np.concatenate([y, more.median])
        timings.seconds = np.hstack([timings.seconds, more.seconds])
    return x, y


def _fit_floored(rig: _Rig, x, y, timings: Timings):
    """The robust fit, refitted with the attention coefficient floored where noise hid it."""
    shapes = rig.shapes
    fit, rejected = fit_form_robust(x, y, noise=float(np.median(timings.cv)))
    token_flops = 6.0 * (shapes.num_layers * shapes.layer_params() + _head_params(shapes))
    a_min = attention_floor(fit.coefficients[1], token_flops, shapes.num_heads, shapes.head_dim, rig.block_size)
    if fit.coefficients[0] < a_min:  # noise hid the attention term: keep it priced
        floor = [a_min, 0.0, 0.0, 0.0, 0.0]
        fit, rejected = fit_form_robust(x, y, noise=float(np.median(timings.cv)), floor=floor)
    return fit, rejected


def _assemble_profile(rig: _Rig, dtype, design, y, timings: Timings, fit, rejected, opt_s, allreduce, run) -> Profile:
    """The :class:`Profile`: the fitted form's tables, the fit and its design points, the noise;
    ``run`` is (meta, t_start, stage seconds): the total profiling time is taken last."""
    meta, t_start, stages = run
    shapes, nl, block_size = rig.shapes, rig.shapes.num_layers, rig.block_size
    share = nl * shapes.layer_params() / (nl * shapes.layer_params() + _head_params(shapes))
    t = form_tables(fit.coefficients, nl, block_size, rig.top, share, rig.crossover)
    noise = {**timings.noise(), "load_1min": _load(), "design_points": len(design), "design_outliers": len(rejected)}
    return Profile(
        fingerprint=fingerprint(shapes, rig.device, dtype, rig.backend, block_size, layout=rig.layout),
        attention=AttentionTable(t["lengths"], t["densities"], t["attention"]),
        layer_other=Table1D(t["lengths"], t["layer_other"]),
        head=Table1D(t["lengths"], t["head"]),
        num_layers=nl,
        optimizer_seconds=opt_s,
        allreduce_seconds=allreduce,
        meta={**meta, "profiling_seconds": time.perf_counter() - t_start, **stages},
        fit={
            "features": list(FEATURES),
            "coefficients": fit.coefficients,
            "loo_mape": fit.loo_mape,
            "loo_max_error": float(np.max(np.abs(fit.loo_errors))),
            "layer_token_share": share,
            "block_size": block_size,
            "design": [
                {
                    "lengths": b[0],
                    "densities": b[1],
                    "seconds": float(s),
                    "cv": float(c),
                    "rejected": i in rejected,
                    "rounds": timings.seconds[:, i].tolist(),
                }
                for i, (b, s, c) in enumerate(zip(design, y, timings.cv, strict=True))
            ],
        },
        noise=noise,
        dense_from=rig.crossover,
    )


def noise_line(
    profile: Profile,
    target: float = TARGET_MAPE,
    redo: str = "to measure again, rerun `sparsebalance profile` when the machine is quieter",
) -> str:
    """One line: the timing noise and the fit's own leave-one-out error, and whether ``target``
    MAPE is reachable on this machine now; when not, what that means for the run and what to do
    (``redo``: how to measure again)."""
    n, f = profile.noise, profile.fit
    if not n or not f:
        return "profile: no noise measurement (analytic or schema-1 profile)"
    cv, loo = n["cv_median"], f["loo_mape"]
    head = (
        f"profile: timing noise {100 * cv:.1f} % (CV of one timing, median of "
        f"{n['design_points']} micro-batches x {n['rounds']} rounds; "
        f"load {n['load_1min']:.1f}),"
        f" fit leave-one-out error {100 * loo:.1f} %"
    )
    if n.get("design_outliers"):
        head += f", {n['design_outliers']} design micro-batch(es) dropped as outliers"
    # A median of 3 timings has about 0.6x the spread of one; |N(0, s)| averages 0.8 s.
    floor = 0.8 * 0.6 * cv
    if floor > target:
        return head + (
            f"; this noise keeps predictions from the {100 * target:.0f} % target: SAB's plans "
            "and DST's budgets rest on a rough profile, so expect less balance (online "
            f"recalibration corrects its overall level during training, not relative costs); {redo}"
        )
    if loo > target:
        return head + (
            f"; above the {100 * target:.0f} % target (too few points for this noise, "
            "or a shape the form misses: see `profile --validate --json`)"
        )
    return head


def _refine(design: list[Batch], loo: list[float], top: int, block_size: int, seed: int):
    """Candidates near the worst leave-one-out micro-batch: same document count, lengths within
    x1.5, densities re-drawn (the fit is weakest there)."""
    if not loo:
        return []
    lengths, _ = design[int(np.argmax(np.abs(loo)))]
    rng = np.random.default_rng(seed + 1)
    out = []
    for _ in range(16):
        ls = [max(1, int(n * rng.uniform(0.67, 1.5))) for n in lengths]
        if sum(ls) <= top:
            out.append((ls, rng.uniform(0.02, 1.0, len(ls)).round(3).tolist()))
    return out


def _head_params(shapes: ModelShapes) -> int:
    return shapes.vocab_size * shapes.hidden_size


def _load() -> float:
    try:
        return float(os.getloadavg()[0])
    except OSError:  # not available on every platform
        return float("nan")


def _optimizer_seconds(model: ProxyModel, device: torch.device) -> tuple[float, int]:
    """The AdamW step over a full-size model's parameters."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return median_time(opt.step, device, 1, 3), sum(p.numel() for p in model.parameters())


def _allreduce_worker(rank: int, world: int, init: str, numel: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    buf = torch.randn(numel)
    seconds = median_time(lambda: dist.all_reduce(buf), torch.device("cpu"), 1, 3)
    if rank == 0:
        with open(out, "w") as f:
            f.write(repr(seconds))
    dist.destroy_process_group()


def measure_allreduce(num_params: int, world_size: int) -> float:
    """Median seconds of an fp32 gloo all-reduce of ``num_params`` over ``world_size`` processes."""
    with tempfile.TemporaryDirectory() as tmp:
        init, out = f"file://{os.path.join(tmp, 'rdzv')}", os.path.join(tmp, "t")
        mp.spawn(_allreduce_worker, args=(world_size, init, num_params, out), nprocs=world_size)
        with open(out) as f:
            return float(f.read())
