"""A hand-written accelerate loop with SparseBalance's plain-loop API: each step yields this
rank's planned micro-batches (the same count on every rank); ``step.finish()`` feeds the step back.

    python examples/accelerate_loop.py      # or: accelerate launch / torchrun --nproc-per-node 2
"""

import contextlib
import os
import sys
import tempfile

import torch
from accelerate import Accelerator
from accelerate.utils import send_to_device

import sparsebalance
from sparsebalance.integrations import PlannerConfig, balanced_loader
from sparsebalance.latency import analytic_profile
from sparsebalance.models import load_shapes
from sparsebalance.models.hf import build_model

sys.path.insert(0, os.path.dirname(__file__))
from hf_trainer import documents  # the same synthetic token documents


def main(out: str, steps: int = 2) -> list[float]:
    accelerator = Accelerator(cpu=True)
    model = build_model("tiny")
    runtime = sparsebalance.attach(model, block_size=32)  # before accelerate wraps it in DDP
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    profile = f"{out}/profile-{accelerator.process_index}.json"
    analytic_profile(load_shapes("tiny"), "h100", block_size=32).save(profile)
    config = PlannerConfig(global_batch=8, micro_batches=4, capacity=1024, block_size=32)
    loop = balanced_loader(runtime, documents(), config, profile=profile)
    losses = []
    for step in loop.steps(epoch=0, max_steps=steps):
        total = 0.0
        for i, batch in enumerate(step):
            batch = send_to_device(batch, accelerator.device)  # the ticket stays as it is
            last = i == len(step) - 1  # DDP syncs gradients in the last backward only
            with contextlib.nullcontext() if last else accelerator.no_sync(model):
                loss = model(**batch).loss  # this micro-batch's share of the global token mean
                accelerator.backward(loss * accelerator.num_processes)  # DDP averages ranks
            total += float(loss.detach())
        optimizer.step()
        optimizer.zero_grad()
        step.finish()  # latency model + density estimator feedback, telemetry
        losses.append(float(accelerator.reduce(torch.tensor(total), "sum")))
    return losses


if __name__ == "__main__":
    losses = main(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp())
    if os.environ.get("RANK", "0") == "0":  # once per run, not per rank
        print("losses", losses)
    sparsebalance.shutdown()  # frees the trainer, then the process group: a clean exit on every rank
