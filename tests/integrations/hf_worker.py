"""Run under ``torchrun --nproc-per-node 2`` (gloo, CPU) by ``test_hf_trainer.py``: the same
global batches trained by ``sparsebalance train`` (its ``Trainer``), by HF ``Trainer`` with
``sparsebalance.attach`` + ``sparsebalance.hf.enable`` (then resumed mid-run), by TRL
``SFTTrainer`` and by the plain-loop API; every rank writes ``<out>/<name>-<rank>.json``.

Configured alike (what "the same run" means here): same initial weights (``build_model`` with the
seed), one AdamW parameter group with weight decay on every parameter (HF gets it through
``optimizers=``), constant LR without warm-up, gradient-norm clip 1.0, deterministic DST
(no timings), loss = global target-token mean (``sparsebalance train --loss plain``; HF: the
model's loss over ``shift_labels`` / ``num_items_in_batch`` with
``average_tokens_across_devices=True``, DDP averaging over the 2 ranks).
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from sparsebalance.batching import PlanConfig, plan_batch
from sparsebalance.engine.runtime import Runtime
from sparsebalance.latency import analytic_profile
from sparsebalance.models import load_shapes
from sparsebalance.models.hf import build_model
from sparsebalance.train import TrainConfig, Trainer
from sparsebalance.tuning import DSTConfig

LR, WD, STEPS, GLOBAL_BATCH, CAPACITY, ACCUM, BLOCK = 3e-3, 0.01, 3, 8, 512, 4, 32
DST = DSTConfig(mode="bidirectional", budget="gamma", gamma0=0.9, gamma_min=0.5, gamma_max=0.99)


def write_data(tmp: Path) -> Path:
    """32 documents with heavy-tailed lengths (seeded), as jsonl text."""
    rng = np.random.default_rng(7)
    words = np.clip(rng.lognormal(4.2, 0.9, 32).astype(int), 8, 420)
    path = tmp / "data.jsonl"
    path.write_text(
        "".join(
            json.dumps({"text": " ".join(f"w{(i * 7 + j) % 50}" for j in range(n))}) + "\n" for i, n in enumerate(words)
        )
    )
    return path


def sb_config(tmp: Path, profile: Path) -> TrainConfig:
    return TrainConfig(
        data=str(write_data(tmp)),
        profile=str(profile),
        out=str(tmp / "sb"),
        steps=STEPS,
        global_batch=GLOBAL_BATCH,
        capacity=CAPACITY,
        block_size=BLOCK,
        lr=LR,
        weight_decay=WD,
        warmup_steps=0,
        schedule="constant",
        grad_clip=1.0,
        deterministic=True,
        loss="plain",
        dst=DST,
        overwrite=True,
        strategy="sab",  # the integrations plan whole documents
        device="cpu",
    )


class LossProbe:
    """Sums the model's returned loss (its share of the global token mean) per optimizer step
    (test-only: a forward hook, the public torch API)."""

    def __init__(self, model, accum: int) -> None:
        self.values, self.accum, self.n = [], accum, 0
        model.register_forward_hook(self.hook)

    def hook(self, module, args, output):
        if not module.training or getattr(output, "loss", None) is None:
            return
        if self.n % self.accum == 0:
            self.values.append(0.0)
        self.values[-1] += float(output.loss.detach())
        self.n += 1

    def global_losses(self) -> list[float]:
        total = torch.tensor(self.values, dtype=torch.float64)
        dist.all_reduce(total)
        return total.tolist()


def word_tokenizer():
    """A three-word tokenizer built here (TRL wants a processing class; the dataset is already
    tokenized): nothing is downloaded."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


class LogRecorder:
    """A callback that keeps every training log the Trainer's loggers receive."""

    def __init__(self) -> None:
        from transformers import TrainerCallback

        self.logs: list[dict] = []
        outer = self

        class _Recorder(TrainerCallback):
            def on_log(self, args, state, control, logs=None, **kwargs):
                if logs and "loss" in logs:
                    outer.logs.append(dict(logs))

        self.callback = _Recorder()


