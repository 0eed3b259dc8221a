"""Pipeline parallelism (``--pp``, issue 44) on real gloo processes: a pipeline of 2 stages
computes what one process computes (losses, gradients, weights), keeps one record per pipeline
with per-stage bubbles, saves ordinary checkpoints and resumes exactly; what it cannot run is
refused in one line."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from sparsebalance.batching.zero_bubble import WEIGHT_SHARE
from sparsebalance.engine.runtime import Runtime
from sparsebalance.launches import LaunchCounter
from sparsebalance.train import TrainConfig, Trainer
from sparsebalance.train.checkpoint import load_weights
from sparsebalance.tuning import DSTConfig
from tests.train.harness import base_config, matches_one_process, rewind, run_ranks, run_trainers

OFF = DSTConfig(mode="off", budget="gamma", gamma0=0.9)


def _cfg(tmp: Path, **over) -> TrainConfig:
    return base_config(tmp, **{"steps": 3, "strategy": "sab", "dst": OFF, **over})


def _model(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_weights(run / "checkpoints" / f"step-{step:06d}")  # the stages' files merged


def _resumed(cfg: TrainConfig, world: int, run: Path, tmp: Path, step: int, last: int) -> list[dict]:
    """``cfg`` resumed on ``world`` processes from a copy of ``run``'s checkpoints up to ``step``
    (``last``, the final one, removed) in ``tmp``; checks the final weights equal ``run``'s."""
    rewind(run, tmp, step, last)
    resumed = run_ranks(replace(cfg, out=str(tmp / "run"), resume=True), world, tmp)
    for name, tensor in _model(run, last).items():
        torch.testing.assert_close(_model(tmp / "run", last)[name], tensor, rtol=1e-6, atol=1e-7, msg=name)
    return resumed


