"""Issue 54 (planning that scales): the speed-ups of SAB's pipeline search and DST's pricing
change no decision. Every seeded case of :mod:`.golden_plan_dst` (plans, budgets per rank and per
micro-batch, predicted times) equals, exactly, what the code before them decided."""

import json

import pytest

from .golden_plan_dst import GOLDEN, cases

pytestmark = pytest.mark.filterwarnings("ignore::sparsebalance.latency.OutsideGridWarning")


@pytest.fixture(scope="module")
def now() -> dict:
    return cases()


@pytest.fixture(scope="module")
def pinned() -> dict:
    return json.loads(GOLDEN.read_text())


def test_every_case_is_pinned(now, pinned):
    assert sorted(now) == sorted(pinned)


@pytest.mark.parametrize("name", sorted(json.loads(GOLDEN.read_text())))
def test_decisions_equal_the_pinned_ones(now, pinned, name):
    got, want = now[name], pinned[name]
    assert got["packs"] == want["packs"], "the plan changed"
    for key in want:
        assert got[key] == want[key], f"{name}: {key} changed"
