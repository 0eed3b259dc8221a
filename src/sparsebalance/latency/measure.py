"""The profiling sweep (``sparsebalance profile``) and held-out validation (``--validate``).

Everything is timed with :func:`sparsebalance.timing.median_time` (warm-up, median of repeats,
CUDA events on GPU) on the :mod:`proxy` model built with the model's shapes.
"""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tqdm import tqdm

from ..models import ModelShapes
from ..ops import (
    Budget,
    block_sparse_attention,
    estimate_block_mass,
    random_layout,
    resolve_backend,
)
from ..timing import median_time
from .model import LatencyModel
from .profile import AttentionTable, Profile, Table1D, fingerprint
from .proxy import ProxyHead, ProxyLayer, ProxyModel, rotary

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Grid:
    lengths: tuple[int, ...]
    densities: tuple[float, ...]
    tokens: tuple[int, ...]
    warmup: int = 1
    repeats: int = 3


def default_grid(shapes: ModelShapes, block_size: int, quick: bool, max_len: int | None) -> Grid:
    """Lengths doubling from ``2 * block_size`` to the model's max context (or ``max_len``)."""
    top = max_len or shapes.max_context
    if quick:  # lengths x4 apart up to ``top``: seconds to measure, coarse but covering the run
        lengths = sorted({*(n for n in (128, 512, 2048, 8192, 32768) if n < top), top})
        return Grid(tuple(lengths), (0.05, 0.3, 1.0), tuple(lengths), warmup=1, repeats=3)
    lengths = tuple(2 * block_size * 2**i for i in range(20) if 2 * block_size * 2**i <= top)
    densities = (0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0)
    return Grid(lengths, densities, (*lengths, 2 * lengths[-1]))


def _progress(total: int, desc: str, quiet: bool):
    return tqdm(total=total, desc=desc, file=sys.stderr, disable=quiet or not sys.stderr.isatty())


