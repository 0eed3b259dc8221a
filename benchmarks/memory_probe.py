"""One memory measurement in a fresh process: peak RSS of one training micro-batch on CPU.

Run by ``benchmarks/memory.py`` (one process per configuration, so every peak is the process's own
``ru_maxrss``). The process builds the model (fp32), an AdamW whose state already exists (one step
on a 64-token batch first, as in any step after the first), then runs one packed micro-batch of
``--tokens`` tokens (one document) forward + loss + backward and reports:

- ``import_rss``: RSS once the libraries are imported, before the model (the model's base);
- ``static_rss``: RSS after the warm-up step (model, optimizer state, libraries);
- ``peak_rss``: the process's peak RSS (``ru_maxrss``) after the measured micro-batch;
- ``seconds``: wall time of the measured forward + backward.
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from sparsebalance.data import pack
from sparsebalance.models.attention import PackedAttention
from sparsebalance.models.checkpointing import apply_activation_checkpointing
from sparsebalance.models.head import forward_hidden, output_head
from sparsebalance.models.hf import build_model
from sparsebalance.models.shapes import CONFIG_DIR
from sparsebalance.ops import Budget
from sparsebalance.ops.loss import linear_cross_entropy


def current_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def model_dir(base: str, layers: int) -> str:
    cfg = json.loads((CONFIG_DIR / f"{base}.json").read_text())
    cfg["num_hidden_layers"] = layers
    out = Path(tempfile.mkdtemp(prefix="sb-memory-"))
    (out / "config.json").write_text(json.dumps(cfg))
    return str(out)


def step(model, tokens, loss_impl: str, budget: Budget, block_size: int) -> float:
    rng = np.random.default_rng(tokens)
    vocab = model.config.vocab_size
    batch = pack([rng.integers(0, vocab, tokens)], "cpu")
    ctx = PackedAttention(batch.cu_seqlens, budget, block_size, "torch")
    kw = dict(
        input_ids=batch.input_ids,
        position_ids=batch.position_ids,
        sb_attention=ctx,
        use_cache=False,
    )
    t0 = time.perf_counter()
    weights = batch.loss_weights[0]
    if loss_impl == "plain":
        logits = model(**kw).logits[0]
        ce = torch.nn.functional.cross_entropy(logits.float(), batch.labels[0], ignore_index=-100, reduction="none")
        loss = (ce * weights).sum()
    else:
        hidden = forward_hidden(model, **kw)[0]
        weight, bias = output_head(model)
        loss = linear_cross_entropy(hidden, weight, batch.labels[0], weights, bias, "chunked")
    (loss / max(1, tokens - 1)).backward()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-0.5b")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--tokens", type=int, required=True)
    p.add_argument("--checkpointing", default="off", choices=["off", "full", "selective"])
    p.add_argument("--loss", default="chunked", choices=["plain", "chunked"])
    p.add_argument("--gamma", type=float, default=0.9)
    p.add_argument("--max-density", type=float, default=0.1)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    import_rss = current_rss()  # libraries loaded, no model yet: the memory model's base
    torch.manual_seed(0)
    model = build_model(model_dir(a.model, a.layers), "cpu", torch.float32, seed=0)
    apply_activation_checkpointing(model, a.checkpointing)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    budget = Budget(gamma=a.gamma, max_density=a.max_density)
    step(model, 64, a.loss, budget, a.block_size)  # creates gradients and the optimizer state
    opt.step()
    opt.zero_grad(set_to_none=True)
    static = current_rss()
    seconds = step(model, a.tokens, a.loss, budget, a.block_size)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result = {
        **vars(a),
        "import_rss": import_rss,
        "static_rss": static,
        "peak_rss": peak,
        "seconds": seconds,
        "num_params": sum(p.numel() for p in model.parameters()),
        "threads": torch.get_num_threads(),
    }
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
