"""Mixture parsing and the seeded sampler: proportions, epochs without repeats, exact resume."""

from __future__ import annotations

import numpy as np
import pytest

from sparsebalance.data.mixture import MixtureSampler, parse_mixture


def test_parse(tmp_path):
    assert parse_mixture("a:0.7,b:0.3") == [("a", 0.7), ("b", 0.3)]
    assert parse_mixture("a:3,b:1") == [("a", 0.75), ("b", 0.25)]
    assert parse_mixture("data/x.jsonl") == [("data/x.jsonl", 1.0)]
    assert parse_mixture("s3:bucket") == [("s3:bucket", 1.0)]  # not a number: part of the path
    odd = tmp_path / "a,b:1"
    odd.mkdir()
    assert parse_mixture(str(odd)) == [(str(odd), 1.0)]  # an existing path wins
    bad_specs = [
        ("a:0.5,b", "every entry"),
        ("a:0,b:1", "must be > 0"),
        ("a:1,,b:1", "empty"),
        ("a:1,a:2", "twice"),
        ("a:nan,b:1", "> 0"),
    ]
    for bad, msg in bad_specs:
        with pytest.raises(ValueError, match=msg):
            parse_mixture(bad)


def test_single_component_is_the_plain_epoch_order():
    s = MixtureSampler([np.arange(10)], [1.0], seed=3, global_batch=4)
    got = [[i for _, i in s.next_batch()] for _ in range(5)]
    e0 = np.random.default_rng([3, 0]).permutation(10)
    e1 = np.random.default_rng([3, 1]).permutation(10)
    e2 = np.random.default_rng([3, 2]).permutation(10)
    want = [e0[0:4], e0[4:8], e1[0:4], e1[4:8], e2[0:4]]  # the 2-document tails are dropped
    assert got == [w.tolist() for w in want]


def test_proportions_within_sampling_error():
    pools = [np.arange(500), np.arange(300) + 1000, np.arange(50) + 5000]
    w = [0.6, 0.3, 0.1]
    s = MixtureSampler(pools, w, seed=0, global_batch=16)
    n_batches = 400
    comps = np.array([c for _ in range(n_batches) for c, _ in s.next_batch()])
    n = len(comps)
    for c, p in enumerate(w):
        k = int((comps == c).sum())
        assert abs(k - n * p) < 4 * np.sqrt(n * p * (1 - p)), (c, k, n * p)
    assert s.drawn == [int((comps == c).sum()) for c in range(3)]


def test_every_epoch_covers_the_component_once_and_batches_never_repeat():
    pools = [np.arange(40), np.arange(0, 60, 3)]
    s = MixtureSampler(pools, [0.5, 0.5], seed=1, global_batch=8)
    seen: dict[int, list[int]] = {0: [], 1: []}
    epochs = [0, 0]
    for _ in range(60):
        batch = s.next_batch()
        assert len(set(batch)) == len(batch)
        for c in (0, 1):
            if s.epochs[c] != epochs[c]:  # an epoch ended: it held no document twice
                assert len(seen[c]) == len(set(seen[c]))
                assert set(seen[c]) <= set(pools[c].tolist())
                assert len(seen[c]) > len(pools[c]) - 8  # only a short tail was dropped
                seen[c], epochs[c] = [], s.epochs[c]
        for c, i in batch:
            seen[c].append(i)
    assert min(s.epochs) >= 2


def test_resume_draws_the_same_batches():
    pools = [np.arange(30), np.arange(25), np.arange(20)]
    w = [0.5, 0.25, 0.25]
    full = MixtureSampler(pools, w, seed=7, global_batch=6)
    batches = [full.next_batch() for _ in range(12)]
    first = MixtureSampler(pools, w, seed=7, global_batch=6)
    for _ in range(5):
        first.next_batch()
    state = first.state_dict()
    resumed = MixtureSampler(pools, w, seed=7, global_batch=6)
    resumed.load_state_dict(state)
    assert [resumed.next_batch() for _ in range(7)] == batches[5:]
    for kw, msg in [
        ({"weights": [0.4, 0.3, 0.3]}, "mixture weights"),
        ({"seed": 8}, "seed"),
        ({"global_batch": 5}, "global_batch"),
    ]:
        args = {"weights": w, "seed": 7, "global_batch": 6, **kw}
        other = MixtureSampler(pools, args["weights"], args["seed"], args["global_batch"])
        with pytest.raises(ValueError, match=msg):
            other.load_state_dict(state)


def test_component_smaller_than_the_batch_refused():
    with pytest.raises(ValueError, match="fewer than --global-batch 8"):
        MixtureSampler([np.arange(100), np.arange(5)], [0.9, 0.1], 0, 8, names=["a", "b"])
