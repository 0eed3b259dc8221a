"""What CI runs: the default tier and the slow tier (all but the newcomer walk), property tests
derandomized, each tier against the time budget the README states."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ci_runs_the_default_and_the_slow_tier_derandomized():
    script = (ROOT / ".ci" / "run").read_text()
    assert "export HYPOTHESIS_PROFILE=ci" in script
    tiers = re.findall(r"^tier (\w+) (\d+) (.*)$", script, re.M)
    assert [(name, int(budget)) for name, budget, _ in tiers] == [("default", 600), ("slow", 1200)]
    assert "-m 'slow and not newcomer'" in tiers[1][2]
    assert "-m" not in tiers[0][2]  # the default tier keeps pyproject's selection
    assert sum(int(b) for _, b, _ in tiers) <= 30 * 60


def test_the_readme_states_each_tiers_budget():
    dev = (ROOT / "README.md").read_text().split("## Development", 1)[1].split("\n## ", 1)[0]
    assert "default tier" in dev and "10 min" in dev
    assert "slow tier" in dev and "20 min" in dev
    assert "HYPOTHESIS_PROFILE=explore" in dev
