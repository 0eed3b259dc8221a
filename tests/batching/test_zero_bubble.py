"""ZB-H1 (``--pp-schedule zb-h1``): its per-stage orders, its exact makespan against an independent
event-driven simulation of those orders, the closed forms at equal op times, and the planner
(SAB's order search and plans) pricing it."""

import heapq
import itertools

import numpy as np
import pytest

from sparsebalance.batching import PlanConfig
from sparsebalance.batching import zero_bubble as zb
from sparsebalance.batching.pipeline import PipelineShape, best_orders, pack_makespans
from sparsebalance.batching.plan import padded_packs
from sparsebalance.batching.planner import assign_batch
from sparsebalance.batching.schedule import head_seconds, makespans, schedule_order, split_forward_backward
from sparsebalance.latency import LatencyModel, analytic_profile
from sparsebalance.models import load_shapes


def _orders(p: int, m: int) -> list[list[tuple[str, int]]]:
    """Each stage's ops as zero_bubble's docstring states them: 1F1B's (a warm-up of
    ``min(P - s - 1, M)`` forwards, then one forward and one backward, then the remaining
    backwards), each ``W_j`` right after ``B_{j+s}``, the last s W's at the end."""
    out = []
    for s in range(p):
        warm = min(p - s - 1, m)
        fb = [("F", i) for i in range(warm)]
        for i in range(m - warm):
            fb += [("F", warm + i), ("B", i)]
        fb += [("B", i) for i in range(m - warm, m)]
        ops = []
        for kind, j in fb:
            ops.append((kind, j))
            if kind == "B" and j >= s:
                ops.append(("W", j - s))
        out.append(ops + [("W", j) for j in range(max(0, m - s), m)])
    return out


def _simulate(f: np.ndarray, b: np.ndarray, w: np.ndarray) -> float:
    """Event-driven: a stage starts its next op once it is idle and the op's input has ended (a
    forward: the stage before's forward; a B: the stage after's B, or the last stage's own
    forward; a W: its own B). ``f``, ``b``, ``w``: ``(M, P)`` seconds. Returns the last end."""
    m, p = f.shape
    orders, seconds = _orders(p, m), {"F": f, "B": b, "W": w}
    done: set[tuple[str, int, int]] = set()
    nxt, idle = [0] * p, [True] * p
    events, seq, last = [(0.0, 0, -1, None)], itertools.count(1), 0.0
    while events:
        now, _, stage, op = heapq.heappop(events)
        last = max(last, now)
        if stage >= 0:
            done.add(op)
            idle[stage] = True
        for s in range(p):
            if not idle[s] or nxt[s] == len(orders[s]):
                continue
            kind, j = orders[s][nxt[s]]
            if kind == "F":
                need = ("F", j, s - 1) if s > 0 else None
            elif kind == "B":
                need = ("F", j, s) if s == p - 1 else ("B", j, s + 1)
            else:
                need = ("B", j, s)
            if need is None or need in done:
                idle[s], nxt[s] = False, nxt[s] + 1
                heapq.heappush(events, (now + float(seconds[kind][j, s]), next(seq), s, (kind, j, s)))
    assert len(done) == 3 * m * p, "the orders wait on each other"
    return last


def test_makespans_equal_an_event_driven_simulation_of_the_orders():
    rng = np.random.default_rng(54)
    cases = 0
    for p in range(2, 9):
        for m in range(1, 13):
            times = rng.uniform(0.0, 2.0, (3, 4, m, p))  # (F, B, W), 4 pipelines
            times[:, 0] = np.round(times[:, 0])  # small integers: ties between ops
            times[:, 1] *= rng.random((3, m, p)) > 0.2  # some ops take no time
            got = zb.makespans(*times)
            want = [_simulate(times[0, i], times[1, i], times[2, i]) for i in range(4)]
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-9)
            cases += 4
    assert cases == 336


@pytest.mark.parametrize(
    "f, b, w",
    [(1.0, 1.0, 1.0), (1.0, 4 / 3, 2 / 3), (1.3, 2.1, 0.7), (2.0, 1.0, 0.1), (1.0, 1.0, 0.0), (0.8, 1.0, 0.8)],
    ids=["equal", "default-share", "mixed", "small-W", "no-W", "W=F"],
)
def test_equal_op_times_by_the_papers_formula(f, b, w):
    # M (F + B + W) + (P - 1)(F + B - W) against 1F1B's (M + P - 1)(F + B + W); W <= min(F, B)
    for p in range(2, 9):
        for m in range(p, 13):
            ones = np.ones((1, m, p))
            span = zb.makespans(f * ones, b * ones, w * ones)[0]
            assert span == pytest.approx(m * (f + b + w) + (p - 1) * (f + b - w), abs=1e-9)
            assert makespans(f * ones, (b + w) * ones)[0] == pytest.approx((m + p - 1) * (f + b + w), abs=1e-9)


