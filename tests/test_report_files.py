"""Results files and run reports on disk: written atomically (a full disk leaves nothing
half-written and no temporary file), dated results files never replaced (a second one the same
day gets ``-2`` and the command names it); and the report's wording (no speed-up of a run against
itself, no range from a value to itself)."""

from __future__ import annotations

import errno
import json
import os
import stat
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from sparsebalance import results
from sparsebalance.cli import main
from sparsebalance.report import budgets, comparison_table, write_report

CPU = torch.device("cpu")


def _write(folder, table="| a |", name="bench"):
    return results.write_results(folder, name, CPU, table, {"x": 1})


def test_a_second_results_file_the_same_day_gets_a_suffix_and_the_first_is_kept(tmp_path):
    md1, js1 = _write(tmp_path, "| first |")
    first = md1.read_bytes(), js1.read_bytes()
    md2, js2 = _write(tmp_path, "| second |")
    md3, js3 = _write(tmp_path, "| third |")
    assert md1.name.endswith("-bench-cpu.md") and js1.name == md1.stem + ".json"
    assert (md2.name, js2.name) == (f"{md1.stem}-2.md", f"{md1.stem}-2.json")
    assert (md3.name, js3.name) == (f"{md1.stem}-3.md", f"{md1.stem}-3.json")
    assert (md1.read_bytes(), js1.read_bytes()) == first  # the name the docs link: unchanged
    assert "| second |" in md2.read_text() and "| third |" in md3.read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        p.name for p in (md1, js1, md2, js2, md3, js3)
    )  # no temporary file left


def test_writers_at_the_same_time_each_get_their_own_pair(tmp_path):
    with ThreadPoolExecutor(8) as pool:
        pairs = list(pool.map(lambda i: _write(tmp_path, f"| writer {i} |"), range(8)))
    assert len({md for md, _ in pairs}) == 8 and len(list(tmp_path.iterdir())) == 16
    for i, (md, js) in enumerate(pairs):
        assert f"| writer {i} |" in md.read_text() and js.stem == md.stem


def test_a_lone_json_of_that_name_is_not_replaced_either(tmp_path):
    stem = _write(tmp_path)[0].stem
    for p in tmp_path.iterdir():
        p.unlink()
    (tmp_path / f"{stem}.json").write_text("someone's\n")
    md, js = _write(tmp_path)
    assert (md.name, js.name) == (f"{stem}-2.md", f"{stem}-2.json")
    assert (tmp_path / f"{stem}.json").read_text() == "someone's\n"


def _disk_full_at_fsync(monkeypatch, after: int = 0):
    """The disk fills while a file's data reaches it: fsync of a regular file (the ``after``+1st)
    raises ENOSPC, as a write on a full filesystem does; fsync of a folder still works."""
    real, calls = os.fsync, []

    def fsync(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode) or len(calls) < after:
            calls.append(fd)
            return real(fd)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", fsync)


@pytest.mark.parametrize("after", [0, 1], ids=["md-fails", "json-fails"])
def test_a_full_disk_leaves_no_partial_results_file(tmp_path, monkeypatch, after):
    _write(tmp_path, "| kept |")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    _disk_full_at_fsync(monkeypatch, after)
    with pytest.raises(ValueError) as err:  # DiskFull
        _write(tmp_path, "| lost |")
    (line,) = str(err.value).splitlines()  # one line
    assert line.startswith(f"results file {tmp_path}/") and "-bench-cpu.md/.json: not written" in line
    assert "the disk is full" in line and "partial temporary files were removed" in line
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # no temp, no -2


