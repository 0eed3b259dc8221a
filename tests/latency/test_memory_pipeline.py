"""The memory model of a pipeline stage (``--pp``) and of a step of several micro-batches: what a
stage holds, what 1F1B keeps in flight on it, the gradients a later micro-batch's backward holds,
and ``sparsebalance memory --pp``."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from sparsebalance.batching.schedule import balanced_layers, head_layers, schedule_order
from sparsebalance.cli import main
from sparsebalance.latency.memory import ANALYTIC, MemoryConfig, MemoryModel, StageShare, cpu_coefficients
from sparsebalance.models import load_shapes

H200 = ANALYTIC["h200"]


def _split(shapes, stages: int) -> tuple[int, ...]:
    return tuple(balanced_layers(shapes.num_layers, stages, head_layers(shapes)).tolist())


@pytest.mark.parametrize("tied", [True, False])
def test_the_stages_hold_the_model_once_and_a_tied_head_twice(tied):
    shapes = load_shapes("qwen2.5-3b")
    mem = MemoryModel(shapes, H200, tied)
    split = _split(shapes, 4)
    stages = [StageShare.of(split, s) for s in range(4)]
    assert [s.in_flight for s in stages] == [4, 3, 2, 1]  # 1F1B: P - s on stage s
    assert [(s.embedding, s.head) for s in stages] == [(True, False), (False, False), (False, False), (False, True)]
    copy = shapes.vocab_size * shapes.hidden_size if tied else 0  # the last stage's head
    assert sum(mem.num_params(s) for s in stages) == mem.num_params() + copy
    assert mem.num_params(StageShare.whole(shapes.num_layers)) == mem.num_params()


@pytest.mark.parametrize("p", [1, 2, 4])
def test_the_micro_batches_in_flight_are_the_schedules(p):
    """``StageShare.of``'s ``in_flight`` is the most forwards 1F1B's order runs on the stage before
    their backwards (given enough micro-batches)."""
    for s in range(p):
        order, open_, most = schedule_order(p, 8, s), 0, 0
        for kind, _ in order:
            open_ += 1 if kind == "F" else -1
            most = max(most, open_)
        assert StageShare.of((1,) * p, s).in_flight == most


def test_a_stage_keeps_the_activations_of_its_micro_batches_in_flight():
    """A middle stage of ``l`` layers with ``k`` micro-batches in flight keeps ``k`` times what
    an ``l``-layer model keeps for one micro-batch, less the final norm it does not run."""
    shapes = load_shapes("qwen2.5-0.5b")
    t, a = 8192, H200.act_bytes
    for ckpt in ("off", "selective", "full"):
        cfg = MemoryConfig(ckpt, "chunked", block_size=128)
        stage = StageShare(6, False, False, 3)
        middle, _ = MemoryModel(shapes, H200)._kept(t, replace(cfg, stage=stage), stage)
        six = replace(shapes, num_layers=6)
        whole, _ = MemoryModel(six, H200)._kept(t, cfg, StageShare.whole(6))
        norm = 2 * shapes.hidden_size * t * a
        assert middle == pytest.approx(3 * (whole - norm))
        parts = MemoryModel(shapes, H200).breakdown(t, replace(cfg, stage=stage))
        assert parts["loss"] == 0.0  # the loss is the last stage's


def test_a_later_micro_batch_holds_every_accumulated_gradient():
    """From a step's second micro-batch on, a backward holds the gradients accumulated so far,
    unsharded (FSDP2 reduce-scatters in the last micro-batch only), beside the tied head's new
    gradient, which waits for the embedding's (the first micro-batch's backward holds only that):
    the difference is every gradient."""
    shapes = load_shapes("qwen2.5-3b")
    mem = MemoryModel(shapes, H200)
    one = MemoryConfig("full", "chunked", shard=8, block_size=128)
    first, later = mem.breakdown(65536, one), mem.breakdown(65536, replace(one, micro_batches=2))
    assert (first["moment"], later["moment"]) == ("first layer backward", "later backward")
    assert later["peak"] - first["peak"] == pytest.approx(mem.num_params() * H200.grad_bytes)
    with pytest.raises(ValueError, match="micro_batches"):
        MemoryConfig(micro_batches=0, block_size=128)


def test_every_moment_of_a_later_micro_batch_holds_the_accumulated_gradients():
    """The gradients accumulated by earlier micro-batches are alive through a later one's forward
    and loss too, not only its backward: a loss-bound micro-batch's peak rises by all of them."""
    shapes = load_shapes("qwen2.5-0.5b")
    mem = MemoryModel(shapes, cpu_coefficients(0.0))
    one = MemoryConfig("off", "plain", block_size=128)
    first, later = mem.breakdown(1024, one), mem.breakdown(1024, replace(one, micro_batches=2))
    assert (first["moment"], later["moment"]) == ("loss", "loss")
    assert later["peak"] - first["peak"] == pytest.approx(mem.num_params() * 4.0)


