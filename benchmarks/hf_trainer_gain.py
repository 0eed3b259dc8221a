"""What do I gain over what I run today? The same HF Trainer job twice, on the same documents:

- ``baseline``: the Trainer's defaults for packed long-context fine-tuning: dense SDPA, padding-free
  packing (``DataCollatorWithFlattening``: ``per_device_train_batch_size`` documents per
  micro-batch), the default random sampler;
- ``sparsebalance``: ``sparsebalance.attach`` + ``sparsebalance.hf.enable`` (SAB plans of
  ``--capacity`` tokens per micro-batch, block-sparse attention, DST budgets, feedback).

Both draw ``per_device_train_batch_size x gradient_accumulation_steps x ranks`` documents per
optimizer step from one seeded set (their step compositions differ: each sampler picks its own),
run ``--steps`` steps and report tokens/s, mean step time (the first ``--warmup`` steps left
out), peak memory (CUDA: ``max_memory_allocated``; CPU: the process's ``VmHWM``), the share of
the step spent inside attention (forward and backward: :class:`AttentionTimer`), measured
balance (mean / max rank compute, each rank's compute ending when DDP got its last gradient
bucket; none with one rank) and the loss after the same steps. Each variant is a fresh
``torchrun`` of this file; one process or several, on CPU (gloo) or CUDA (NCCL).

Length mixes (``--mix``), documents longer than ``--max-len`` truncated to it (counted):

- ``short``: lognormal, median ``max_len / 8``, in [64, max_len] (the first GPU run's mix);
- ``chatqa2``, ``longalign``: the ChatQA2-like and LongAlign-like long-context fine-tuning mixes
  of ``configs/table1.toml``: at the paper's scale on CUDA (``[simulated.mixes]``: ChatQA2-like
  85 % in 1K..4K and 15 % in 16K..64K; LongAlign-like 8K..72K), scaled by 1/8 on CPU
  (``[measured.mixes]``).

Defaults per mix (``DEFAULTS``): ``--max-len`` 2,048 / 16,384 (CPU / CUDA) for ``short`` and
8,192 / 32,768 for the long mixes, with Liger's fused linear cross-entropy in both variants on
CUDA (``--liger``): the Trainer's full-vocabulary logits (151,936 x tokens, upcast to fp32 for
the loss) of a 32K micro-batch do not fit one 80 GB H100 with Qwen2.5-0.5B beside the rest
(~2.6 MB a token measured at 16K), so 32K is the longest document both variants hold whole.

    python benchmarks/hf_trainer_gain.py --model tiny --nproc 2 --steps 20            # CPU, tiny
    python benchmarks/hf_trainer_gain.py --model qwen2.5-0.5b --device cuda --nproc 1 \\
        --mix chatqa2 --batch 1 --accum 4 --steps 10 --profile h100.json            # one GPU

Measure alone: every rank's time is the machine's. Writes
``benchmarks/results/<date>-hf-trainer-gain-<mix>-<device>.{md,json}``.
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

sys.path.insert(0, str(Path(__file__).parent))
from table1 import CONFIG, draw_lengths  # the mixes' one definition

VARIANTS = ("baseline", "sparsebalance")
DEFAULTS = {"short": (2048, 16384, False), "chatqa2": (8192, 32768, True), "longalign": (8192, 32768, True)}
"""mix -> (--max-len on CPU, on CUDA, Liger's loss on CUDA)."""


def lengths(rng, mix: str, device: str, num: int, max_len: int) -> tuple[np.ndarray, int]:
    """``num`` document lengths (int64) in ``[64, max_len]`` drawn with ``rng``, and how many
    were truncated to ``max_len``."""
    if mix == "short":
        raw = rng.lognormal(np.log(max_len / 8), 1.0, num).astype(int)
    else:
        import tomllib

        section = "simulated" if device == "cuda" else "measured"
        raw = draw_lengths(tomllib.loads(CONFIG.read_text())[section]["mixes"][mix], num, rng)
    return np.clip(raw, 64, max_len), int((raw > max_len).sum())


def documents(args, vocab: int) -> tuple[list[dict], np.ndarray, int]:
    """The run's documents (random tokens; a list is the Trainer's map-style dataset), their
    lengths and how many were truncated: the same for both variants and every rank."""
    rng = np.random.default_rng(args.seed)
    lens, cut = lengths(rng, args.mix, args.device, args.documents, args.max_len)
    return [{"input_ids": rng.integers(0, vocab, int(n)).tolist()} for n in lens], lens, cut


def peak_memory(device) -> int:
    import torch

    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


class AttentionTimer:
    """Device time inside the model's attention calls, forward and backward.

    :meth:`wrap` returns an attention function (transformers' ``AttentionInterface`` signature)
    that marks before and after each training call and hooks the gradients: the output's hook
    fires where the call's backward starts, the inputs' (query, key, value) where it has ended
    (the last one). Marks come from a :class:`sparsebalance.clock.Clock` (CUDA events on the
    compute stream; host stamps on CPU) and are read by :meth:`take` after the step's
    synchronize."""

    def __init__(self, clock) -> None:
        self.clock = clock
        self.calls: list[tuple[list, list]] = []  # per call: (forward marks, backward marks)

    def wrap(self, fn):
        import torch

        def attention(module, query, key, value, *args, **kwargs):
            if not (module.training and torch.is_grad_enabled() and query.requires_grad):
                return fn(module, query, key, value, *args, **kwargs)
            fwd, bwd = [self.clock.mark()], []
            out, weights = fn(module, query, key, value, *args, **kwargs)
            fwd.append(self.clock.mark())

            def stamp(grad):
                bwd.append(self.clock.mark())

            out.register_hook(stamp)
            for x in (query, key, value):
                if x.requires_grad:
                    x.register_hook(stamp)
            self.calls.append((fwd, bwd))
            return out, weights

        return attention

    def take(self) -> float:
        """Seconds inside attention since the last call (forward + backward); the marks must be
        complete (after the step's synchronize)."""
        total = 0.0
        for fwd, bwd in self.calls:
            total += self.clock.seconds(fwd[0], fwd[1])
            if len(bwd) >= 2:
                total += self.clock.seconds(bwd[0], bwd[-1])
        self.calls = []
        return total


def gather_rows(trainer, row: list[float]) -> np.ndarray:
    """Every rank's ``row`` (float64 ``(ranks, len(row))``, rank order): gathered through the
    trainer's device (NCCL gathers CUDA tensors only)."""
    import torch

    local = torch.tensor([row], dtype=torch.float64, device=trainer.args.device)
    return trainer.accelerator.gather(local).cpu().numpy()


def summarize(args, trainer, clock, seen: int, peak: int, history: list | None) -> dict | None:
    """The variant's row (on the main process; None elsewhere). ``clock`` holds this rank's
    per-step ``steps``, ``attention`` and (baseline under DDP) ``compute`` seconds;
    ``history``: SparseBalance's per-step telemetry (None for the baseline)."""
    w = args.warmup if len(clock.steps) > args.warmup else 0
    timed = clock.steps[w:]
    row = [peak, seen, float(np.sum(clock.attention[w:])), float(np.sum(timed))]
    compute = clock.compute[w:] if history is None else []
    rows = gather_rows(trainer, row + list(compute))  # (ranks, 4 + steps): one collective
    if rows.shape[0] == 1:
        balance = None  # one rank: nothing to balance
    elif history is not None:
        balance = float(np.mean([h["efficiency"] for h in history[w:]]))
    else:  # mean / max rank compute per step
        per_step = rows[:, 4:]
        balance = float(np.mean(per_step.mean(0) / per_step.max(0))) if per_step.size else None
    if not trainer.is_world_process_zero():
        return None
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    tokens = int(rows[:, 1].sum())
    return {
        "variant": args.variant,
        "steps": len(clock.steps),
        "step_s": float(np.mean(timed)),
        "tokens": tokens,
        "tokens_per_s": tokens * len(timed) / len(clock.steps) / sum(timed),
        "peak_bytes_max_rank": int(rows[:, 0].max()),
        "loss_last": losses[-1],
        "loss_mean_last5": float(np.mean(losses[-5:])),
        "losses": losses,
        "attention_share": float(np.mean(rows[:, 2] / rows[:, 3])),
        "balance": balance,
    }


def worker(args) -> None:
    """One variant on this torchrun rank; rank 0 writes ``<out>/<variant>.json``."""
    import torch
    from transformers import (
        AttentionInterface,
        DataCollatorWithFlattening,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    import sparsebalance
    import sparsebalance.hf
    from sparsebalance.clock import Clock as Marks
    from sparsebalance.engine.parallelize import ReadyClock
    from sparsebalance.models.hf import build_model

    cuda = args.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    impl = "sdpa" if args.variant == "baseline" else "sparsebalance"
    model = build_model(args.model, "cuda" if cuda else "cpu", dtype, attn_implementation=impl)
    data, _, _ = documents(args, int(model.config.vocab_size))
    targs = TrainingArguments(
        output_dir=args.out,
        per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.accum,
        max_steps=args.steps,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=not cuda,
        bf16=cuda,
        seed=args.seed,
        disable_tqdm=True,
        ddp_find_unused_parameters=False,
        use_liger_kernel=args.liger,
        # no include_num_input_tokens_seen: it gathers per micro-batch, which makes every rank
        # wait for the slowest at each micro-batch
    )
    collator = DataCollatorWithFlattening(return_position_ids=True)
    trainer = Trainer(model=model, args=targs, train_dataset=data, data_collator=collator)
    runtime = None
    if args.variant == "sparsebalance":
        runtime = sparsebalance.attach(model, block_size=args.block_size)
        sparsebalance.hf.enable(trainer, capacity=args.capacity, profile=args.profile, block_size=args.block_size)
    marks = Marks(trainer.args.device)
    timer = AttentionTimer(marks)
    name = model.config._attn_implementation  # the variant's function, timed under its name
    AttentionInterface.register(name, timer.wrap(ALL_ATTENTION_FUNCTIONS[name]))

    class Clock(TrainerCallback):
        """Step and attention times; for the baseline also each rank's compute (until DDP got
        its last gradient bucket: SparseBalance's callback measures its own the same way)."""

        def __init__(self) -> None:
            self.steps, self.attention, self.compute, self.t0, self.ready = [], [], [], 0.0, None

        def on_train_begin(self, *a, **k):
            wrapped = trainer.model_wrapped
            if runtime is None and isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):
                self.ready = ReadyClock(Marks("cpu"))  # host stamps, as the callback's
                wrapped.register_comm_hook(self.ready, ReadyClock.hook)

        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_pre_optimizer_step(self, *a, **k):
            if self.ready is not None and self.ready.last is not None:
                self.compute.append(self.ready.last.host - self.t0)

        def on_step_end(self, *a, **k):
            marks.synchronize()
            self.steps.append(time.perf_counter() - self.t0)
            self.attention.append(timer.take())

    clock = Clock()
    trainer.add_callback(clock)
    seen = [0]  # input tokens of this rank's forwards (fillers included: 2 tokens each)

    def count(module, a, kw):
        if module.training:
            seen[0] += int(kw["input_ids"].numel())

    model.register_forward_pre_hook(count, with_kwargs=True)
    trainer.train()
    history = runtime.planner.history if runtime is not None else None
    row = summarize(args, trainer, clock, seen[0], peak_memory(trainer.args.device), history)
    if row is not None:
        Path(args.out, f"{args.variant}.json").write_text(json.dumps(row))
    if torch.distributed.is_initialized():  # gloo torn down at interpreter exit can abort
        # ("terminate called without an active exception"); the barrier keeps a rank from
        # closing its connections while the other is still on its way out of the last collective
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    # Even so, gloo's worker threads can still hold finished work at interpreter exit and abort
    # the process (SIGABRT after the row is written: CI, 2026-12-02); the row is on disk, so
    # leave without the interpreter's teardown, as the project's other multi-process workers do.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launch(args, variant: str, tmp: Path) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(args.nproc),
        "--master-port",
        str(args.port),
        __file__,
        "--worker",
        "--variant",
        variant,
        "--out",
        str(tmp),
        "--liger" if args.liger else "--no-liger",
    ]
    for key in (
        "model",
        "device",
        "mix",
        "steps",
        "warmup",
        "documents",
        "max_len",
        "capacity",
        "batch",
        "accum",
        "lr",
        "seed",
        "block_size",
        "profile",
    ):
        value = getattr(args, key)
        if value is not None:
            cmd += [f"--{key.replace('_', '-')}", str(value)]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    subprocess.run(cmd, check=True, env=env)
    return json.loads((tmp / f"{variant}.json").read_text())


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="tiny | qwen2.5-0.5b | a local config dir")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--mix", default="short", choices=tuple(DEFAULTS), help="document lengths")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the timing")
    p.add_argument("--documents", type=int, default=512)
    p.add_argument("--max-len", type=int, default=None, help="longest document (default: mix's)")
    p.add_argument("--capacity", type=int, default=None, help="sparsebalance tokens/micro-batch")
    p.add_argument("--batch", type=int, default=2, help="per_device_train_batch_size")
    p.add_argument("--accum", type=int, default=4, help="gradient_accumulation_steps")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-size", type=int, default=None, help="default: the device's")
    p.add_argument(
        "--liger",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Liger's fused loss in both variants (default: the mix's, CUDA only)",
    )
    p.add_argument("--profile", default=None, help="latency profile JSON (default: measured)")
    p.add_argument("--port", type=int, default=29517)
    p.add_argument("--results", default="benchmarks/results")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    from sparsebalance.ops.flex_config import default_block_size

    cpu_len, cuda_len, liger = DEFAULTS[args.mix]
    cuda = args.device == "cuda"
    args.max_len = args.max_len or (cuda_len if cuda else cpu_len)
    args.capacity = args.capacity or args.batch * args.max_len
    args.block_size = args.block_size or default_block_size(args.device)
    args.liger = (liger and cuda) if args.liger is None else args.liger
    if args.liger and not cuda:
        p.error("--liger needs --device cuda (Liger's kernels are Triton's)")
    return args