def _lines(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.distributed
def test_two_stages_compute_what_one_process_computes(tmp_path):
    """Issue 44's correctness target: PP2 (gloo, fp32, deterministic) gives PP1's per-step
    losses within 1e-5 and the same weights; the checkpoint is the whole model's."""
    one, two, _ = matches_one_process(tmp_path, "pp2", _cfg, pp=2)
    per_pipeline = [x for x in _lines(two / "run") if x["rank"] != "all"]
    assert [x["step"] for x in per_pipeline] == [1, 2, 3]  # one record per pipeline, not per stage
    for x in per_pipeline:
        assert [s["stage"] for s in x["stages"]] == [0, 1]
        assert all(s["busy_s"] > 0 and s["idle_s"] >= 0 for s in x["stages"])
        assert len(x["units"]) >= 1 and x["compute_s"] > 0
        for unit in x["units"]:  # each stage's [forward, backward] seconds: the stages' closed loop
            assert len(unit["stage_s"]) == 2 and all(f > 0 and b > 0 for f, b in unit["stage_s"])
            assert sum(f + b for f, b in unit["stage_s"]) == pytest.approx(unit["seconds"], rel=1e-9)
    assert all(x["stages"] == [] for x in _lines(one / "run") if x["rank"] != "all")
    assert all("stage_s" not in u for x in _lines(one / "run") if x["rank"] != "all" for u in x["units"])


def _grads_body(trainer: Trainer, rank: int) -> dict:
    tuned = trainer.engine.begin(trainer.next_batch())
    executor, reads, wire = trainer.runner.executor, [], []
    if trainer.stage is not None:  # count what the 1F1B schedule reads back from the device
        schedule = executor._schedule
        groups = {id(executor.groups.activations): "activations", id(executor.groups.gradients): "gradients"}
        groups[id(executor.groups.tied)] = "tied"
        send, recv = dist.isend, dist.recv

        def watched(op, fn):  # which group carries each send and receive, and to or from whom
            def call(tensor, peer, group=None, **kw):
                wire.append((op, peer - rank, groups.get(id(group), "other")))
                return fn(tensor, peer, group=group, **kw)

            return call

        dist.isend, dist.recv = watched("send", send), watched("recv", recv)

        def counted(step):
            with LaunchCounter(trace=True) as count:
                out = schedule(step)
            # the CPU kernel's own reads (ops/block_sparse_torch.py: not the CUDA path) aside
            reads.append(sorted({s for s in count.read_sites if not s.startswith("ops/block_sparse_torch.py")}))
            return out

        executor._schedule = counted
    trainer.runner.synchronize(trainer.runner.execute(tuned))
    entries = trainer.model.state_dict(keep_vars=True)  # a tied weight under both its names
    names = trainer.stage.names if trainer.stage is not None else list(entries)
    result = {n: entries[n].grad.clone() for n in names if entries[n].grad is not None}
    result[f"reads-{rank}"] = reads
    result[f"wire-{rank}"] = sorted(set(wire))
    if trainer.stage is not None:  # the split the stage runs, and the one the planner and DST price
        result[f"split-{rank}"] = (
            trainer.stage.span,
            trainer.stage.layout.split,
            trainer.engine.config.stage_layers,
        )
    return result


def _grads(cfg: TrainConfig, world: int, tmp: Path) -> dict[str, torch.Tensor]:
    merged = {}
    for res in run_trainers(_grads_body, cfg, world, tmp, "grads"):
        merged.update(res)
    return merged


def _reads(grads: dict, prefix: str = "reads-") -> dict:
    return {k: grads.pop(k) for k in [k for k in grads if k.startswith(prefix)]}


@pytest.mark.distributed
def test_two_stages_give_one_processs_gradients(tmp_path):
    """The same gradients within 1e-5 relative, the tied embedding's two parts summed; and the
    1F1B schedule reads nothing back from the device (issue 44: at most one host synchronisation
    per micro-batch boundary beyond the sends and receives; the losses and layer statistics are
    read after the step's one synchronize)."""
    one, two = tmp_path / "pp1", tmp_path / "pp2"
    one.mkdir(), two.mkdir()
    want = _grads(_cfg(one), 1, one)
    have = _grads(_cfg(two, pp=2), 2, two)
    _reads(want), _reads(want, "wire-")
    assert _reads(have) == {"reads-0": [[]], "reads-1": [[]]}
    # one direction per group (NCCL orders a pair's sends and receives of one group on one stream)
    assert _reads(have, "wire-") == {
        "wire-0": [("recv", 1, "gradients"), ("send", 1, "activations")],
        # and, after the schedule, the tied embedding's rows the first stage sends back (issue 54)
        "wire-1": [("recv", -1, "activations"), ("recv", -1, "tied"), ("send", -1, "gradients")],
    }
    # the tiny model's head weighs ~1.33 layers: 3 + 1 layers, run and priced alike on both stages
    assert _reads(have, "split-") == {
        "split-0": (range(0, 3), (3, 1), (3, 1)),
        "split-1": (range(3, 4), (3, 1), (3, 1)),
    }
    assert sorted(have) == sorted(want)
    for name, grad in want.items():
        torch.testing.assert_close(have[name], grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.distributed
def test_a_pipeline_resumes_exactly(tmp_path):
    """With --plan-ahead on (what a CUDA run resolves): each step plans the next one between its
    schedule and its wait, on both stages; the checkpoint re-plans step 3 on resume."""
    dst = DSTConfig(mode="bidirectional", budget="gamma")
    cfg = _cfg(tmp_path, pp=2, steps=4, checkpoint_every=2, dst=dst, plan_ahead="on")
    full = run_ranks(cfg, 2, tmp_path)
    state = torch.load(tmp_path / "run" / "checkpoints" / "step-000002" / "state.pt", weights_only=False)
    assert state["pipeline"] == {"stages": 2, "layers": [3, 1]}  # another split reshards on resume
    assert state["trainer"]["ahead"] is not None  # step 3 was planned during step 2
    summaries = [x for x in _lines(tmp_path / "run") if x["rank"] == "all"]
    assert [x["planned_ahead"] for x in summaries] == [False, True, True, True]
    # the stages' learned pricing is saved (--deterministic: no timing enters it, the identity)
    want = {"ratio": 2.0, "scales": [1.0, 1.0], "weight_share": WEIGHT_SHARE, "steps": 0}
    assert state["trainer"]["stage_calibration"] == want
    resumed = _resumed(cfg, 2, tmp_path / "run", tmp_path / "again", 2, 4)
    assert resumed[0]["losses"] == pytest.approx(full[0]["losses"][2:], rel=1e-6, abs=1e-6)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp2"])
def test_two_pipelines_of_two_stages_match_two_ranks(tmp_path, parallel):
    """DP2 x PP2 (4 processes) computes what DP2 (2 processes) does, each stage averaged over its
    peer (``ddp``) or sharded over it (``fsdp2``: the checkpoint gathers the shards)."""
    dp, both = tmp_path / "dp2", tmp_path / "dp2pp2"
    dp.mkdir(), both.mkdir()
    ref = run_ranks(_cfg(dp), 2, dp)
    cfg = _cfg(both, pp=2, parallel=parallel, checkpoint_every=2)
    got = run_ranks(cfg, 4, both)
    assert got[0]["losses"] == pytest.approx(ref[0]["losses"], rel=1e-5, abs=1e-5)
    for name, tensor in _model(dp / "run", 3).items():
        torch.testing.assert_close(_model(both / "run", 3)[name], tensor, rtol=1e-5, atol=1e-5, msg=name)
    per_pipeline = [x for x in _lines(both / "run") if x["rank"] != "all"]
    assert sorted({x["rank"] for x in per_pipeline}) == [0, 1]
    if parallel == "fsdp2":  # and it resumes exactly from its own checkpoint
        resumed = _resumed(cfg, 4, both / "run", tmp_path / "again", 2, 3)
        assert resumed[0]["losses"] == pytest.approx(got[0]["losses"][2:], rel=1e-6, abs=1e-6)


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["full", pytest.param("selective", marks=pytest.mark.slow)])
def test_a_pipeline_with_activation_checkpointing_computes_the_same(tmp_path, mode):
    """``--activation-checkpointing`` with ``--pp``: a stage's layers rerun in their backward,
    which 1F1B runs after later micro-batches' forwards; each rerun takes its own micro-batch's
    layouts, so PP2 with checkpointing gives PP1's losses (DST on: budgets vary per micro-batch)."""
    dst = DSTConfig(mode="bidirectional", budget="gamma")
    one, two = tmp_path / "pp1", tmp_path / "pp2"
    one.mkdir(), two.mkdir()
    ref = run_ranks(_cfg(one, dst=dst), 1, one)
    got = run_ranks(_cfg(two, pp=2, activation_checkpointing=mode, dst=dst), 2, two)
    assert got[0]["losses"] == pytest.approx(ref[0]["losses"], rel=1e-5, abs=1e-5)


def _collectives_body(trainer: Trainer, rank: int) -> dict:
    counts = {"all_gather_single": 0, "reduce_scatter_single": 0}
    originals = {name: getattr(dist, name) for name in counts}
    executor, inside = trainer.runner.executor, [False, dict.fromkeys(counts, 0)]  # in the schedule; its calls
    schedule = executor._schedule

    def timed(step):
        inside[0] = True
        try:
            return schedule(step)
        finally:
            inside[0] = False

    def counting(name):
        def call(*args, **kwargs):
            counts[name] += 1
            inside[1][name] += inside[0]
            return originals[name](*args, **kwargs)

        return call

    executor._schedule = timed
    for name in counts:  # what FSDP2 calls (torch.distributed's, looked up at each call)
        setattr(dist, name, counting(name))
    micro = [[len(r.microbatches) for r in trainer.run_step().records] for _ in range(trainer.cfg.steps)]
    for name, fn in originals.items():
        setattr(dist, name, fn)
    units = len(trainer.stage.layers) + 1  # a unit per decoder layer, and the stage itself
    result = {"counts": counts, "units": units, "micro": micro, "dp": trainer.stage.layout.dp, "in": inside[1]}
    result["sharded"] = all(isinstance(p, DTensor) for p in trainer.stage.parameters_owned())
    return result


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("strategy, capacity", [("sequential", 300), ("lbb", 4096)])
def test_fsdp2_stages_gather_and_reduce_once_per_step(tmp_path, strategy, capacity):
    """``--parallel fsdp2`` with ``--pp``: every parameter is a shard, and each FSDP unit of a stage
    all-gathers once and reduce-scatters once per step (not once per micro-batch), so pipelines
    with different micro-batch counts stay in step, a pipeline without any included. The
    all-gathers run before the schedule; the reduce-scatters inside the stage's last backward
    (issue 54: no pass after it), except on a pipeline without micro-batches, which joins its
    peers after its (empty) schedule."""
    cfg = _cfg(tmp_path, pp=2, parallel="fsdp2", steps=3, capacity=capacity, strategy=strategy)
    results = run_trainers(_collectives_body, cfg, 4, tmp_path, "collectives")
    for r in results:
        assert r["sharded"] and r["in"]["all_gather_single"] == 0
        assert r["counts"] == {"all_gather_single": 3 * r["units"], "reduce_scatter_single": 3 * r["units"]}
        busy = sum(1 for counts in r["micro"] if counts[r["dp"]] > 0)  # steps this pipeline ran
        assert r["in"]["reduce_scatter_single"] == busy * r["units"]
    assert [r["units"] for r in results] == [4, 2, 4, 2]  # the tiny model's 3/1 split, plus each root
    # plans without the latency model: dataset order at 300 tokens has steps where one pipeline
    # has more micro-batches than the other; LBB's one bucket of 4,096 leaves pipeline 1 empty
    if strategy == "sequential":
        assert any(len(set(counts)) > 1 for counts in results[0]["micro"])
    else:
        assert all(counts[1] == 0 for counts in results[0]["micro"])


def _capacity_body(trainer: Trainer, rank: int) -> dict:
    """``--capacity auto`` on this rank's stage: the chosen capacity and bound, what this rank's
    own stage would allow with the chosen coefficients, and the step's micro-batch sizes."""
    from sparsebalance.latency.memory import MemoryModel, StageShare
    from sparsebalance.latency.memory_bound import auto_capacity

    bound = trainer.memory_bound
    own = replace(bound.config, stage=StageShare.of(trainer.stage.split, trainer.stage.layout.stage))
    model = MemoryModel(bound.model.shapes, bound.model.c, trainer.stage.tied)
    mine = auto_capacity(model, bound.budget_bytes, own)
    result = trainer.run()
    return {"capacity": trainer.cfg.capacity, "bound": bound.config, "mine": mine, "result": result}


@pytest.mark.distributed
@pytest.mark.parametrize("parallel, world", [("ddp", 2), pytest.param("fsdp2", 4, marks=pytest.mark.slow)])
def test_capacity_auto_fits_every_stage(tmp_path, capfd, parallel, world):
    """``--pp 2 --capacity auto``: each rank prices its own stage (its layers, embedding or head,
    and the micro-batches 1F1B keeps in flight on it; under FSDP2 its shards over the other
    pipeline), every rank plans with the tightest stage's capacity, the line printed names that
    stage, and the run trains."""
    from sparsebalance.latency.host_memory import current_rss_bytes
    from sparsebalance.latency.memory import StageShare

    budget = str(current_rss_bytes() + 2**30)  # the workers' base is their own resident size
    cfg = _cfg(tmp_path, pp=2, steps=1, capacity="auto", memory_budget=budget, parallel=parallel, global_batch=4)
    results = run_trainers(_capacity_body, cfg, world, tmp_path)
    cap, bound = results[0]["capacity"], results[0]["bound"]
    assert all(r["capacity"] == cap and r["bound"] == bound for r in results)
    assert cap == min(r["mine"] for r in results) and bound.micro_batches == 2
    assert bound.shard == (2 if parallel == "fsdp2" else 1)
    assert bound.stage in (StageShare(3, True, False, 2), StageShare(1, False, True, 1))  # the tiny model's 3/1 split
    assert results[0]["result"]["steps"] == 1
    binding = min(range(world), key=lambda r: results[r]["mine"]) % 2  # rank r runs stage r % 2
    said = f"on stage {binding} of 2, {bound.stage.in_flight} micro-batches in flight"
    assert f"--capacity auto = {cap} tokens per micro-batch" in (err := capfd.readouterr().err) and said in err


@pytest.mark.parametrize(
    "overlong, global_batch, world, in_flight, micro_batches",
    [
        ("split", 1, 2, 2, 2),  # one document, split into pieces: as many micro-batches as pieces
        ("truncate", 1, 2, 1, 1),  # one document, never split: one micro-batch
        ("skip", 3, 4, 2, 2),  # SAB may give one pipeline all three
        ("truncate", 2, 4, 2, 2),  # or both documents, to shorten its bubbles
    ],
)
def test_the_memory_bound_counts_the_micro_batches_a_step_can_run(
    tmp_path, overlong, global_batch, world, in_flight, micro_batches
):
    """``--capacity auto``'s memory config: the first of two stages keeps up to 2 micro-batches in
    flight and a later one holds earlier gradients, unless the step cannot give it that many: a
    pipeline's micro-batches are bounded by its documents only when no document is split."""
    from types import SimpleNamespace

    from sparsebalance.engine.stage import PipelineLayout
    from sparsebalance.train.build import _memory_config

    cfg = _cfg(tmp_path, pp=2, overlong=overlong, global_batch=global_batch)
    stage = SimpleNamespace(split=(3, 1), rank_split=(3, 1), layout=PipelineLayout.of(0, world, 2, (3, 1)))
    mem = _memory_config(cfg, world, stage)
    assert (mem.stage.in_flight, mem.micro_batches) == (in_flight, micro_batches)
    plain = _memory_config(replace(cfg, pp=1), world // 2, None)  # as many ranks
    assert plain.micro_batches == micro_batches and plain.ddp == (world > 2) and not mem.ddp


@pytest.mark.parametrize(
    "over, says",
    [
        ({"pp": 0}, "--pp must be >= 1, got 0"),
        ({"pp": 2, "strategy": "sab-cp"}, "--strategy sab-cp cannot run with --pp 2: use --strategy sab"),
        ({"pp": 2, "measure_bubble": "exact"}, "cannot run with --pp 2: use --measure-bubble overlap"),
        ({"pp": 2, "precision": "fp16"}, "--precision fp16 cannot run with --pp 2: use --precision bf16"),
        ({"pp": 2, "emulate_ranks": 4}, "--emulate-ranks cannot run with --pp 2"),
    ],
)
def test_what_a_pipeline_cannot_run_is_one_line(tmp_path, over, says):
    from sparsebalance.flags import command_line

    with command_line(), pytest.raises(ValueError) as err:  # as `sparsebalance train` says it
        _cfg(tmp_path, **over)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_more_stages_than_layers_and_a_world_they_do_not_divide_are_refused(tmp_path):
    from sparsebalance.engine.stage import PipelineLayout, check_pipeline_model
    from sparsebalance.models.hf import build_model

    model = build_model("tiny", "cpu", torch.float32, seed=0)  # 4 layers
    with pytest.raises(ValueError, match="--pp 5: more pipeline stages than the model's 4 layers"):
        check_pipeline_model(model.config, 5)
    with pytest.raises(ValueError, match=r"--pp 2 must divide the number of processes \(3\)"):
        PipelineLayout.of(0, 3, 2)
    assert [PipelineLayout.of(r, 4, 2).layers(4) for r in range(4)] == [range(0, 2), range(2, 4)] * 2  # no split: even
    assert [PipelineLayout.of(r, 4, 2, (3, 1)).layers(4) for r in range(4)] == [range(0, 3), range(3, 4)] * 2
    with pytest.raises(ValueError, match=r"a split of 3 stages"):
        PipelineLayout.of(0, 4, 2, (2, 1, 1))
    with pytest.raises(ValueError, match=r"summing to the model's 4 layers"):
        PipelineLayout.of(0, 4, 2, (3, 2)).layers(4)


def test_the_trainers_stages_split_the_layers_by_cost(tmp_path):
    """``build.pipeline_stage``: the tiny model's LM head (H x V = 1.33 layers of FLOPs) puts 3
    layers on the first stage and 1 beside the head (max stage cost 3, not 2 + 1.33); the stages
    hold every layer once."""
    from sparsebalance.models.hf import build_model
    from sparsebalance.train import build

    cfg = _cfg(tmp_path, pp=2)
    stages = []
    for rank in range(2):
        model = build_model("tiny", "cpu", torch.float32, seed=0)
        stages.append(build.pipeline_stage(cfg, Runtime(rank, 2, torch.device("cpu")), model))
    assert [s.layout.split for s in stages] == [(3, 1), (3, 1)]
    assert [s.span for s in stages] == [range(0, 3), range(3, 4)]
    assert sorted(n for s in stages for n in s.names if ".layers." in n) == sorted(
        n for n in build_model("tiny", "cpu", torch.float32, seed=0).state_dict() if ".layers." in n
    )


def test_only_the_stage_reaches_the_device(tmp_path):
    """``--pp``: the model is built on ``meta`` (issue 54: no storage for any of it) and only this
    rank's stage gets storage and moves to the device (a model whose weights do not fit one
    device still starts). The meta device stands in for a GPU: every stage parameter lands there."""
    from sparsebalance.train import build

    cfg = _cfg(tmp_path, pp=2)
    meta = torch.device("meta")
    for rank, layers in ((0, 3), (1, 1)):
        model = build.checked_model(cfg, meta, "--model tiny")
        assert {p.device.type for p in model.parameters()} == {"meta"} and len(model.get_decoder().layers) == 4
        stage = build.pipeline_stage(cfg, Runtime(rank, 2, meta), model)
        assert {p.device.type for p in stage.parameters()} == {"meta"} and len(stage.layers) == layers
    whole = build.checked_model(replace(cfg, pp=1), meta, "--model tiny")  # no pipeline: built there
    assert {p.device.type for p in whole.parameters()} == {"meta"}


def test_resuming_with_another_pp_is_the_same_run(tmp_path):
    """Issue 54: another --pp is resharded on resume (tests/train/test_reshard.py), not another run."""
    from sparsebalance.train.config_io import to_dict
    from sparsebalance.train.resume import differences

    saved = to_dict(_cfg(tmp_path, pp=2))
    assert differences(saved, _cfg(tmp_path)) == []
    assert differences(saved, _cfg(tmp_path, seed=1)) == ["--seed 0 -> 1"]


def test_the_launcher_refuses_a_grid_before_any_process_starts(tmp_path):
    """``--nproc`` not a multiple of ``--pp``, or more stages than layers: one line from the
    launcher's preflight, before anything is profiled or launched."""
    from sparsebalance.train.launch import default_nproc, preflight

    with pytest.raises(ValueError, match=r"^--pp 2 must divide --nproc 3: the processes are DP x PP$"):
        preflight(_cfg(tmp_path, pp=2), 3)
    with pytest.raises(ValueError, match="--pp 8: more pipeline stages than the model's 4 layers"):
        preflight(_cfg(tmp_path, pp=8), 8)
    fsdp2 = _cfg(tmp_path, pp=2, parallel="fsdp2")
    with pytest.raises(
        ValueError, match=r"^--parallel fsdp2 with --pp 2 shards each stage .* use --nproc 4 \(or more\)"
    ):
        preflight(fsdp2, 2)
    # without --nproc on a CPU: one pipeline when the default count is not a multiple of --pp,
    # two with FSDP2 (its shards need data-parallel peers)
    assert default_nproc(_cfg(tmp_path, pp=3), None) == 3
    assert default_nproc(_cfg(tmp_path, pp=2), None) == 2
    assert default_nproc(fsdp2, None) == 4


def test_resuming_a_checkpoint_of_another_split_is_one_line(tmp_path):
    """A pipeline checkpoint records its split; another split (its optimizer states are per stage)
    is refused by rank 0 and said by every rank, before any state is loaded."""
    from sparsebalance.engine.stage import PipelineLayout, StageModel
    from sparsebalance.models.hf import build_model
    from sparsebalance.train.pipeline_checkpoint import _read

    stage = StageModel(build_model("tiny", "cpu", torch.float32, seed=0), PipelineLayout.of(0, 2, 2, (3, 1)))
    torch.save({}, tmp_path / "model.pt")
    torch.save({"pipeline": {"stages": 2, "layers": [2, 2]}}, tmp_path / "state.pt")
    model_sd, state, error = _read(tmp_path, stage)
    assert model_sd is None and state is None
    assert error.startswith(
        f"--resume: {tmp_path} split the layers [2, 2] over its stages, this version splits them [3, 1]"
    )
    torch.save({"pipeline": {"stages": 4}}, tmp_path / "state.pt")
    assert _read(tmp_path, stage)[2] == f"--resume: {tmp_path} was saved with --pp 4; resume it with --pp 4"
    torch.save({"pipeline": {"stages": 2, "layers": [3, 1]}}, tmp_path / "state.pt")
    assert _read(tmp_path, stage)[2] is None


def test_a_pipeline_checkpoint_with_optimizer_states_by_index_is_one_line(tmp_path):
    """Pipeline checkpoints of earlier development builds kept each stage's optimizer state by
    parameter index; they are refused in one line, not loaded under another meaning."""
    from sparsebalance.engine.stage import PipelineLayout, StageModel
    from sparsebalance.models.hf import build_model
    from sparsebalance.train.pipeline_checkpoint import _read

    stage = StageModel(build_model("tiny", "cpu", torch.float32, seed=0), PipelineLayout.of(0, 2, 2, (3, 1)))
    torch.save({}, tmp_path / "model.pt")
    by_index = {"state": {0: {"step": torch.tensor(1.0)}}, "param_groups": [{"params": [0]}]}
    torch.save({"optimizer": [by_index, by_index], "pipeline": {"stages": 2, "layers": [3, 1]}}, tmp_path / "state.pt")
    model_sd, state, error = _read(tmp_path, stage)
    assert model_sd is None and state is None
    assert "earlier development build" in error and "\n" not in error
