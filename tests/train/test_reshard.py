"""Resuming on another grid (issue 54): a checkpoint of ``--pp 2`` resumes as ``--pp 1`` and one of
``--pp 1`` as ``--pp 2``, and the step after it is the uninterrupted run's (CPU, gloo, fp32,
deterministic, DST off); each rank reads only its stage's names, from the files holding them;
what defines the run stays refused in one line.

Why equality holds here: with ``--dst-mode off`` every document's attention budget is the base
budget whatever micro-batch it lands in, and documents never attend across a pack, so the
gradient of the global batch is the same sum however the grid packs and splits it (one pipeline
in every run: the planner splits the batch over as many planned ranks). What differs is the
order of the sums: hence 1e-5, not bit-exact (as ``--pp 2`` against one process,
:func:`tests.train.harness.matches_one_process`)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from sparsebalance.train import TrainConfig
from sparsebalance.train.checkpoint import load_weights
from sparsebalance.tuning import DSTConfig
from tests.train.harness import base_config, rewind, run_ranks

OFF = DSTConfig(mode="off", budget="gamma", gamma0=0.9)


def _cfg(tmp: Path, **over) -> TrainConfig:
    return base_config(tmp, **{"steps": 3, "strategy": "sab", "dst": OFF, "checkpoint_every": 2, **over})


def _weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_weights(run / "checkpoints" / f"step-{step:06d}")  # model.pt, or the stage files merged


def _resumed_on_another_grid(tmp: Path, before: dict, world: int, after: dict, again_world: int) -> str:
    """3 steps on ``before``'s grid (``world`` processes, checkpoints at 2 and 3), then from a copy
    of its step-2 checkpoint step 3 again on ``after``'s grid: the same loss and weights within
    1e-5. Returns what the resumed run printed on stderr (checked by the caller)."""
    cfg = _cfg(tmp, **before)
    full = run_ranks(cfg, world, tmp)
    again = rewind(tmp / "run", tmp / "again", step=2, drop=3)
    resumed = run_ranks(replace(cfg, out=str(again), resume=True, **after), again_world, tmp / "again")
    assert len(resumed[0]["losses"]) == 1
    assert resumed[0]["losses"] == pytest.approx(full[0]["losses"][2:], rel=1e-5, abs=1e-5)
    want, have = _weights(tmp / "run", 3), _weights(again, 3)
    assert sorted(have) == sorted(want)
    for name, tensor in want.items():  # after 3 AdamW steps: see harness.matches_one_process
        torch.testing.assert_close(have[name], tensor, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.slow  # default tier time (~10 min on 2 cores): its correctness is CI's slow tier
@pytest.mark.distributed
def test_a_pp2_checkpoint_resumes_as_pp1(tmp_path, capfd):
    _resumed_on_another_grid(tmp_path, {"pp": 2}, 2, {"pp": 1}, 1)
    err = capfd.readouterr().err
    line = next(x for x in err.splitlines() if "resumes as" in x)
    assert line.startswith(
        "sparsebalance train: --resume: checkpoints/step-000002 was saved by --pp 2 x 1 pipeline (2 ranks) and "
        "resumes as --pp 1 x 1 pipeline (1 rank): parameters and optimizer state resharded by name; the stages' "
        "learned time scales reset to 1"
    ), line
    assert "rank r restores the RNG state saved by rank r mod 2" in line


@pytest.mark.distributed
@pytest.mark.slow
def test_a_pp1_checkpoint_resumes_as_pp2(tmp_path, capfd):
    _resumed_on_another_grid(tmp_path, {"pp": 1}, 1, {"pp": 2}, 2)
    err = capfd.readouterr().err
    assert "was saved by --pp 1 x 1 pipeline (1 rank) and resumes as --pp 2 x 1 pipeline (2 ranks)" in err


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(
    "before, after",
    [({"pp": 2}, {"pp": 1}), ({"pp": 2}, {"pp_virtual": 2}), ({"pp": 2, "pp_virtual": 2}, {"pp": 1, "pp_virtual": 1})],
    ids=["pp2x1-as-pp1x2", "pp2-as-pp2v2", "pp2v2-as-pp1x2"],
)
def test_two_processes_resume_on_another_grid(tmp_path, capfd, before, after):
    """Two processes both times: one pipeline of two stages becomes two pipelines of one (the
    planner splits the batch over two ranks; with DST off the same gradient sum), or the stages'
    layers are split into other chunks (``--pp-virtual``)."""
    _resumed_on_another_grid(tmp_path, before, 2, {**before, **after}, 2)
    assert "parameters and optimizer state resharded by name" in capfd.readouterr().err


def _stage(rank: int, stages: int, split: tuple[int, ...], virtual: int = 1):
    """Stage ``rank`` of the tiny model (seed 0) in a pipeline of ``stages`` split as ``split``,
    with an AdamW over its parameters."""
    from sparsebalance.engine.stage import PipelineLayout, StageModel
    from sparsebalance.models.hf import build_model

    model = build_model("tiny", "cpu", torch.float32, seed=0)
    stage = StageModel(model, PipelineLayout.of(rank, stages, stages, split, virtual))
    return stage, torch.optim.AdamW(stage.parameters_owned(), lr=1e-3)


def _pipeline_checkpoint(path: Path) -> None:
    """A ``--pp 2`` (split 3 + 1) checkpoint's stage files and checksums in ``path``, each stage
    after one AdamW step on gradients that depend on the parameter's name alone (the tied
    embedding takes the same step on both stages, as in a run)."""
    import json

    from sparsebalance.train.checkpoint import CHECKSUMS, sha256
    from sparsebalance.train.pipeline_checkpoint import _optimizer_state
    from sparsebalance.train.shards import MODEL_SHARD, OPTIM_SHARD

    path.mkdir(exist_ok=True)
    for s in range(2):
        stage, opt = _stage(s, 2, (3, 1))
        for name, p in stage.named_parameters():
            p.grad = torch.full_like(p, 1e-3 * (1 + sum(map(ord, name)) % 97))
        opt.step()
        torch.save(stage.state_dict_owned(), path / MODEL_SHARD.format(s))
        torch.save(_optimizer_state(stage, opt), path / OPTIM_SHARD.format(s))
    sums = {p.name: sha256(p) for p in sorted(path.iterdir())}
    (path / CHECKSUMS).write_text(json.dumps(sums))


@pytest.mark.parametrize(
    "stages, split, virtual, rank, files",
    [
        (4, (1, 1, 1, 1), 1, 0, [0]),  # the embedding and layer 0
        (4, (1, 1, 1, 1), 1, 2, [0]),  # layer 2 alone
        (4, (1, 1, 1, 1), 1, 3, [1]),  # layer 3, norm, head and the tied embedding: the last file has them all
        (2, (1, 1, 1, 1), 2, 1, [0, 1]),  # --pp-virtual 2: layers 1 and 3, norm, head, tied embedding
    ],
    ids=["pp4-s0", "pp4-s2", "pp4-s3", "pp2v2-s1"],
)
def test_a_rank_reads_only_its_names_from_the_files_holding_them(
    tmp_path, monkeypatch, stages, split, virtual, rank, files
):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from sparsebalance.train import reshard
    from sparsebalance.train.optimizer_state import load_optimizer_state_dict
    from sparsebalance.train.shards import MODEL_SHARD, OPTIM_SHARD

    _pipeline_checkpoint(tmp_path)
    saved = {}
    for s in range(2):
        saved.update(torch.load(tmp_path / MODEL_SHARD.format(s), weights_only=True))
    optim = [torch.load(tmp_path / OPTIM_SHARD.format(s), weights_only=True)["state"] for s in range(2)]
    read = []  # the files whose tensors are read: each is hashed first
    real = reshard.sha256
    monkeypatch.setattr(reshard, "sha256", lambda f: read.append(f.name) or real(f))
    stage, opt = _stage(rank, stages, split, virtual)
    groups = reshard.optimizer_names(stage, opt, reshard.STAGE_PREFIX)
    model_sd, optim_sd = reshard.read_part(tmp_path, stage.names, groups, 2, reshard.STAGE_PREFIX)
    assert read == [f.format(s) for s in files for f in (MODEL_SHARD, OPTIM_SHARD)]
    assert list(model_sd) == stage.names  # its names, nothing else
    for name in stage.names:
        assert torch.equal(model_sd[name], saved[name]), name
    assert list(optim_sd["state"]) == [f"model.{n}" for n in groups[0]]  # the tied weight once
    assert optim_sd["param_groups"][0]["params"] == [f"model.{n}" for n in groups[0]]
    # and they load: every parameter its saved values, every AdamW moment the one saved for its name
    options = StateDictOptions(full_state_dict=True, strict=False)
    set_model_state_dict(stage, {f"model.{n}": t for n, t in model_sd.items()}, options=options)
    load_optimizer_state_dict(stage, opt, optim_sd, options, unstepped=False)
    named = dict(stage.model.named_parameters())
    for name in groups[0]:
        torch.testing.assert_close(named[name].detach(), saved[name], rtol=0, atol=0)
        want = next(o[f"model.{name}"] for o in optim if f"model.{name}" in o)
        assert torch.equal(opt.state[named[name]]["exp_avg"], want["exp_avg"]), name


def test_a_pp1_rank_0_merges_the_stage_files_by_name(tmp_path, monkeypatch):
    """``--pp 1`` holds the whole model: rank 0 reads every stage file, the tied weight once."""
    from sparsebalance.models.hf import build_model
    from sparsebalance.train import reshard

    _pipeline_checkpoint(tmp_path)
    torch.save({"pipeline": {"stages": 2, "layers": [3, 1]}, "rng": []}, tmp_path / "state.pt")
    model = build_model("tiny", "cpu", torch.float32, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model_sd, optim_sd, state = reshard.read_whole(tmp_path, model, opt)
    assert sorted(model_sd) == sorted(model.state_dict())
    names = [n for n, _ in model.named_parameters()]  # the tied head: under the embedding's name
    assert list(optim_sd["state"]) == names and optim_sd["param_groups"][0]["params"] == names
    assert state["pipeline"]["stages"] == 2


def test_another_grid_changes_the_rng_states_and_the_stage_scales_only_as_said():
    from sparsebalance.engine.stage_calibration import StageCalibration
    from sparsebalance.train.reshard import adapt_state

    learned = {"ratio": 2.5, "scales": [0.8, 1.2], "steps": 4}

    def state():
        return {"rng": ["r0", "r1"], "trainer": {"step": 2, "stage_calibration": dict(learned)}}

    out = adapt_state(state(), (3, 1), None, 1, 3)  # --pp 2 on 2 ranks -> --pp 1 on 3
    assert out["rng"] == ["r0", "r1", "r0"]
    assert out["trainer"] == {"step": 2, "stage_calibration": {"ratio": 2.5, "scales": [1.0], "steps": 4}}
    StageCalibration(1).load_state_dict(out["trainer"]["stage_calibration"])  # what the engine loads
    assert adapt_state(state(), (3, 1), (2, 2), 2, 2)["trainer"]["stage_calibration"]["scales"] == [1.0, 1.0]
    same = adapt_state(state(), (3, 1), (3, 1), 2, 4)  # another --nproc only: the scales stay
    assert same["rng"] == ["r0", "r1", "r0", "r1"] and same["trainer"]["stage_calibration"] == learned
    # --plan-ahead: the state that planned the next step gets the same reset
    ahead = {**state()["trainer"], "ahead": {"engine": {"stage_calibration": dict(learned)}}}
    out = adapt_state({"rng": [], "trainer": ahead}, (3, 1), None, 1, 3)["trainer"]
    assert out["ahead"]["engine"]["stage_calibration"]["scales"] == [1.0]


def test_a_parameter_without_its_saved_optimizer_state_is_refused(tmp_path):
    """A stepped optimizer's file that lacks one of the rank's parameters (a naming mismatch)
    is one line naming it, never a silent restart of its moments at 0."""
    import json

    from sparsebalance.train import reshard
    from sparsebalance.train.checkpoint import CHECKSUMS, sha256
    from sparsebalance.train.shards import OPTIM_SHARD

    _pipeline_checkpoint(tmp_path)
    optim = torch.load(tmp_path / OPTIM_SHARD.format(0), weights_only=True)
    gone = sorted(optim["state"])[0]
    del optim["state"][gone]
    torch.save(optim, tmp_path / OPTIM_SHARD.format(0))
    (tmp_path / CHECKSUMS).write_text(json.dumps({p.name: sha256(p) for p in sorted(tmp_path.glob("*.pt"))}))
    stage, opt = _stage(0, 1, (4,))
    groups = reshard.optimizer_names(stage, opt, reshard.STAGE_PREFIX)
    with pytest.raises(ValueError, match=r"has no optimizer state for 1 parameters") as err:
        reshard.read_part(tmp_path, stage.names, groups, 2, reshard.STAGE_PREFIX)
    assert gone.removeprefix(reshard.STAGE_PREFIX) in str(err.value) and "\n" not in str(err.value)
