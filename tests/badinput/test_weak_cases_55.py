"""Issue 55's weak cases (right outcome, but a misleading or missing message), each one line:

- ``--cp 2 --pp 2`` blamed ``--strategy 'sab'``, a strategy the user never gave (``auto`` resolved
  under ``--pp``): it says a pipeline has no context-parallel units;
- a config with a UTF-8 BOM was "Invalid statement (at line 1, column 1)": it is read;
- ``schema_version = "2"`` (a string) was "schema version 2 (written by an older SparseBalance);
  this build reads 1, 2": it says the value must be a whole number;
- a path over 255 characters was a traceback in ``train``, ``prepare`` and ``eval``;
- a run stopped before its first step left ``tensorboard/``, and the corrected rerun was refused
  as "an earlier run".
"""

from __future__ import annotations

import pytest

from sparsebalance.cli import main
from sparsebalance.flags import load_file
from sparsebalance.train import TrainConfig
from sparsebalance.train.launch import check_run_folder
from tests.docs.pages import ROOT


def test_cp_with_pp_is_refused_for_what_it_is(tmp_path):
    with pytest.raises(ValueError, match=r"cp \(--cp\) 2 cannot run with TrainConfig.pp \(--pp\) 2: a pipeline trains"):
        TrainConfig(cp=2, pp=2, out=str(tmp_path / "run"))


def test_a_config_with_a_utf8_bom_is_read(tmp_path):
    path = tmp_path / "run.toml"
    path.write_bytes(b"\xef\xbb\xbfsteps = 3\n")
    assert load_file(str(path)) == {"steps": 3}


def test_a_quoted_schema_version_is_named(tmp_path, capsys):
    path = tmp_path / "run.toml"
    path.write_text('schema_version = "2"\nsteps = 3\n')
    assert main(["train", "--config", str(path), "--out", str(tmp_path / "run")]) == 2
    want = f"--config {path}: schema_version must be a whole number, got '2' (write it without quotes)"
    assert capsys.readouterr().err == f"sparsebalance train: error: {want}\n"


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--steps", "1", "--out"],
        ["prepare", str(ROOT / "examples" / "data" / "sample.jsonl"), "--out"],
        ["eval", "--task", "ppl", "--model"],
    ],
    ids=lambda a: a[0],
)
def test_a_path_too_long_is_one_line(tmp_path, capsys, argv):
    long = tmp_path / ("a" * 300)
    assert main([*argv, str(long)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"sparsebalance {argv[0]}: error: a path is too long for this file system: ")
    assert err.rstrip().endswith(f"({len(str(long))} characters)")


def test_a_start_stopped_before_its_first_step_does_not_block_the_rerun(tmp_path):
    run = tmp_path / "run"
    (run / "tensorboard").mkdir(parents=True)  # what Telemetry made before the first step
    check_run_folder(TrainConfig(out=str(run)))  # no --overwrite needed
    (run / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"holds an earlier run \(metrics.jsonl, tensorboard\)"):
        check_run_folder(TrainConfig(out=str(run)))
