"""Zero bubble in the trainer (``--pp-schedule zb-h1``, issue 54): each stage's backward split
into B (the input's gradient, sent upstream at once) and W (the linear layers' weight GEMMs, run
later), computing what one process computes; the deferred GEMMs give autograd's gradients bit for
bit; the stages measure their W's; what zero bubble cannot run is refused in one line."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from sparsebalance.batching.zero_bubble import WEIGHT_SHARE, zb_order
from sparsebalance.engine.deferred_weights import DeferredWeights
from sparsebalance.report_pipeline import pipeline_line
from sparsebalance.train import TrainConfig
from sparsebalance.tuning import DSTConfig
from tests.train.harness import base_config, matches_one_process, rewind, run_ranks

OFF = DSTConfig(mode="off", budget="gamma", gamma0=0.9)


def _cfg(tmp: Path, **over) -> TrainConfig:
    return base_config(tmp, **{"steps": 3, "strategy": "sab", "dst": OFF, **over})


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8, bias=False), nn.LayerNorm(8), nn.Linear(8, 4))


@pytest.mark.parametrize("autocast", [False, True])
def test_deferred_weight_gradients_are_autograds(autocast):
    """Two micro-batches' backwards with the weight GEMMs deferred, then their W's: every
    gradient equals plain autograd's (fp32, and bf16 autocast), and before the W's the linear
    weights have none while the bias and the norm have theirs."""
    plain, split = _net(), _net()
    store = DeferredWeights(split)
    xs = [torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    for m, x in enumerate(xs):
        for net, deferred in ((plain, False), (split, True)):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                y = net(x)
            if deferred:
                store.begin(m)
            y.float().pow(2).sum().backward()
            if deferred:
                store.end()
    assert all(split[i].weight.grad is None for i in (0, 2, 4))  # deferred to the W's
    assert split[0].bias.grad is not None and split[3].weight.grad is not None  # made in B
    ready = []
    for m in range(2):
        store.run(m, ready.append if m == 1 else None)
    assert [id(w) for w in ready] == [id(split[i].weight) for i in (4, 2, 0)]  # the backward's order, once
    for (name, a), b in zip(plain.named_parameters(), split.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0, msg=name)
    store.remove()
    assert "forward" not in vars(split[0])


def test_a_backward_outside_a_b_is_not_deferred():
    """Without ``begin`` (a backward that is not a micro-batch's B) the weights get their
    gradients at once, and no-grad forwards use the plain linear."""
    net, ref = _net(), _net()
    store = DeferredWeights(net)
    x = torch.randn(4, 8)
    net(x).sum().backward()
    ref(x).sum().backward()
    torch.testing.assert_close(net[0].weight.grad, ref[0].weight.grad, rtol=0, atol=0)
    assert not store.pending
    with torch.no_grad():
        torch.testing.assert_close(net(x), ref(x), rtol=0, atol=0)


@pytest.mark.distributed
def test_two_zero_bubble_stages_compute_what_one_process_computes(tmp_path):
    """Issue 54: PP2 with ZB-H1 (gloo, fp32, deterministic, DST off) gives PP1's per-step losses
    within 1e-5 and its weights; each stage measured its W's."""
    _, two, _ = matches_one_process(tmp_path, "pp2zb", _cfg, pp=2, pp_schedule="zb-h1", checkpoint_every=3)
    lines = [json.loads(x) for x in (two / "run" / "metrics.jsonl").read_text().splitlines()]
    units = [u for x in lines if x["rank"] != "all" for u in x["units"]]
    assert units and all(len(u["stage_s"]) == 2 for u in units)
    for f, b, w in (s for u in units for s in u["stage_s"]):  # (forward, B + W, W) per stage
        assert f > 0 and b > w > 0
    ranks = [x for x in lines if x["rank"] != "all"]
    assert all(s["schedule"] == "zb-h1" and 0 < s["weight_s"] < s["busy_s"] for x in ranks for s in x["stages"])
    line = pipeline_line(ranks)
    assert "(zero bubble ZB-H1, W " in line and " % of the backward)" in line


@pytest.mark.distributed
@pytest.mark.slow
def test_two_zero_bubble_pipelines_match_two_ranks(tmp_path):
    """DP2 x PP2 with ZB-H1 (4 processes, ``ddp``: the deferred weights' buckets reduce from the
    last W) computes what DP2 does."""
    from sparsebalance.train.checkpoint import load_weights

    dp, both = tmp_path / "dp2", tmp_path / "dp2pp2zb"
    dp.mkdir(), both.mkdir()
    ref = run_ranks(_cfg(dp), 2, dp)
    got = run_ranks(_cfg(both, pp=2, pp_schedule="zb-h1", checkpoint_every=3), 4, both)
    assert got[0]["losses"] == pytest.approx(ref[0]["losses"], rel=1e-5, abs=1e-5)
    want, have = (load_weights(d / "run" / "checkpoints" / "step-000003") for d in (dp, both))
    for name, tensor in want.items():
        torch.testing.assert_close(have[name], tensor, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.distributed
@pytest.mark.slow
def test_a_zero_bubble_pipeline_with_dst_resumes_exactly(tmp_path):
    """DST on: a resume from step 2 gives the uninterrupted run's losses (the learned W share is
    in the checkpoint)."""
    cfg = _cfg(tmp_path, pp=2, pp_schedule="zb-h1", steps=4, checkpoint_every=2, dst=DSTConfig(mode="bidirectional"))
    full = run_ranks(cfg, 2, tmp_path)
    again = tmp_path / "again"
    run = rewind(tmp_path / "run", again, step=2, drop=4)
    resumed = run_ranks(replace(cfg, out=str(run), resume=True), 2, again)
    assert resumed[0]["losses"] == pytest.approx(full[0]["losses"][2:], rel=1e-6, abs=1e-6)


@pytest.mark.parametrize(
    "over, says",
    [
        ({"pp_schedule": "zb-h1"}, "--pp-schedule zb-h1 needs a pipeline: give --pp >= 2"),
        ({"pp": 2, "pp_schedule": "zb-h1", "pp_virtual": 2}, "--pp-schedule zb-h1 cannot run with --pp-virtual 2"),
        ({"pp": 2, "pp_schedule": "zb-h1", "parallel": "fsdp2"}, "--pp-schedule zb-h1 cannot run with --parallel"),
        ({"pp": 2, "pp_schedule": "zb"}, "--pp-schedule must be one of"),
    ],
)
def test_what_zero_bubble_cannot_run_is_one_line(tmp_path, over, says):
    from sparsebalance.flags import command_line

    with command_line(), pytest.raises(ValueError) as err:
        _cfg(tmp_path, **over)
    assert str(err.value).startswith(says) and "\n" not in str(err.value)


def test_the_executor_runs_every_op_of_its_order_once():
    """The order the executor walks: each micro-batch's F, B and W once per stage."""
    for p, m in ((2, 3), (4, 6)):
        for s in range(p):
            ops = zb_order(p, m, s)
            assert sorted(ops) == sorted((k, j, 0) for k in "FBW" for j in range(m))
    assert copy.copy(WEIGHT_SHARE) == pytest.approx(1 / 3)
