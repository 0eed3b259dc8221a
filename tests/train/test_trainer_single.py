"""Single-process trainer checks: attention equivalence, bad input, non-finite loss."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from sparsebalance.data import load_tokenizer, pack
from sparsebalance.models.attention import PackedAttention
from sparsebalance.models.hf import build_model
from sparsebalance.ops import Budget
from sparsebalance.train import TrainConfig, Trainer
from sparsebalance.train.checkpoint import latest_checkpoint, load_checkpoint
from sparsebalance.train.runtime import Runtime
from sparsebalance.train.step import NonFiniteLoss
from tests.train.harness import base_config

CPU1 = Runtime(0, 1, torch.device("cpu"))
# The tests use an analytic (GPU) profile on purpose: the fingerprint warning is expected.
pytestmark = pytest.mark.filterwarnings("ignore::sparsebalance.latency.ProfileMismatchWarning")


@pytest.mark.parametrize("model_type", ["tiny"])
def test_gamma_one_logits_equal_eager_attention_on_packed_input(model_type):
    model = build_model(model_type, seed=1)
    eager = build_model(model_type, attn_implementation="eager", seed=1)
    eager.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 4096, (n,), generator=g).numpy() for n in (70, 1, 130, 33)]
    batch = pack(docs)
    ctx = PackedAttention(batch.cu_seqlens, Budget(gamma=1.0), block_size=32, backend="torch")
    with torch.no_grad():
        packed = model(input_ids=batch.input_ids, position_ids=batch.position_ids,
                       sb_attention=ctx, use_cache=False).logits[0]  # fmt: skip
        start, refs = 0, []
        for d in docs:
            ids = torch.as_tensor(d, dtype=torch.long)[None]
            refs.append(eager(input_ids=ids, use_cache=False).logits[0])
            start += len(d)
    torch.testing.assert_close(packed, torch.cat(refs), rtol=1e-4, atol=1e-4)
    assert len(ctx.stats) == model.config.num_hidden_layers
    assert all(s.density == 1.0 for s in ctx.stats)


def test_packing_labels_stay_inside_documents():
    batch = pack([torch.arange(3).numpy(), torch.arange(10, 12).numpy()])
    assert batch.labels.tolist() == [[1, 2, -100, 11, -100]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 0, 1]]
    assert batch.cu_seqlens.tolist() == [0, 3, 5]
    weighted = pack([torch.arange(3).numpy(), torch.arange(10, 12).numpy()], per_doc_weighting=True)
    assert weighted.loss_weights.tolist() == [[0.5, 0.5, 0.0, 1.0, 0.0]]


def test_bad_input_is_reported_clearly(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        TrainConfig(data=str(tmp_path / "missing.jsonl"))
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="empty"):
        Trainer(replace(base_config(tmp_path), data=str(tmp_path / "empty.jsonl")), CPU1)
    (tmp_path / "nofield.jsonl").write_text('{"body": "hello there"}\n')
    with pytest.raises(ValueError, match="text-field"):
        Trainer(replace(base_config(tmp_path), data=str(tmp_path / "nofield.jsonl")), CPU1)
    with pytest.raises(ValueError, match="--global-batch"):
        TrainConfig(global_batch=0)
    with pytest.raises(ValueError, match="exactly one"):
        TrainConfig(micro_batches=2, capacity=1024)


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    cfg = base_config(tmp_path, lr=1e30, steps=5, checkpoint_every=1, deterministic=True)
    trainer = Trainer(cfg, CPU1)
    with pytest.raises(NonFiniteLoss, match="non-finite loss"):
        trainer.run()
    good = latest_checkpoint(tmp_path / "run")
    assert good is not None
    fresh = Trainer(replace(cfg, lr=1e-3, overwrite=True), CPU1)  # only to load the checkpoint
    state = load_checkpoint(good, fresh.model, fresh.optimizer, fresh.scheduler)
    assert 1 <= state["trainer"]["step"] < 5
    assert all(torch.isfinite(p).all() for p in fresh.model.parameters())


def test_default_tokenizer_is_offline_qwen():
    tok = load_tokenizer()
    ids = tok.encode("The passkey is 12345.")
    assert tok.decode(ids) == "The passkey is 12345."
    assert tok.eos_token_id > 150000  # Qwen2.5 special tokens sit above the BPE vocabulary


def test_a_fresh_run_never_mixes_into_an_earlier_one(tmp_path):
    cfg = base_config(tmp_path, steps=1)
    Trainer(cfg, CPU1).run()
    with pytest.raises(ValueError, match="--resume to continue it or --overwrite"):
        Trainer(cfg, CPU1)
    Trainer(replace(cfg, overwrite=True), CPU1).run()
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert sum('"rank": "all"' in x for x in lines) == 1  # the earlier run's metrics are gone