def measure_profile(
    shapes: ModelShapes,
    device: torch.device,
    dtype: str = "fp32",
    backend: str = "auto",
    block_size: int = 64,
    grid: Grid | None = None,
    allreduce_world_size: int = 0,
    quiet: bool = False,
    calibration_batches: int = 8,
) -> Profile:
    """Measure every table of a :class:`Profile` on this machine."""
    grid = grid or default_grid(shapes, block_size, quick=False, max_len=None)
    tdtype = DTYPES[dtype]
    backend = resolve_backend(backend, device)
    torch.manual_seed(0)
    cells = len(grid.lengths) * len(grid.densities) + 2 * len(grid.tokens) + 1
    bar = _progress(cells, "profile", quiet)
    attn = np.zeros((len(grid.lengths), len(grid.densities)))
    h, hkv, d = shapes.num_heads, shapes.num_kv_heads, shapes.head_dim
    budget = Budget(gamma=0.9)
    for i, length in enumerate(grid.lengths):
        q, k, v = (torch.randn(length, n, d, device=device, dtype=tdtype).requires_grad_()
                   for n in (h, hkv, hkv))  # fmt: skip
        grad = torch.randn_like(q)
        cu = torch.tensor([0, length], dtype=torch.int32, device=device)
        for j, density in enumerate(grid.densities):
            layout = random_layout(cu.cpu(), h, block_size, density, seed=i).to(device)

            def step(layout=layout, q=q, k=k, v=v, cu=cu, grad=grad):
                estimate_block_mass(q, k, cu, block_size).layout(budget)
                block_sparse_attention(q, k, v, layout, cu, backend=backend).backward(grad)

            attn[i, j] = median_time(step, device, grid.warmup, grid.repeats)
            bar.update()
    # The per-call part: the same call on a one-block document.
    q, k, v = (torch.randn(block_size, n, d, device=device, dtype=tdtype).requires_grad_()
               for n in (h, hkv, hkv))  # fmt: skip
    cu = torch.tensor([0, block_size], dtype=torch.int32, device=device)
    layout = random_layout(cu.cpu(), h, block_size, 1.0).to(device)

    def one_block():
        estimate_block_mass(q, k, cu, block_size).layout(budget)
        block_sparse_attention(q, k, v, layout, cu, backend=backend).backward(torch.ones_like(q))

    call_s = min(median_time(one_block, device, grid.warmup + 2, max(5, grid.repeats)), attn.min())
    layer = ProxyLayer(shapes).to(device, tdtype)
    head = ProxyHead(shapes).to(device, tdtype)
    other, head_t = [], []
    for tokens in grid.tokens:
        x = torch.randn(tokens, shapes.hidden_size, device=device, dtype=tdtype, requires_grad=True)
        pos = torch.arange(tokens, device=device)
        cos, sin = rotary(pos, d, tdtype)
        other.append(median_time(lambda x=x, c=cos, s=sin: layer(x, c, s, None).sum().backward(),
                                 device, grid.warmup, grid.repeats))  # fmt: skip
        bar.update()
        ids = torch.randint(0, shapes.vocab_size, (tokens,), device=device)

        def head_step(ids=ids):
            hidden = head.embed(ids)
            head.loss(hidden + 0.0, torch.roll(ids, -1)).backward()

        head_t.append(median_time(head_step, device, grid.warmup, grid.repeats))
        bar.update()
    # The optimizer step over a full-size model's parameters (a proxy with every layer).
    model = ProxyModel(shapes).to(device, tdtype)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    opt_s = median_time(opt.step, device, 1, grid.repeats)
    num_params = sum(p.numel() for p in model.parameters())
    del model, opt
    bar.update()
    bar.close()
    allreduce = (
        measure_allreduce(num_params, allreduce_world_size) if allreduce_world_size > 1 else None
    )
    profile = Profile(
        fingerprint=fingerprint(shapes, device, dtype, backend, block_size),
        attention=AttentionTable(list(grid.lengths), list(grid.densities), attn.tolist()),
        layer_other=Table1D(list(grid.tokens), other),
        head=Table1D(list(grid.tokens), head_t),
        num_layers=shapes.num_layers,
        optimizer_seconds=opt_s,
        allreduce_seconds=allreduce,
        attention_call_seconds=call_s,
        meta={"model": shapes.name, "source": "measured", "num_params": num_params,
              "allreduce_world_size": allreduce_world_size or None},
    )  # fmt: skip
    if calibration_batches:
        profile.scales = calibrate_scales(
            profile, shapes, device, dtype, backend, block_size, calibration_batches,
            repeats=grid.repeats, max_tokens=min(4096, grid.lengths[-1]),
        )  # fmt: skip
    return profile


def calibrate_scales(
    profile: Profile,
    shapes: ModelShapes,
    device,
    dtype: str,
    backend: str,
    block_size: int,
    count: int,
    repeats: int,
    max_tokens: int,
) -> list[float]:
    """Fit the (attention, rest, head) scales on ``count`` random micro-batches timed end to end
    (seed 12345: never the validation batches). Parts timed alone carry their own call and
    autograd overheads, so their sum over-predicts a fused step; this removes that bias.

    Relative least squares, ridge-pulled towards one common scale (the components are
    correlated across batches): ``min sum((x_i . s / y_i - 1)^2) + lam |s - s_common|^2``.
    """
    model = LatencyModel(profile)
    batches = random_microbatches(profile, count, max_tokens, seed=12345)
    proxy = ProxyModel(shapes).to(device, DTYPES[dtype])
    x = np.array([model._components(lengths, dens) for lengths, dens in batches])
    y = np.array([
        measure_microbatch(shapes, n, d, device, dtype, backend, block_size, 1, repeats, proxy)
        for n, d in batches
    ])  # fmt: skip
    common = float(np.median(y / x.sum(1)))
    a = x / y[:, None]
    lam = 0.5
    scales = np.linalg.solve(a.T @ a + lam * np.eye(3), a.T @ np.ones(len(y)) + lam * common)
    return np.clip(scales, 0.2, 5.0).tolist()


