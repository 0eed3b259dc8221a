"""Whether DST paid in a run: per step, the balance it was predicted to reach and the balance the
ranks measured, beside an estimate of what they would have measured without it (issue 56: a run
where DST left the ranks as uneven as SAB alone said nothing of it)."""

from __future__ import annotations

import numpy as np

PAID_MARGIN = 0.005
"""A step counts as paid (or not) only when the measured balance is this far above (below) its
estimate without DST; closer is a tie (timing noise on one step)."""


def dst_steps(steps: list[dict]) -> list[dict]:
    """Per step that tuned budgets: its number, the predicted balance before and after DST, the
    measured one and the estimate without DST, and the verdict (``paid``, ``lost`` or ``tie``).
    Runs with DST off, runs before these fields and unmeasured steps: empty."""
    out = []
    for s in steps:
        if s.get("dst_mode", "off") == "off" or "balance_without_dst" not in s or not s.get("measured", True):
            continue
        gain = s["efficiency"] - s["balance_without_dst"]
        verdict = "paid" if gain > PAID_MARGIN else "lost" if gain < -PAID_MARGIN else "tie"
        out.append(
            {
                "step": s["step"],
                "predicted_before": s["balance_predicted_before"],
                "predicted_after": s["balance_predicted_after"],
                "measured": s["efficiency"],
                "without_dst": s["balance_without_dst"],
                "verdict": verdict,
            }
        )
    return out


def dst_line(steps: list[dict]) -> str:
    """One line for the report and the run's summary: did DST even the ranks? Empty without DST
    steps. The first step is left out when there are others (warm-up), as in the run's means."""
    rows = dst_steps(steps)
    if len(rows) > 1:
        rows = rows[1:]
    if not rows:
        return ""
    mean = lambda k: float(np.mean([r[k] for r in rows]))  # noqa: E731
    count = {v: sum(r["verdict"] == v for r in rows) for v in ("paid", "lost", "tie")}
    n = len(rows)
    line = (
        f"balance predicted {mean('predicted_before'):.3f} -> {mean('predicted_after'):.3f}; measured "
        f"{mean('measured'):.3f} against an estimated {mean('without_dst'):.3f} without DST (each rank's "
        f"measured time priced back to the base budget by the latency model); it evened the ranks in "
        f"{count['paid']} of {n} step{'s' if n != 1 else ''}, unevened them in {count['lost']}"
    )
    if count["lost"] > count["paid"]:
        line += (
            ". DST did not pay here: the latency profile may not fit this machine or load "
            "(measure it again with `sparsebalance profile`), or raise --skew-margin"
        )
    return line + "."
