"""What do I gain over what I run today? The same HF Trainer job twice, on the same documents:

- ``baseline``: the Trainer's defaults for packed long-context fine-tuning: dense SDPA, padding-free
  packing (``DataCollatorWithFlattening``: ``per_device_train_batch_size`` documents per
  micro-batch), the default random sampler;
- ``sparsebalance``: ``sparsebalance.attach`` + ``sparsebalance.hf.enable`` (SAB plans of
  ``--capacity`` tokens per micro-batch, block-sparse attention, DST budgets, feedback).

Both draw ``per_device_train_batch_size x gradient_accumulation_steps x ranks`` documents per
optimizer step from one seeded heavy-tailed set (their step compositions differ: each sampler
picks its own), run ``--steps`` steps and report tokens/s, mean step time (the first
``--warmup`` steps left out), peak memory (CUDA: ``max_memory_allocated``; CPU: the process's
``VmHWM``), measured balance (mean / max rank compute, each rank's compute ending when DDP
got its last gradient bucket) and the loss after the same steps. Each variant is a fresh
``torchrun`` of this file.

    python benchmarks/hf_trainer_gain.py --model tiny --nproc 2 --steps 20            # CPU, tiny
    python benchmarks/hf_trainer_gain.py --model qwen2.5-0.5b --nproc 2 --device cuda \\
        --max-len 32768 --capacity 32768 --steps 30                                 # GPU node

Measure alone: every rank's time is the machine's. Writes
``benchmarks/results/<date>-hf-trainer-gain-<device>.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

VARIANTS = ("baseline", "sparsebalance")


def documents(num: int, max_len: int, vocab: int, seed: int):
    """``num`` token documents, lengths lognormal (heavy tail) in ``[64, max_len]``."""
    from datasets import Dataset

    rng = np.random.default_rng(seed)
    mu = np.log(max_len / 8)
    lengths = np.clip(rng.lognormal(mu, 1.0, num).astype(int), 64, max_len)
    ids = [rng.integers(0, vocab, n).tolist() for n in lengths]
    return Dataset.from_dict({"input_ids": ids})


def peak_memory(device) -> int:
    import torch

    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def worker(args) -> None:
    """One variant on this torchrun rank; rank 0 writes ``<out>/<variant>.json``."""
    import torch
    from transformers import DataCollatorWithFlattening, Trainer, TrainerCallback, TrainingArguments

    import sparsebalance
    import sparsebalance.hf
    from sparsebalance.clock import Clock as Marks
    from sparsebalance.models.hf import build_model
    from sparsebalance.train.parallelize import _ReadyClock

    cuda = args.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    impl = "sdpa" if args.variant == "baseline" else "sparsebalance"
    model = build_model(args.model, "cuda" if cuda else "cpu", dtype, attn_implementation=impl)
    data = documents(args.documents, args.max_len, int(model.config.vocab_size), args.seed)
    targs = TrainingArguments(
        output_dir=args.out, per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.accum, max_steps=args.steps, learning_rate=args.lr,
        lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[],
        use_cpu=not cuda, bf16=cuda, seed=args.seed, disable_tqdm=True,
        ddp_find_unused_parameters=False,  # no include_num_input_tokens_seen: it gathers per
        # micro-batch, which makes every rank wait for the slowest at each micro-batch
    )  # fmt: skip
    collator = DataCollatorWithFlattening(return_position_ids=True)
    trainer = Trainer(model=model, args=targs, train_dataset=data, data_collator=collator)
    runtime = None
    if args.variant == "sparsebalance":
        runtime = sparsebalance.attach(model, block_size=args.block_size)
        sparsebalance.hf.enable(trainer, capacity=args.capacity, profile=args.profile,
                                block_size=args.block_size)  # fmt: skip

    class Clock(TrainerCallback):
        """Step times; for the baseline also each rank's compute (until DDP got its last
        gradient bucket: SparseBalance's callback measures its own the same way)."""

        def __init__(self) -> None:
            self.steps, self.compute, self.t0, self.ready = [], [], 0.0, None

        def on_train_begin(self, *a, **k):
            wrapped = trainer.model_wrapped
            if runtime is None and isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):
                self.ready = _ReadyClock(Marks("cpu"))  # host stamps, as the callback's
                wrapped.register_comm_hook(self.ready, _ReadyClock.hook)

        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_pre_optimizer_step(self, *a, **k):
            if self.ready is not None and self.ready.last is not None:
                self.compute.append(self.ready.last.host - self.t0)

        def on_step_end(self, *a, **k):
            if cuda:
                torch.cuda.synchronize()
            self.steps.append(time.perf_counter() - self.t0)

    clock = Clock()
    trainer.add_callback(clock)
    seen = [0]  # input tokens of this rank's forwards (fillers included: 2 tokens each)

    def count(module, a, kw):
        if module.training:
            seen[0] += int(kw["input_ids"].numel())

    model.register_forward_pre_hook(count, with_kwargs=True)
    trainer.train()
    state = trainer.state
    losses = [e["loss"] for e in state.log_history if "loss" in e]
    peaks = trainer.accelerator.gather(torch.tensor([peak_memory(trainer.args.device)])).tolist()
    tokens = int(trainer.accelerator.gather(torch.tensor([seen[0]])).sum())
    if runtime is not None:
        balance = [h["balance"] for h in runtime.planner.history[args.warmup :]]
    else:  # mean / max rank compute per step
        per_rank = trainer.accelerator.gather(torch.tensor([clock.compute[args.warmup :]]))
        per_rank = per_rank.reshape(-1, len(clock.compute[args.warmup :]))
        balance = (per_rank.mean(0) / per_rank.max(0).values).tolist()
    if trainer.is_world_process_zero():
        timed = clock.steps[args.warmup :] or clock.steps
        seconds = float(np.sum(timed))
        out = {
            "variant": args.variant, "steps": len(clock.steps), "step_s": float(np.mean(timed)),
            "tokens": tokens, "tokens_per_s": tokens * len(timed) / len(clock.steps) / seconds,
            "peak_bytes_max_rank": int(max(peaks)), "loss_last": losses[-1],
            "loss_mean_last5": float(np.mean(losses[-5:])), "losses": losses,
            "balance": float(np.mean(balance)) if balance else None,
        }  # fmt: skip
        Path(args.out, f"{args.variant}.json").write_text(json.dumps(out))
    if torch.distributed.is_initialized():  # gloo torn down at interpreter exit can abort
        # ("terminate called without an active exception"); the barrier keeps a rank from
        # closing its connections while the other is still on its way out of the last collective
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def launch(args, variant: str, tmp: Path) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc),
           "--master-port", str(args.port), __file__, "--worker", "--variant", variant,
           "--out", str(tmp)]  # fmt: skip
    for key in ("model", "device", "steps", "warmup", "documents", "max_len", "capacity", "batch",
                "accum", "lr", "seed", "block_size", "profile"):  # fmt: skip
        value = getattr(args, key)
        if value is not None:
            cmd += [f"--{key.replace('_', '-')}", str(value)]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    subprocess.run(cmd, check=True, env=env)
    return json.loads((tmp / f"{variant}.json").read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="tiny | qwen2.5-0.5b | a local config dir")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the timing")
    p.add_argument("--documents", type=int, default=512)
    p.add_argument("--max-len", type=int, default=2048, help="longest document (tokens)")
    p.add_argument("--capacity", type=int, default=None, help="sparsebalance tokens/micro-batch")
    p.add_argument("--batch", type=int, default=2, help="per_device_train_batch_size")
    p.add_argument("--accum", type=int, default=4, help="gradient_accumulation_steps")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--profile", default=None, help="latency profile JSON (default: measured)")
    p.add_argument("--port", type=int, default=29517)
    p.add_argument("--results", default="benchmarks/results")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    args.capacity = args.capacity or args.batch * args.max_len
    with tempfile.TemporaryDirectory() as tmp:
        rows = {v: launch(args, v, Path(tmp)) for v in VARIANTS}
    write(args, rows)


