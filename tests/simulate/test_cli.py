"""``sparsebalance simulate`` end to end: JSON, table, plots, distributions, clear errors."""

import json

import numpy as np
import pytest

from sparsebalance.cli import main
from sparsebalance.simulate import LengthDistribution, SparsityModel

FAST = ["--world-size", "4,8", "--steps", "2", "--samples-per-rank", "3", "--max-len", "8192"]


def test_json_output_parses(capsys):
    assert main(["simulate", *FAST, "--micro-batches", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)  # only JSON on stdout
    assert [r["world_size"] for r in out["results"]] == [4, 8]
    table = out["results"][1]["strategies"]
    assert set(table) >= {"baseline", "sab", "dst", "sab+dst", "sab+dst@min", "sab+dst@max"}
    assert table["baseline"]["speedup"] == 1.0
    assert 0 < table["sab+dst"]["balance_efficiency"] <= 1.0


def test_table_and_plots(tmp_path, capsys):
    rc = main(
        ["simulate", *FAST, "--capacity", "8192", "--strategy", "sab+dst", "--plot", str(tmp_path), "--dist", "bimodal"]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "| sab+dst |" in out and "| baseline |" in out
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert pngs == ["rank_times_R4.png", "rank_times_R8.png", "speedup_vs_world_size.png"]
    assert all((tmp_path / p).read_bytes()[:4] == b"\x89PNG" for p in pngs)


def test_lengths_file_with_densities(tmp_path, capsys):
    f = tmp_path / "lens.json"
    f.write_text(json.dumps({"lengths": [512, 4096, 1000], "densities": [1.0, 0.2, 0.5]}))
    assert (
        main(["simulate", "--world-size", "2", "--steps", "2", "--micro-batches", "1", "--lengths", str(f), "--json"])
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert "measured densities" in out["sparsity"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--world-size", "0", "--micro-batches", "2"], "--world-size"),
        (["--world-size", "4", "--micro-batches", "2", "--strategy", "fastest"], "--strategy"),
        (["--world-size", "4", "--micro-batches", "2", "--steps", "0"], "--steps"),
        (["--world-size", "4", "--micro-batches", "2", "--tolerance", "-1"], "--tolerance"),
    ],
)
def test_bad_flags_give_clear_errors(args, message, capsys):
    assert main(["simulate", *args]) == 2
    assert message in capsys.readouterr().err


def test_both_micro_batches_and_capacity_rejected(capsys):
    with pytest.raises(SystemExit):
        main(["simulate", "--world-size", "4", "--micro-batches", "2", "--capacity", "9"])
    assert "not allowed with" in capsys.readouterr().err


def test_empty_lengths_file(tmp_path, capsys):
    f = tmp_path / "empty.txt"
    f.write_text("\n# nothing\n")
    assert main(["simulate", "--world-size", "2", "--micro-batches", "1", "--lengths", str(f)]) == 2
    assert "empty" in capsys.readouterr().err


def test_distributions_and_sparsity_model():
    rng = np.random.default_rng(0)
    for name in ("heavy", "uniform", "bimodal"):
        lens, dens = LengthDistribution(name, 128, 32768).sample(rng, 20000)
        assert dens is None and lens.min() >= 128 and lens.max() <= 32768
    heavy, _ = LengthDistribution("heavy").sample(rng, 20000)
    top = np.sort(heavy)[-2000:]
    assert top.sum() / heavy.sum() > 0.4  # a heavy tail: the longest 10 % hold most tokens
    sm = SparsityModel()
    d = sm.sample(rng, heavy, 128)
    assert np.all((d > 0) & (d <= 1))
    assert sm.median(np.array([256]), 128)[0] > sm.median(np.array([32768]), 128)[0]  # longer: sparser
    with pytest.raises(ValueError, match="--dist"):
        LengthDistribution("zipf")
    with pytest.raises(ValueError, match="--density-at-4k"):
        SparsityModel(density_at_4k=0.0)


def test_hybrid_strategies_keep_the_json_shape(capsys):
    args = [
        "simulate",
        "--world-size",
        "8",
        "--steps",
        "2",
        "--samples-per-rank",
        "6",
        "--micro-batches",
        "2",
        "--dist",
        "longtail",
        "--max-len",
        "131072",
        "--strategy",
        "sab,sab-cp,sab-cp+dst",
        "--json",
    ]
    assert main(args) == 0
    table = json.loads(capsys.readouterr().out)["results"][0]["strategies"]
    assert set(table["sab-cp"]) == set(table["sab"]) == set(table["sab-cp+dst"])
    assert table["sab-cp"]["planner"] == "sab-cp" and table["sab-cp+dst"]["dst_mode"] != "off"
    assert table["sab-cp"]["split_documents"] > 0 == table["sab"]["split_documents"]
    assert table["sab-cp"]["step_seconds"] <= table["sab"]["step_seconds"]
    assert table["sab-cp+dst"]["step_seconds"] <= table["sab-cp"]["step_seconds"] * (1 + 1e-9)
    with pytest.raises(ValueError, match="--ring must be one of"):
        from sparsebalance.simulate import SimConfig

        SimConfig(micro_batches=2, ring="star")


def test_ranks_per_node_reaches_the_links_and_the_all_reduce(capsys):
    """2 ranks per node at R = 8: the gradient all-reduce crosses nodes (slower than inside one
    8-GPU node) and the cost model says which node size it priced."""
    args = [
        "simulate",
        "--world-size",
        "8",
        "--steps",
        "2",
        "--samples-per-rank",
        "3",
        "--micro-batches",
        "2",
        "--dist",
        "longtail",
        "--max-len",
        "65536",
        "--strategy",
        "sab-cp",
        "--json",
    ]
    runs = {}
    for g in (None, 2):
        assert main(args + ([] if g is None else ["--ranks-per-node", str(g)])) == 0
        runs[g] = json.loads(capsys.readouterr().out)
    assert "2 ranks per node" in runs[2]["cost_model"]
    assert "one node" in runs[None]["cost_model"]  # analytic h100: 8 GPUs per node, R = 8
    base = [runs[g]["results"][0]["strategies"]["baseline"]["step_seconds"] for g in (None, 2)]
    assert base[1] > base[0]
    assert main(["simulate", *FAST, "--micro-batches", "2", "--ranks-per-node", "0"]) != 0
    assert "--ranks-per-node must be >= 1" in capsys.readouterr().err