def main() -> None:
    args = parse()
    if args.worker:
        return worker(args)
    if args.liger:
        import importlib.util

        if importlib.util.find_spec("liger_kernel") is None:
            sys.exit(
                "hf_trainer_gain: --liger: liger-kernel is not installed (pip install "
                "liger-kernel, or --no-liger with --max-len 16384 on an 80 GB GPU)"
            )
    with tempfile.TemporaryDirectory() as tmp:
        rows = {v: launch(args, v, Path(tmp)) for v in VARIANTS}
    write(args, rows)


def write(args, rows: dict) -> None:
    import torch

    from sparsebalance.results import markdown_table, write_results

    base, sb = rows["baseline"], rows["sparsebalance"]
    table = markdown_table(
        [
            "variant",
            "step (s)",
            "tokens/s",
            "peak memory (GiB, max rank)",
            "attention share",
            "measured balance",
            "loss (last)",
            "loss (mean of last 5)",
        ],
        [
            [
                r["variant"],
                r["step_s"],
                r["tokens_per_s"],
                r["peak_bytes_max_rank"] / 2**30,
                r["attention_share"],
                r["balance"],
                r["loss_last"],
                r["loss_mean_last5"],
            ]
            for r in (base, sb)
        ],
    )
    _, lens, cut = documents(args, vocab=2)  # the lengths only matter here
    notes = (
        f"{args.nproc} rank(s), model {args.model}, {args.steps} steps ({args.warmup} warm-up "
        f"steps untimed), {args.batch} x {args.accum} x {args.nproc} documents per step; "
        f"mix {args.mix}: {args.documents} documents of {lens.min()}..{lens.max()} tokens "
        f"(mean {lens.mean():.0f}), {cut} truncated to --max-len {args.max_len}; "
        f"SparseBalance capacity {args.capacity}, block {args.block_size}; Liger's fused "
        f"loss {'in both variants' if args.liger else 'off'}. Speed-up (tokens/s): "
        f"{sb['tokens_per_s'] / base['tokens_per_s']:.3f}x; peak memory "
        f"{sb['peak_bytes_max_rank'] / base['peak_bytes_max_rank']:.3f}x. Attention share: "
        "attention's forward + backward time / step time. Measured balance: none with one "
        "rank. The two samplers draw different documents per step (same set, same "
        "count)."
    )
    device = torch.device(args.device)
    paths = write_results(
        args.results,
        f"hf-trainer-gain-{args.mix}",
        device,
        table,
        {"rows": rows, "mix": args.mix, "truncated": cut},
        notes,
    )
    print(table, "\n", notes, "\n", *paths)


if __name__ == "__main__":
    main()