def write(args, rows: dict) -> None:
    import torch

    from sparsebalance.results import markdown_table, write_results

    base, sb = rows["baseline"], rows["sparsebalance"]
    table = markdown_table(
        ["variant", "step (s)", "tokens/s", "peak memory (GiB, max rank)", "measured balance",
         "loss (last)", "loss (mean of last 5)"],
        [[r["variant"], r["step_s"], r["tokens_per_s"], r["peak_bytes_max_rank"] / 2**30,
          r["balance"], r["loss_last"], r["loss_mean_last5"]] for r in (base, sb)],
    )  # fmt: skip
    notes = (f"{args.nproc} ranks, model {args.model}, {args.steps} steps ({args.warmup} warm-up "
             f"steps untimed), {args.batch} x {args.accum} x {args.nproc} documents per step, "
             f"lengths 64..{args.max_len} (lognormal), SparseBalance capacity {args.capacity}. "
             f"Speed-up (tokens/s): {sb['tokens_per_s'] / base['tokens_per_s']:.3f}x. The two "
             "samplers draw different documents per step (same set, same count).")  # fmt: skip
    device = torch.device(args.device)
    paths = write_results(args.results, "hf-trainer-gain", device, table, {"rows": rows}, notes)
    print(table, "\n", notes, "\n", *paths)


if __name__ == "__main__":
    main()