def _allreduce_worker(rank: int, world: int, init: str, numel: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    buf = torch.randn(numel)
    seconds = median_time(lambda: dist.all_reduce(buf), torch.device("cpu"), 1, 3)
    if rank == 0:
        with open(out, "w") as f:
            f.write(repr(seconds))
    dist.destroy_process_group()


def measure_allreduce(num_params: int, world_size: int) -> float:
    """Median seconds of an fp32 gloo all-reduce of ``num_params`` over ``world_size`` processes."""
    with tempfile.TemporaryDirectory() as tmp:
        init, out = f"file://{os.path.join(tmp, 'rdzv')}", os.path.join(tmp, "t")
        mp.spawn(_allreduce_worker, args=(world_size, init, num_params, out), nprocs=world_size)
        with open(out) as f:
            return float(f.read())


def random_microbatches(
    profile: Profile, count: int, max_tokens: int, seed: int = 0
) -> list[tuple[list[int], list[float]]]:
    """Held-out micro-batches: 1-4 documents of off-grid lengths and densities."""
    rng = np.random.default_rng(seed)
    lo = profile.attention.lengths[0]
    out = []
    while len(out) < count:
        n = int(rng.integers(1, 5))
        lengths = np.exp(rng.uniform(np.log(lo), np.log(max_tokens), n)).astype(int)
        if lengths.sum() > max_tokens or np.isin(lengths, profile.attention.lengths).any():
            continue
        dens = rng.uniform(0.04, 0.95, n).round(3)
        out.append((lengths.tolist(), dens.tolist()))
    return out


def measure_microbatch(
    shapes: ModelShapes, lengths: list[int], densities: list[float], device: torch.device,
    dtype: str, backend: str, block_size: int, warmup: int = 1, repeats: int = 3, model=None,
) -> float:  # fmt: skip
    """End-to-end fwd+bwd seconds of one packed micro-batch on the proxy model."""
    model = model or ProxyModel(shapes).to(device, DTYPES[dtype])
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in lengths]).to(device)
    ids = torch.randint(0, shapes.vocab_size, (int(cu[-1]),), device=device)
    layouts = [
        random_layout(cu, shapes.num_heads, block_size, densities, seed=i).to(device)
        for i in range(len(model.layers))
    ]
    cu = cu.to(device)
    return median_time(
        lambda: model.step(ids, positions, cu, layouts, block_size, backend),
        device,
        warmup,
        repeats,
    )


def recalibration_steps(
    profile: Profile, batches: list, measured: list[float], factor: float = 1.5, tol: float = 0.05
) -> tuple[int | None, float]:
    """Steps of online recalibration a profile scaled by ``factor`` needs to predict the measured
    set within ``max(tol, MAPE of the unscaled model)``; returns (steps or None, final MAPE)."""
    base = LatencyModel(profile)
    target = max(tol, mape(base, batches, measured))
    scaled = Profile.from_json(profile.to_json())
    for table in (scaled.attention.seconds, scaled.layer_other.seconds, scaled.head.seconds):
        for i, row in enumerate(table):
            table[i] = [x * factor for x in row] if isinstance(row, list) else row * factor
    model = LatencyModel(scaled)
    for step in range(1, 4 * len(batches) + 1):
        lengths, dens = batches[(step - 1) % len(batches)]
        model.update(lengths, dens, measured[(step - 1) % len(batches)])
        err = mape(model, batches, measured)
        if err <= target:
            return step, err
    return None, mape(model, batches, measured)


def mape(model: LatencyModel, batches: list, measured: list[float]) -> float:
    pred = np.array([model.predict(lengths, dens) for lengths, dens in batches])
    return float(np.mean(np.abs(pred - np.asarray(measured)) / np.asarray(measured)))
