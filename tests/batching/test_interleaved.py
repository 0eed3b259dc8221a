"""Interleaved 1F1B (``--pp-virtual V``): the order, freedom from deadlock, the exact makespan
against an independent event-driven simulator, the sends a rank may drop, and the pricing that
SAB, DST and the simulator share."""

import heapq
import itertools

import numpy as np
import pytest

from sparsebalance.batching import interleaved
from sparsebalance.batching.interleaved import check_virtual, virtual_order
from sparsebalance.batching.pipeline import PipelineShape, best_orders
from sparsebalance.batching.schedule import makespans, schedule_order, settled_sends


def event_makespan(f: np.ndarray, b: np.ndarray, p: int, v: int) -> tuple[float, np.ndarray]:
    """An independent discrete-event simulation: every rank walks its order; an op starts at the
    event (an op's end) that makes both its rank idle and its input there. Inputs are derived here
    from virtual stage arithmetic, not from :mod:`~sparsebalance.batching.interleaved`. Returns
    (makespan, per-rank busy seconds)."""
    m, stages = f.shape
    orders = [virtual_order(p, v, m, s) for s in range(p)]
    ends: dict[tuple[str, int, int], float] = {}
    nxt = [0] * p
    busy = np.zeros(p)
    events: list[tuple[float, int]] = [(0.0, -1)]  # (time, rank that finished; -1: the start)

    def ready(s: int, now: float) -> bool:  # its input has ended by now
        kind, mb, c = orders[s][nxt[s]]
        k = c * p + s
        if kind == "F":
            need = None if k == 0 else ("F", mb, k - 1)
        else:
            need = ("F", mb, k) if k == stages - 1 else ("B", mb, k + 1)
        return need is None or ends.get(need, np.inf) <= now

    running = [False] * p
    while events:
        now, done = heapq.heappop(events)
        if done >= 0:
            running[done] = False
        for s in range(p):
            if running[s] or nxt[s] == len(orders[s]) or not ready(s, now):
                continue
            kind, mb, c = orders[s][nxt[s]]
            k = c * p + s
            took = (f if kind == "F" else b)[mb, k]
            ends[(kind, mb, k)] = now + took
            busy[s] += took
            nxt[s] += 1
            running[s] = True
            heapq.heappush(events, (now + took, s))
    assert all(n == len(o) for n, o in zip(nxt, orders, strict=True)), "the event simulation stalled"
    return max(ends.values()), busy


def test_one_chunk_is_plain_1f1b():
    for p, m in itertools.product(range(1, 6), range(1, 9)):
        for s in range(p):
            assert virtual_order(p, 1, m, s) == [(k, mb, 0) for k, mb in schedule_order(p, m, s)]
    rng = np.random.default_rng(0)
    f, b = rng.uniform(0, 2, (5, 6, 3)), rng.uniform(0, 4, (5, 6, 3))
    assert np.array_equal(interleaved.makespans(f, b, 1), makespans(f, b))


