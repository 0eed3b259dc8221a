"""Multi-node launch: rendezvous flags, torchrun arguments, SLURM's environment mapping."""

import pytest

from sparsebalance.cli import main as cli_main
from sparsebalance.train.multinode import Rendezvous, slurm_env


def test_single_node_keeps_standalone():
    assert Rendezvous().torchrun_args(4) == ["--standalone", "--nproc_per_node=4"]


def test_multinode_uses_c10d_rendezvous():
    args = Rendezvous(2, 1, "10.0.0.1:29500", "job7").torchrun_args(8)
    assert args == [
        "--nnodes=2",
        "--node_rank=1",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=10.0.0.1:29500",
        "--rdzv_conf=is_host=0",
        "--rdzv_id=job7",
        "--nproc_per_node=8",
    ]
    # node 0 alone hosts the rendezvous store (never whichever launcher started first)
    assert "--rdzv_conf=is_host=1" in Rendezvous(2, 0, "10.0.0.1:29500", "j").torchrun_args(8)


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
        ({"nnodes": 2, "endpoint": "h:1"}, "--rdzv-id is required with --nnodes > 1"),
    ],
)
def test_bad_rendezvous_names_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        Rendezvous(**kwargs)


def test_cli_rejects_bad_node_rank_before_launching(tmp_path, capsys):
    rc = cli_main(
        [
            "train",
            "--nnodes",
            "2",
            "--node-rank",
            "3",
            "--rdzv-endpoint",
            "127.0.0.1:29500",
            "--out",
            str(tmp_path / "run"),
        ]
    )
    assert rc != 0
    assert "--node-rank must be in [0, 2)" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_cli_needs_a_run_id_across_nodes_and_says_trusted_network(tmp_path, capsys):
    rc = cli_main(["train", "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29500", "--out", str(tmp_path / "run")])
    assert rc == 2
    assert "--rdzv-id is required with --nnodes > 1" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
    from sparsebalance.cli import build_parser

    parser = build_parser()
    train = parser._subparsers._group_actions[0].choices["train"]
    assert "trusted network only" in " ".join(train.format_help().split())


SLURM = {
    "SLURM_PROCID": "5",
    "SLURM_NTASKS": "8",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_NTASKS_PER_NODE": "4(x2)",
    "MASTER_ADDR": "n0",
    "MASTER_PORT": "29500",
}


