"""``sparsebalance.launches``: what the counter calls a launch and a host read (the guard behind
the no-read and few-launch tests of issue 42)."""

from __future__ import annotations

import numpy as np
import torch

from sparsebalance.launches import LaunchCounter, kernel
from sparsebalance.transfer import upload, upload_many


def test_launches_exclude_views_and_allocations():
    x = torch.randn(4, 6)
    with LaunchCounter() as count:
        y = x.t().reshape(24).view(6, 4)  # a copy: the transposed view cannot be flattened
        z = x.view(24)[:5].unsqueeze(0)  # views only
        torch.empty(3)
        w = y.sum(0) + 1
    assert count.ops == ["clone", "sum", "add"]
    assert not count.reads and z.shape == (1, 5) and w.shape == (4,)


def test_host_reads_are_every_way_of_reading_values():
    x = torch.arange(6.0)
    with LaunchCounter(trace=True) as count:
        x.sum().item()
        bool(x[0] > 1)
        x.tolist()
        x.nonzero()
        x[x > 2]  # a boolean mask: its nonzero runs inside the op
    assert len([r for r in count.reads if r.startswith("Tensor.")]) == 3
    assert {"aten.nonzero.default", "aten.index.Tensor"} <= set(count.reads)
    assert all(site.startswith("?") or site for site in count.read_sites)


def test_a_kernel_runs_uncounted_or_not_at_all():
    q = torch.randn(8, 2)
    with LaunchCounter() as count:
        out = kernel(lambda t: (t * 2).sum(0, keepdim=True).expand_as(t), q, like=q)
    assert count.kernels == 1 and count.ops == [] and torch.equal(out[0], (q * 2).sum(0))
    with LaunchCounter(run_kernels=False) as count:
        out = kernel(lambda t: 1 / 0, q, like=q)  # never called
    assert count.kernels == 1 and out.shape == q.shape
    assert torch.equal(kernel(torch.neg, q, like=q), -q)  # outside a counter: a plain call


def test_uploads_count_as_launches():
    with LaunchCounter() as count:
        upload(np.arange(3), torch.device("cpu"))
        upload_many([np.arange(3), np.zeros(2)], torch.device("cpu"))
    assert count.ops == ["h2d_copy", "h2d_copy"]


def test_what_syncs_on_cuda_is_a_read_and_what_does_not_is_not():
    """Issue 53: ``bincount`` and ``histc`` without a range read values to size or scale their
    output (a sync on CUDA); ``repeat_interleave`` told its ``output_size`` does not; a method
    read and the op it dispatches are one read."""
    x = torch.arange(10)
    with LaunchCounter() as count:
        torch.bincount(x)
        torch.histc(x.float(), bins=4)
    assert count.reads == ["aten.bincount.default", "aten.histc.default"]
    with LaunchCounter() as count:
        torch.histc(x.float(), bins=4, min=0, max=10)
        torch.repeat_interleave(x, torch.ones(10, dtype=torch.long), output_size=10)
    assert count.reads == []
    with LaunchCounter() as count:
        torch.repeat_interleave(x, torch.ones(10, dtype=torch.long))
    assert count.reads == ["aten.repeat_interleave.Tensor"]
    with LaunchCounter() as count:
        int(x.sum())
        float(x.sum())
        x.sum().item()
    assert count.reads == ["Tensor.__int__", "Tensor.__float__", "Tensor.item"]


def test_a_constructor_copy_to_a_device_is_a_launch():
    """``torch.tensor(host data, device=...)`` copies to the device without an op a dispatch
    mode sees (on CUDA from pageable memory: the host waits): counted, with its site."""
    ones = torch.ones(2)
    with LaunchCounter() as count:
        torch.tensor([1, 2, 3], device="cpu")
        torch.as_tensor(np.arange(4), device="cpu")
        torch.tensor([1, 2, 3])  # no device: stays on the host, nothing copied
        torch.as_tensor(ones, device="cpu")  # already a tensor: its own device's business
    assert count.ops == ["h2d_copy", "h2d_copy"]
    assert len(count.constructor_copies) == 2  # their sites (the project's frames; "?" from a test)
