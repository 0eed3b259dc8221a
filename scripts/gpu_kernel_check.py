"""The GPU check's preflight for the two attention kernels (issue 53, item 4): FlexAttention compiles
one tiny block-sparse case and runs it forward and backward, FlashAttention varlen runs a packed
pair of documents. One line says what ran, or which one failed and why; exit status 1 if any did.

    python scripts/gpu_kernel_check.py                  # CUDA, bf16 (what the stages run)
    python scripts/gpu_kernel_check.py --device cpu     # the same calls on the CPU (flex forward
                                                        # only, SDPA for varlen): a smoke test

The compile also fills Inductor's cache, so the stages after it compile flex faster.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch


def _why(err: BaseException) -> str:
    lines = [x for x in str(err).splitlines() if x.strip()]
    return f"{type(err).__name__}: {lines[0][:200] if lines else ''}"


def check_flex(device: torch.device, dtype: torch.dtype) -> str:
    """A 300-token document with a 200-token one, top-k 1 block of 128 (both selected), compiled
    flex forward (and backward on CUDA) against the reference."""
    from sparsebalance.ops import Budget, block_sparse_attention, select_blocks

    g = torch.Generator().manual_seed(0)
    lengths = (300, 200)
    cu = torch.tensor([0, 300, 500], dtype=torch.int32, device=device)
    grad = device.type == "cuda"
    q, k, v = (torch.randn(500, h, 64, generator=g).to(device, dtype).requires_grad_(grad) for h in (4, 2, 2))
    layout = select_blocks(q, k, cu, Budget(top_k=1), 128)
    t0 = time.perf_counter()
    with torch.set_grad_enabled(grad):
        out = block_sparse_attention(q, k, v, layout, cu, backend="flex")
        if grad:
            out.float().sum().backward()
    exact = (x.detach().double() for x in (q, k, v))
    ref = block_sparse_attention(*exact, layout, cu, backend="reference")
    err = float((out.double() - ref).abs().max())
    if err > 0.05:
        raise AssertionError(f"flex differs from the reference by {err:.3g} (lengths {lengths})")
    what = "forward + backward" if grad else "forward"
    return f"flex compiled and ran a tiny case {what} ({time.perf_counter() - t0:.1f} s, max error {err:.1e})"


def check_varlen(device: torch.device, dtype: torch.dtype) -> str:
    """Two packed documents through the dense kernel (FlashAttention varlen on CUDA)."""
    from sparsebalance.ops.dense import dense_attention, uses_varlen

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(500, h, 64, generator=g).to(device, dtype) for h in (4, 2, 2))
    cu = torch.tensor([0, 300, 500], dtype=torch.int32, device=device)
    out = dense_attention(q, k, v, cu, (300, 200), 64**-0.5)
    if not bool(torch.isfinite(out).all()):
        raise AssertionError("varlen returned non-finite values")
    if device.type == "cuda" and not uses_varlen(q, 64**-0.5):
        raise AssertionError(f"varlen is not used on this torch ({torch.__version__}): SDPA per document instead")
    return "varlen ran" if uses_varlen(q, 64**-0.5) else "dense SDPA ran (no varlen here)"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("kernels: skipped: no CUDA GPU here")
        return 0
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    said, failed = [], []
    for name, check in (("flex", check_flex), ("varlen", check_varlen)):
        try:
            said.append(check(device, dtype))
        except Exception as err:  # one line naming what failed, whatever it was
            failed.append(f"{name}: {_why(err)}")
    if failed:
        print(f"kernels: FAILED: {'; '.join(failed)}" + (f" ({'; '.join(said)})" if said else ""))
        return 1
    print(f"kernels: {'; '.join(said)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