def _metrics(run, scale=1.0, kind="top-k", budget=lambda r: 8.0):
    lines = []
    for step in (1, 2, 3):
        for r in (0, 1):
            lines.append(
                {
                    "step": step,
                    "rank": r,
                    "compute_s": scale * (1 + r),
                    "derived_bubble_s": scale * (1 - r),
                    "budget_mean": budget(r),
                    "density": 0.5,
                    "units": [],
                }
            )
        lines.append(
            {
                "step": step,
                "rank": "all",
                "loss": 5.0,
                "step_seconds": 2 * scale,
                "max_compute_s": 2 * scale,
                "efficiency": 0.75,
                "bubble_fraction": 0.25,
                "mean_density": 0.5,
                "tokens_per_s": 1e3,
                "overhead_s": 0.01,
                "coverage_limited": 0,
                "budget_kind": kind,
            }
        )
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return run


def test_a_full_disk_while_writing_a_report_keeps_the_earlier_one(tmp_path, monkeypatch):
    run = _metrics(tmp_path / "run")
    write_report(run, plots=False)
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    _disk_full_at_fsync(monkeypatch)
    with pytest.raises(
        ValueError,
        match=r"report\.md: not written, the disk is full.*earlier "
        r"report\.md is intact",
    ):
        write_report(run, plots=False)
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before


def test_report_command_names_the_results_file_it_wrote(tmp_path, capsys):
    root = tmp_path / "runs"
    _metrics(root / "baseline", 2.0)
    _metrics(root / "sparsebalance", 1.0)
    (root / "sparsebalance" / "config.json").write_text(json.dumps({"out": str(root / "sparsebalance"), "steps": 3}))
    out = tmp_path / "results"
    args = ["report", str(root), "--no-plots", "--results-dir", str(out)]
    assert main(args) == 0
    first = next(out.glob("*.md"))
    kept = first.read_bytes()
    assert f"wrote {first} and {first.stem}.json" in capsys.readouterr().out
    for made in (first, first.with_suffix(".json")):  # no machine path in a results file
        assert str(tmp_path) not in made.read_text(), made.name
    assert main(args) == 0
    said = capsys.readouterr().out
    second = out / f"{first.stem}-2.md"
    assert f"wrote {second} and {first.stem}-2.json ({first.name} exists from earlier today" in said
    assert first.read_bytes() == kept and second.is_file()
    assert main([*args, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["results_file"] == str(out / f"{first.stem}-3.md")


def test_report_command_on_a_full_disk_says_so_in_one_line(tmp_path, capsys, monkeypatch):
    run = _metrics(tmp_path / "run")
    _disk_full_at_fsync(monkeypatch)
    assert main(["report", str(run), "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the disk is full" in err
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl"]


def _summary(step):
    return {
        "steps": 3,
        "mean_step_s": step,
        "mean_max_compute_s": step,
        "efficiency": 0.9,
        "bubble_fraction": 0.1,
        "mean_density": 0.5,
        "tokens_per_s": 1.0,
        "final_loss": 1.0,
    }


def test_one_run_has_no_speedup_against_itself(tmp_path):
    table, out = comparison_table({"run": _summary(2.0)})
    assert "speedup" not in table and "speedup" not in out["run"]
    table, out = comparison_table({"a": _summary(2.0), "b": _summary(1.0)})
    assert "| speedup | compute speedup |" in table and out["b"]["speedup"] == 2.0
    text = write_report(_metrics(tmp_path / "run"), plots=False)[0].read_text()
    table, note = text.split("\n\n")[1:3]
    assert "speedup" not in table and "1.000" not in table
    assert "one run, nothing to compare it with" in note and "Speedup =" not in note


def test_a_fixed_budget_is_one_value_not_a_range_from_it_to_itself(tmp_path):
    run = _metrics(tmp_path / "fixed")
    from sparsebalance.report import load_run

    line = budgets(*load_run(run))
    assert line.startswith("top-k, budget k 8.0 on every rank and step (mean over layers)")
    assert " .. " not in line and "0.0 apart" not in line
    assert "coverage bound stopped no layer cut" in line
    moving = budgets(*load_run(_metrics(tmp_path / "moving", budget=lambda r: 6.0 + 4 * r)))
    assert "per-rank budgets k 6.0 .. 10.0 (mean over layers; up to 4.0 apart" in moving
