"""benchmarks/table1.py: the pre-registered settings are enforced, and --quick runs every row end
to end in both measured modes (slow tier: ~1.5 min each on the 2-core CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import table1  # noqa: E402

ROWS = ["baseline", "+DST", "+SAB", "+LBB", "+SAB+DST", "+LBB+DST"]


def test_another_config_is_refused_unless_declared(tmp_path):
    other = tmp_path / "t.toml"
    other.write_text(table1.CONFIG.read_text())
    with pytest.raises(ValueError, match="not the pre-registered"):
        table1.load_config(other, allow_other=False)
    assert table1.load_config(other, allow_other=True)["rows"] == ROWS


def _run(mode: str, out: Path) -> tuple[str, dict]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "table1.py"),
        "--mode",
        mode,
        "--quick",
        "--mixes",
        "chatqa2",
        "--out",
        str(out),
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    md = next(out.glob(f"*-table1-{mode}-quick-cpu.md"))
    data = json.loads(md.with_suffix(".json").read_text())
    assert done.stderr.count("chatqa2 seed 0:") == 1  # one line per seed, not one per rank
    return md.read_text(), data


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["measured", "gloo"])
def test_quick_runs_every_row(tmp_path, mode):
    md, data = _run(mode, tmp_path)
    assert "--worker" not in data["command"] and "--quick" in data["command"]
    assert "a smoke test, not a measurement" in md
    rows = data["results"]["chatqa2/seed0"]["rows"]
    assert list(rows) == ROWS
    assert rows["baseline"]["speedup"] == pytest.approx(1.0)
    for r in rows.values():
        assert r["step_ms"] > 0 and r["imbalance"] >= 1.0 - 1e-9 and 0 < r["density"] <= 1
        assert r["overhead_share"] < 1
        assert r["predicted_speedup"] > 0  # the latency model's view of the same rows
    assert rows["baseline"]["predicted_speedup"] == pytest.approx(1.0)
    assert "predicted speedup (latency model)" in md


def test_simulated_pipelines_quick(tmp_path):
    # --pp 4: the paper's DP2 PP4 rows on the simulator (cheap: a few seconds)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    script = [sys.executable, str(ROOT / "benchmarks" / "table1.py"), "--mode"]
    args = ["--quick", "--mixes", "chatqa2", "--out", str(tmp_path)]
    done = subprocess.run([*script, "simulated", "--pp", "4", *args], env=env, capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    md = next(tmp_path.glob("*-table1-simulated-pp4-quick-cpu.md"))
    text = md.read_text()
    assert "### chatqa2/DP2 PP4" in text and "imbalance (micro-batch)" in text
    assert "SAB and DST are pipeline-aware" in text and "Why +LBB stays below 1.0x" in text
    rows = json.loads(md.with_suffix(".json").read_text())["results"]["chatqa2/DP2 PP4"]
    assert list(rows) == ROWS
    assert all(r["device_idle"] > 0 and r["imbalance"] >= 1 for r in rows.values())
    refused = subprocess.run([*script, "measured", "--pp", "2", *args], env=env, capture_output=True, text=True)
    assert refused.returncode == 2 and "--pp 2" in refused.stderr
