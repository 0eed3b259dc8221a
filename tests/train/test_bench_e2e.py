"""bench-e2e end to end on emulated ranks (tiny, 2 steps): every strategy runs on the same data
and the table carries the simulator's prediction next to the measurement."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sparsebalance.cli import main
from sparsebalance.data.mixture import MixtureSampler
from tests.train.harness import write_dataset, write_profile

pytestmark = pytest.mark.filterwarnings("ignore::sparsebalance.latency.ProfileMismatchWarning")


def batch_schedule(seed: int, num_docs: int, global_batch: int, steps: int) -> list[list[int]]:
    """Document indices of each step's global batch for one source, as the trainer draws them."""
    sampler = MixtureSampler([np.arange(num_docs)], [1.0], seed, global_batch)
    return [[i for _, i in sampler.next_batch()] for _ in range(steps)]


def test_batch_schedule_never_repeats_a_document_within_a_batch():
    sched = batch_schedule(seed=3, num_docs=10, global_batch=4, steps=6)
    assert [len(b) for b in sched] == [4] * 6
    assert all(len(set(b)) == 4 for b in sched)  # an epoch's short tail is dropped
    assert len(set(sched[0] + sched[1])) == 8  # inside an epoch: no document twice
    assert batch_schedule(3, 10, 4, 6) == sched


@pytest.mark.slow
def test_bench_e2e_on_emulated_ranks(tmp_path, capsys):
    argv = [
        "bench-e2e",
        "--strategies",
        "baseline,sab+dst",
        "--emulate-ranks",
        "2",
        "--steps",
        "2",
        "--global-batch",
        "6",
        "--capacity",
        "512",
        "--block-size",
        "32",
        "--device",
        "cpu",
        "--data",
        str(write_dataset(tmp_path)),
        "--profile",
        str(write_profile(tmp_path)),
        "--out",
        str(tmp_path / "runs"),
        "--results-dir",
        str(tmp_path),
        "--json",
    ]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    rows = result["strategies"]
    assert set(rows) == {"baseline", "sab+dst"}
    assert rows["baseline"]["speedup"] == 1.0
    for r in rows.values():
        assert r["mean_step_s"] > 0 and 0 < r["efficiency"] <= 1
        assert r["predicted_step_s"] > 0 and r["predicted_speedup"] > 0
    assert list(tmp_path.glob("*bench-e2e-cpu.md"))
    assert (tmp_path / "runs" / "sab_dst" / "metrics.jsonl").is_file()


def test_bad_ablation_names_and_emulation_values(capsys):
    assert main(["bench-e2e", "--strategies", "baseline,fast"]) == 2
    assert "unknown" in capsys.readouterr().err
    assert main(["train", "--emulate-ranks", "-1"]) == 2
    assert "--emulate-ranks" in capsys.readouterr().err


def test_global_batch_must_cover_ranks_and_dataset(tmp_path, capsys):
    common = [
        "--data",
        str(write_dataset(tmp_path)),
        "--profile",
        str(write_profile(tmp_path)),
        "--out",
        str(tmp_path / "r"),
        "--steps",
        "1",
        "--nproc",
        "1",
        "--block-size",
        "32",
    ]
    # user errors are found before launching: one line, exit 2
    assert main(["train", "--emulate-ranks", "4", "--global-batch", "3", *common]) == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith("smaller than the 4 ranks: every rank needs at least one document per step")
    )
    assert main(["train", "--global-batch", "1000", *common]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "exceeds the dataset's 32 documents" in err
    assert not (tmp_path / "r").exists()  # a refused run leaves no folder behind
    # A [dst] table is read (tests/train/test_config.py); its values are validated like flags.
    (tmp_path / "run.toml").write_text('steps = 2\n[dst]\nmode = "sideways"\n')
    assert main(["train", "--config", str(tmp_path / "run.toml")]) == 2
    assert "--dst-mode must be one of" in capsys.readouterr().err