def test_ddp_holds_its_gradients_from_the_first_micro_batch():
    """Under DDP the gradients are views of its buckets, allocated once: even a step's first
    micro-batch runs beside all of them, as a later one does; and once, when DDP rebuilds its
    buckets, old and new are alive together (with no activation)."""
    mem = MemoryModel(load_shapes("qwen2.5-0.5b"), cpu_coefficients(0.0))
    grads = mem.num_params() * 4.0
    for ckpt, loss, tokens in (("off", "plain", 16384), ("full", "chunked", 2048)):
        one = MemoryConfig(ckpt, loss, block_size=128)
        ddp = mem.breakdown(tokens, replace(one, ddp=True))
        later = mem.breakdown(tokens, replace(one, micro_batches=2))
        rebuild = ddp["base"] + ddp["weights+optimizer"] + ddp["attention workspace"] + 2 * grads
        assert ddp["peak"] == pytest.approx(max(later["peak"], rebuild))
        assert ddp["peak"] > mem.peak_bytes(tokens, one)
        assert ddp["moment"] == ("loss" if tokens > 8192 else "bucket rebuild")


def test_the_first_stage_holds_its_embedding_gradient_twice_in_a_later_micro_batch():
    """At the end of a later micro-batch's backward the embedding's dense gradient lands beside the
    one accumulated so far, on the first stage too (it has no head to tie it to)."""
    shapes = load_shapes("qwen2.5-0.5b")
    mem = MemoryModel(shapes, cpu_coefficients(0.0))
    first_stage = StageShare.of(_split(shapes, 4), 0)
    one = MemoryConfig("full", "chunked", stage=first_stage, block_size=128)
    first, later = mem.breakdown(128, one), mem.breakdown(128, replace(one, micro_batches=2))
    assert (first["moment"], later["moment"]) == ("end", "end")
    assert later["peak"] - first["peak"] == pytest.approx(shapes.vocab_size * shapes.hidden_size * 4.0)


def test_a_backwards_end_holds_the_other_micro_batches_in_flight():
    """In steady 1F1B the first stage ends a backward (where the embedding's gradient lands) with
    the other ``in_flight - 1`` micro-batches' activations still kept."""
    shapes = load_shapes("qwen2.5-0.5b")
    mem = MemoryModel(shapes, cpu_coefficients(0.0))
    first = StageShare.of(_split(shapes, 4), 0)
    cfg = MemoryConfig("full", "chunked", micro_batches=2, stage=first, block_size=128)
    alone = replace(cfg, stage=replace(first, in_flight=1))
    four, one = mem.breakdown(128, cfg), mem.breakdown(128, alone)
    assert (four["moment"], one["moment"]) == ("end", "end")
    kept_one, _ = mem._kept(128, alone, alone.stage)
    layouts = four["attention workspace"] - one["attention workspace"]  # their layouts too
    assert four["peak"] - one["peak"] - layouts == pytest.approx(3 * kept_one)


