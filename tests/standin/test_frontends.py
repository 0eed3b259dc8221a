"""Issue 53, item 1: the other front ends' steps on the stand-in device with the defaults a CUDA run
resolves, the model's own loss: ``sparsebalance.hf.enable`` under the HF Trainer and TRL's
SFTTrainer (their own ``training_step``), the plain-loop API in an accelerate loop and in a
hand-written loop, and ``generate()`` after training.

``hf.enable`` decides with the Trainer's device reported as ``cuda:0`` (block 128, flex, DST's
top-k defaults, controllers deciding on the device); the model and every batch then live on the
stand-in device, as the Trainer's input preparation puts them on a GPU. Each micro-batch's
forward and backward: no device mixing, no read by this project's code in any layer or anywhere
in the micro-batch. The trainers' own reads (TRL's metrics, the Trainer's logging) are theirs.

On the main of 2026-12-01 (d182e21) these fail: the collator built the pack index on the host,
only ``cu_seqlens`` moved, and the top-k gate's ``index_select`` mixed a host index into device
work (a crash on CUDA).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import sparsebalance
from sparsebalance.integrations import PlannerConfig
from sparsebalance.integrations.loop import BalancedLoop
from sparsebalance.integrations.setup import build_sampler
from sparsebalance.tuning import DSTConfig

from . import device as sd
from .runs import CAPACITY, CUDA, LENGTHS, documents, hf_model, model_on_device, profile_file, to_device

pytest.importorskip("transformers")
pytestmark = [
    pytest.mark.filterwarnings("ignore::sparsebalance.latency.OutsideGridWarning"),
    pytest.mark.filterwarnings("ignore:User provided device_type of 'cuda'"),
    pytest.mark.filterwarnings("ignore:CUDA is not available"),
]
ACCUM = 2


@pytest.fixture
def stand_in(monkeypatch):
    return sd.install(monkeypatch)


def dataset():
    from datasets import Dataset

    return Dataset.from_dict({"input_ids": [d.tolist() for d in documents()]})


@contextlib.contextmanager
def trainer_on_cuda(monkeypatch):
    """The Trainer's device reads ``cuda:0`` (and CUDA is "available") inside, the stand-in
    device after: what ``hf.enable`` decides with, then where the Trainer puts the batches."""
    from transformers import TrainingArguments

    where = [CUDA]
    monkeypatch.setattr(TrainingArguments, "device", property(lambda self: where[0]))
    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "is_available", lambda: True)
        yield
    where[0] = sd.DEVICE


def hf_args(tmp_path, trl: bool = False):
    kw = dict(
        output_dir=str(tmp_path / "hf"),
        per_device_train_batch_size=len(LENGTHS) // ACCUM,
        gradient_accumulation_steps=ACCUM,
        max_steps=1,
        use_cpu=True,
        bf16=True,
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
        save_strategy="no",
    )
    if not trl:
        from transformers import TrainingArguments

        return TrainingArguments(**kw)
    from trl import SFTConfig

    return SFTConfig(packing=False, gradient_checkpointing=False, dataset_kwargs={"skip_prepare_dataset": True}, **kw)


def run_trainer_step(trainer, model, guard: sd.StandIn) -> list:
    """The Trainer's micro-batches of one step as its training loop runs them: its loader,
    ``get_batch_samples`` (the token count), ``training_step`` (input preparation, the model's
    loss, the backward); the optimizer step and the logging are left out. Returns the tickets."""
    batches, num_items = trainer.get_batch_samples(iter(trainer.get_train_dataloader()), ACCUM, sd.DEVICE)
    tickets = []
    with guard:
        for i, batch in enumerate(batches):
            guard.phase = f"micro-batch {i}"
            tickets.append(batch["sb_attention"])
            trainer.training_step(model, batch, num_items)
    return tickets


def check_planned(tickets, guard, kernels) -> None:
    sd.check_clean(guard, kernels)
    real = [t for t in tickets if not t.filler]
    assert len(real) == ACCUM, tickets
    assert any(t.attention.choose_budget is not None and not t.attention._all_covered for t in real)
    assert all(t.attention.pack.device == sd.DEVICE for t in real)
    assert kernels.sparse and kernels.dense  # the long document selected, the short ones dense


def test_hf_trainer_with_enable(stand_in, monkeypatch, tmp_path):
    from transformers import Trainer

    import sparsebalance.hf

    model = hf_model()
    trainer = Trainer(model=model, args=hf_args(tmp_path), train_dataset=dataset())
    with trainer_on_cuda(monkeypatch):
        runtime = sparsebalance.hf.enable(trainer, capacity=CAPACITY, profile=str(profile_file(tmp_path)))
    assert runtime.block_size == 128 and runtime.planner.config.dst == DSTConfig()
    model_on_device(model)
    guard = sd.StandIn()
    check_planned(run_trainer_step(trainer, model, guard), guard, stand_in)
    assert not guard.reads, guard.summary(guard.reads)  # the Trainer's micro-batches read nothing


def test_trl_sft_trainer_with_enable(stand_in, monkeypatch, tmp_path):
    pytest.importorskip("trl", reason="TRL is not installed (pip install -e .[hf])")
    from trl import SFTTrainer

    import sparsebalance.hf
    from tests.integrations.hf_worker import word_tokenizer

    model = hf_model()
    trainer = SFTTrainer(
        model=model, args=hf_args(tmp_path, trl=True), train_dataset=dataset(), processing_class=word_tokenizer()
    )
    with trainer_on_cuda(monkeypatch):
        sparsebalance.hf.enable(trainer, capacity=CAPACITY, profile=str(profile_file(tmp_path)))
    model_on_device(model)
    guard = sd.StandIn()
    check_planned(run_trainer_step(trainer, model, guard), guard, stand_in)
    # TRL's SFTTrainer reads its metrics back in every micro-batch (entropy, token accuracy,
    # tokens seen: trl/trainer/sft_trainer.py): its reads, not this project's
    assert {e.site.split(":")[0] for e in guard.reads} <= {"trl/trainer/sft_trainer.py"}


def cuda_loop(runtime, tmp_path) -> BalancedLoop:
    """``balanced_loader(runtime, dataset, config)`` for a model on CUDA (the planner's device is
    where the parameters are: given here, the parameters being on the stand-in device)."""
    config = PlannerConfig(global_batch=len(LENGTHS), micro_batches=ACCUM, capacity=CAPACITY)
    data = dataset()
    return BalancedLoop(build_sampler(runtime, data, config, str(profile_file(tmp_path)), device=CUDA), data)


def test_accelerate_loop_and_generate_after_it(stand_in, tmp_path):
    """The plain-loop API in an accelerate loop (batches to the device with accelerate's
    ``send_to_device``, as its prepared loaders do), then greedy ``generate`` from the trained
    model: the prompt's forward runs the sparse op, the decoding steps the model's own attention."""
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from accelerate.utils import send_to_device

    accelerator = Accelerator(cpu=True)
    model = hf_model()
    runtime = sparsebalance.attach(model, block_size=128)  # CUDA's default block
    model = model_on_device(accelerator.prepare(model))
    loop = cuda_loop(runtime, tmp_path)
    guard, tickets = sd.StandIn(), []
    step = next(loop.steps(epoch=0))  # its finish (the feedback, after the step) is not run
    with guard:
        for i, batch in enumerate(step):
            guard.phase = f"micro-batch {i}"
            tickets.append(batch["sb_attention"])
            batch = send_to_device(batch, sd.DEVICE)
            accelerator.backward(model(**batch).loss * accelerator.num_processes)
        guard.phase = "generate"
        model.eval()
        prompt = torch.randint(1, 500, (1, 300)).to(sd.DEVICE)
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3, do_sample=False)
    check_planned(tickets, guard, stand_in)
    # the stand-in's reads say "finished" after the first token: the prompt's forward (sparse)
    assert out.shape == (1, 301) and runtime.forwards >= 1
    # the prompt's forward reads its offsets once (no ticket: docs/integrations.md); no layer
    # reads anything
    reads = guard.project_reads("generate")
    assert all(e.layer is None for e in reads) and len(reads) <= 2, guard.summary(reads)


def test_plain_loop(stand_in, tmp_path):
    """A hand-written loop: the batch's tensors to the device, the model's loss, its backward."""
    model = hf_model()
    runtime = sparsebalance.attach(model, block_size=128)  # CUDA's default block
    model = model_on_device(model)
    loop = cuda_loop(runtime, tmp_path)
    guard, tickets = sd.StandIn(), []
    with guard:
        for i, batch in enumerate(next(loop.steps(epoch=0))):
            guard.phase = f"micro-batch {i}"
            tickets.append(batch["sb_attention"])
            model(**to_device(batch)).loss.backward()
    check_planned(tickets, guard, stand_in)
