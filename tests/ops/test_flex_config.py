"""Issue 26, item 1: the flex block size per device, one line for a combination that cannot compile
(a 64-token block on CUDA: Inductor's default tiles are 128 there), checked before anything runs.
The CUDA side of it is decided from the device alone, so it is tested here on CPU."""

from __future__ import annotations

import pytest
import torch

from sparsebalance.engine.kernel import resolve_block_size
from sparsebalance.ops.flex_config import (
    CUDA_TILE,
    check_flex_block_size,
    default_block_size,
    flex_settings,
)
from sparsebalance.train import TrainConfig


def test_default_block_size_per_device():
    assert default_block_size("cuda") == CUDA_TILE == 128
    assert default_block_size("cpu") == 64
    assert resolve_block_size("cuda") == 128 and resolve_block_size("cpu") == 64
    assert resolve_block_size("cuda", 256) == 256 and resolve_block_size("cuda", 32, backend=None) == 32
    with pytest.raises(ValueError, match="--block-size must be a positive integer"):
        resolve_block_size("cpu", 0)


@pytest.mark.parametrize("block", [64, 96, 192])
def test_a_block_flex_cannot_compile_on_cuda_is_one_line_naming_the_flag(block):
    with pytest.raises(ValueError, match=f"--block-size {block} cannot compile") as err:
        check_flex_block_size(block, "cuda")
    assert "\n" not in str(err.value) and "--backend torch" in str(err.value)
    check_flex_block_size(block, "cpu")  # CPU flex (forward only) takes any block


def test_multiples_of_the_tile_pass():
    for block in (128, 256):
        assert flex_settings(block, "cuda").block_size == block


def test_train_config_resolves_the_block_per_device_and_refuses_64_on_cuda(tmp_path):
    out = str(tmp_path / "run")
    assert TrainConfig(out=out, device="cpu").block_size == 64
    assert TrainConfig(out=out, device="cuda").block_size == 128  # validated, not run
    with pytest.raises(ValueError, match="--block-size 64 cannot compile with the flex backend"):
        TrainConfig(out=out, device="cuda", block_size=64)
    # the torch backend has no tile: 64 is fine there
    assert TrainConfig(out=out, device="cuda", block_size=64, backend="torch").block_size == 64


def test_profile_refuses_before_the_proxy_compiles():
    from sparsebalance.latency.measure import measure_profile
    from sparsebalance.models import load_shapes

    with pytest.raises(ValueError, match="--block-size 64 cannot compile"):
        measure_profile(load_shapes("tiny"), torch.device("cuda"), "bf16", "flex", block_size=64)


def test_recompile_limits_fail_loudly_inside_the_call_only(monkeypatch):
    """The flex call runs with Dynamo's ``fail_on_recompile_limit_hit`` on (never a silent eager
    flex at T x T), switched by a patcher built once, and off again after it (issue 53: a
    ``config.patch`` per call cost 13-50 us of host time per layer)."""
    from sparsebalance.ops import BlockLayout, block_sparse_flex
    from sparsebalance.ops.pack_index import PackIndex

    seen = []

    def stand_in(q, k, v, **kwargs):
        seen.append(torch._dynamo.config.fail_on_recompile_limit_hit)
        return q

    monkeypatch.setattr(block_sparse_flex, "_compiled_flex", lambda: stand_in)
    pack = PackIndex.build(torch.tensor([0, 300], dtype=torch.int32), 128, (300,))
    mask = torch.ones(2, pack.num_blocks, pack.num_blocks, dtype=torch.bool).tril()
    q, k, v = (torch.randn(300, 2, 16) for _ in range(3))
    before = torch._dynamo.config.fail_on_recompile_limit_hit
    block_sparse_flex.flex_block_sparse_attention(q, k, v, BlockLayout(mask, pack, 2, (False,)), 0.25)
    assert seen == [True] and torch._dynamo.config.fail_on_recompile_limit_hit == before is False
    assert block_sparse_flex._fail_on_recompile_limit() is block_sparse_flex._fail_on_recompile_limit()