def test_the_formula_needs_w_at_most_f_and_b():
    # W > min(F, B) (a weight share above 1/2 at backward = 2 x forward): the tail is longer
    ones = np.ones((1, 2, 2))
    assert zb.makespans(ones, ones, 1.5 * ones)[0] == pytest.approx(8.0)  # the formula says 7.5
    assert zb.makespans(0.5 * ones, ones, ones)[0] == pytest.approx(6.0)  # the formula says 5.5


def test_orders_hold_every_op_once_in_1f1b_order():
    for p in range(2, 9):
        for m in range(1, 13):
            for s in range(p):
                order = zb.zb_order(p, m, s)
                assert [(k, j) for k, j, _ in order] == _orders(p, m)[s]
                assert all(c == 0 for _, _, c in order)
                at = {(k, j): i for i, (k, j, _) in enumerate(order)}
                assert len(at) == len(order) == 3 * m
                assert all(at["F", j] < at["B", j] < at["W", j] for j in range(m))
                # F and B as 1F1B runs them: the engine's sends and receives are unchanged
                assert [(k, j) for k, j, _ in order if k != "W"] == schedule_order(p, m, s)
                held = zb.held_micro_batches(p, m, s)
                assert held <= p and (held == p) == (m >= p)
            assert len(zb.dependency_order(p, m)) == 3 * m * p


def test_no_weight_share_is_1f1b_and_equal_times_never_lose():
    rng = np.random.default_rng(0)
    for _ in range(200):
        p, m = int(rng.integers(2, 9)), int(rng.integers(1, 13))
        f, back = rng.uniform(0.0, 2.0, (1, m, p)), rng.uniform(0.0, 4.0, (1, m, p))
        # W = 0 ops right after their own B delay nothing: 1F1B's makespan, exactly
        assert zb.makespans(f, *zb.split_backward(back, 0.0))[0] == pytest.approx(makespans(f, back)[0], abs=1e-12)
    for share in (0.1, 1 / 3, 0.5, 0.9):
        for p, m in itertools.product(range(2, 7), range(1, 10)):
            ones = np.ones((1, m, p))
            assert zb.makespans(ones, *zb.split_backward(2 * ones, share))[0] <= makespans(ones, 2 * ones)[0] + 1e-12


def test_heterogeneous_steps_can_be_longer_than_1f1b():
    # Not a bound: stage 1 defers W_0 behind F_1 and B_1, past the bubble where 1F1B ran all of
    # B_0 (P = 2, M = 2; a third of the backward in W).
    f = np.array([[[2.0, 0.0], [3.0, 2.0]]])
    back = np.array([[[0.0, 3.0], [0.0, 0.0]]])
    assert makespans(f, back)[0] == pytest.approx(7.0)
    assert zb.makespans(f, *zb.split_backward(back, 1 / 3))[0] == pytest.approx(8.0)


def _zb_of_spread(times, head, layers, share, ratio=2.0, scales=None):
    stages = (times - head)[..., None] * layers / layers.sum()
    stages[..., -1] += head
    if scales is not None:
        stages = stages * scales
    forward, backward = split_forward_backward(stages, ratio)
    return zb.makespans(forward, *zb.split_backward(backward, share))


