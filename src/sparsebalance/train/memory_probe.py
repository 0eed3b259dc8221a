"""One memory probe, run in a fresh process: the peak memory of one training micro-batch.

    python -m sparsebalance.train.memory_probe --model tiny --device cpu --tokens 2048

:func:`measure_memory` starts one process per probe (so that every CPU peak is that process's
own peak resident size) and fits the memory model's coefficients to the results. The process imports
what the trainer uses, notes its resident size (the memory model's ``base``: libraries, no model),
builds the model in fp32 with activation checkpointing as asked, gives AdamW its state (one step
on a 64-token batch, as in every step after the first), then runs one packed micro-batch of
``--tokens`` tokens (one document) forward + loss + backward exactly as the trainer does
(:func:`sparsebalance.engine.loss.packed_loss`: bf16 autocast on CUDA) and prints one JSON line:

- ``base_bytes``: CPU: resident bytes before the model; CUDA: 0 (the allocator counts tensors only);
- ``static_bytes``: after the warm-up step (model, optimizer state; CPU: + the libraries);
- ``peak_bytes``: CPU: the process's peak resident size (Linux ``VmHWM``, see
  :func:`~sparsebalance.latency.host_memory.peak_rss_bytes`);
  CUDA: ``torch.cuda.max_memory_allocated`` over the measured micro-batch (peak statistics reset
  after the warm-up; the optimizer's own step is not part of it, as in the memory model);
- ``seconds``: wall time of the measured forward + backward.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from ..data import pack
from ..engine.kernel import add_block_size_argument, resolve_block_size
from ..engine.loss import packed_loss
from ..latency.host_memory import current_rss_bytes, peak_rss_bytes
from ..latency.memory import cpu_coefficients, device_coefficients
from ..latency.memory_fit import MemoryCalibration, MemoryProbe, fit_memory
from ..models import BUILTIN_MODELS, load_shapes
from ..models.attention import PackedAttention
from ..models.checkpointing import MODES, apply_activation_checkpointing
from ..models.hf import build_model
from ..models.shapes import CONFIG_DIR
from ..ops import Budget


def _step(model, tokens: int, device, loss: str, block_size: int, backend: str) -> float:
    """Forward + loss + backward of one document of ``tokens`` random ids; seconds."""
    ids = np.random.default_rng(tokens).integers(0, model.config.vocab_size, tokens)
    batch = pack([ids], device)
    ctx = PackedAttention(batch.cu_seqlens, Budget(gamma=0.9), block_size, backend, lengths=batch.lengths)
    t0 = time.perf_counter()
    loss_sum = packed_loss(model, batch, ctx, loss)
    (loss_sum / max(1, tokens - 1)).backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def probe(
    model_name: str, device: torch.device, tokens: int, checkpointing: str, loss: str, block_size: int, backend: str
) -> dict:
    """Measure one micro-batch in this process (see the module docstring); returns the record."""
    import transformers.models.qwen2.modeling_qwen2  # noqa: F401  (imported before the base)

    cuda = device.type == "cuda"
    base = 0 if cuda else current_rss_bytes()
    model = build_model(model_name, device, torch.float32, seed=0)
    apply_activation_checkpointing(model, checkpointing)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    _step(model, min(64, tokens), device, loss, block_size, backend)
    opt.step()
    opt.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        static = torch.cuda.memory_allocated(device)
    else:
        static = current_rss_bytes()
    seconds = _step(model, tokens, device, loss, block_size, backend)
    if cuda:
        peak = torch.cuda.max_memory_allocated(device)
        source = "torch.cuda.max_memory_allocated"
    else:
        peak, source = peak_rss_bytes()  # this program's own peak (not its parent's)
    return {
        "tokens": tokens,
        "checkpointing": checkpointing,
        "loss": loss,
        "base_bytes": int(base),
        "static_bytes": int(static),
        "peak_bytes": int(peak),
        "seconds": seconds,
        "source": source,
    }


def tied_embeddings(model: str) -> bool:
    """Whether ``model``'s config ties the input embedding and the lm-head (HF default: yes)."""
    path = CONFIG_DIR / f"{model}.json" if model in BUILTIN_MODELS else Path(model)
    if path.is_dir():
        path = path / "config.json"
    return bool(json.loads(path.read_text()).get("tie_word_embeddings", True))


def run_probes(
    model: str,
    device: torch.device,
    tokens: Sequence[int],
    checkpointing: str = "off",
    loss: str = "chunked",
    *,
    block_size: int,
    backend: str = "torch",
    timeout_s: float = 600.0,
) -> list[MemoryProbe]:
    """One fresh process per token count (sequentially: concurrent probes would share the
    machine's memory and time); raises ``RuntimeError`` with the child's last error lines when
    one fails."""
    src = str(Path(__file__).resolve().parents[2])  # this package's root, first on the path
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(x for x in (src, os.environ.get("PYTHONPATH")) if x)}
    out = []
    for t in tokens:
        cmd = [
            sys.executable,
            "-m",
            "sparsebalance.train.memory_probe",
            "--model",
            str(model),
            "--device",
            str(device),
            "--tokens",
            str(int(t)),
            "--checkpointing",
            checkpointing,
            "--loss",
            loss,
            "--block-size",
            str(block_size),
            "--backend",
            backend,
        ]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"memory probe at {t} tokens ran over {timeout_s:.0f} s") from None
        if res.returncode != 0:
            tail = "\n".join(res.stderr.strip().splitlines()[-5:])
            raise RuntimeError(f"memory probe at {t} tokens failed (rc {res.returncode}):\n{tail}")
        out.append(MemoryProbe(**json.loads(res.stdout.strip().splitlines()[-1])))
    return out


def measure_memory(
    model: str,
    device: torch.device,
    fingerprint: dict,
    tokens: Sequence[int],
    checkpointing: str = "off",
    loss: str = "chunked",
    *,
    block_size: int,
    backend: str = "torch",
    timeout_s: float = 600.0,
) -> MemoryCalibration:
    """``sparsebalance profile --memory``: run the probes and fit the memory model to them
    (:func:`sparsebalance.latency.memory_fit.fit_memory`); ``fingerprint`` from
    :func:`~sparsebalance.latency.memory_fit.memory_fingerprint`."""
    probes = run_probes(
        model, device, tokens, checkpointing, loss, block_size=block_size, backend=backend, timeout_s=timeout_s
    )
    analytic = device_coefficients(device) if device.type == "cuda" else cpu_coefficients(0.0)
    return fit_memory(load_shapes(model), analytic, probes, fingerprint, block_size, tied_embeddings(model))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--tokens", type=int, required=True)
    p.add_argument("--checkpointing", choices=MODES, default="off")
    p.add_argument("--loss", choices=["chunked", "plain"], default="chunked")
    add_block_size_argument(p)
    p.add_argument("--backend", default="torch")
    a = p.parse_args(argv)
    a.block_size = resolve_block_size(a.device, a.block_size, a.backend)
    if a.tokens < 2:
        raise SystemExit(f"--tokens must be >= 2, got {a.tokens}")
    result = probe(a.model, torch.device(a.device), a.tokens, a.checkpointing, a.loss, a.block_size, a.backend)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
