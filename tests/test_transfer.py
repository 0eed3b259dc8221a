"""Issue 42, item 4: what a micro-batch sends to a CUDA device goes from pinned memory, non-blocking
(a copy from pageable memory makes the host wait for the device). The CPU has no CUDA device and
no page-locked memory, so both are faked at the tensor level: ``pin_memory`` marks a copy as
pinned, ``.to(cuda)`` records the copy (pinned source? non-blocking?) and stays on the CPU. The
decision to pin (the device is CUDA) is the code's own."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sparsebalance.data import pack
from sparsebalance.transfer import upload, upload_many

CUDA = torch.device("cuda")


@pytest.fixture
def copies(monkeypatch):
    """Every copy to CUDA: ``(source pinned, non_blocking, bytes)``."""
    made, pinned = [], set()
    real_to = torch.Tensor.to

    def pin_memory(self):
        out = self.clone()
        pinned.add(id(out))
        return out

    def to(self, *args, **kwargs):
        target = args[0] if args else kwargs.get("device")
        if isinstance(target, (str, torch.device)) and torch.device(target).type == "cuda":
            blocking = not (kwargs.get("non_blocking") or (len(args) > 1 and args[1] is True))
            made.append((id(self) in pinned, not blocking, self.numel() * self.element_size()))
            return self
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "to", to)
    return made


def test_a_packed_micro_batch_is_one_pinned_non_blocking_copy(copies):
    docs = [np.arange(1, 40), np.arange(5, 300), np.array([7])]
    batch = pack(docs, CUDA, per_doc_weighting=True)
    assert len(copies) == 1, copies  # five arrays, one copy
    assert copies[0][:2] == (True, True), "pageable or blocking copy to the device"
    # the views on the "device" are the arrays, dtypes and shapes kept
    cpu = pack(docs, "cpu", per_doc_weighting=True)
    for name in ("input_ids", "labels", "position_ids", "cu_seqlens", "loss_weights"):
        got, want = getattr(batch, name), getattr(cpu, name)
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.equal(got, want), name


def test_a_single_array_is_pinned_and_non_blocking(copies):
    out = upload(np.arange(10), CUDA, torch.int32)
    assert copies == [(True, True, 40)]
    assert out.dtype == torch.int32 and out.tolist() == list(range(10))


def test_mixed_dtypes_share_one_aligned_buffer(copies):
    arrays = [np.array([1, 2, 3], np.int32), np.array([True, False]), np.array([0.5], np.float64)]
    out = upload_many(arrays, CUDA)
    assert len(copies) == 1 and copies[0][:2] == (True, True)
    assert [t.dtype for t in out] == [torch.int32, torch.bool, torch.float64]
    for got, want in zip(out, arrays, strict=True):
        np.testing.assert_array_equal(got.numpy(), want)


def test_on_the_cpu_nothing_is_copied_to_a_device(copies):
    pack([np.arange(1, 9)], "cpu")
    upload(np.arange(3), torch.device("cpu"))
    assert copies == []