def test_megatron_order_by_hand():
    # P = 2, V = 2, M = 4: groups of 2 micro-batches, chunk 0 then chunk 1; rank 0 warms up
    # 2 (P - 1) + (V - 1) 2 = 4 forwards, rank 1 two
    f = [("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("F", 1, 1), ("F", 2, 0), ("F", 3, 0), ("F", 2, 1), ("F", 3, 1)]
    b = [("B", 0, 1), ("B", 1, 1), ("B", 0, 0), ("B", 1, 0), ("B", 2, 1), ("B", 3, 1), ("B", 2, 0), ("B", 3, 0)]
    assert virtual_order(2, 2, 4, 0) == f[:4] + [x for pair in zip(f[4:], b[:4], strict=True) for x in pair] + b[4:]
    assert virtual_order(2, 2, 4, 1) == f[:2] + [x for pair in zip(f[2:], b[:6], strict=True) for x in pair] + b[6:]


@pytest.mark.parametrize("v", [2, 3, 4])
@pytest.mark.parametrize("p", [2, 3, 4, 5, 8])
def test_every_op_once_and_no_deadlock(p, v):
    for m in range(1, 3 * p + 2):
        for s in range(p):
            order = virtual_order(p, v, m, s)
            want = {(k, mb, c) for k in "FB" for mb in range(m) for c in range(v)}
            assert len(order) == len(want) and set(order) == want
        assert len(interleaved.dependency_order(p, v, m)) == 2 * m * p * v  # asserts no deadlock


def test_groups_are_megatrons_unless_that_order_waits_on_itself():
    assert [interleaved.group_size(4, 2, m) for m in (1, 3, 4, 8, 12)] == [1, 3, 4, 4, 4]
    # P = 4, V = 3, M = 5 in groups of 4: a cycle whatever the times; groups of 5 run
    assert interleaved._sweep(4, 3, 5, 4) is None
    assert interleaved.group_size(4, 3, 5) == 5


@pytest.mark.parametrize("v", [2, 3])
@pytest.mark.parametrize("p", [2, 4])
def test_equal_times_shrink_the_bubble_v_fold(p, v):
    # per virtual stage f, b (a rank's chunk: 1/V of its layers); M a multiple of P (Megatron's case)
    fv, bv = 1.0, 2.0
    for m in (p, 2 * p, 3 * p):
        span = interleaved.makespans(np.full((1, m, p * v), fv), np.full((1, m, p * v), bv), v)[0]
        assert span == pytest.approx(m * v * (fv + bv) + (p - 1) * (fv + bv))
        plain = makespans(np.full((1, m, p), v * fv), np.full((1, m, p), v * bv))[0]
        assert plain - span == pytest.approx((p - 1) * (fv + bv) * (v - 1))


def test_exact_against_the_event_simulator_on_random_cases():
    rng = np.random.default_rng(54)
    cases = 0
    for _ in range(300):
        p, v, m = int(rng.integers(2, 6)), int(rng.integers(1, 4)), int(rng.integers(1, 11))
        f = rng.uniform(0.0, 3.0, (m, p * v)) * (rng.random((m, p * v)) < 0.9)  # zeros included
        b = rng.uniform(0.0, 6.0, (m, p * v))
        want, busy = event_makespan(f, b, p, v)
        got = interleaved.makespans(f[None], b[None], v)[0]
        assert got == want  # the same additions and maxima in the same order: 0 difference
        assert interleaved.rank_busy(f, b, v) == pytest.approx(busy, rel=1e-12)
        assert got >= busy.max() - 1e-12 and got >= (f + b).sum(axis=1).max() - 1e-12
        cases += 1
    assert cases == 300


def test_vectorised_over_pipelines():
    rng = np.random.default_rng(3)
    f, b = rng.uniform(0, 2, (7, 5, 8)), rng.uniform(0, 4, (7, 5, 8))
    many = interleaved.makespans(f, b, 2)
    one = [interleaved.makespans(f[i : i + 1], b[i : i + 1], 2)[0] for i in range(7)]
    assert many.tolist() == one


@pytest.mark.parametrize("p,v", [(2, 2), (3, 2), (4, 2), (2, 3), (4, 3)])
@pytest.mark.parametrize("m", [1, 2, 5, 8])
def test_sends_settled_only_when_received(p, v, m):
    """A receive settles a send only if the peer received it before sending what arrives now;
    every send ends settled or pending; a rank holds fewer than 2 P V sends at once."""
    orders = [virtual_order(p, v, m, s) for s in range(p)]
    pos = [{op: i for i, op in enumerate(o)} for o in orders]
    for s in range(p):
        settled, pending, most = interleaved.settled_sends(p, v, m, s), [], 0
        for op in orders[s]:
            kind, mb, c = op
            k = c * p + s
            for mine in settled.get(op, []):
                mk = mine[2] * p + s
                dest = ("F", mine[1], mk + 1) if mine[0] == "F" else ("B", mine[1], mk - 1)
                src = ("F", mb, k - 1) if kind == "F" else ("B", mb, k + 1)
                peer = dest[2] % p
                assert peer == src[2] % p
                # received at or before the op that sent what arrives now (an op receives, then sends)
                assert pos[peer][(dest[0], dest[1], dest[2] // p)] <= pos[peer][(src[0], src[1], src[2] // p)]
                pending.remove(mine)
            sends = (kind == "F" and k < p * v - 1) or (kind == "B" and k > 0)
            if sends:
                pending.append(op)
            most = max(most, len(pending))
        total = sum(
            1 for kind, _, c in orders[s] if (kind == "F" and c * p + s < p * v - 1) or (kind == "B" and c * p + s > 0)
        )
        assert sum(len(x) for x in settled.values()) + len(pending) == total
        assert most < 2 * p * v
    if m == 8 and p == 2:  # rank 0's first activations arrived when rank 1's output comes back round
        assert ("F", 0, 0) in interleaved.settled_sends(p, v, m, 0)[("F", 0, 1)]


def test_one_chunk_settles_as_plain_1f1b():
    for p, m in itertools.product(range(2, 5), range(1, 7)):
        for s in range(p):
            plain = settled_sends(p, m, s)
            mine = interleaved.settled_sends(p, 1, m, s)
            assert {(k, mb, 0): [(x, y, 0) for x, y in v] for (k, mb), v in plain.items()} == mine


def test_chunks_of_a_rank_are_non_adjacent():
    split = np.array([5, 5, 5, 5, 5, 5, 5, 1])  # Qwen2.5-3B at PP4 V2, balanced against its head
    assert interleaved.chunk_layers(split, 4, 0) == [range(0, 5), range(20, 25)]
    assert interleaved.chunk_layers(split, 4, 3) == [range(15, 20), range(35, 36)]


def test_bad_virtual_refused():
    with pytest.raises(ValueError, match="--pp-virtual must be an integer >= 1"):
        check_virtual(2, 0)
    with pytest.raises(ValueError, match=r"--pp-virtual 2 needs a pipeline \(--pp >= 2\)"):
        check_virtual(1, 2)
    with pytest.raises(ValueError, match="8 virtual stages, more than the model's 4 layers"):
        check_virtual(4, 2, 4)
    with pytest.raises(ValueError, match="V = 2 dividing"):
        interleaved.makespans(np.ones((1, 2, 3)), np.ones((1, 2, 3)), 2)


def test_shape_prices_the_interleaved_makespan():
    shape = PipelineShape.of(8, 2, ratio=2.0, scales=(1.0, 1.5), virtual=2)
    assert shape.num_stages == 2 and shape.layers.tolist() == [2, 2, 2, 2]
    rng = np.random.default_rng(5)
    times = rng.uniform(1, 5, (3, 4))
    stages = times[..., None] * np.array([0.25, 0.25, 0.25, 0.25]) * np.array([1.0, 1.5, 1.0, 1.5])
    want = interleaved.makespans(stages / 3, stages * 2 / 3, 2)
    assert shape.makespans(times) == pytest.approx(want, rel=1e-12)
    assert shape != PipelineShape.of(8, 2, ratio=2.0, scales=(1.0, 1.5))


def test_sab_orders_for_the_interleaved_makespan():
    """The order search prices the schedule that runs: its order is the best of all orders under
    interleaving, and on some seeded pipelines that is not the best plain-1F1B order."""
    shape2, shape1 = PipelineShape.of(8, 4, virtual=2), PipelineShape.of(8, 4)
    rng = np.random.default_rng(11)
    times = rng.lognormal(0.0, 1.0, (40, 5))
    _, spans = best_orders(times, shape2)
    perms = np.array(list(itertools.permutations(range(5))))
    every = shape2.makespans(times[:, perms].reshape(-1, 5)).reshape(40, -1)
    assert spans == pytest.approx(every.min(axis=1), rel=1e-12)
    plain, _ = best_orders(times, shape1)
    under2 = shape2.makespans(np.take_along_axis(times, plain, axis=1))
    assert (under2 > spans * (1 + 1e-9)).any()  # the plain order would be slower where it runs