@pytest.mark.parametrize("ckpt, copies", [("off", 3), ("selective", 3), ("full", 0)])
def test_every_micro_batch_in_flight_keeps_its_autocast_weight_copies(ckpt, copies):
    """Autocast's bf16 weight copies are cached through a forward and saved for its backward, so a
    stage's backward runs beside the copies of its 3 micro-batches in flight, unless full
    checkpointing recomputes every layer there (each layer's copy made and freed as it goes)."""
    shapes = load_shapes("qwen2.5-3b")
    stage = StageShare.of(_split(shapes, 4), 1)
    assert stage.in_flight == 3
    cfg = MemoryConfig(ckpt, "chunked", micro_batches=2, stage=stage, block_size=256)
    with_copies = MemoryModel(shapes, H200).breakdown(8192, cfg)
    without = MemoryModel(shapes, replace(H200, cast_bytes=0.0)).breakdown(8192, cfg)
    assert with_copies["moment"] == without["moment"] == "later backward"
    params = MemoryModel(shapes, H200).num_params(stage)
    assert with_copies["peak"] - without["peak"] == pytest.approx(copies * params * H200.cast_bytes)


@pytest.mark.parametrize(
    "tied, shard, micro_batches, copies",
    [(True, 1, 1, 2), (True, 1, 2, 3), (True, 4, 1, 2), (True, 4, 2, 3), (False, 1, 1, 0)],
)
def test_a_backwards_end_holds_the_embeddings_gradients(tied, shard, micro_batches, copies):
    """The end of a backward on the whole model: a tied weight's head gradient, its embedding
    gradient and their sum (``V x H`` each) beside the gradients, one more when a gradient is
    already held (the sum is added into it); an untied embedding's dense gradient is the gradient
    itself. A held gradient is whole even under FSDP2 (reduce-scattered in the last micro-batch
    only)."""
    shapes = load_shapes("qwen2.5-0.5b")
    mem = MemoryModel(shapes, cpu_coefficients(0.0), tied)
    vh = shapes.vocab_size * shapes.hidden_size * 4.0
    cfg = MemoryConfig("full", "chunked", shard=shard, micro_batches=micro_batches, block_size=128)
    parts = mem.breakdown(128, cfg)
    assert parts["moment"] == "end"
    grads = mem.num_params() * 4.0 / (shard if micro_batches == 1 else 1)
    assert parts["other at peak"] == pytest.approx(grads + copies * vh)


def test_an_fsdp2_stage_is_gathered_through_the_step():
    """``--pp`` with ``--parallel fsdp2``: the stage's whole weights beside their shards, and only
    the optimizer state divided by the data-parallel degree."""
    shapes = load_shapes("qwen2.5-3b")
    mem = MemoryModel(shapes, H200)
    stage = StageShare.of(_split(shapes, 4), 1)
    params = mem.num_params(stage)
    parts = mem.breakdown(4096, MemoryConfig("full", "chunked", shard=4, stage=stage, block_size=128))
    c = H200
    assert parts["weights+optimizer"] == pytest.approx(params * (c.param_bytes * 1.25 + c.optimizer_bytes / 4))
    whole = mem.breakdown(4096, MemoryConfig("full", "chunked", shard=4, block_size=128))
    assert whole["weights+optimizer"] == pytest.approx(mem.num_params() * (c.param_bytes + c.optimizer_bytes) / 4)


