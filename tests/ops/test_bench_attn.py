"""``bench-attn`` (issue 36, item 8): every part timed and divided by the same run's dense
baseline, the packed cases, the targets' verdicts, and sizes refused before allocating."""

from __future__ import annotations

import argparse
import math

import pytest

from sparsebalance.commands import bench_attn
from sparsebalance.commands.attention_cases import check_targets, pack_lengths


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_attn.add_arguments(parser)
    return bench_attn.prepare_args(parser.parse_args(["--device", "cpu", *argv]))


def test_a_cpu_run_measures_every_part_of_every_case():
    args = _args(
        "--seq-lens",
        "640",
        "--densities",
        "1,0.1",
        "--warmup",
        "0",
        "--repeats",
        "1",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "--head-dim",
        "16",
        "--json",
    )
    result = bench_attn.run_benchmark(args)
    rows = {r["case"]: r for r in result["rows"]}
    assert set(rows) == {"d=1", "d=0.1", "mixed", "short", "docs4", "docs64"}
    for r in rows.values():
        for part in ("select_s", "mask_s", "fwd_s", "fwd_bwd_s", "base_fwd_s", "base_fwd_bwd_s"):
            assert r[part] > 0, (r["case"], part)
        assert math.isclose(r["ratio"], r["fwd_bwd_s"] / r["base_fwd_bwd_s"])
    assert rows["d=1"]["dense_docs"] == 1 and rows["d=0.1"]["dense_docs"] == 0
    assert rows["short"]["dense_docs"] == rows["short"]["num_docs"] > 1
    assert rows["d=0.1"]["density"] < 0.5
    table = bench_attn.format_table(result["rows"], result["targets"])
    assert "not measured" in table  # no flex row on CPU: no target is judged


def test_packed_cases_fill_the_length_with_short_documents():
    assert sum(pack_lengths(100_000, "mixed")) == 100_000
    mixed = pack_lengths(100_000, "mixed")
    assert mixed[0] == 50_000 and max(mixed[1:]) <= 4096 and len(mixed) > 10
    assert max(pack_lengths(9000, "short")) <= 4096


def test_flex_on_the_cpu_times_the_forward_and_counts_the_cuda_path():
    """Issue 42: ``bench-attn --device cpu --backends flex`` runs: selection, mask and forward
    timed (flex has no backward on the CPU: not measured), and every row counts a training
    layer's launches around the kernel and its host reads, the budget fixed and DST cutting."""
    args = _args(
        "--seq-lens",
        "1000",
        "--densities",
        "1,0.1",
        "--warmup",
        "0",
        "--repeats",
        "1",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "--head-dim",
        "16",
        "--backends",
        "flex",
        "--packs",
        "mixed,short",
        "--json",
    )
    result = bench_attn.run_benchmark(args)
    for r in result["rows"]:
        assert r["fwd_s"] > 0 and r["fwd_bwd_s"] is None and r["ratio"] is None, r["case"]
        assert 0 <= r["ops_per_layer"] <= 40 and 0 <= r["ops_per_layer_dst"] <= 40, r
        assert r["host_reads_per_layer"] == 0
    ops = {r["case"]: (r["ops_per_layer"], r["ops_per_layer_dst"]) for r in result["rows"]}
    # issue 53: a pack its budget keeps whole is one dense call and nothing else; a selected one
    # (and DST cutting a whole one) launches the gate's operations
    assert ops["d=1"][0] == ops["short"][0] == ops["short"][1] == 0
    assert ops["d=0.1"][0] > 0 and ops["d=1"][1] > 0
    assert "not measured" in bench_attn.format_table(result["rows"], result["targets"])
    verdict = {t["target"].split(":")[0]: t["met"] for t in result["targets"]}
    assert verdict["host reads per layer"] is True


def test_a_pack_of_64_documents_launches_what_one_of_4_does():
    """``--counts-only`` counts at sizes this machine could not time: 64 and 4 selected
    documents (block 32, each document more than 3 blocks long) launch the same operations."""
    args = _args(
        "--seq-lens",
        "8k",
        "--densities",
        "0.1",
        "--block-size",
        "32",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "--head-dim",
        "16",
        "--backends",
        "flex",
        "--packs",
        "docs4,docs64",
        "--counts-only",
    )
    result = bench_attn.run_benchmark(args)
    rows = {r["case"]: r for r in result["rows"]}
    assert rows["docs4"]["dense_docs"] == rows["docs64"]["dense_docs"] == 0
    for field in ("ops_per_layer", "ops_per_layer_dst"):
        assert rows["docs4"][field] == rows["docs64"][field] <= 40, field
    assert all(r["fwd_s"] is None for r in rows.values())  # nothing timed
    verdict = {t["target"].split(":")[0]: t["met"] for t in result["targets"]}
    assert verdict["launches per layer"] is True


def test_targets_are_judged_on_flex_rows_only():
    rows = [
        {"backend": "flex", "case": "d=0.05", "seq_len": 32768, "ratio": 0.2, "overhead_share": 0.15},
        {"backend": "torch", "case": "d=0.05", "seq_len": 131072, "ratio": 0.01, "overhead_share": 0.0},
        {
            "backend": "flex",
            "case": "short",
            "seq_len": 16384,
            "ratio": 1.0,
            "layer_ratio": 1.05,
            "overhead_share": 0.0,
        },
        {"backend": "flex", "case": "short", "seq_len": 32768, "ratio": 1.0, "layer_ratio": 1.2, "overhead_share": 0.0},
    ]
    verdict = {t["target"].split(":")[0]: t["met"] for t in check_targets(rows)}
    assert verdict["d=0.05 at 32K"] is True
    assert verdict["d=0.05 at 128K"] is None  # only a torch row: not measured
    assert verdict["packs of documents <= 4K, every part"] is False  # one of two lengths missed
    assert verdict["selection + mask at 32K, d=0.05"] is False


def test_a_length_that_cannot_fit_is_refused_before_allocating():
    with pytest.raises(ValueError, match=r"--seq-lens: bench-attn at T=10000000 .* GiB"):
        _args("--seq-lens", "10000000")
