"""Every artefact SparseBalance writes carries a schema version, and a file of a version this build
does not read is refused in one line that says what to do (``sparsebalance/versions.py``)."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from sparsebalance.latency import analytic_profile, load_profile
from sparsebalance.latency.memory_fit import save_calibration
from sparsebalance.latency.profile import SCHEMA
from sparsebalance.models import load_shapes
from sparsebalance.train.config_io import add_train_arguments, config_from_args, to_record
from sparsebalance.versions import CHECKPOINT, CONFIG, PROFILE, STORE, Schema


def test_check_says_what_to_do_in_one_line():
    s = Schema("widget", version=3, fix="make it again", readable=(2,))
    s.check(3, "w")
    s.check(2, "w")  # still read (converted)
    with pytest.raises(ValueError) as err:
        s.check(1, "w.json")
    assert str(err.value) == (
        "w.json: widget schema version 1 (written by an older SparseBalance); this build reads 2, 3: make it again"
    )
    with pytest.raises(ValueError, match=r"newer SparseBalance.*upgrade SparseBalance$"):
        s.check(4, "w.json")
    with pytest.raises(ValueError, match="version None"):
        s.check(None, "w.json")
    for schema in (CONFIG, CHECKPOINT, PROFILE, STORE):  # every artefact has a remedy
        assert schema.fix and schema.version >= 1


def _parse(tmp_path, text: str):
    path = tmp_path / "run.json"
    path.write_text(text)
    p = argparse.ArgumentParser()
    add_train_arguments(p)
    return config_from_args(p.parse_args(["--config", str(path), "--out", str(tmp_path / "o")]))


def test_run_configs_carry_their_version(tmp_path):
    cfg = _parse(tmp_path, json.dumps({"steps": 3}))  # hand-written, no version: today's
    record = to_record(cfg)
    assert record["schema_version"] == CONFIG.version
    again = _parse(tmp_path, json.dumps(record))  # what the launcher writes reads back
    assert again.steps == 3
    with pytest.raises(ValueError, match=r"--config .*run\.json: run config schema version 99"):
        _parse(tmp_path, json.dumps({**record, "schema_version": 99}))


def test_a_profile_of_another_version_is_refused(tmp_path):
    path = tmp_path / "p.json"
    analytic_profile(load_shapes("tiny"), block_size=128).save(path)
    data = json.loads(path.read_text())
    assert data["schema"] == SCHEMA == f"sparsebalance.profile/{PROFILE.version}"
    path.write_text(json.dumps({**data, "schema": "sparsebalance.profile/9"}))
    with pytest.raises(ValueError, match=r"p\.json.*version 9 .*upgrade SparseBalance, or measure"):
        load_profile(path)
    path.write_text(json.dumps({**data, "schema": "something/1"}))
    with pytest.raises(ValueError, match="not a SparseBalance profile"):
        load_profile(path)


def test_profile_and_calibration_writers_use_names_of_their_own(tmp_path):
    # what a concurrent writer's temporary would be under the old fixed names: now never used
    path = tmp_path / "p.json"
    (tmp_path / "p.json.tmp").mkdir()
    analytic_profile(load_shapes("tiny"), block_size=128).save(path)
    assert load_profile(path).num_layers == 4
    assert sorted(os.listdir(tmp_path)) == ["p.json", "p.json.tmp"]  # no temporary left

    from sparsebalance.latency.memory_fit import MemoryCalibration, cache_path

    cal = MemoryCalibration(
        fingerprint={"shapes": {"num_layers": 4}},
        act_bytes=1.0,
        overhead_bytes=0.0,
        probes=(),
        errors=(),
        analytic_errors=(),
        at_range_end=False,
    )
    target = cache_path(cal.fingerprint, tmp_path)
    target.with_suffix(".tmp").mkdir()
    assert save_calibration(cal, tmp_path) == target
    assert json.loads(target.read_text())["act_bytes"] == 1.0