def test_slurm_maps_to_torchrun_variables():
    assert slurm_env(SLURM) == {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "GROUP_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
    }


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
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_nodes_on_localhost_match_one_node(tmp_path):
    """2 "nodes" x 1 process (two launchers, c10d rendezvous on 127.0.0.1) train the same
    2 steps as 1 node x 2 processes: same losses."""
    import os
    import subprocess
    import sys

    flags = [
        "--model",
        "tiny",
        "--nproc",
        "1",
        "--steps",
        "2",
        "--deterministic",
        "--num-builtin",
        "16",
        "--max-len",
        "256",
        "--global-batch",
        "4",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cli = [sys.executable, "-m", "sparsebalance", "train"]
    one = subprocess.run(
        [*cli, *flags, "--nproc", "2", "--out", str(tmp_path / "one")],
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert one.returncode == 0, one.stderr[-2000:]
    multi = [
        *cli,
        *flags,
        "--nnodes",
        "2",
        "--rdzv-endpoint",
        f"127.0.0.1:{_free_port()}",
        "--rdzv-id",
        "test",
        "--out",
        str(tmp_path / "two"),
    ]
    procs = [
        subprocess.Popen(
            [*multi, "--node-rank", str(i)], env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for i in (0, 1)
    ]
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


def _placements(nodes, per_node):
    return [
        {"group_rank": r // per_node, "local_rank": r % per_node, "local_world_size": per_node}
        for r in range(nodes * per_node)
    ]


def test_topology_from_every_ranks_launcher_variables():
    from sparsebalance.train.multinode import Topology

    topo, note = Topology.from_launcher(4, _placements(2, 2))
    assert (topo.nodes, topo.ranks_per_node, topo.source, note) == (2, 2, "launcher", None)
    topo, note = Topology.from_launcher(4, _placements(2, 2), ranks_per_node=4)
    assert (topo.nodes, topo.source) == (1, "--ranks-per-node")
    assert note == "--ranks-per-node 4 overrides the launcher's 2 ranks per machine"
    assert Topology.from_launcher(4, [{}] * 4)[0].nodes == 1  # no launcher variables: one node
    assert Topology.from_launcher(8, [], ranks_per_node=2)[0].nodes == 4  # emulated ranks
    uneven = _placements(2, 2)
    uneven[3] = {**uneven[3], "local_world_size": 3}
    with pytest.raises(ValueError, match="same --nproc"):
        Topology.from_launcher(4, uneven)
    cyclic = _placements(2, 2)
    cyclic[1], cyclic[2] = cyclic[2], cyclic[1]  # srun --distribution=cyclic
    with pytest.raises(ValueError, match="not numbered node by node"):
        Topology.from_launcher(4, cyclic)
    with pytest.raises(ValueError, match="--ranks-per-node \\(3\\) must divide"):
        Topology.from_launcher(4, _placements(2, 2), ranks_per_node=3)


def test_inner_ring_of_a_unit_is_its_ranks_on_one_node():
    from sparsebalance.train.multinode import Topology

    topo = Topology(8, 4)
    assert topo.inner_size(range(8)) == 4  # two whole nodes: hierarchical, inner = a node
    assert topo.inner_size([4, 5]) == 2  # inside one node: a flat ring
    assert topo.inner_size([2, 3, 4, 5]) == 2  # two halves of two nodes
    with pytest.raises(ValueError, match="unevenly"):
        topo.inner_size([1, 2, 3, 4])


def test_node_local_caches_are_written_by_one_rank_per_node():
    """4 ranks (threads) on 2 nodes of 2; node 1 cannot see node 0's cache: rank 0 resolves
    for node 0, rank 2 (node 1's LOCAL_RANK 0) for node 1, ranks 1 and 3 write nothing."""
    import threading

    from sparsebalance.train.multinode import node_leaders, resolve_on_nodes

    world, barrier, lock = 4, threading.Barrier(4), threading.Lock()
    slots: list = [None] * world
    calls: list[int] = []
    results: dict[int, str] = {}
    leaders = node_leaders(_placements(2, 2))
    assert leaders == [0, 0, 2, 2]

    def gather(rank):
        def all_gather(obj):
            barrier.wait()
            slots[rank] = obj
            barrier.wait()
            out = list(slots)
            barrier.wait()
            return out

        return all_gather

    def run(rank, visible):
        def resolve():
            with lock:
                calls.append(rank)
            return f"cache-of-node-{rank // 2}"

        results[rank] = resolve_on_nodes(resolve, lambda s: visible, rank, leaders, gather(rank))

    for node1_sees_node0 in (True, False):
        calls.clear()
        threads = [threading.Thread(target=run, args=(r, r < 2 or node1_sees_node0)) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        if node1_sees_node0:
            assert calls == [0] and set(results.values()) == {"cache-of-node-0"}
        else:
            assert sorted(calls) == [0, 2]
            assert [results[r] for r in range(world)] == ["cache-of-node-0"] * 2 + ["cache-of-node-1"] * 2
    # without launcher variables every rank is its own machine's writer (today's behaviour)
    assert node_leaders([{}, {}]) == [0, 1]


@pytest.mark.filterwarnings("ignore::sparsebalance.latency.ProfileMismatchWarning")
def test_trainer_takes_ranks_per_node(tmp_path):
    import torch

    from sparsebalance.engine.runtime import Runtime
    from sparsebalance.train import Trainer
    from tests.train.harness import base_config

    cfg = base_config(tmp_path, steps=1, emulate_ranks=4, ranks_per_node=2)
    trainer = Trainer(cfg, Runtime(0, 1, torch.device("cpu")))
    assert trainer.topology.describe() == {
        "world_size": 4,
        "nodes": 2,
        "ranks_per_node": 2,
        "source": "--ranks-per-node",
    }
    assert trainer.engine.config.ranks_per_node == 2  # what the planner's PlanConfig gets
    with pytest.raises(ValueError, match=r"TrainConfig.ranks_per_node \(--ranks-per-node\) must be"):
        base_config(tmp_path, ranks_per_node=0)


def test_launcher_refuses_ranks_per_node_that_does_not_divide_the_ranks(tmp_path, capsys):
    rc = cli_main(
        [
            "train",
            "--nproc",
            "4",
            "--ranks-per-node",
            "3",
            "--num-builtin",
            "8",
            "--max-len",
            "256",
            "--global-batch",
            "4",
            "--out",
            str(tmp_path / "bad"),
        ]
    )
    assert rc == 2
    assert "--ranks-per-node (3) must divide the world size (4)" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()
