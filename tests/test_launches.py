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