def test_plan_config_prices_zb_h1():
    rng = np.random.default_rng(1)
    times = rng.uniform(0.5, 4.0, (6, 5))
    head = 0.1 * times
    cfg = PlanConfig(2, 5, pipeline_stages=4, stage_layers=(7, 7, 7, 3), pipeline_schedule="zb-h1", weight_share=0.4)
    shape = cfg.pipeline(24)
    assert shape.weight_share == 0.4
    want = _zb_of_spread(times, head, np.array([7, 7, 7, 3.0]), 0.4)
    np.testing.assert_allclose(shape.makespans(times, head), want, rtol=1e-12)
    scaled = PlanConfig(2, 5, pipeline_stages=4, stage_scales=(1.0, 1.2, 0.9, 1.1), pipeline_schedule="zb-h1")
    want = _zb_of_spread(times, head, np.full(4, 6.0), zb.WEIGHT_SHARE, scales=np.array([1.0, 1.2, 0.9, 1.1]))
    np.testing.assert_allclose(scaled.pipeline(24).makespans(times, head), want, rtol=1e-12)
    # the schedule is part of what a shape prices: a ZB-H1 shape is not a 1F1B one
    plain = PlanConfig(2, 5, pipeline_stages=4, stage_layers=(7, 7, 7, 3)).pipeline(24)
    assert plain.weight_share is None and plain != shape
    assert PipelineShape.of(24, 4, (7, 7, 7, 3), weight_share=0.4) == shape
    assert PipelineShape.of(24, 4, (7, 7, 7, 3), weight_share=0.3) != shape
    # P = 1 and 1f1b: no pipeline, as before the field
    assert PlanConfig(2, 5).pipeline(24) is None


def test_order_search_finds_zb_h1s_best_order():
    # five micro-batches whose best ZB-H1 order is not their best 1F1B order
    times = np.array([[1.1, 3.5, 2.4, 1.5, 2.0]])
    plain, zero = PipelineShape.of(24, 4), PipelineShape.of(24, 4, weight_share=1 / 3)
    every = times[0][np.array(list(itertools.permutations(range(5))))]
    least = zero.makespans(every).min()
    order, span = best_orders(times, zero)
    assert span[0] == pytest.approx(least, rel=1e-12)
    assert zero.makespans(times[:, order[0]])[0] == pytest.approx(least, rel=1e-12)
    one_order, _ = best_orders(times, plain)
    assert zero.makespans(times[:, one_order[0]])[0] > least * (1 + 1e-6)  # 1F1B's best is not ZB's


@pytest.fixture(scope="module")
def model():
    return LatencyModel(analytic_profile(load_shapes("qwen2.5-0.5b"), "h200", block_size=128))


def test_sab_plans_for_zb_h1s_makespan(model):
    rng = np.random.default_rng(3)
    lengths, dens = rng.integers(256, 16384, 24), rng.uniform(0.1, 0.6, 24)
    shapes = {
        "1f1b": PipelineShape.of(model.num_layers, 4),
        "zb-h1": PipelineShape.of(model.num_layers, 4, weight_share=0.5),
    }
    for schedule in shapes:
        cfg = PlanConfig(3, 4, strategy="sab", pipeline_stages=4, pipeline_schedule=schedule, weight_share=0.5)
        a = assign_batch(lengths, dens, model, cfg)
        # the plan's predicted makespan is its schedule's (the head on the last stage), priced apart
        lens, d = padded_packs(a.flat, a.items)
        head = head_seconds(model, lens, d, a.times[0])
        priced = {k: pack_makespans(a.times[0], a.flat.mb_rank, 3, s, head).max() for k, s in shapes.items()}
        assert a.extra["makespan"] == pytest.approx(priced[schedule], rel=1e-12)
        assert priced["zb-h1"] < priced["1f1b"]


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(pipeline_schedule="zb-h1"), r"zb-h1 needs a pipeline \(--pp >= 2\), got --pp 1"),
        (dict(pipeline_stages=4, pipeline_virtual=2, pipeline_schedule="zb-h1"), "cannot run with --pp-virtual 2"),
        (dict(pipeline_stages=4, pipeline_schedule="zb"), "--pp-schedule must be one of 1f1b, zb-h1, got 'zb'"),
        (dict(pipeline_stages=4, pipeline_schedule="zb-h1", weight_share=1.0), r"weight_share .* \[0, 1\), got 1.0"),
        (dict(pipeline_stages=4, weight_share=-0.1), r"weight_share .* \[0, 1\), got -0.1"),
        (dict(pipeline_stages=4, weight_share=float("nan")), r"weight_share .* \[0, 1\), got nan"),
    ],
    ids=["no-pipeline", "interleaved", "unknown", "share-1", "share-negative", "share-nan"],
)
def test_refusals_in_one_line(kw, match):
    with pytest.raises(ValueError, match=match) as err:
        PlanConfig(2, 4, **kw)
    assert "\n" not in str(err.value)


def test_shape_refuses_zero_bubble_interleaved():
    with pytest.raises(ValueError, match="cannot run with --pp-virtual 2"):
        PipelineShape.of(24, 4, virtual=2, weight_share=0.3)
    with pytest.raises(ValueError, match="zb-h1 needs a pipeline"):
        PipelineShape.of(24, 1, weight_share=0.3)
