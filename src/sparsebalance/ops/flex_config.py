"""FlexAttention's block size and kernel options, decided in one place per device.

Inductor compiles flex with tiles of ``BLOCK_M x BLOCK_N`` (query x key tokens) in the forward and
``BLOCK_M1/N1/M2/N2`` in the backward, and a ``BlockMask`` block must be a multiple of every tile.
The default tiles of torch 2.11-2.13 (``torch/_inductor/template_heuristics/triton.py``):

- forward, head_dim 64: H100 (sm90) and B200 (sm100) bf16/fp16 128 x 128, fp32 128 x 32;
  A100 (sm80) 128 x 64 (bf16) / 128 x 32 (fp32); up to head_dim 256 no tile exceeds 128;
- backward, sm90 and sm10x, bf16/fp16, head_dim 64..128: (64, 128, 128, 64); sm8x 64 x 64.

So a 64-token block cannot compile on an H100: the forward raises ``ValueError: Q and KV block
size must be divisible by BLOCK_M and BLOCK_N`` and the backward, whose candidate filter reads the
heuristic's own tiles before any ``kernel_options`` apply (torch 2.13), is left without a choice
(``NoValidChoicesError``; attention-gym #65). 128 tokens divide every default tile, hence the
CUDA default of 128 and the rule "a multiple of 128 on CUDA", checked before anything compiles
(rank 0's latency profile included) with a one-line error naming the flag. Budgets are stated
per query in tokens (top-k) or as a mass (gamma), so a change of block size keeps their meaning.

CPU: FlexAttention runs forward only and accepts any block; 64 stays the default there, so
CPU figures remain comparable with earlier runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

CUDA_TILE = 128
"""The largest default flex tile (tokens) of torch 2.11-2.13 on CUDA: a block must be a multiple."""
DEFAULT_BLOCK_SIZE = {"cuda": CUDA_TILE, "cpu": 64}
GQA_MODES = ("expand", "native")


def default_block_size(device: torch.device | str) -> int:
    """128 on CUDA (FlexAttention's tile), 64 elsewhere."""
    return DEFAULT_BLOCK_SIZE.get(torch.device(device).type, 64)


def resolve_block_size(device: torch.device | str, block_size: int | None = None, backend: str | None = "auto") -> int:
    """The one block-size resolution: ``block_size``, or ``device``'s default when None
    (``--block-size`` not given), checked for the ``backend`` that runs it (flex on CUDA: a
    multiple of 128; ``"auto"`` on a CUDA device is checked as flex, its CUDA choice, even on a
    machine without CUDA, so a config for a GPU is refused where it is written). ``backend=None``:
    no kernel runs (an estimate or a layout analysis), any positive block is accepted. Front ends
    reach it through :mod:`sparsebalance.engine.kernel`; library functions below take the block it
    returns (``block_size`` without a default)."""
    device = torch.device(device)
    if block_size is None:
        block_size = default_block_size(device)
    elif isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"--block-size must be a positive integer, got {block_size!r}")
    if backend == "flex" or (backend == "auto" and device.type == "cuda"):
        check_flex_block_size(block_size, device)
    return block_size


def check_flex_block_size(block_size: int, device: torch.device | str) -> None:
    """Raise a one-line ``ValueError`` when flex cannot compile this block size on ``device``."""
    if torch.device(device).type == "cuda" and block_size % CUDA_TILE:
        raise ValueError(
            f"--block-size {block_size} cannot compile with the flex backend on CUDA "
            f"(Inductor's flex tiles are up to {CUDA_TILE} tokens and a block must be a multiple "
            f"of them): use a multiple of {CUDA_TILE} (the CUDA default) or --backend torch"
        )


@dataclass(frozen=True)
class FlexSettings:
    """What a flex call on one device uses."""

    block_size: int
    kernel_options: dict = field(default_factory=dict)
    """Passed to ``flex_attention(kernel_options=...)``; empty: Inductor's default tiles, which a
    checked block size always divides."""
    gqa: str = "expand"
    """Grouped-query attention: ``"expand"`` K/V to the query heads before the kernel (measured
    on an H100, 32K tokens, d = 0.05, fwd + bwd: 3.5 ms against 7.9 ms for flex's own GQA, whose
    backward loops serially over a KV group's query heads), or ``"native"``
    (``enable_gqa=True``: no copies of K and V)."""

    def __post_init__(self) -> None:
        if self.gqa not in GQA_MODES:
            raise ValueError(f"gqa must be one of {GQA_MODES}, got {self.gqa!r}")


def flex_settings(block_size: int, device: torch.device | str) -> FlexSettings:
    """The checked settings of a flex call with blocks of ``block_size`` tokens on ``device``."""
    check_flex_block_size(block_size, device)
    return FlexSettings(block_size)
