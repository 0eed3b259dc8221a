"""Issue 39, item 10: an attached model still generates and evaluates through the HF APIs. Decoding
with a KV cache and padded batches run with the model's own attention (``integrations/inference``),
equal to the un-attached model's; a training forward with such inputs is still refused."""

from __future__ import annotations

import pytest
import torch

import sparsebalance
from sparsebalance.integrations import IMPLEMENTATION
from sparsebalance.models.hf import build_model


def _pair():
    plain = build_model("tiny", attn_implementation="sdpa", seed=3)
    attached = build_model("tiny", attn_implementation="sdpa", seed=3)
    runtime = sparsebalance.attach(attached, block_size=32, backend="torch")
    return plain.eval(), attached.eval(), runtime


def test_greedy_generate_equals_the_unattached_model():
    plain, attached, runtime = _pair()
    prompt = torch.randint(5, 4000, (1, 37), generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    want = plain.generate(prompt, attention_mask=torch.ones_like(prompt), **kw)
    got = attached.generate(prompt, attention_mask=torch.ones_like(prompt), **kw)
    assert torch.equal(got, want)
    assert runtime.dense_forwards == 5  # every decoding step; the prefill ran the sparse op
    assert runtime.forwards >= 1
    assert attached.config._attn_implementation == IMPLEMENTATION  # switched back


def test_a_padded_batch_generates_and_evaluates_like_the_unattached_model():
    plain, attached, runtime = _pair()
    ids = torch.randint(5, 4000, (2, 20), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # left padding
    with torch.no_grad():
        want = plain(input_ids=ids, attention_mask=mask).logits
        got = attached(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(
        attached.generate(ids, attention_mask=mask, **kw), plain.generate(ids, attention_mask=mask, **kw)
    )
    assert runtime.dense_forwards >= 5


def test_a_kv_cache_forward_equals_the_unattached_model():
    plain, attached, _ = _pair()
    ids = torch.randint(5, 4000, (1, 30), generator=torch.Generator().manual_seed(2))
    outs = []
    for model in (plain, attached):
        with torch.no_grad():
            cache = model(input_ids=ids[:, :25], use_cache=True).past_key_values
            outs.append(model(ids[:, 25:], past_key_values=cache, use_cache=True).logits)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)


def test_a_training_forward_on_a_padded_batch_is_still_refused():
    _, attached, runtime = _pair()
    attached.train()
    ids = torch.randint(5, 4000, (2, 16), generator=torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match="runs packed batches"):
        attached(input_ids=ids, attention_mask=torch.ones_like(ids))
    assert runtime.dense_forwards == 0
