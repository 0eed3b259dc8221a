"""Interleaved 1F1B in the trainer (``--pp-virtual V``, issue 54): two stages holding two
non-adjacent chunks each compute what one process computes; the stage holds its chunks' layers
only; what interleaving cannot run is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sparsebalance.train import TrainConfig
from sparsebalance.train.checkpoint import load_weights
from sparsebalance.tuning import DSTConfig
from tests.train.harness import base_config, matches_one_process, rewind, run_ranks

OFF = DSTConfig(mode="off", budget="gamma", gamma0=0.9)


def _cfg(tmp: Path, **over) -> TrainConfig:
    return base_config(tmp, **{"steps": 3, "strategy": "sab", "dst": OFF, **over})


def _model(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_weights(run / "checkpoints" / f"step-{step:06d}")  # the stages' files merged


@pytest.mark.distributed
def test_two_stages_of_two_chunks_compute_what_one_process_computes(tmp_path):
    """Issue 54's target: PP2 V2 (gloo, fp32, deterministic, DST off) gives PP1's per-step
    losses within 1e-5 and the same weights; the checkpoint records the four virtual stages."""
    _, two, _ = matches_one_process(tmp_path, "pp2v2", _cfg, pp=2, pp_virtual=2, checkpoint_every=3)
    state = torch.load(two / "run" / "checkpoints" / "step-000003" / "state.pt", weights_only=False)
    assert state["pipeline"] == {"stages": 2, "layers": [1, 1, 1, 1]}  # the tiny model's 4 layers, 4 virtual stages
    lines = [json.loads(x) for x in (two / "run" / "metrics.jsonl").read_text().splitlines()]
    for x in (x for x in lines if x["rank"] != "all"):
        assert [s["stage"] for s in x["stages"]] == [0, 1]
        assert [s["chunks"] for s in x["stages"]] == [2, 2]  # the report names the interleaved schedule
        for unit in x["units"]:  # one [forward, backward] per rank: its two chunks summed
            assert len(unit["stage_s"]) == 2 and all(f > 0 and b > 0 for f, b in unit["stage_s"])


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(
    "parallel, strategy, capacity", [("ddp", "sab", 512), ("fsdp2", "sab", 512), ("fsdp2", "lbb", 4096)]
)
def test_two_interleaved_pipelines_match_two_ranks(tmp_path, parallel, strategy, capacity):
    """DP2 x PP2 V2 (4 processes) computes what DP2 does: each stage's gradients reduced from each
    chunk's last backward (a rank's last backward covers one of its chunks), averaged over its peer
    (``ddp``) or reduce-scattered to its shards (``fsdp2``: the checkpoint gathers them). LBB's one
    bucket of 4,096 tokens leaves pipeline 1 without micro-batches: it joins its peer's reductions."""
    dp, both = tmp_path / "dp2", tmp_path / "dp2pp2v2"
    dp.mkdir(), both.mkdir()
    ref = run_ranks(_cfg(dp, strategy=strategy, capacity=capacity), 2, dp)
    cfg = _cfg(both, pp=2, pp_virtual=2, parallel=parallel, strategy=strategy, capacity=capacity, checkpoint_every=3)
    got = run_ranks(cfg, 4, both)
    assert got[0]["losses"] == pytest.approx(ref[0]["losses"], rel=1e-5, abs=1e-5)
    for name, tensor in _model(dp / "run", 3).items():
        torch.testing.assert_close(_model(both / "run", 3)[name], tensor, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.slow  # default tier time (~10 min on 2 cores): its correctness is CI's slow tier
@pytest.mark.distributed
def test_an_interleaved_pipeline_with_dst_resumes_exactly(tmp_path):
    """DST on (per-layer budgets, one attention context per chunk): a resume from step 2 gives
    the uninterrupted run's losses."""
    from dataclasses import replace

    cfg = _cfg(tmp_path, pp=2, pp_virtual=2, steps=4, checkpoint_every=2, dst=DSTConfig(mode="bidirectional"))
    full = run_ranks(cfg, 2, tmp_path)
    again = tmp_path / "again"
    run = rewind(tmp_path / "run", again, step=2, drop=4)
    resumed = run_ranks(replace(cfg, out=str(run), resume=True), 2, again)
    assert resumed[0]["losses"] == pytest.approx(full[0]["losses"][2:], rel=1e-6, abs=1e-6)


def test_layer_statistics_go_back_to_model_order():
    """Each stage reports its chunks' layers in turn; the pipeline's record lists them in model
    order (virtual stage k is chunk k // P of stage k % P)."""
    from sparsebalance.engine.pipeline import _model_order

    assert _model_order([("L0", "L2"), ("L1", "L3")], (1, 1, 1, 1), 2) == ("L0", "L1", "L2", "L3")
    stages = [("L0", "L1", "L3"), ("L2", "L4", "L5", "L6")]  # split 2/1/1/3 over P = 2, V = 2
    assert _model_order(stages, (2, 1, 1, 3), 2) == tuple(f"L{i}" for i in range(7))
    assert _model_order([("L0", "L1", "L2"), ("L3",)], (3, 1), 1) == ("L0", "L1", "L2", "L3")


def test_a_rank_holds_its_chunks_only():
    from sparsebalance.engine.stage import PipelineLayout, StageModel
    from sparsebalance.models.hf import build_model

    layouts = [PipelineLayout.of(r, 2, 2, (1, 1, 1, 1), virtual=2) for r in range(2)]
    assert [lay.chunks(4) for lay in layouts] == [[range(0, 1), range(2, 3)], [range(1, 2), range(3, 4)]]
    assert layouts[1].peer(0, 1) == (0, 1) and layouts[0].peer(1, -1) == (
        1,
        0,
    )  # rank 1's chunk 0 feeds rank 0's chunk 1
    stages = [StageModel(build_model("tiny", "cpu", torch.float32, seed=0), lay) for lay in layouts]
    held = [sorted({int(n.split(".")[2]) for n in st.names if n.startswith("model.layers.")}) for st in stages]
    assert held == [[0, 2], [1, 3]]
    assert stages[0].rank_split == (2, 2)
    with pytest.raises(ValueError, match="8 virtual stages, more than the model's 4 layers"):
        PipelineLayout.of(0, 2, 2, virtual=4).chunks(4)
    for st in stages:  # the chunks' parameters, which each chunk's last backward reduces: all, once
        chunks = [{id(p) for p in st.chunk_parameters(c)} for c in range(2)]
        assert not chunks[0] & chunks[1] and chunks[0] | chunks[1] == {id(p) for p in st.parameters_owned()}
    embed = stages[0].decoder.embed_tokens.weight
    assert any(p is embed for p in stages[0].chunk_parameters(0))  # virtual stage 0
    assert any(p is stages[1].decoder.norm.weight for p in stages[1].chunk_parameters(1))  # the last


def test_chunk_by_chunk_is_the_whole_model():
    """Running rank 0's chunk 0, rank 1's chunk 0, rank 0's chunk 1, rank 1's chunk 1 in turn (the
    path a micro-batch takes) gives the whole model's hidden states, bit for bit (fp32, CPU)."""
    import numpy as np

    from sparsebalance.data import pack
    from sparsebalance.engine.layers import packed_attention
    from sparsebalance.engine.stage import PipelineLayout, StageModel
    from sparsebalance.models.hf import build_model
    from sparsebalance.ops import Budget

    whole = build_model("tiny", "cpu", torch.float32, seed=0)
    stages = [
        StageModel(build_model("tiny", "cpu", torch.float32, seed=0), PipelineLayout.of(r, 2, 2, (1, 1, 1, 1), 2))
        for r in range(2)
    ]
    batch = pack([np.arange(1, 70) % 97, np.arange(3, 40) % 97], torch.device("cpu"), False)

    def ctx():
        return packed_attention(batch.cu_seqlens, batch.lengths, Budget(gamma=1.0), block_size=32, backend="torch")

    x = batch.input_ids
    for c in range(2):
        for s in range(2):
            x = stages[s](x, batch.position_ids, ctx(), c)
    single = StageModel(whole, PipelineLayout.of(0, 1, 1))
    torch.testing.assert_close(x, single(batch.input_ids, batch.position_ids, ctx()), rtol=0, atol=0)


@pytest.mark.parametrize(
    "over, says",
    [
        ({"pp_virtual": 0}, "--pp-virtual must be >= 1, got 0"),
        ({"pp_virtual": 2}, "--pp-virtual 2 needs a pipeline: give --pp >= 2"),
        (
            {"pp": 2, "pp_virtual": 2, "micro_batches": 1, "capacity": None},
            "--pp-virtual 2 needs --micro-batches >= --pp (2) as Megatron's interleaved schedule does, got 1",
        ),
        (  # interleaved zero bubble is not built, with FSDP2 or not
            {"pp": 2, "pp_virtual": 2, "parallel": "fsdp2", "pp_schedule": "zb-h1"},
            "--pp-schedule zb-h1 cannot run with --pp-virtual 2 (interleaved zero bubble is not built)",
        ),
    ],
)
def test_what_interleaving_cannot_run_is_one_line(tmp_path, over, says):
    from sparsebalance.flags import command_line

    with command_line(), pytest.raises(ValueError) as err:
        _cfg(tmp_path, **over)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_interleaving_runs_with_fsdp2(tmp_path):
    """``--pp-virtual`` with ``--parallel fsdp2`` (refused before each chunk's units reduce-scattered
    in its own last backward): accepted, reducing once a step as every FSDP2 pipeline does."""
    from sparsebalance.flags import command_line

    with command_line():
        cfg = _cfg(tmp_path, pp=2, pp_virtual=2, parallel="fsdp2")
    assert (cfg.pp_virtual, cfg.parallel, cfg.fsdp_gradient_sync) == (2, "fsdp2", "step")


def test_the_launcher_refuses_more_virtual_stages_than_layers(tmp_path):
    from sparsebalance.train.launch import preflight

    with pytest.raises(ValueError, match=r"--pp 2 x 3 = 6 virtual stages, more than the model's 4 layers"):
        preflight(_cfg(tmp_path, pp=2, pp_virtual=3), 2)


def test_capacity_auto_counts_the_chunks_in_flight(tmp_path):
    """``--capacity auto`` with ``--pp-virtual 2``: each rank's memory config keeps the
    activations interleaving holds (``held_stages``), more than plain 1F1B's ``P - s``, so the
    capacity it sizes is no larger."""
    from types import SimpleNamespace

    from sparsebalance.batching.interleaved import held_stages
    from sparsebalance.engine.stage import PipelineLayout
    from sparsebalance.latency.memory import MemoryModel, cpu_coefficients
    from sparsebalance.models import load_shapes
    from sparsebalance.train.build import _memory_config

    split = (1, 1, 1, 1)  # the tiny model's 4 layers, one per virtual stage
    cfg = _cfg(tmp_path, pp=2, pp_virtual=2, capacity="auto", memory_budget="1GiB", global_batch=8)
    plain_cfg = _cfg(tmp_path, pp=2, capacity="auto", memory_budget="1GiB", global_batch=8)
    mem = MemoryModel(load_shapes("tiny"), cpu_coefficients(0.0), True)
    for s in range(2):
        layout = PipelineLayout.of(s, 2, 2, split, 2)
        stage = SimpleNamespace(split=split, rank_split=(2, 2), layout=layout)
        interleaved = _memory_config(cfg, 2, stage)
        plain = _memory_config(
            plain_cfg, 2, SimpleNamespace(split=(2, 2), rank_split=(2, 2), layout=PipelineLayout.of(s, 2, 2, (2, 2)))
        )
        assert interleaved.stage.in_flight == held_stages(split, 2, s, range(1, 9)) > plain.stage.in_flight == 2 - s
        assert mem.max_tokens(2**30, interleaved) <= mem.max_tokens(2**30, plain)
