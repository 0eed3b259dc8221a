"""The run's topology in the hybrid planner: CP units inside a node when they fit, hierarchical
rings (inner ring = a node) across nodes, cross-node rings priced at the inter-node link."""

from __future__ import annotations

import numpy as np
import pytest

from sparsebalance.batching import PlanConfig, check_units, plan_batch
from sparsebalance.parallel.topology import Topology
from sparsebalance.workload import Sample
from tests.batching.fake_cost import fake_context

CAPACITY = 4096


def batch(longs, num_short, seed=0):
    """Documents ``longs`` (over the capacity: they need k >= 2 ranks) + short ones."""
    rng = np.random.default_rng(seed)
    lens = [*longs, *rng.integers(200, 1500, num_short).tolist()]
    return [Sample(i, int(n)) for i, n in enumerate(lens)], np.full(len(lens), 0.3)


def plan(world, per_node, longs, links_per_node=8):
    samples, dens = batch(longs, 6 * world)
    cfg = PlanConfig(world, capacity=CAPACITY, strategy="sab-cp", ranks_per_node=per_node)
    p = plan_batch(samples, fake_context(per_node=links_per_node), cfg, dens)
    check_units(*p.execution(), {s.id: s.num_tokens for s in samples}, CAPACITY)
    return p


def test_two_nodes_of_two_keep_two_rank_units_inside_a_node():
    p = plan(4, 2, (6000, 5000))
    topo = Topology(4, 2)
    assert [u.degree for u in p.units] == [2, 2]
    for u in p.units:
        assert len({topo.node_of(r) for r in u.ranks}) == 1, u.ranks
        assert (u.ring, u.inner_size) == ("flat", 2)
    assert {u.ranks for u in p.units} == {(0, 1), (2, 3)}


def test_the_topology_changes_where_units_go():
    """6 ranks, four 2-rank units: on 2 nodes of 3 no unit straddles ranks 2|3; on one node of
    6 the planner uses the window (2, 3)."""
    on_nodes = plan(6, 3, (6000,) * 4)
    topo = Topology(6, 3)
    assert all(len({topo.node_of(r) for r in u.ranks}) == 1 for u in on_nodes.units)
    one_node = plan(6, 6, (6000,) * 4)
    assert (2, 3) in {u.ranks for u in one_node.units}
    assert (2, 3) not in {u.ranks for u in on_nodes.units}


def test_a_unit_over_nodes_runs_the_hierarchical_ring_and_pays_the_slow_link():
    two = plan(4, 2, (15000,))
    one = plan(4, 4, (15000,))
    (u2,), (u1,) = two.units, one.units
    assert (u2.ranks, u2.ring, u2.inner_size) == ((0, 1, 2, 3), "hierarchical", 2)
    assert (u1.ring, u1.inner_size) == ("flat", 4)
    assert u2.seconds > u1.seconds  # the outer ring's transfers use the 8x slower link
    # k = 3 cannot fit a node of 2: it spans nodes (flat), priced at the inter-node link
    (w2,), (w1,) = plan(4, 2, (11000,)).units, plan(4, 4, (11000,)).units
    assert w2.degree == w1.degree == 3 and w2.seconds > w1.seconds


def test_default_is_the_links_node_size_and_bad_input_names_the_flag():
    samples, dens = batch((15000,), 24)
    cfg = PlanConfig(4, capacity=CAPACITY, strategy="sab-cp")
    (u,) = plan_batch(samples, fake_context(per_node=2), cfg, dens).units
    assert (u.ring, u.inner_size) == ("hierarchical", 2)
    with pytest.raises(ValueError, match="--ranks-per-node must be >= 1"):
        PlanConfig(4, capacity=CAPACITY, ranks_per_node=0)
    # strategies without CP units ignore the topology: the same plan
    sab = [
        plan_batch(samples, fake_context(), PlanConfig(4, capacity=CAPACITY, ranks_per_node=g), dens) for g in (1, 4)
    ]
    assert sab[0].hash() == sab[1].hash()


def test_on_nodes_keeps_the_calibration_and_changes_only_the_node_size():
    cost = fake_context(per_node=8)
    cost.compute_scale, cost.comm_scale = 1.3, 2.0
    two = cost.on_nodes(2)
    assert (two.links.ranks_per_node, cost.links.ranks_per_node) == (2, 8)
    assert (two.compute_scale, two.comm_scale, two.calibration) == (1.3, 2.0, cost.calibration)
    assert two.links.inter_bytes_per_s == cost.links.inter_bytes_per_s
    assert cost.on_nodes(8) is cost
    lens, dens = np.array([20000]), np.array([0.3])
    assert two.unit_seconds(lens, dens, np.array([4]))[0][0] > cost.unit_seconds(lens, dens, np.array([4]))[0][0]
