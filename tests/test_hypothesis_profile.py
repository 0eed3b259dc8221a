"""CI's property tests are reproducible: the derandomized profile is the default."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from .conftest import PROFILE, examples

pytestmark = pytest.mark.skipif(PROFILE != "ci", reason="checks the default (ci) profile")


def test_ci_profile_is_derandomized_without_deadline():
    assert settings.default.derandomize is True
    assert settings.default.deadline is None
    assert settings.default.database is None  # nothing replayed from an earlier machine's run
    assert examples(15) == 15


def test_two_runs_draw_the_same_examples():
    def draws():
        seen = []

        @settings(max_examples=20)
        @given(st.integers(0, 2**62))
        def record(x):
            seen.append(x)

        record()
        return seen

    first, second = draws(), draws()
    assert len(set(first)) > 5  # really drawn, not one constant
    assert first == second