def hf_args(tmp: Path, name: str, steps: int, **over):
    from transformers import TrainingArguments

    kw = dict(
        output_dir=str(tmp / name),
        per_device_train_batch_size=1,
        gradient_accumulation_steps=ACCUM,
        max_steps=steps,
        learning_rate=LR,
        weight_decay=WD,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=1.0,
        optim="adamw_torch",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        ddp_backend="gloo",
        average_tokens_across_devices=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    kw.update(over)
    if name.startswith("trl"):
        from trl import SFTConfig

        return SFTConfig(
            packing=False,
            gradient_checkpointing=False,
            bf16=False,
            dataset_kwargs={"skip_prepare_dataset": True},
            **kw,
        )
    return TrainingArguments(**kw)


def hf_run(tmp, name, dataset, profile, steps, resume=None, trl=False, **over) -> dict:
    import sparsebalance
    import sparsebalance.hf

    model = build_model("tiny", seed=0)
    sparsebalance.attach(model, block_size=BLOCK)
    probe = LossProbe(model, ACCUM)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)  # one group, like train
    args = hf_args(tmp, name, steps, **over)
    if trl:
        from trl import SFTTrainer

        trainer = SFTTrainer(
            model=model,
            args=args,
            train_dataset=dataset,
            optimizers=(opt, None),
            processing_class=word_tokenizer(),
        )
    else:
        from transformers import Trainer as HFTrainer

        trainer = HFTrainer(model=model, args=args, train_dataset=dataset, optimizers=(opt, None))
    runtime = sparsebalance.hf.enable(
        trainer, capacity=CAPACITY, dst=DST, profile=profile, block_size=BLOCK, deterministic=True, log="all"
    )
    logs = LogRecorder()
    trainer.add_callback(logs.callback)  # after SparseBalance's (before it: test_hf_logs.py)
    trainer.train(resume_from_checkpoint=resume)
    hist = runtime.planner.history
    return {
        "losses": probe.global_losses(),
        "hashes": [h["plan_hash"] for h in hist],
        "steps": [h["step"] for h in hist],
        "predicted_balance": [h["plan_efficiency"] for h in hist],
        "logged": logs.logs,
    }


def loop_run(dataset, profile, steps: int) -> dict:
    """The plain-loop API in an accelerate loop (as ``examples/accelerate_loop.py``), configured
    like the other runs (clip 1.0 through accelerate, constant LR)."""
    import contextlib

    from accelerate import Accelerator

    import sparsebalance
    from sparsebalance.integrations import PlannerConfig, balanced_loader

    accelerator = Accelerator(cpu=True)
    model = build_model("tiny", seed=0)
    runtime = sparsebalance.attach(model, block_size=BLOCK)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    model, opt = accelerator.prepare(model, opt)
    config = PlannerConfig(GLOBAL_BATCH, ACCUM, CAPACITY, dst=DST, block_size=BLOCK, deterministic=True)
    loop = balanced_loader(runtime, dataset, config, profile=profile)
    losses, hashes = [], []
    for step in loop.steps(epoch=0, max_steps=steps):
        total = 0.0
        for i, batch in enumerate(step):
            last = i == len(step) - 1
            with contextlib.nullcontext() if last else accelerator.no_sync(model):
                loss = model(**batch).loss
                accelerator.backward(loss * accelerator.num_processes)
            total += float(loss.detach())
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        hashes.append(step.finish()["plan_hash"])
        losses.append(total)
    total = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(total)
    return {"losses": total.tolist(), "hashes": hashes}


def default_sampler_balance(sb: Trainer, batches) -> list[float]:
    """Predicted balance of the HF Trainer's default split of the same global batches (equal
    document counts per rank, in order: ``sequential``) under the same latency model."""
    cfg = PlanConfig(2, None, CAPACITY, "sequential", "split")
    return [plan_batch(b, sb.latency, cfg, estimator=sb.estimator).metrics.efficiency for b in batches]


def main(tmp: Path) -> None:
    rank = int(__import__("os").environ["RANK"])
    profile = tmp / f"profile-{rank}.json"  # the same analytic profile, one file per rank (no race)
    analytic_profile(load_shapes("tiny"), "h100", block_size=BLOCK).save(profile)
    torch.set_num_threads(1)
    sb = Trainer(sb_config(tmp, profile), Runtime.init("cpu"))
    batches = [sb.data.next_batch() for _ in range(STEPS)]  # what run() will draw: reset below
    sb.data = type(sb.data)(sb.corpus, 0, GLOBAL_BATCH)
    out = sb.run()
    from datasets import Dataset

    docs = [sb.corpus.docs[i].tolist() for i in range(len(sb.corpus.lengths()))]
    dataset = Dataset.from_dict({"input_ids": docs})
    result = {
        "sb_losses": out["losses"],
        "sb_hashes": [s["plan_hash"] for s in out["summaries"]],
        "sb_plan_efficiency": [s["plan_efficiency"] for s in out["summaries"]],
        "default_balance": default_sampler_balance(sb, batches),
        "batches": [[s.id for s in b] for b in batches],
    }
    if "trl" in sys.argv[2:]:
        result["trl"] = hf_run(tmp, "trl", dataset, profile, STEPS, trl=True)
    if "loop" in sys.argv[2:]:
        result["loop"] = loop_run(dataset, profile, STEPS)
    if len(sys.argv) == 2:  # 3 steps saving at step 2, then step 3 again from that checkpoint
        result["hf"] = hf_run(tmp, "hf", dataset, profile, STEPS, save_strategy="steps", save_steps=2)
        result["resumed"] = hf_run(
            tmp, "hf", dataset, profile, STEPS, save_strategy="no", resume=str(tmp / "hf" / "checkpoint-2")
        )
    (tmp / f"result-{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    # The trainers above sit in reference cycles that hold their DDP models and, through them,
    # gloo's last work objects: freed by the interpreter's shutdown, gloo's threads can touch
    # objects already gone and a rank aborts ("terminate called without an active exception",
    # exit -6; seen under load). Free them now, then tear the group down (as train/__main__.py).
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
