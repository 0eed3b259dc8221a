"""Multi-node launch: rendezvous flags, torchrun arguments, SLURM's environment mapping."""

import pytest

from sparsebalance.cli import main as cli_main
from sparsebalance.train.multinode import Rendezvous, slurm_env


def test_single_node_keeps_standalone():
    assert Rendezvous().torchrun_args(4) == ["--standalone", "--nproc_per_node=4"]


def test_multinode_uses_c10d_rendezvous():
    args = Rendezvous(2, 1, "10.0.0.1:29500", "job7").torchrun_args(8)
    assert args == ["--nnodes=2", "--node_rank=1", "--rdzv_backend=c10d",
                    "--rdzv_endpoint=10.0.0.1:29500", "--rdzv_id=job7",
                    "--nproc_per_node=8"]  # fmt: skip


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        ({"nnodes": 0}, "--nnodes"),
        ({"nnodes": 2, "node_rank": 2, "endpoint": "h:1"}, "--node-rank"),
        ({"nnodes": 2, "node_rank": -1, "endpoint": "h:1"}, "--node-rank"),
        ({"nnodes": 2}, "--rdzv-endpoint"),
        ({"nnodes": 2, "endpoint": "host"}, "--rdzv-endpoint"),
        ({"nnodes": 2, "endpoint": "host:0"}, "--rdzv-endpoint"),
        ({"nnodes": 2, "endpoint": ":29500"}, "--rdzv-endpoint"),
        ({"nnodes": 2, "endpoint": "h:1", "rdzv_id": ""}, "--rdzv-id"),
    ],
)
def test_bad_rendezvous_names_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        Rendezvous(**kwargs)


def test_cli_rejects_bad_node_rank_before_launching(tmp_path, capsys):
    rc = cli_main(["train", "--nnodes", "2", "--node-rank", "3", "--rdzv-endpoint",
                   "127.0.0.1:29500", "--out", str(tmp_path / "run")])  # fmt: skip
    assert rc != 0
    assert "--node-rank must be in [0, 2)" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


SLURM = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
         "SLURM_NTASKS_PER_NODE": "4(x2)", "MASTER_ADDR": "n0", "MASTER_PORT": "29500"}  # fmt: skip


def test_slurm_maps_to_torchrun_variables():
    assert slurm_env(SLURM) == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                                "GROUP_RANK": "1", "LOCAL_WORLD_SIZE": "4"}  # fmt: skip


def test_torchrun_variables_win_over_slurm():
    assert slurm_env({**SLURM, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}) == {}
    assert slurm_env({"MASTER_ADDR": "x"}) == {}  # not under srun


def test_slurm_without_master_addr_is_a_clear_error():
    env = {k: v for k, v in SLURM.items() if k != "MASTER_ADDR"}
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        slurm_env(env)


def test_a_rank_on_another_node_joins_node_0s_lock(tmp_path):
    from sparsebalance.train.runlock import FOLLOW, RunLock, join

    assert not join(tmp_path / "run", FOLLOW)  # no lock yet: the worker takes it itself
    with RunLock(tmp_path / "run"):
        assert join(tmp_path / "run", FOLLOW)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _losses(run) -> list[float]:
    import json

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_two_nodes_on_localhost_match_one_node(tmp_path):
    """2 "nodes" x 1 process (two launchers, c10d rendezvous on 127.0.0.1) train the same
    2 steps as 1 node x 2 processes: same losses."""
    import os
    import subprocess
    import sys

    flags = ["--model", "tiny", "--nproc", "1", "--steps", "2", "--deterministic",
             "--num-builtin", "16", "--max-len", "256", "--global-batch", "4"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cli = [sys.executable, "-m", "sparsebalance", "train"]
    one = subprocess.run([*cli, *flags, "--nproc", "2", "--out", str(tmp_path / "one")],
                         env=env, capture_output=True, text=True, timeout=280)  # fmt: skip
    assert one.returncode == 0, one.stderr[-2000:]
    multi = [*cli, *flags, "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}",
             "--rdzv-id", "test", "--out", str(tmp_path / "two")]  # fmt: skip
    procs = [subprocess.Popen([*multi, "--node-rank", str(i)], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for i in (0, 1)]  # fmt: skip
    try:
        outs = [p.communicate(timeout=280) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-2000:]
    a, b = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert len(a) == 2 and a == pytest.approx(b, rel=1e-5)
    import json

    topo = json.loads((tmp_path / "two" / "topology.json").read_text())
    assert (topo["nodes"], topo["ranks_per_node"]) == (2, 1)
    assert json.loads((tmp_path / "one" / "topology.json").read_text())["nodes"] == 1


def test_topology_from_the_launchers_environment():
    from sparsebalance.train.multinode import Topology

    topo = Topology.from_env(8, {"LOCAL_WORLD_SIZE": "4"})
    assert (topo.nodes, topo.ranks_per_node, topo.node_of(3), topo.node_of(4)) == (2, 4, 0, 1)
    assert Topology.from_env(4, {}).nodes == 1  # no launcher variables: one machine
    with pytest.raises(ValueError, match="--ranks-per-node \\(3\\) must divide the world size"):
        Topology(8, 3)