def test_the_memory_command_gives_the_pipelines_tightest_stage(capsys):
    shapes = load_shapes("qwen2.5-3b")
    args = ["memory", "--model", "qwen2.5-3b", "--analytic", "h200", "--devices", "8", "--pp", "4", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    mem = MemoryModel(shapes, H200)
    split = _split(shapes, 4)
    for row in out["rows"]:
        cfg = MemoryConfig(row["checkpointing"], row["loss"], shard=2, micro_batches=2, density=0.1, block_size=128)
        fits = [mem.max_tokens(out["budget_bytes"], replace(cfg, stage=StageShare.of(split, s))) for s in range(4)]
        assert set(row) == {"checkpointing", "loss", "micro-batch/rank @8"}  # no CP column: whole documents
        assert row["micro-batch/rank @8"] == min(fits) > 0
    assert main([*args[:-1], "--check", "32768"]) == 0
    table = capsys.readouterr().out
    assert "32,768 tokens per micro-batch, PP 4 over 8 devices" in table and "| stage |" in table
    assert main(["memory", "--analytic", "h200", "--devices", "6", "--pp", "4"]) == 2
    assert "--pp 4 must divide every --devices count (6)" in capsys.readouterr().err


def test_the_memory_command_prices_interleaving_as_train_runs_it(capsys):
    """``--pp-virtual 2``: each stage keeps ``held_stages`` of activations in flight and, as
    ``train --parallel fsdp2`` runs interleaving too, is sharded over its 8 / 4 peers as without it."""
    from sparsebalance.batching.interleaved import held_stages

    shapes = load_shapes("qwen2.5-3b")
    args = ["memory", "--model", "qwen2.5-3b", "--analytic", "h200", "--devices", "8", "--pp", "4"]
    assert main([*args, "--pp-virtual", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    mem = MemoryModel(shapes, H200)
    split = tuple(balanced_layers(shapes.num_layers, 8, head_layers(shapes)).tolist())
    ranks = tuple(sum(split[s::4]) for s in range(4))
    for row in out["rows"]:
        cfg = MemoryConfig(row["checkpointing"], row["loss"], shard=2, micro_batches=2, density=0.1, block_size=128)
        stages = [replace(StageShare.of(ranks, s), in_flight=held_stages(split, 4, s)) for s in range(4)]
        assert row["micro-batch/rank @8"] == min(
            mem.max_tokens(out["budget_bytes"], replace(cfg, stage=st)) for st in stages
        )
    assert main([*args, "--pp-virtual", "2"]) == 0
    assert "x 2 chunks (interleaved)" in capsys.readouterr().out
    assert main(["memory", "--analytic", "h200", "--pp-virtual", "2"]) == 2
    assert "--pp-virtual 2 needs a pipeline (--pp >= 2), got --pp 1" in capsys.readouterr().err


def test_a_pending_zero_bubble_w_keeps_what_the_memory_model_prices():
    """The bytes a :class:`~sparsebalance.engine.deferred_weights.DeferredWeights` store keeps for
    one micro-batch's W (its tensors' storages, each once) are ``weight_elems`` per token and
    layer; stage s of ZB-H1 holds up to ``s + 1`` of them besides 1F1B's in flight, and under full
    activation checkpointing they cost far more than the micro-batches' saved inputs."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from sparsebalance.batching.zero_bubble import pending_weights
    from sparsebalance.engine.deferred_weights import DeferredWeights
    from sparsebalance.models.shapes import ModelShapes

    cfg = Qwen2Config(
        hidden_size=64, intermediate_size=176, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=2, vocab_size=128, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    store = DeferredWeights(model.model)  # the decoder's linear layers (the head as the chunked loss runs it)
    t = 24
    store.begin(0)
    model.model(torch.arange(t)[None] % 128).last_hidden_state.sum().backward()
    store.end()
    storages = {x.untyped_storage().data_ptr(): x.untyped_storage().nbytes() for w in store.pending[0] for x in w[1:]}
    shapes = ModelShapes.from_hf_config(cfg.to_dict())
    mem = MemoryModel(shapes, cpu_coefficients(0))
    assert sum(storages.values()) == mem.weight_elems() * t * cfg.num_hidden_layers * 4  # fp32
    assert [pending_weights(4, 8, s) for s in range(4)] == [1, 2, 3, 4]
    qwen = load_shapes("qwen2.5-3b")
    split = _split(qwen, 4)
    plain = StageShare.of(split, 3)
    zb = replace(plain, pending_weights=4)
    model3b = MemoryModel(qwen, H200)
    for ckpt, more in (("off", 1.5), ("full", 10.0)):
        base = MemoryConfig(ckpt, "chunked", block_size=128)
        one = model3b._kept(8192, replace(base, stage=plain), plain)[0]
        both = model3b._kept(8192, replace(base, stage=zb), zb)[0]
        assert both > more * one  # the last stage: 1 micro-batch in flight, 4 pending W's
