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
