"""Issue 54, item 1: with ``--pp`` no rank builds the whole model. The model is built on ``meta``
and each rank gives storage to its own stage only, with exactly the values a whole-model build
gives for the seed (and leaves the generator where that build leaves it); a pretrained stage
reads its own tensors alone from the safetensors files."""

from __future__ import annotations

import pytest
import torch

from sparsebalance.engine.runtime import Runtime
from sparsebalance.models.hf import build_model
from sparsebalance.train import build, stage_init
from sparsebalance.train.stage_init import build_on_meta, materialise
from tests.train.harness import base_config

CPU = torch.device("cpu")


def _stage(cfg, rank: int, world: int):
    model = build.checked_model(cfg, CPU, "--model tiny")
    assert {p.device.type for p in model.parameters()} == {"meta"}  # nothing of it is built yet
    return build.pipeline_stage(cfg, Runtime(rank, world, CPU), model)


@pytest.mark.parametrize("pp, seed", [(2, 0), (4, 3)])
def test_a_stage_holds_exactly_what_a_whole_build_holds(tmp_path, pp, seed):
    cfg = base_config(tmp_path, pp=pp, seed=seed)
    whole = build_model("tiny", "cpu", torch.float32, seed=seed)
    after_whole = torch.get_rng_state()
    ref = whole.state_dict()
    held = set()
    for rank in range(pp):
        torch.manual_seed(99)  # whatever came before: the build seeds itself
        stage = _stage(cfg, rank, pp)
        assert torch.equal(torch.get_rng_state(), after_whole)  # the generator where a whole build leaves it
        mine = stage.state_dict_owned()
        assert set(mine) == set(stage.names) and mine
        for name, tensor in mine.items():
            assert torch.equal(tensor, ref[name]), name
        assert not any(t.is_meta for t in [*stage.parameters(), *stage.buffers()])
        assert torch.equal(stage.decoder.rotary_emb.inv_freq, whole.model.rotary_emb.inv_freq)
        if stage.tied_weight() is not None and stage.layout.last:  # the head is the embedding, still
            assert stage.model.get_output_embeddings().weight is stage.decoder.embed_tokens.weight
        held |= set(mine)
    assert held == set(ref)


def test_slices_move_the_generator_as_one_fill():
    """A tensor larger than the scratch is skipped in slices (n % 16 kept in the last): the
    generator ends where one fill leaves it, for sizes with and without a residue."""
    for n in (4096, 4096 + 7, 33):
        torch.manual_seed(5)
        want = torch.empty(n).normal_(0.0, 0.02)
        after = torch.get_rng_state()
        torch.manual_seed(5)
        with stage_init.InitRecorder(scratch_bytes=256) as rec:
            t = torch.empty(n)
            t.normal_(0.0, 0.02)
        assert t.is_meta and torch.equal(rec.log.final_rng, after), n
        real = torch.empty(n)
        torch.set_rng_state(rec.log.writes[0].rng)
        rec.log.writes[0].func(real, *rec.log.writes[0].args, **rec.log.writes[0].kwargs)
        assert torch.equal(real, want)


def test_the_whole_build_in_slices_gives_the_same_stage(tmp_path):
    cfg = base_config(tmp_path, pp=2, seed=1)
    whole = build_model("tiny", "cpu", torch.float32, seed=1).state_dict()
    model, log = build_on_meta(lambda: build_model("tiny", "meta", torch.float32, seed=1), scratch_bytes=4096)
    from sparsebalance.engine.stage import PipelineLayout, StageModel

    stage = StageModel(model, PipelineLayout.of(1, 2, 2, (3, 1)))
    materialise(model, log)
    for name, tensor in stage.state_dict_owned().items():
        assert torch.equal(tensor, whole[name]), name
    assert cfg.pp == 2


def test_a_pretrained_stage_reads_only_its_tensors(tmp_path, monkeypatch):
    folder = tmp_path / "pretrained"
    whole = build_model("tiny", "cpu", torch.float32, seed=7)
    whole.save_pretrained(folder)
    ref = whole.state_dict()
    read: list[str] = []
    original = stage_init._read

    def spy(path, keys):
        read.extend(keys)
        yield from original(path, keys)

    monkeypatch.setattr(stage_init, "_read", spy)
    cfg = base_config(tmp_path, pp=2, model=str(folder))
    for rank in range(2):
        read.clear()
        stage = _stage(cfg, rank, 2)
        mine = stage.state_dict_owned()
        assert set(read) <= set(stage.names) and len(read) == len({id(p) for p in stage.parameters()})
        for name, tensor in mine.items():
            assert torch.equal(tensor, ref[name]), name


def test_a_pretrained_folder_lacking_a_stage_tensor_is_one_line(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "pretrained"
    build_model("tiny", "cpu", torch.float32, seed=7).save_pretrained(folder)
    tensors = load_file(folder / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if ".layers.3." not in k}, folder / "model.safetensors")
    cfg = base_config(tmp_path, pp=2, model=str(folder))
    with pytest.raises(ValueError, match=r"lack model\.layers\.3\.") as err:
        _stage(cfg, 1, 2)
    assert "\n" not in str(err.value)


@pytest.mark.slow  # default tier time (~10 min on 2 cores): its correctness is CI's slow tier
@pytest.mark.distributed
def test_a_pipeline_from_a_pretrained_folder_trains_as_one_process(tmp_path):
    """The trainer at ``--pp 2`` from a safetensors folder (each stage reading its own tensors)
    gives the per-step losses of ``--pp 1`` from the same folder."""
    from sparsebalance.tuning import DSTConfig
    from tests.train.harness import run_ranks

    folder = tmp_path / "pretrained"
    build_model("tiny", "cpu", torch.float32, seed=11).save_pretrained(folder)
    off = DSTConfig(mode="off", budget="gamma", gamma0=0.9)
    one, two = tmp_path / "pp1", tmp_path / "pp2"
    one.mkdir(), two.mkdir()
    ref = run_ranks(base_config(one, model=str(folder), steps=2, strategy="sab", dst=off), 1, one)
    got = run_ranks(base_config(two, model=str(folder), steps=2, strategy="sab", dst=off, pp=2), 2, two)
    assert got[0]["losses"] == pytest.approx(ref[0]["losses"], rel=1e-5, abs=1e-5)
