"""Issue 54, item 6: what crosses between stages on gloo from a CUDA stage lands in pinned host
memory (one DMA to the device, not blocking), and the step's object collectives (the plan's
hash, the records) use gloo groups when the default group is NCCL (an object all-gather on NCCL
stages its pickle in device memory). No GPU here: the device is a type, the backend a stand-in."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from sparsebalance.engine.pipeline import PipelineGroups, to_wire, wire_buffer
from sparsebalance.engine.runtime import Runtime
from sparsebalance.engine.stage import PipelineLayout

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


class _Pins(TorchDispatchMode):
    """Records the allocations asked to be pinned, and makes them unpinned (no CUDA here: the
    request is what is tested)."""

    def __init__(self) -> None:
        super().__init__()
        self.pinned: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if kwargs.get("pin_memory"):
            self.pinned.append(str(func))
            kwargs["pin_memory"] = False
        return func(*args, **kwargs)


def test_a_cuda_stage_receives_into_pinned_host_memory():
    with _Pins() as mode:
        buf = wire_buffer((1, 5, 8), torch.float32, CUDA, CPU)
    assert buf.shape == (1, 5, 8) and buf.device == CPU and len(mode.pinned) == 1
    with _Pins() as mode:  # a CPU stage (gloo): plain host memory; NCCL: the device's own
        wire_buffer((1, 5, 8), torch.float32, CPU, CPU)
        wire_buffer((1, 5, 8), torch.float32, torch.device("meta"), torch.device("meta"))
    assert mode.pinned == []


def test_a_send_already_on_the_wire_is_not_copied():
    t = torch.randn(1, 3, 4)
    assert to_wire(t, CPU) is t


def test_object_collectives_use_gloo_when_the_default_group_is_nccl(monkeypatch):
    made = []

    def new_group(ranks=None, timeout=None, backend=None):
        made.append((tuple(ranks) if ranks is not None else None, backend))
        return len(made) - 1

    monkeypatch.setattr(dist, "new_group", new_group)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    groups = PipelineGroups.create(PipelineLayout.of(3, 4, 2), tied=True)  # DP 2 x PP 2, rank 3
    assert made[groups.pipeline_objects] == ((2, 3), "gloo")  # this pipeline's stages, on gloo
    assert made[groups.objects] == (None, "gloo")
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    made.clear()
    assert PipelineGroups.create(PipelineLayout.of(3, 4, 2), tied=True).pipeline_objects is None

    seen = []
    monkeypatch.setattr(dist, "all_gather_object", lambda out, obj, group=None: seen.append(group))
    monkeypatch.setattr(dist, "broadcast_object_list", lambda box, src=0, group=None: seen.append(group))
    rt = Runtime(0, 2, CPU, objects="gloo-group")
    rt.all_gather_object("plan hash")
    rt.broadcast_object("choice")
    assert seen == ["gloo-group", "gloo-group"]
