"""2 "nodes" x 2 processes on localhost (two ``sparsebalance train`` launchers, ``--nnodes 2``,
distinct node ranks, one c10d endpoint): SAB + DST train the same losses as one node of 4, the
topology reports 2 nodes of 2, and the job restarted from its checkpoint (same node count)
continues with bit-identical losses. Tiny model, 8 documents of <= 256 tokens, an analytic
latency profile (nothing measured): 4 processes on 2 cores still take minutes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sparsebalance.latency import analytic_profile
from sparsebalance.models import load_shapes

from .test_multinode import _free_port, _losses

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # ~110 s: CI runs it in the slow tier

CLI = [sys.executable, "-m", "sparsebalance", "train"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
LAUNCH_TIMEOUT = 420


def _flags(tmp: Path) -> list[str]:
    profile = tmp / "profile.json"
    if not profile.exists():
        analytic_profile(load_shapes("tiny"), "h100", block_size=32).save(profile)
    return [
        "--model",
        "tiny",
        "--steps",
        "3",
        "--deterministic",
        "--num-builtin",
        "16",
        "--max-len",
        "256",
        "--global-batch",
        "8",
        "--block-size",
        "32",
        "--device",
        "cpu",
        "--profile",
        str(profile),
        "--strategy",
        "sab",
        "--dst-mode",
        "bidirectional",
        "--checkpoint-every",
        "1",
    ]


def _two_nodes(flags: list[str], out: Path) -> None:
    """Node 0 and node 1, 2 processes each, meeting at one c10d endpoint on 127.0.0.1."""
    cmd = [
        *CLI,
        *flags,
        "--nproc",
        "2",
        "--nnodes",
        "2",
        "--rdzv-endpoint",
        f"127.0.0.1:{_free_port()}",
        "--rdzv-id",
        out.name,
        "--out",
        str(out),
    ]
    procs = [
        subprocess.Popen(
            [*cmd, "--node-rank", str(i)], env=ENV, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for i in (0, 1)
    ]
    try:
        outs = [p.communicate(timeout=LAUNCH_TIMEOUT) for p in procs]
    finally:
        for p in procs:
            p.kill()
    codes = [p.returncode for p in procs]
    # both nodes' ends: the node that failed first is often not the one whose error is shown
    assert codes == [0, 0], "\n".join(
        f"node {i} (exit {c}): ...{err[-2500:]}" for i, (c, (_, err)) in enumerate(zip(codes, outs, strict=True))
    )


@pytest.fixture(scope="module")
def two_by_two(tmp_path_factory) -> tuple[Path, list[str]]:
    tmp = tmp_path_factory.mktemp("two-nodes")
    flags = _flags(tmp)
    _two_nodes(flags, tmp / "two")
    return tmp, flags


@pytest.mark.timeout(1200)
def test_two_nodes_of_two_match_one_node_of_four(two_by_two):
    tmp, flags = two_by_two
    one = subprocess.run(
        [*CLI, *flags, "--nproc", "4", "--out", str(tmp / "one")],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=LAUNCH_TIMEOUT,
    )
    assert one.returncode == 0, one.stderr[-3000:]
    a, b = _losses(tmp / "one"), _losses(tmp / "two")
    assert len(a) == 3 and a == pytest.approx(b, rel=1e-6)
    topo = json.loads((tmp / "two" / "topology.json").read_text())
    assert (topo["nodes"], topo["ranks_per_node"], topo["source"]) == (2, 2, "launcher")
    topo = json.loads((tmp / "one" / "topology.json").read_text())
    assert (topo["nodes"], topo["ranks_per_node"]) == (1, 4)
    rows = [json.loads(x) for x in (tmp / "two" / "metrics.jsonl").read_text().splitlines()]
    ranks = {r["rank"] for r in rows if r.get("rank") != "all"}
    assert ranks == {0, 1, 2, 3}  # every rank of both nodes reported each step
    steps = [(r["strategy"], r["dst_mode"]) for r in rows if r["rank"] == "all"]
    assert steps == [("sab", "bidirectional")] * 3


@pytest.mark.timeout(1200)
def test_two_nodes_restart_from_their_checkpoint_bit_identical(two_by_two):
    """The 2 x 2 job loses its last step (a crash after checkpoint step-2) and is restarted on
    2 nodes of 2 with --resume: step 3 is recomputed with exactly the uninterrupted loss."""
    tmp, flags = two_by_two
    run = tmp / "restarted"
    shutil.copytree(tmp / "two", run)
    shutil.rmtree(run / "checkpoints" / "step-000003")
    (run / "checkpoints" / "latest").write_text("step-000002\n")
    _two_nodes([*flags, "--resume"], run)
    assert _losses(run) == _losses(tmp / "two")  # bit-identical, all 3 steps
    assert (run / "checkpoints" / "step-000003").is_dir()


@pytest.mark.timeout(900)
def test_a_cp_unit_over_both_nodes_runs_the_hierarchical_ring(tmp_path):
    """``sab-cp --cp 4`` on 2 nodes of 2 (capacity 64 tokens, documents of 128-256): every CP
    unit spans both launchers' nodes and runs the hierarchical ring, whose inner ring is a node
    (from the launchers' topology; on one node of 4 the same unit runs flat). 1 step."""
    flags = [*_flags(tmp_path), "--strategy", "sab-cp", "--cp", "4", "--capacity", "64", "--steps", "1"]
    _two_nodes(flags, tmp_path / "cp")
    rows = [json.loads(x) for x in (tmp_path / "cp" / "metrics.jsonl").read_text().splitlines()]
    units = {(tuple(u["ranks"]), u["ring"]) for r in rows if r["rank"] != "all" for u in r["units"]}
    wide = {unit for unit in units if len(unit[0]) > 1}  # one-rank units: documents <= 64 tokens
    assert wide == {((0, 1, 2, 3), "hierarchical")}, units
