"""The process groups of a DP x PP grid (``--pp P``): each pipeline's stages, each stage's
data-parallel peers, the tied embedding's two ends, and one group per direction of the
activations and gradients a pipeline sends (:class:`PipelineGroups`)."""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch.distributed as dist

from .stage import PipelineLayout


@dataclass
class PipelineGroups:
    """The process groups of a DP x PP grid (created once, every rank, in the same order)."""

    pipeline: object
    """This rank's pipeline (its P stages): where the micro-batch records are gathered."""
    data: object | None
    """This rank's stage in every pipeline: where its gradients are averaged (None: one pipeline)."""
    tied: object | None
    """This pipeline's first and last stage (the tied embedding's two copies); None if not needed."""
    activations: object = None
    """This pipeline's stages again, for the activations sent forward only."""
    gradients: object = None
    """And for their gradients sent back only. NCCL runs a pair's sends and receives of one group
    in order on one stream: 1F1B's send of the next forward and its peer's send of a backward
    would each wait for a receive queued behind the other's send. One direction per group keeps
    every pair's queue in one order on both ends."""
    objects: object = None
    """Every rank on gloo, for a checkpoint's objects when the default group is NCCL (it would
    stage every pickle in device memory); None: the default group."""
    pipeline_objects: object = None
    """This pipeline's stages on gloo when the default group is NCCL, for the step's records
    (an object all-gather on NCCL goes through device memory); None: :attr:`pipeline`."""
    wrap_activations: object = None
    """Interleaved (``--pp-virtual``): the activations rank P-1 sends round to rank 0 (at P = 2
    they would share a pair with rank 0's sends to rank 1 in one group); None: not interleaved."""
    wrap_gradients: object = None
    """Interleaved: the gradients rank 0 sends round to rank P-1."""

    @classmethod
    def create(cls, layout: PipelineLayout, tied: bool, timeout_s: float | None = None) -> PipelineGroups:
        """Every rank calls it, once. ``timeout_s``: how long a send, receive or collective of
        these groups may wait (``--comm-timeout``); a group made without one waits the backend's
        default (gloo: 30 minutes), so a stalled stage would hang the run instead of failing."""
        P, D = layout.stages, layout.dp_size
        timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)

        def group(ranks=None, **kw):
            return dist.new_group(ranks, timeout=timeout, **kw)

        nccl = dist.get_backend() == "nccl"
        mine = {}
        for d in range(D):
            for kind in ("pipeline", "activations", "gradients"):
                mine[(kind, d)] = group([layout.rank(d, s) for s in range(P)])
            if nccl:
                mine[("pipeline_objects", d)] = group([layout.rank(d, s) for s in range(P)], backend="gloo")
        for s in range(P):
            mine[("data", s)] = group([layout.rank(d, s) for d in range(D)]) if D > 1 else None
        for d in range(D):
            ends = [layout.rank(d, 0), layout.rank(d, P - 1)]
            mine[("tied", d)] = group(ends) if tied and P > 1 else None
        objects = group(backend="gloo") if nccl else None
        if layout.virtual > 1:
            for d in range(D):
                for kind in ("wrap_activations", "wrap_gradients"):
                    mine[(kind, d)] = group([layout.rank(d, s) for s in range(P)])
        d = layout.dp
        return cls(
            mine[("pipeline", d)],
            mine[("data", layout.stage)],
            mine[("tied", d)],
            mine[("activations", d)],
            mine[("gradients", d)],
            objects,
            mine.get(("pipeline_objects", d)),
            mine.get(("wrap_activations", d)),
            mine.get(("wrap_gradients", d)),
        )
