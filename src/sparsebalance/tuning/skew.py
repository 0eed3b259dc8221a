"""Raises that stay safe when the latency model's split between attention and the rest is off.

DST raises a worker below the anchor to the largest budget *predicted* within it. The prediction
is ``T(v) = R + A(v)``, the rest and the attention; a profile measured on another load, another
machine or another model version is off in the split (issue 56 measured it off by 2x and more),
and then a raise that looked free makes a new straggler: DST ends slower than SAB alone.

The guard: with the true time ``T_s(v) = R + s A(v)`` for an unknown skew ``s`` in
``[1/m, m]`` (``m = DSTConfig.skew_margin``), a raised worker ``r`` keeps the largest budget
``v`` (at most its nominal raise) for which some *reference* worker ``w`` that DST does not raise
stays at least as slow at both ends of the range:

    T_s(v)_r <= T_s(v_w)_w   for s = 1/m and s = m

Both sides are linear in ``s``, so this holds for every ``s`` in the range; a worker that is not
raised is at or below its time before DST (a cut lowers ``A``), so no ``s`` in the range makes
the slowest worker after DST slower than before it. The references are the slowest non-raised
workers at ``s = 1/m``, 1 and ``m`` (three, whatever the number of workers). Where even the base
budget fails (SAB's plan itself is uneven under the skew) the worker keeps the base.

Pipelines (a :class:`~.pipeline_workload.PipelineWorkload`) are not guarded yet: a makespan is
not additive in the attention seconds, so ``R + s A`` does not price it; their raises trust the
model (:mod:`.microbatch_dst` keeps no pipeline slower than with its one budget, by the model).

Cost: the rest ``R = T(base) - A(base)`` once (the base prices are the tuner's own, memoised),
then one :func:`~.knob.search_many` over the raised workers the check fails at their nominal
budget, each probe one ``seconds`` pricing of those workers (``T_s = s T - (s - 1) R``).
"""

from __future__ import annotations

import numpy as np

from .knob import Knob, search_many


def safe_raises(work, knob: Knob, value: np.ndarray, raised: np.ndarray, base: np.ndarray, margin: float) -> np.ndarray:
    """``value`` ``(W,)`` with the ``raised`` workers' budgets lowered (never below ``base``)
    to what stays safe for a skew up to ``margin`` (see the module docstring); ``work``: the
    step's workload (``seconds``, ``attention_seconds``)."""
    if margin <= 1.0 or not raised.any() or raised.all():
        return value
    ends = np.array([1.0 / margin, margin])[:, None]  # (E, 1)
    # The rest does not depend on the budget: T_s(v) = s T(v) - (s - 1) R, one pricing per probe.
    rest = work.seconds(base) - work.attention_seconds(base)
    t = work.seconds(value)
    at_ends = ends * t[None, :] - (ends - 1.0) * rest[None, :]  # (E, W)
    others = np.flatnonzero(~raised)
    picks = [np.argmax(at_ends[0, others]), np.argmax(t[others]), np.argmax(at_ends[1, others])]
    refs = np.unique(others[picks])
    ref_times = at_ends[:, refs]  # (E, Q)

    def excess(v: np.ndarray, priced: np.ndarray) -> np.ndarray:
        """``(W,)`` > 0 where the budget ``v`` passes every reference at some end (``priced``:
        the workers to price, a fixed set during the search so the workload reuses its subset)."""
        mine = ends * work.seconds(v, priced)[None, :] - (ends - 1.0) * rest[None, :]  # (E, W)
        # per reference: the worker's worst end; it is safe if some reference stays slower
        gap = (mine[:, :, None] - ref_times[:, None, :]).max(axis=0)  # (W, Q)
        return np.where(priced, gap.min(axis=1), 0.0)

    unsafe = raised & (excess(value, raised) > 0)
    if not unsafe.any():
        return value
    # a guard needs no 1e-4 precision: a hundredth of a block (top-k), or 1e-4 in gamma
    tol = 0.01 if knob.integer else 1e-4
    safe = search_many(knob, lambda v, sel: np.where(sel, excess(v, unsafe), 0.0), base, value, unsafe, tol=tol)
    return np.where(unsafe, safe, value)
