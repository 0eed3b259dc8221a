"""``sparsebalance.shutdown()``: the last line of a distributed training script.

A Hugging Face ``Trainer`` (or accelerate's objects) sits in reference cycles that hold its DDP
model and, through it, gloo's last work objects; the interpreter frees them while it shuts down,
when gloo's threads can touch objects already gone, and a rank aborts after its work is done
(``terminate called without an active exception``, exit -6, so ``torchrun`` reports the run as
failed; seen under load on CPU machines). ``shutdown`` frees those cycles while the interpreter is
whole, then destroys the process group (which the Trainer leaves open): what
``sparsebalance train`` does at its end, for users' own scripts.
"""

from __future__ import annotations

import gc


def shutdown() -> None:
    """Free unreachable objects, wait for every rank, then destroy the default process group if
    one is initialised (a no-op without torch.distributed); call it once per process, on every
    rank, after training and saving, with nothing left referencing the trainer."""
    gc.collect()
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if dist.get_world_size() > 1:  # no rank closes its connections while a peer still uses them
            dist.barrier()
        dist.destroy_process_group()
